"""p_kNN and the interpolation against hand computations."""

from __future__ import annotations

import math

import numpy as np
import pytest

from service.interpolate import interpolate, knn_distribution, rank_of, top_k


def test_knn_distribution_matches_hand_computation():
    # neighbours: d = [0, 6, 12] labelled [2, 2, 3]; l = 6 -> weights e^0, e^-1, e^-2 normalised
    d = np.array([0.0, 6.0, 12.0])
    labels = np.array([2, 2, 3])
    p = knn_distribution(d, labels, vocab_size=5, temperature=6.0)
    z = 1 + math.exp(-1) + math.exp(-2)
    assert p[2] == pytest.approx((1 + math.exp(-1)) / z, rel=1e-6)  # a sum over both neighbours of word 2
    assert p[3] == pytest.approx(math.exp(-2) / z, rel=1e-6)
    assert p[[0, 1, 4]].sum() == 0
    assert p.sum() == pytest.approx(1.0, abs=1e-6)


def test_sum_not_nearest_only():
    # word 1 has the single nearest neighbour, word 2 has many slightly farther ones: the sum lets 2 win
    d = np.array([1.0, 1.5, 1.5, 1.5])
    labels = np.array([1, 2, 2, 2])
    p = knn_distribution(d, labels, 4, 6.0)
    assert p[2] > p[1]


def test_stable_for_huge_distances():
    d = np.array([1e6, 1e6 + 6.0])
    p = knn_distribution(d, np.array([0, 1]), 2, 6.0)
    assert np.isfinite(p).all()
    assert p[0] == pytest.approx(1 / (1 + math.exp(-1)), rel=1e-6)


def test_empty_neighbours_give_zeros():
    p = knn_distribution(np.zeros(0), np.zeros(0, int), 7, 6.0)
    assert p.shape == (7,) and p.sum() == 0


def test_interpolation_hand_computed_and_sums_to_one():
    p_knn = np.array([0.0, 1.0, 0.0])
    p_mlm = np.array([0.5, 0.25, 0.25])
    p = interpolate(p_knn, p_mlm, 0.3)
    assert p == pytest.approx([0.35, 0.475, 0.175])
    assert p.sum() == pytest.approx(1.0)
    with pytest.raises(ValueError):
        interpolate(p_knn, p_mlm, 1.5)


def test_top_k_and_rank():
    p = np.array([0.1, 0.4, 0.1, 0.3, 0.1])
    assert [i for i, _ in top_k(p, 3)] == [1, 3, 0]  # ties broken by the lower id
    assert rank_of(p, 1) == 1 and rank_of(p, 3) == 2 and rank_of(p, 0) == 3 and rank_of(p, 4) == 5
    assert top_k(np.array([0.0, 0.5, 0.5]), 3, nonzero=True) == [(1, 0.5), (2, 0.5)]


def test_fp16_search_matches_exact_float32_distances() -> None:
    from service.retrieval.knn import fp16_search

    rng = np.random.default_rng(3)
    rows = (rng.standard_normal((257, 24)) * 3).astype(np.float16)
    q = rng.standard_normal(24).astype(np.float32)
    exact = ((rows.astype(np.float32) - q[None, :]) ** 2).sum(axis=1)
    d, idx = fp16_search(rows, q, 10)
    assert list(idx) == list(np.argsort(exact, kind="stable")[:10])
    np.testing.assert_allclose(d, exact[idx], rtol=1e-5)
    d_all, idx_all = fp16_search(rows[:5], q, 10)  # k larger than the rows: all of them, nearest first
    assert sorted(idx_all.tolist()) == [0, 1, 2, 3, 4] and np.all(np.diff(d_all) >= 0)
