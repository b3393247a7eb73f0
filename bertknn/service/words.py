"""Whole-word answers over a whole-word datastore: p_kNN over words, p_MLM of multi-piece words by sequential fill.

Candidates: every word of the k neighbours (in order of its nearest neighbour) plus the MLM's most probable
one-piece words (the top ``max(top_k, MLM_CANDIDATES)`` tokens that are whole words), each word once (by text).

p_kNN(w) = the sum of softmax(-d/l) over the neighbours whose stored word is w, as for tokens.

p_MLM(w): a one-piece word takes the ordinary p_MLM at the query's single [MASK] (the forward pass every query
has). A word of m >= 2 wordpieces is scored by **sequential fill, left to right**: the query's [MASK] is replaced
by m masks; pass j reads p(piece_j) at mask j while the masks before it hold the word's own pieces 1..j-1;
p_MLM(w) = the product of the m piece probabilities. All candidates share the passes: pass j is one batched
forward pass with one row per distinct (length, prefix), so a query costs max(m) extra passes whatever the
number of words (the longest candidate's length; none when every candidate is one piece).
The scores are cached (key: model, query tokens, pieces). These are not one distribution normalised over all
words: each length is its own event space, as in LAMA-style multi-token probing. A word whose masks do not fit
the model's window scores 0.

Answers are ranked by p(w) = lambda * p_kNN(w) + (1 - lambda) * p_MLM(w) over the candidates (ties: candidate
order). Single-piece datastores never come here: their path is the one forward pass of `AnswerPipeline.answer`.
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

from bertknn.core.encoder import MaskedLMEncoder
from bertknn.core.errors import check_deadline
from bertknn.core.format import Datastore
from bertknn.core.inputs import MaskedInput
from bertknn.core.text import is_punctuation
from bertknn.core.words import WordEntry as Word
from bertknn.service.answer import ContextReader, knn_offsets, lambda_for
from bertknn.service.cache import cache_key
from bertknn.service.codec import QueryEncoding
from bertknn.service.encoding import QueryEncoder
from bertknn.service.interpolate import interpolate, knn_distribution, top_k, weigh_vote
from bertknn.service.results import (
    ArticleHit,
    Assembled,
    Distributions,
    Prediction,
    Query,
    TokenProb,
)
from bertknn.service.retrieval.knn import Neighbours

logger = logging.getLogger(__name__)

MLM_CANDIDATES = 10  # one-piece words the MLM contributes (at least top_k): exact ranks up to P@10
FILL_BATCH = 64  # rows per forward pass of the fill
FILL_BATCH_SHARED = 8  # ... while other requests wait for the model (their wait is one such pass)


@dataclass(frozen=True)
class WordDistributions(Distributions):
    """`Distributions` over the candidate words (``p_mlm``, ``p_knn``, ``p`` indexed like ``words``)."""

    words: tuple[Word, ...] = ()
    token_p_mlm: np.ndarray | None = None  # the query's p_MLM over single tokens (scores a one-piece word)

    def index(self, text: str) -> int | None:
        for i, w in enumerate(self.words):
            if w.text == text:
                return i
        return None




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


def _encode_by(encoder: MaskedLMEncoder, items: Sequence[MaskedInput], deadline: float | None) -> Any:
    """One fill forward pass, unless the request's deadline passed while it waited for the model thread."""
    check_deadline(deadline)
    return encoder.encode(items, with_mlm=True)


def _log_probs_by(
    encoder: MaskedLMEncoder, sequences: Sequence[Sequence[int]], reads: Sequence[tuple[int, int]], deadline: float | None
) -> Any:
    """The one-pass fill's forward, unless the request's deadline passed while it waited for the model thread."""
    check_deadline(deadline)
    return encoder.log_probs_at(sequences, reads)


class WordAnswerer:
    """The whole-word counterpart of `AnswerPipeline.answer` (see the module docstring for the method)."""

    def __init__(self, encoder: MaskedLMEncoder, datastore: Datastore, queries: QueryEncoder, reader: ContextReader):
        self.encoder = encoder
        self.datastore = datastore
        self.queries = queries  # its cache and key prefix hold the fill scores too
        self.reader = reader
        self.mask_id = int(self.encoder.tokenizer.mask_token_id)
        # Runs a model call; the async server points it at its model thread (all torch calls from one thread).
        self.run_model: Callable[[Callable[[], Any]], Any] = lambda fn: fn()
        # Whether other requests wait for the model thread now (the server's batcher says): fill passes are
        # then FILL_BATCH_SHARED rows, so that their wait for one pass stays short.
        self.others_waiting: Callable[[], bool] = lambda: False
        # filled lazily: only the MLM's top tokens are ever asked
        self._token_words: dict[int, Word | None] = {}

    # ---- vocabulary --------------------------------------------------------------------------------------

    def token_word(self, token_id: int) -> Word | None:
        """The whole word a token spells on its own (`WordModel.token_word`), or None: inner pieces (``##s``),
        special tokens, punctuation."""
        if token_id not in self._token_words:
            words = self.encoder.words
            label = words.token_word(token_id)
            self._token_words[token_id] = Word(words.token_text(label), (label,)) if label >= 0 else None
        return self._token_words[token_id]

    # ---- p_MLM of words ----------------------------------------------------------------------------------

    def mlm_probs(self, query: Query, token_p: np.ndarray, words: Sequence[Word]) -> np.ndarray:
        """p_MLM of each word: one-piece words from ``token_p``, multi-piece words by sequential fill."""
        out = np.zeros(len(words), dtype=np.float64)
        multi = []
        for i, w in enumerate(words):
            if w.multi_piece:
                multi.append(i)
            else:
                out[i] = float(token_p[w.pieces[0]])
        if multi:
            out[multi] = self.fill_probs(query.text, [words[i].pieces for i in multi], deadline=query.deadline)
        return out

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

    # ---- the answer --------------------------------------------------------------------------------------

    def candidates(self, query: Query, enc: QueryEncoding, nbrs: Neighbours) -> tuple[list[Word], np.ndarray]:
        """Candidate words (neighbours' words first, then the MLM's top one-piece words) and each neighbour's
        candidate index."""
        words: list[Word] = []
        index: dict[str, int] = {}
        labels = np.empty(len(nbrs), dtype=np.int64)
        for n, row in enumerate(nbrs.rows):
            entry = self.datastore.word_at(int(row))
            c = index.get(entry.text)
            if c is None:
                c = index[entry.text] = len(words)
                words.append(entry)  # the shard's word-table entry (frozen)
            labels[n] = c
        want, taken = max(query.top_k, MLM_CANDIDATES), 0
        for token_id in enc.ranked_ids():  # most probable first
            w = self.token_word(int(token_id))
            if w is None or (not query.any_token and is_punctuation(w.text)):  # a cloze answer is a word
                continue
            if w.text not in index:
                index[w.text] = len(words)
                words.append(w)
            taken += 1
            if taken >= want:
                break
        return words, labels

    def answer(
        self, query: Query, enc: QueryEncoding, articles: list[ArticleHit], nbrs: Neighbours, *, with_distributions: bool
    ) -> Assembled:
        token_p = enc.p_mlm()
        words, labels = self.candidates(query, enc, nbrs)
        p_mlm = self.mlm_probs(query, token_p, words).astype(np.float32)
        assert query.temperature is not None, "the pipeline resolves temperature auto"
        offsets = knn_offsets(query, nbrs.article, articles)
        p_knn = knn_distribution(nbrs.distances, labels, len(words), query.temperature, offsets)
        p_knn = weigh_vote(p_knn, p_mlm, query.mlm_prior)
        lam = lambda_for(query, p_mlm, p_knn, nbrs)
        p = interpolate(p_knn, p_mlm, lam)
        preds = []
        best, shown = self.reader.top_with_support(p, query, nbrs, labels)
        for c, prob in best:
            w = words[c]
            token_id = w.pieces[0] if not w.multi_piece else -1
            preds.append(
                Prediction(w.text, token_id, prob, float(p_mlm[c]), float(p_knn[c]), shown[c], len(w.pieces))
            )
        mlm = [TokenProb(words[c].text, pr) for c, pr in top_k(p_mlm, query.top_k)]
        knn = [TokenProb(words[c].text, pr) for c, pr in top_k(p_knn, query.top_k, nonzero=True)]
        dists = WordDistributions(p_mlm, p_knn, p, tuple(words), token_p) if with_distributions else None
        return Assembled(preds, mlm, knn, lam, dists, self.reader.articles_seen(query, nbrs, articles))

