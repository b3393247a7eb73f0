"""p_MLM of words of several wordpieces at a question's [MASK]: the extra forward passes of whole-word answers.

A word of m >= 2 wordpieces is scored by **sequential fill, left to right** (`WordFill.fill_probs`): the query's
[MASK] is replaced by m masks; pass j reads p(piece_j) at mask j while the masks before it hold the word's own
pieces 1..j-1; p_MLM(w) = the product of the m piece probabilities. All candidates share the passes: pass j is one
batched forward pass with one row per distinct (length, prefix), so a query costs max(m) extra passes whatever the
number of words. `WordFill.one_pass_probs` is another estimator: every piece of a length's masks read in one pass.
The scores are cached (key: model, query tokens, pieces). Each length is its own event space, as in LAMA-style
multi-token probing. A word whose masks do not fit the model's window scores 0.
"""

from __future__ import annotations

import logging
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

import numpy as np

from bertknn.core.errors import check_deadline
from bertknn.core.inputs import MaskedInput
from bertknn.core.query_model import QueryModel
from bertknn.service.cache import cache_key
from bertknn.service.encoding import QueryEncoder

logger = logging.getLogger(__name__)

FILL_BATCH = 64  # rows per forward pass of the fill
FILL_BATCH_SHARED = 8  # ... while other requests wait for the model (their wait is one such pass)


def _pack(p: float) -> bytes:
    body = struct.pack("<d", p)
    return body + struct.pack("<I", zlib.crc32(body))


def _unpack(raw: bytes) -> float | None:
    if len(raw) != 12 or zlib.crc32(raw[:8]) != struct.unpack("<I", raw[8:])[0]:
        return None
    (p,) = struct.unpack("<d", raw[:8])
    return p if np.isfinite(p) and 0.0 <= p <= 1.0 else None


@dataclass(frozen=True)
class _Group:
    """The words of one length m: their indexes, the query with m masks, the first mask's position."""

    m: int
    members: list[int]
    input_ids: tuple[int, ...]
    first: int


def _scores(groups: list[_Group], log_p: np.ndarray) -> np.ndarray:
    """p of each word from its fill's log p; words of lengths whose masks did not fit the window score 0."""
    out = np.zeros(len(log_p), dtype=np.float64)
    scored = [w for g in groups for w in g.members]
    out[scored] = np.exp(log_p[scored])
    return out


def _encode_by(encoder: QueryModel, items: Sequence[MaskedInput], deadline: float | None) -> Any:
    """One fill forward pass, unless the request's deadline passed while it waited for the model thread."""
    check_deadline(deadline)
    return encoder.encode(items, with_mlm=True)


def _log_probs_by(
    encoder: QueryModel, sequences: Sequence[Sequence[int]], reads: Sequence[tuple[int, int]], deadline: float | None
) -> Any:
    """The one-pass fill's forward, unless the request's deadline passed while it waited for the model thread."""
    check_deadline(deadline)
    return encoder.log_probs_at(sequences, reads)


class WordFill:
    """The fill passes of one model, their scores cached in the query encoder's cache."""

    def __init__(self, encoder: QueryModel, queries: QueryEncoder):
        self.encoder = encoder
        self.queries = queries  # its cache and key prefix hold the fill scores
        self.mask_id = int(encoder.tokenizer.mask_token_id)
        # Runs a model call; the async server points it at its model thread (all torch calls from one thread).
        self.run_model: Callable[[Callable[[], Any]], Any] = lambda fn: fn()
        # Whether other requests wait for the model thread now (the server's batcher says): fill passes are
        # then FILL_BATCH_SHARED rows, so that their wait for one pass stays short.
        self.others_waiting: Callable[[], bool] = lambda: False

    def fill_probs(
        self, text: str, words: Sequence[tuple[int, ...]], *, deadline: float | None = None
    ) -> np.ndarray:
        """p_MLM of multi-piece words at the [MASK] of ``text`` (cached), by sequential fill: one forward pass
        per piece. ``deadline``: a `time.monotonic` time after which no further forward pass starts
        (`DeadlineExceeded`). `one_pass_probs` is the other estimator."""
        inp = self.encoder.query_input(text)
        out, keys, todo = self._cached(inp, words, "fill")
        if todo:
            missing = [words[i] for i in todo]
            groups = self._mask_groups(inp, missing)
            self._keep(out, keys, todo, _scores(groups, self._sequential_log_p(groups, missing, deadline)))
        return out

    def one_pass_probs(
        self, requests: Sequence[tuple[str, Sequence[tuple[int, ...]]]], *, deadline: float | None = None
    ) -> list[np.ndarray]:
        """Another estimator than `fill_probs`: p_MLM of multi-piece words from one pass, every piece of a
        length's masks read at once (`_parallel_log_p`), for several questions (text, words) together: every
        question's lengths are rows of one forward pass (cached apart from `fill_probs`' values)."""
        outs: list[np.ndarray] = []
        parts: list[tuple[list[_Group], list[tuple[int, ...]]]] = []
        pending: list[tuple[int, list[str], list[int]]] = []  # request, cache keys, indexes to compute
        for r, (text, words) in enumerate(requests):
            inp = self.encoder.query_input(text)
            out, keys, todo = self._cached(inp, words, "pfill")
            outs.append(out)
            if todo:
                missing = [words[i] for i in todo]
                parts.append((self._mask_groups(inp, missing), missing))
                pending.append((r, keys, todo))
        if parts:
            for (r, keys, todo), log_p, (groups, _) in zip(
                pending, self._parallel_log_p(parts, deadline), parts, strict=True
            ):
                self._keep(outs[r], keys, todo, _scores(groups, log_p))
        return outs

    def _keep(self, out: np.ndarray, keys: list[str], todo: list[int], fresh: np.ndarray) -> None:
        """Fresh scores into ``out`` at ``todo``, and into the cache under their keys."""
        out[todo] = fresh
        self.queries.cache.set_many({keys[i]: _pack(float(p)) for i, p in zip(todo, fresh, strict=True)})

    def _cached(
        self, inp: MaskedInput, words: Sequence[tuple[int, ...]], kind: str
    ) -> tuple[np.ndarray, list[str], list[int]]:
        """The cached scores of ``words`` at ``inp`` (0 where missing), their cache keys, and the missing ones."""
        prefix, sha, numerics = self.queries.key_prefix, self.encoder.weights_sha256, self.encoder.numerics
        keys = [cache_key(prefix, kind, sha, numerics, inp.input_ids, pieces) for pieces in words]
        out = np.zeros(len(words), dtype=np.float64)
        todo: list[int] = []
        for i, raw in enumerate(self.queries.cache.get_many(keys)):
            value = _unpack(raw) if raw is not None else None
            if value is None:
                todo.append(i)
            else:
                out[i] = value
        return out, keys, todo

    def _mask_groups(self, inp: MaskedInput, words: Sequence[tuple[int, ...]]) -> list[_Group]:
        """The words by length m, each length with its m-mask input (lengths whose masks do not fit: left out)."""
        cls_id, sep_id = self.encoder.tokenizer.cls_token_id, self.encoder.tokenizer.sep_token_id
        ids = list(inp.input_ids)
        body, pos = ids, inp.mask_pos
        # back to the bare tokens: masked_input adds the special tokens again
        if ids and ids[0] == cls_id and ids[-1] == sep_id:
            body, pos = ids[1:-1], inp.mask_pos - 1
        by_length: dict[int, list[int]] = {}
        for i, pieces in enumerate(words):
            by_length.setdefault(len(pieces), []).append(i)
        groups: list[_Group] = []
        for m, members in sorted(by_length.items()):
            base = self.encoder.masked_input([*body[:pos], *[self.mask_id] * m, *body[pos + 1 :]], pos)
            first = base.mask_pos
            if first + m > len(base.input_ids) or any(
                base.input_ids[first + j] != self.mask_id for j in range(m)
            ):
                logger.debug(
                    "word fill: %d masks do not fit the window; %d words score 0", m, len(members)
                )
                continue
            groups.append(_Group(m, members, base.input_ids, first))
        return groups

    def _sequential_log_p(
        self, groups: list[_Group], words: Sequence[tuple[int, ...]], deadline: float | None
    ) -> np.ndarray:
        """Pass j fills piece j of every word of every length > j at once: max(m) passes in all, one row per
        distinct (length, prefix)."""
        log_p = np.zeros(len(words), dtype=np.float64)
        for j in range(max((g.m for g in groups), default=0)):
            items: list[MaskedInput] = []
            row_of: dict[tuple[int, tuple[int, ...]], int] = {}
            for g in groups:
                if j >= g.m:
                    continue
                for w in g.members:
                    key = (g.m, words[w][:j])
                    if key not in row_of:
                        row = list(g.input_ids)
                        row[g.first : g.first + j] = key[1]
                        row_of[key] = len(items)
                        items.append(MaskedInput(tuple(row), g.first + j))
            step = self._log_probs(items, deadline)
            for g in groups:
                if j < g.m:
                    for w in g.members:
                        log_p[w] += step[row_of[(g.m, words[w][:j])], words[w][j]]
        return log_p

    def _parallel_log_p(
        self, parts: Sequence[tuple[list[_Group], Sequence[tuple[int, ...]]]], deadline: float | None
    ) -> list[np.ndarray]:
        """One pass for every length of every part (a question's groups and words): each length's m-mask input
        once (one row of the batch), read at each of its m masks; a word's log p is the sum of its pieces' log p
        at their masks."""
        groups = [g for part_groups, _ in parts for g in part_groups]
        reads = [(i, g.first + j) for i, g in enumerate(groups) for j in range(g.m)]
        sequences = [g.input_ids for g in groups]
        step = self.run_model(partial(_log_probs_by, self.encoder, sequences, reads, deadline)).numpy()
        out = []
        row = 0
        for part_groups, words in parts:
            log_p = np.zeros(len(words), dtype=np.float64)
            for g in part_groups:
                for w in g.members:
                    log_p[w] = float(sum(step[row + j, piece] for j, piece in enumerate(words[w])))
                row += g.m
            out.append(log_p)
        return out

    def _log_probs(self, items: list[MaskedInput], deadline: float | None = None) -> np.ndarray:
        parts = []
        start = 0
        while start < len(items):
            check_deadline(deadline)
            chunk = items[start : start + (FILL_BATCH_SHARED if self.others_waiting() else FILL_BATCH)]
            start += len(chunk)
            result = self.run_model(partial(_encode_by, self.encoder, chunk, deadline))
            assert result.mlm_log_probs is not None
            parts.append(result.mlm_log_probs.numpy())
        return np.concatenate(parts)
