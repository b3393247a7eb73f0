"""Cached values: compact, self-checking, and exactly what the uncached path computes."""

from __future__ import annotations

import numpy as np
import pytest

from service.cache import InMemoryCache, cache_key
from service.codec import CorruptValue, QueryEncoding, decode_hits, encode_hits


def _enc(seed: int = 0, vocab: int = 100, hidden: int = 8) -> QueryEncoding:
    rng = np.random.default_rng(seed)
    logits = rng.normal(size=vocab)
    log_probs = logits - np.log(np.exp(logits).sum())
    return QueryEncoding.from_log_probs(rng.normal(size=hidden).astype(np.float32), log_probs, n_top=10)


def test_roundtrip_is_exact_and_distribution_sums_to_one():
    enc = _enc()
    back = QueryEncoding.from_bytes(enc.to_bytes(), hidden=8, vocab_size=100)
    assert np.array_equal(back.embedding, enc.embedding)
    assert np.array_equal(back.top_ids, enc.top_ids)
    assert np.array_equal(back.p_mlm(), enc.p_mlm())
    p = enc.p_mlm()
    assert p.sum() == pytest.approx(1.0, abs=1e-5)
    assert int(np.argmax(p)) == int(enc.top_ids[0])
    assert (np.diff(enc.top_probs.astype(np.float32)) <= 0).all()


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "other_model"])
def test_corrupted_values_are_rejected(damage):
    raw = bytearray(_enc().to_bytes())
    if damage == "flip":
        raw[20] ^= 0xFF
    elif damage == "truncate":
        raw = raw[:-7]
    elif damage == "empty":
        raw = bytearray()
    with pytest.raises(CorruptValue):
        QueryEncoding.from_bytes(bytes(raw), hidden=8 if damage != "other_model" else 16, vocab_size=100)


def test_hits_roundtrip_and_corruption():
    hits = [("Émile Grusk", None, "subject"), ("Plonk", 3.5, "bm25")]
    assert decode_hits(encode_hits(hits)) == hits
    with pytest.raises(CorruptValue):
        decode_hits(encode_hits(hits)[:-1] + b"x")


def test_keys_are_namespaced_digests():
    k = cache_key("bertknn", "enc", "a'; FLUSHALL", (1, 2))
    prefix, kind, digest = k.split(":")
    assert (prefix, kind, len(digest)) == ("bertknn", "enc", 64)
    assert k != cache_key("bertknn", "enc", "a'; FLUSHALL", (1, 3))


def test_lru_evicts_oldest():
    c = InMemoryCache(2)
    c.set_many({"a": b"1", "b": b"2"})
    assert c.get_many(["a"]) == [b"1"]  # a is now the most recent
    c.set_many({"c": b"3"})
    assert c.get_many(["a", "b", "c"]) == [b"1", None, b"3"]
