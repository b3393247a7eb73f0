"""Codecs: distances over codes against exact ones on known vectors; the temperature statistic on known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bertknn.core.calibration import (
    FIXED_STATISTIC,
    PAPER_TEMPERATURE,
    STATISTIC,
    AutoTemperature,
    fit_temperature,
    temperature_for,
)
from bertknn.core.format import DistanceScale
from bertknn.core.format.codec import CodecSpec, code_index, decode, encode, rows_index, train_codec


def _exact(q: np.ndarray, xb: np.ndarray) -> np.ndarray:
    return ((xb.astype(np.float64) - q.astype(np.float64)[None, :]) ** 2).sum(axis=1)


def _search_all(index, q: np.ndarray, n: int) -> np.ndarray:
    """Distances of q to every row, in row order."""
    d, i = index.search(q.reshape(1, -1).astype(np.float32), n)
    out = np.empty(n)
    out[i[0]] = d[0]
    return out


def test_pq_codes_of_vectors_it_can_represent_give_exact_distances() -> None:
    """Each 4-dim block of every vector is one of 5 prototypes: 8 sub-quantizers of 256 centroids represent them
    exactly, so the distances over the codes are the exact ones."""
    rng = np.random.default_rng(0)
    dim, m = 32, 8
    protos = rng.standard_normal((m, 5, dim // m)).astype(np.float32) * 3
    choice = rng.integers(0, 5, size=(600, m))
    xb = np.concatenate([protos[j, choice[:, j]] for j in range(m)], axis=1)
    codec = train_codec(CodecSpec("pq", code_bytes=m, rotation="none"), xb)
    codes = encode(codec, xb)
    assert codes.shape == (600, m) and codes.dtype == np.uint8
    np.testing.assert_allclose(decode(codec, codes), xb, atol=1e-4)
    q = rng.standard_normal(dim).astype(np.float32)
    np.testing.assert_allclose(_search_all(code_index(codec, codes), q, 600), _exact(q, xb), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("spec", [CodecSpec("int8"), CodecSpec("pq", code_bytes=8, rotation="opq"),
                                  CodecSpec("pq", code_bytes=8, rotation="none")])
def test_distances_over_codes_are_the_distances_to_what_the_codes_stand_for(spec: CodecSpec) -> None:
    """Asymmetric distances: the float query against each code's reconstruction, exactly (an orthogonal rotation
    keeps them); and close to the true distances on clustered data (neighbours found)."""
    rng = np.random.default_rng(1)
    centres = rng.standard_normal((20, 32)).astype(np.float32) * 4
    xb = (centres[rng.integers(0, 20, 2000)] + 0.3 * rng.standard_normal((2000, 32))).astype(np.float32)
    codec = train_codec(spec, xb)
    codes = encode(codec, xb)
    assert codes.shape[1] == spec.code_size(32)
    q = xb[7] + 0.05 * rng.standard_normal(32).astype(np.float32)
    got = _search_all(code_index(codec, codes), q, len(xb))
    np.testing.assert_allclose(got, _exact(q, decode(codec, codes)), rtol=1e-3, atol=1e-2)
    exact = _exact(q, xb)
    rel = np.abs(got - exact) / exact.mean()
    assert np.median(rel) < (0.01 if spec.name == "int8" else 0.1)
    # the true nearest row is among the 5 nearest codes
    assert int(np.argmin(exact)) in np.argsort(got)[:5]


def test_int8_error_is_bounded_by_the_quantisation_step() -> None:
    rng = np.random.default_rng(2)
    xb = rng.uniform(-2, 2, size=(500, 16)).astype(np.float32)
    codec = train_codec(CodecSpec("int8"), xb)
    step = (xb.max(axis=0) - xb.min(axis=0)) / 255
    err = np.abs(decode(codec, encode(codec, xb)) - xb)
    assert (err <= step[None, :] * 0.51 + 1e-6).all()


def test_training_is_deterministic_for_a_seed_and_uses_a_sample() -> None:
    rng = np.random.default_rng(3)
    xb = rng.standard_normal((3000, 32)).astype(np.float32)
    spec = CodecSpec("pq", code_bytes=8, rotation="opq", train_contexts=1000, seed=5)
    a, b = train_codec(spec, xb), train_codec(spec, xb)
    np.testing.assert_array_equal(encode(a, xb), encode(b, xb))
    other = train_codec(CodecSpec("pq", code_bytes=8, rotation="opq", train_contexts=1000, seed=6), xb)
    assert not np.array_equal(encode(a, xb), encode(other, xb))
    # the seed also seeds k-means, not only the sample: every vector taken, two seeds, two codecs
    sub = xb[:1000]
    whole = [train_codec(CodecSpec("pq", code_bytes=8, train_contexts=len(sub), seed=s), sub) for s in (5, 6)]
    assert not np.array_equal(encode(whole[0], sub), encode(whole[1], sub))


def test_pca_rotation_codes_fewer_dimensions() -> None:
    rng = np.random.default_rng(4)
    xb = rng.standard_normal((1000, 32)).astype(np.float32)
    spec = CodecSpec("pq", code_bytes=4, rotation="pca", pca_dim=16)
    assert spec.factory(32) == "PCAR16,PQ4x8"
    codec = train_codec(spec, xb)
    assert encode(codec, xb[:3]).shape == (3, 4)
    assert decode(codec, encode(codec, xb[:3])).shape == (3, 32)


def test_codecs_that_cannot_work_are_refused_with_the_minimum() -> None:
    with pytest.raises(ValueError, match="must divide the 32 coded dimensions"):
        CodecSpec("pq", code_bytes=12).check(32)
    with pytest.raises(ValueError, match="--pca-dim 64 must be between 1 and the model's 32"):
        CodecSpec("pq", code_bytes=8, rotation="pca", pca_dim=64).check(32)
    xb = np.zeros((100, 32), np.float32)
    with pytest.raises(ValueError, match="needs at least 256 vectors to train, got 100"):
        train_codec(CodecSpec("pq", code_bytes=8), xb)
    assert CodecSpec("pq", code_bytes=8, rotation="opq").min_train(768) == 768  # a rotation: one per dimension
    assert CodecSpec("int8").min_train(768) == 2


def test_rows_index_searches_float16_rows_exactly() -> None:
    rng = np.random.default_rng(5)
    xb = rng.standard_normal((50, 16)).astype(np.float16)
    q = rng.standard_normal(16).astype(np.float32)
    np.testing.assert_allclose(_search_all(rows_index(xb, None), q, 50), _exact(q, xb.astype(np.float32)), rtol=1e-5)


def test_the_temperature_statistic_finds_the_known_maximum_likelihood() -> None:
    """Two neighbours at distances 0 and D; in a fraction p of the samples the nearer one carries the context's word.
    The likelihood p log s + (1-p) log(1-s), s = sigmoid(D/l), peaks at s = p: l = D / ln(p / (1-p))."""
    D, p, n = 10.0, 0.8, 500
    distances = [np.array([0.0, D])] * n
    matches = [np.array([True, False])] * int(n * p) + [np.array([False, True])] * (n - int(n * p))
    want = D / math.log(p / (1 - p))
    got = fit_temperature(distances, matches)
    assert got is not None and abs(got - want) / want < 0.05, (got, want)
    # scaling every distance scales the temperature
    got10 = fit_temperature([d * 10 for d in distances], matches)
    assert got10 is not None and abs(got10 / got - 10) < 0.05 * 10
    # samples whose word is not among their neighbours carry no information: the same answer
    extra = [np.array([1.0, 2.0])] * 50
    assert fit_temperature(distances + extra, matches + [np.array([False, False])] * 50) == pytest.approx(got)


def test_the_relative_temperature_statistic_finds_the_known_maximum_likelihood() -> None:
    """The same two-neighbour likelihood, but each sample at its own distance scale s (its neighbours at 0 and
    2 s, so their median is s): with l = a * s the likelihood peaks where 2 / a = ln(p / (1-p)), for every s at once,
    which no single fixed l can fit."""
    p, n = 0.8, 600
    rng = np.random.default_rng(3)
    scales = rng.choice([5.0, 50.0, 500.0], size=n)
    distances = [np.array([0.0, 2 * s]) for s in scales]
    matches = [np.array([True, False]) if i < int(n * p) else np.array([False, True]) for i in range(n)]
    want = 2 / math.log(p / (1 - p))
    got = fit_temperature(distances, matches, [float(np.median(d)) for d in distances])
    assert got is not None and abs(got - want) / want < 0.05, (got, want)
    # samples whose scale is 0 say nothing about a factor: left out
    got0 = fit_temperature(distances + [np.zeros(2)] * 40, matches + [np.array([True, False])] * 40,
                           [float(np.median(d)) for d in distances] + [0.0] * 40)
    assert got0 == pytest.approx(got)


def test_auto_temperature_falls_back_to_the_paper_without_a_measurement() -> None:
    assert temperature_for(None) == AutoTemperature(None, PAPER_TEMPERATURE) and PAPER_TEMPERATURE == 6.0
    assert temperature_for(None).of(np.array([100.0, 200.0])) == 6.0
    # the earlier statistic: one l for every query, whatever its neighbours' distances
    fixed = temperature_for(DistanceScale(statistic=FIXED_STATISTIC, value=17.5, sample=10, seed=0))
    assert fixed.of(np.array([1.0, 3.0])) == fixed.of(np.array([100.0, 300.0])) == 17.5
    # the relative one: the factor times the median of the query's own neighbour distances
    auto = temperature_for(DistanceScale(statistic=STATISTIC, value=0.2, typical=20.0, sample=10, seed=0))
    assert auto.of(np.array([50.0, 100.0, 400.0])) == pytest.approx(20.0)
    assert auto.of(np.array([5.0, 10.0, 40.0])) == pytest.approx(2.0)
    assert auto.of(np.zeros(0)) == auto.of(np.zeros(3)) == 20.0  # no neighbours, or all at 0: the typical l
    assert temperature_for(DistanceScale(statistic=STATISTIC, value=0.2, sample=10, seed=0)).typical == 6.0
    assert temperature_for(DistanceScale(statistic="some-future-statistic", value=17.5, sample=10, seed=0)).typical == 6.0
    assert fit_temperature([], []) is None
    assert fit_temperature([np.array([1.0, 2.0])], [np.array([False, False])]) is None  # nothing to learn from
    assert fit_temperature([np.zeros(3)] * 5, [np.array([True, False, False])] * 5) is None  # all at distance 0


def test_auto_code_size_keeps_twelve_dimensions_per_byte() -> None:
    auto = CodecSpec("pq")
    assert (auto.pq_bytes(384), auto.pq_bytes(768), auto.pq_bytes(1024), auto.pq_bytes(32)) == (32, 64, 64, 2)
    assert auto.factory(768) == "PQ64x8" and auto.code_size(768) == 64
    assert CodecSpec("pq", code_bytes=96).pq_bytes(384) == 96  # an explicit size wins
    assert CodecSpec("pq", rotation="pca", pca_dim=192).pq_bytes(384) == 16  # counted on the coded dimensions
