"""Compact, self-checking byte encodings of cached values (no pickle): query encodings and retrieval results."""

from __future__ import annotations

import json
import struct
import zlib
from dataclasses import dataclass

import numpy as np

from bertknn.core.errors import CorruptCacheValue
from bertknn.core.topk import top_entries, top_set

_ENC_MAGIC = b"BKE1"
_ENC_HEADER = struct.Struct("<4sIII")  # magic, hidden, n_top, vocab


@dataclass(frozen=True)
class QueryEncoding:
    """The expensive part of a query: its [MASK] embedding and the head of p_MLM (float16, the top entries).

    The answer is always computed from this compact form, whether it came from the model or the cache, so a
    cached answer is identical to an uncached one.
    """

    embedding: np.ndarray  # float16 [hidden]
    top_ids: np.ndarray  # int32 [n], ascending: the ids of the n most probable entries (a set, not a ranking)
    top_probs: np.ndarray  # float16 [n], p_MLM at top_ids
    vocab_size: int

    @classmethod
    def from_log_probs(cls, embedding: np.ndarray, log_probs: np.ndarray, n_top: int) -> QueryEncoding:
        """From the whole log p_MLM: its ``n_top`` largest entries are kept (`top_set`: ties by smaller id)."""
        values, ids = top_set(log_probs, n_top)
        return cls.from_top(embedding, values, ids, len(log_probs))

    @classmethod
    def from_top(
        cls, embedding: np.ndarray, top_log_probs: np.ndarray, top_ids: np.ndarray, vocab_size: int
    ) -> QueryEncoding:
        """From the largest entries of log p_MLM, in any order (`top_set`'s id order, `top_entries`' ranking):
        they are kept in id order, so that the same entries always make the same encoding (and bytes)."""
        ids, values = _in_id_order(np.asarray(top_ids), np.asarray(top_log_probs, dtype=np.float32))
        return cls(
            np.asarray(embedding, dtype=np.float16),
            ids.astype(np.int32),
            probs_to_float16(np.exp(values.astype(np.float64))),
            vocab_size,
        )

    def bare(self) -> QueryEncoding:
        """The same encoding without the arrays requests derived from it (`p_mlm`'s vocabulary-sized one): what a
        cache keeps."""
        return QueryEncoding(self.embedding, self.top_ids, self.top_probs, self.vocab_size)

    def ranked_ids(self) -> np.ndarray:
        """The stored ids most probable first (ties by smaller id)."""
        _, order = top_entries(self.top_probs.astype(np.float32), len(self.top_ids))  # top_ids ascending
        return self.top_ids[order]

    def p_mlm(self) -> np.ndarray:
        """The full distribution: stored entries exact, the remaining mass spread evenly over the rest.

        Built once per encoding (the adaptive rule and the interpolation both read it) and returned read-only.
        """
        cached = self.__dict__.get("_p_mlm")
        if cached is None:
            stored, rest_value = self._normalised()
            cached = np.full(self.vocab_size, rest_value, dtype=np.float32)
            cached[self.top_ids] = stored
            cached.flags.writeable = False
            object.__setattr__(self, "_p_mlm", cached)
        return cached

    def p_mlm_at(self) -> PMlmAt:
        """`p_mlm` read at given ids without building the vocabulary-sized array (the same float32 values)."""
        return PMlmAt(self)

    def rest_p_mlm(self) -> float | None:
        """p_MLM of every id not stored (the value `p_mlm` has there); None when every id is stored."""
        return None if len(self.top_ids) >= self.vocab_size else float(self._normalised()[1])

    def _normalised(self) -> tuple[np.ndarray, np.float32]:
        """(p_MLM at ``top_ids`` float32, p_MLM at every other id), computed once."""
        cached = self.__dict__.get("_normalised_p")
        if cached is None:
            top = self.top_probs.astype(np.float64)
            rest = self.vocab_size - len(top)
            stored = float(top.sum())  # exact (float16 values summed in float64), so in any order the same
            fill = max(0.0, 1.0 - stored) / rest if rest else 0.0
            total = stored + fill * rest  # normalised to sum 1 (float16 rounding of the stored entries)
            values = (top / total).astype(np.float32)
            values.flags.writeable = False
            cached = (values, np.float32(fill / total))
            object.__setattr__(self, "_normalised_p", cached)
        return cached

    def to_bytes(self) -> bytes:
        body = (
            _ENC_HEADER.pack(_ENC_MAGIC, len(self.embedding), len(self.top_ids), self.vocab_size)
            + self.embedding.astype("<f2").tobytes()
            + self.top_ids.astype("<i4").tobytes()
            + self.top_probs.astype("<f2").tobytes()
        )
        return body + struct.pack("<I", zlib.crc32(body))

    @classmethod
    def from_bytes(cls, data: bytes, *, hidden: int, vocab_size: int) -> QueryEncoding:
        if len(data) < _ENC_HEADER.size + 4:
            raise CorruptCacheValue("too short")
        body, (crc,) = data[:-4], struct.unpack("<I", data[-4:])
        if zlib.crc32(body) != crc:
            raise CorruptCacheValue("checksum mismatch")
        magic, h, n, v = _ENC_HEADER.unpack_from(body)
        if magic != _ENC_MAGIC or h != hidden or v != vocab_size or n > v:
            raise CorruptCacheValue("header does not fit this model")
        if len(body) != _ENC_HEADER.size + 2 * h + 6 * n:
            raise CorruptCacheValue("length mismatch")
        off = _ENC_HEADER.size
        emb = np.frombuffer(body, "<f2", h, off).astype(np.float16)
        ids = np.frombuffer(body, "<i4", n, off + 2 * h).astype(np.int32)
        probs = np.frombuffer(body, "<f2", n, off + 2 * h + 4 * n).astype(np.float16)
        if (ids < 0).any() or (ids >= v).any() or not np.isfinite(emb).all() or not np.isfinite(probs).all():
            raise CorruptCacheValue("values out of range")
        ids, probs = _in_id_order(ids, probs)  # (values written most probable first are read too)
        if (ids[1:] == ids[:-1]).any():
            raise CorruptCacheValue("repeated ids")
        return cls(emb, ids, probs, v)


_F16_SMALLEST_NORMAL = 2.0**-14
_F16_SUBNORMAL_STEP = 2.0**-24


def probs_to_float16(probs: np.ndarray) -> np.ndarray:
    """Probabilities (float64, at least 0) as float16, bit for bit numpy's ``astype(np.float16)`` (to nearest, ties
    to even), without numpy's slow path for float16's subnormal range, where most of p_MLM's kept entries fall
    (docs/decisions/float16-subnormals.md). There a float16's bits are its count of 2^-24 steps, and `np.rint`
    rounds that count as the cast does (a count of 1024 is the smallest normal float16's bits)."""
    small = probs < _F16_SMALLEST_NORMAL
    if not small.any():
        return probs.astype(np.float16)
    bits = np.empty(probs.shape, dtype=np.uint16)
    bits[small] = np.rint(probs[small] * (1.0 / _F16_SUBNORMAL_STEP)).astype(np.uint16)
    normal = ~small
    bits[normal] = probs[normal].astype(np.float16).view(np.uint16)
    return bits.view(np.float16)


def _in_id_order(ids: np.ndarray, values: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``ids`` ascending, ``values`` along with them (as they are when already in that order)."""
    if len(ids) > 1 and not (ids[1:] > ids[:-1]).all():
        order = np.argsort(ids, kind="stable")
        return ids[order], values[order]
    return ids, values


def encode_hits(hits: list[tuple[str, float | None, str]]) -> bytes:
    body = json.dumps(hits, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    return body + struct.pack("<I", zlib.crc32(body))


def decode_hits(data: bytes) -> list[tuple[str, float | None, str]]:
    if len(data) < 4:
        raise CorruptCacheValue("too short")
    body, (crc,) = data[:-4], struct.unpack("<I", data[-4:])
    if zlib.crc32(body) != crc:
        raise CorruptCacheValue("checksum mismatch")
    try:
        raw = json.loads(body)
        return [(str(t), None if s is None else float(s), str(r)) for t, s, r in raw]
    except (ValueError, TypeError) as exc:
        raise CorruptCacheValue("not a hit list") from exc


class PMlmAt:
    """``enc.p_mlm()[ids]`` for arrays of ids, by binary search in the stored ids (kept in id order): the
    interpolation reads p_MLM at a few hundred ids, and the dense array of the whole vocabulary cost more."""

    def __init__(self, enc: QueryEncoding):
        self._ids = enc.top_ids
        self._stored, self._rest = enc._normalised()
        self._vocab = enc.vocab_size

    def __len__(self) -> int:
        return self._vocab

    def __getitem__(self, ids: np.ndarray) -> np.ndarray:
        if ids is self._ids:  # every stored entry (read-only)
            return self._stored
        ids = np.asarray(ids)
        out = np.full(ids.shape, self._rest, dtype=np.float32)
        if len(self._ids):
            pos = np.minimum(np.searchsorted(self._ids, ids), len(self._ids) - 1)
            hit = self._ids[pos] == ids
            out[hit] = self._stored[pos[hit]]
        return out
