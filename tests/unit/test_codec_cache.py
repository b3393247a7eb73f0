"""Cached values: compact, self-checking, and exactly what the uncached path computes."""

from __future__ import annotations

import struct
import zlib
from unittest import mock

import numpy as np
import pytest

from bertknn.core.errors import CorruptCacheValue
from bertknn.service.cache import InMemoryCache, cache_key
from bertknn.service.codec import QueryEncoding, decode_hits, encode_hits


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
    assert (np.diff(enc.top_ids) > 0).all()  # kept in id order
    ranked = enc.ranked_ids()
    assert int(np.argmax(p)) == int(ranked[0])
    assert (np.diff(p[ranked]) <= 0).all() and sorted(ranked.tolist()) == enc.top_ids.tolist()


def test_bytes_written_most_probable_first_decode_to_the_same_encoding():
    # an earlier version stored the entries most probable first: such cached values still read the same
    enc = _enc(seed=5)
    order = enc.ranked_ids()
    pos = np.searchsorted(enc.top_ids, order)
    old = QueryEncoding(enc.embedding, enc.top_ids[pos], enc.top_probs[pos], enc.vocab_size)
    back = QueryEncoding.from_bytes(old.to_bytes(), hidden=8, vocab_size=100)
    assert np.array_equal(back.top_ids, enc.top_ids) and np.array_equal(back.top_probs, enc.top_probs)
    assert back.to_bytes() == enc.to_bytes()
    repeated = QueryEncoding(enc.embedding, np.r_[enc.top_ids[1:], enc.top_ids[1]], enc.top_probs, 100)
    with pytest.raises(CorruptCacheValue, match="repeated"):
        QueryEncoding.from_bytes(repeated.to_bytes(), hidden=8, vocab_size=100)


@pytest.mark.parametrize("damage", ["flip", "truncate", "empty", "other_model"])
def test_corrupted_values_are_rejected(damage):
    raw = bytearray(_enc().to_bytes())
    if damage == "flip":
        raw[20] ^= 0xFF
    elif damage == "truncate":
        raw = raw[:-7]
    elif damage == "empty":
        raw = bytearray()
    with pytest.raises(CorruptCacheValue):
        QueryEncoding.from_bytes(bytes(raw), hidden=8 if damage != "other_model" else 16, vocab_size=100)


def test_hits_roundtrip_and_corruption():
    hits = [("Émile Grusk", None, "subject"), ("Plonk", 3.5, "bm25")]
    assert decode_hits(encode_hits(hits)) == hits
    with pytest.raises(CorruptCacheValue):
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


# ---- selecting the stored p_MLM entries -------------------------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hypothesis.extra import numpy as hnp  # noqa: E402

from bertknn.core import topk  # noqa: E402
from bertknn.core.topk import top_entries, top_set  # noqa: E402


def _full_sort_top(row: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    """The reference: a stable sort of the whole row (largest first, ties by smaller id)."""
    idx = np.argsort(-row, kind="stable")[:k]
    return row[idx], idx


@settings(max_examples=300, deadline=None)
@given(
    row=hnp.arrays(np.float32, st.integers(1, 400), elements=st.sampled_from([-30.0, -7.5, -7.0, -2.0, -1.0, 0.0])
                   | st.floats(-40, 0, width=32)),
    k=st.integers(0, 450),
)
def test_top_entries_equals_a_full_stable_sort(row: np.ndarray, k: int) -> None:
    # many ties (the sampled values) and rows where the sampled threshold keeps too few candidates; each row
    # ranked both ways: sorted whole (as a row this short is) and through the candidates (as a longer row is)
    want_values, want_ids = _full_sort_top(row, k)
    for whole_below in (topk.SORT_WHOLE_BELOW, 0):
        with mock.patch.object(topk, "SORT_WHOLE_BELOW", whole_below):
            values, ids = top_entries(row, k)
        assert np.array_equal(ids, want_ids), whole_below
        assert np.array_equal(values, want_values), whole_below
    # top_set: the same entries, in id order
    set_values, set_ids = top_set(row, k)
    order = np.argsort(want_ids)
    assert np.array_equal(set_ids, want_ids[order]) and np.array_equal(set_values, want_values[order])


def test_top_entries_on_a_vocabulary_sized_distribution() -> None:
    rng = np.random.default_rng(3)
    for scale, ties in ((0.5, True), (3.0, True), (12.0, True), (3.0, False)):  # flat to peaked
        logits = (rng.standard_normal(30522) * scale).astype(np.float32)
        if ties:  # ties, some of them around the boundary (the stable sort decides); else the SIMD sort's order
            logits[rng.integers(0, 30522, 500)] = logits[7]
        log_probs = logits - np.log(np.exp(logits.astype(np.float64)).sum()).astype(np.float32)
        for k in (16, 2048, 30522):
            values, ids = top_entries(log_probs, k)
            want_values, want_ids = _full_sort_top(log_probs, k)
            assert np.array_equal(ids, want_ids) and np.array_equal(values, want_values)
            set_values, set_ids = top_set(log_probs, k)
            order = np.argsort(want_ids)
            assert np.array_equal(set_ids, want_ids[order]) and np.array_equal(set_values, want_values[order])


def test_from_top_keeps_entries_in_id_order_whatever_their_order() -> None:
    rng = np.random.default_rng(4)
    logits = rng.integers(-6, 0, 200).astype(np.float32)  # many ties
    values, ids = top_entries(logits, 50)
    emb = rng.normal(size=8).astype(np.float32)
    canonical = QueryEncoding.from_top(emb, values, ids, 200)
    shuffled = rng.permutation(50)
    again = QueryEncoding.from_top(emb, values[shuffled], ids[shuffled], 200)
    assert np.array_equal(again.top_ids, canonical.top_ids)
    assert np.array_equal(again.top_probs, canonical.top_probs)
    assert np.array_equal(QueryEncoding.from_log_probs(emb, logits, 50).top_ids, canonical.top_ids)
    assert (np.diff(canonical.top_ids) > 0).all() and again.to_bytes() == canonical.to_bytes()


@pytest.mark.parametrize(("vocab", "n_top"), [(100, 10), (100, 100), (30, 1)])
def test_p_mlm_at_reads_the_dense_distribution_without_building_it(vocab: int, n_top: int) -> None:
    rng = np.random.default_rng(vocab + n_top)
    logits = rng.normal(size=vocab) * 3
    enc = QueryEncoding.from_log_probs(rng.normal(size=8).astype(np.float32), logits - np.log(np.exp(logits).sum()), n_top)
    at = enc.p_mlm_at()
    assert "_p_mlm" not in enc.__dict__  # the dense array was not built
    ids = np.concatenate((rng.integers(0, vocab, 50), enc.top_ids, [0, vocab - 1]))
    got = at[ids]
    assert got.dtype == np.float32 and len(at) == vocab
    assert np.array_equal(got, enc.p_mlm()[ids])  # bit for bit
    assert np.array_equal(at[np.zeros(0, np.int64)], np.zeros(0, np.float32))


def test_probabilities_become_the_float16_bits_numpys_cast_makes() -> None:
    """`probs_to_float16` equals ``astype(np.float16)`` bit for bit: p_MLM's kept entries of real shape (mostly in
    float16's subnormal range), the range's edges, the ties between two steps (to even), values that round up into
    the normal range or down to 0, and arrays with no subnormal at all."""
    from bertknn.service.codec import probs_to_float16

    rng = np.random.default_rng(7)
    step, normal = 2.0**-24, 2.0**-14
    edges = [0.0, step / 2, step * 0.5000001, step, step * 1.5, step * 2.5, step * 3.5, normal - step / 2,
             normal - step / 4, normal - step * 0.75, normal, normal * (1 + 2**-11), 0.5, 1.0]  # fmt: skip
    cases = [
        np.exp(rng.normal(-14, 3, 2048)),  # a question's top 2,048 entries, as exp(log p)
        np.exp(rng.uniform(np.log(step / 4), np.log(normal * 4), 100_000)),  # across the subnormal range
        (rng.integers(0, 2048, 10_000) + 0.5) * step,  # every tie between two steps
        np.array(edges),
        rng.uniform(0.01, 1.0, 500),  # no subnormal at all
        np.array([]),
    ]
    for probs in cases:
        got, want = probs_to_float16(probs), probs.astype(np.float16)
        assert got.dtype == np.float16 and got.shape == want.shape
        np.testing.assert_array_equal(got.view(np.uint16), want.view(np.uint16))


def _hand_made(top_probs: list[float], ids: list[int], vocab: int) -> QueryEncoding:
    return QueryEncoding(np.ones(4, np.float16), np.array(ids, np.int32), np.array(top_probs, np.float16), vocab)


def test_p_mlm_is_the_stored_entries_and_the_rest_spread_evenly() -> None:
    """Stored 0.5 + 0.25: the remaining 0.25 over the 4 other ids; stored entries that sum over 1 (float16
    rounding) are scaled to 1 and the rest get nothing; with every id stored there is no rest."""
    enc = _hand_made([0.5, 0.25], [1, 4], vocab=6)
    np.testing.assert_array_equal(enc.p_mlm(), np.array([0.0625, 0.5, 0.0625, 0.0625, 0.25, 0.0625], np.float32))
    assert enc.rest_p_mlm() == 0.0625 and enc.p_mlm() is enc.p_mlm()  # built once
    over = _hand_made([0.75, 0.5], [0, 2], vocab=4)
    np.testing.assert_array_equal(over.p_mlm(), np.array([0.6, 0.0, 0.4, 0.0], np.float32))
    assert over.rest_p_mlm() == 0.0
    full = _hand_made([0.5, 0.25, 0.25], [0, 1, 2], vocab=3)
    assert full.rest_p_mlm() is None and np.array_equal(full.p_mlm(), np.array([0.5, 0.25, 0.25], np.float32))
    for shared in (enc.p_mlm(), enc._normalised()[0]):  # shared by every reader of the encoding: read-only
        with pytest.raises(ValueError, match="read-only"):
            shared[0] = 1.0


def test_bare_is_the_same_encoding_without_what_requests_derived() -> None:
    enc = _hand_made([0.5, 0.25], [1, 4], vocab=6)
    enc.p_mlm()
    bare = enc.bare()
    assert "_p_mlm" in enc.__dict__ and "_p_mlm" not in bare.__dict__ and "_normalised_p" not in bare.__dict__
    assert bare.to_bytes() == enc.to_bytes() and np.array_equal(bare.p_mlm(), enc.p_mlm())


def test_two_entries_given_highest_id_first_are_kept_in_id_order() -> None:
    enc = QueryEncoding.from_top(np.ones(4), np.log([0.5, 0.25]), np.array([7, 3]), 10)
    assert enc.top_ids.tolist() == [3, 7] and enc.top_probs.tolist() == [0.25, 0.5]
    assert enc.p_mlm_at()[[3, 7, 0]].tolist() == [0.25, 0.5, 0.03125]  # (a list of ids too)


def test_an_encoding_of_every_id_round_trips() -> None:
    enc = _enc(vocab=12)
    every = QueryEncoding.from_log_probs(enc.embedding, np.log(np.full(12, 1 / 12)), n_top=12)
    back = QueryEncoding.from_bytes(every.to_bytes(), hidden=8, vocab_size=12)
    assert back.top_ids.tolist() == list(range(12)) and back.rest_p_mlm() is None


def _sealed(body: bytes) -> bytes:
    """A value with a valid checksum (what a bug, not a damaged disk, writes)."""
    return body + struct.pack("<I", zlib.crc32(body))


@pytest.mark.parametrize(
    ("ids", "embedding_value", "error"),
    [([0, 99], 1.0, None), ([0, 100], 1.0, "out of range"), ([-1, 5], 1.0, "out of range"),
     ([0, 5], np.inf, "out of range"), ([0, 5], np.nan, "out of range")],
)  # fmt: skip
def test_values_with_a_valid_checksum_but_out_of_range_are_rejected(
    ids: list[int], embedding_value: float, error: str | None
) -> None:
    probs = np.array([0.5, 0.25], np.float16)
    enc = QueryEncoding(np.full(8, embedding_value, np.float16), np.array(ids, np.int32), probs, 100)
    if error is None:  # the first and the last id are ids
        assert QueryEncoding.from_bytes(enc.to_bytes(), hidden=8, vocab_size=100).top_ids.tolist() == ids
        return
    with pytest.raises(CorruptCacheValue, match=error):
        QueryEncoding.from_bytes(enc.to_bytes(), hidden=8, vocab_size=100)


def test_a_body_of_the_wrong_length_or_a_json_value_that_is_no_hit_list_is_rejected() -> None:
    body = _enc().to_bytes()[:-4]
    with pytest.raises(CorruptCacheValue, match="length mismatch"):
        QueryEncoding.from_bytes(_sealed(body + b"\0\0"), hidden=8, vocab_size=100)
    with pytest.raises(CorruptCacheValue, match="length mismatch"):
        QueryEncoding.from_bytes(_sealed(body[:-2]), hidden=8, vocab_size=100)
    for short in (b"", b"abc"):
        with pytest.raises(CorruptCacheValue, match="too short"):
            decode_hits(short)
    for raw in (b'{"a": 1}', b"[1, 2]", b"[[1]]", b"not json"):
        with pytest.raises(CorruptCacheValue, match="not a hit list"):
            decode_hits(_sealed(raw))
