"""p_kNN and the interpolation against hand computations."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bertknn.service.interpolate import (
    article_offsets,
    interpolate,
    knn_distribution,
    knn_sparse,
    rank_of,
    top_k,
    weigh_vote,
)


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
    from bertknn.service.retrieval.knn import fp16_search

    rng = np.random.default_rng(3)
    rows = (rng.standard_normal((257, 24)) * 3).astype(np.float16)
    q = rng.standard_normal(24).astype(np.float32)
    exact = ((rows.astype(np.float32) - q[None, :]) ** 2).sum(axis=1)
    d, idx = fp16_search(rows, q, 10)
    assert list(idx) == list(np.argsort(exact, kind="stable")[:10])
    np.testing.assert_allclose(d, exact[idx], rtol=1e-5)
    d_all, idx_all = fp16_search(rows[:5], q, 10)  # k larger than the rows: all of them, nearest first
    assert sorted(idx_all.tolist()) == [0, 1, 2, 3, 4] and np.all(np.diff(d_all) >= 0)


# ---- the sparse path: same values and ranking as the dense one ------------------------------------------------

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from bertknn.service.codec import QueryEncoding  # noqa: E402
from bertknn.service.interpolate import interpolated_top_k, top_k_among  # noqa: E402


def reference_top(p: np.ndarray, k: int) -> list[tuple[int, float]]:
    """A full sort of the whole vocabulary by (-p, id): the documented ranking."""
    order = np.lexsort((np.arange(len(p)), -p))[:k]
    return [(int(i), float(p[i])) for i in order]


def test_knn_sparse_holds_the_non_zero_part_of_the_dense_distribution() -> None:
    d = np.array([0.0, 6.0, 12.0, 1e6])
    labels = np.array([7, 2, 7, 4])  # word 4's weight underflows to 0: left out
    ids, probs = knn_sparse(d, labels, 6.0)
    dense = knn_distribution(d, labels, 9, 6.0)
    assert ids.tolist() == [2, 7] and probs.dtype == np.float32
    np.testing.assert_array_equal(dense[ids], probs)
    assert dense.sum() == pytest.approx(probs.sum()) and dense[4] == 0
    assert [len(x) for x in knn_sparse(np.zeros(0), np.zeros(0, int), 6.0)] == [0, 0]


@settings(max_examples=300, deadline=None)
@given(
    seed=st.integers(0, 2**32 - 1),
    vocab=st.integers(20, 400),
    n_top=st.integers(1, 200),
    n_nbrs=st.integers(0, 40),
    lam=st.sampled_from([0.0, 0.3, 0.5, 1.0]),
    k=st.integers(1, 30),
    alpha=st.sampled_from([0.1, 0.3, 3.0]),  # small alpha: many float16 probabilities tie (subnormals)
    order=st.sampled_from(["ids", "ranked", "shuffled"]),
)
def test_interpolated_top_k_equals_the_dense_ranking(
    seed: int, vocab: int, n_top: int, n_nbrs: int, lam: float, k: int, alpha: float, order: str
) -> None:
    rng = np.random.default_rng(seed)
    log_probs = np.log(np.maximum(rng.dirichlet(np.full(vocab, alpha)), 1e-30)).astype(np.float32)
    enc = QueryEncoding.from_log_probs(rng.standard_normal(8), log_probs, min(n_top, vocab))
    p_mlm = enc.p_mlm()
    d = np.sort(rng.uniform(0, 30, n_nbrs))
    labels = rng.integers(0, vocab, n_nbrs)
    ids, probs = knn_sparse(d, labels, 6.0)
    p = interpolate(knn_distribution(d, labels, vocab, 6.0), p_mlm, lam)
    # stored ids in the encoding's order (ids ascending), most probable first, or in any other order
    mlm_ids = {"ids": enc.top_ids, "ranked": enc.ranked_ids(), "shuffled": rng.permutation(enc.top_ids)}[order]
    got = interpolated_top_k(p_mlm, mlm_ids, ids, probs, lam, k, mlm_rest=enc.rest_p_mlm())
    # the same with p_MLM at the stored ids handed in (as the service does), and read through `PMlmAt`
    at = enc.p_mlm_at()
    assert interpolated_top_k(at, mlm_ids, ids, probs, lam, k, mlm_rest=enc.rest_p_mlm(), mlm_p=at[mlm_ids]) == got
    if got is None:  # only when an id with the shared remainder value of p_MLM could reach either top k
        outside = np.setdiff1d(np.arange(vocab), np.union1d(enc.top_ids, ids))
        assert len(outside) > 0
        kth_p, kth_m = reference_top(p, k)[-1][1], reference_top(p_mlm, k)[-1][1]
        assert p[outside].max() >= kth_p or p_mlm[outside].max() >= kth_m
        return
    best, mlm = got
    assert best == reference_top(p, k)
    assert mlm == reference_top(p_mlm, k)


def test_interpolated_top_k_ranks_only_the_head_of_a_vocabulary_sized_encoding() -> None:
    """The service's case: 2,048 stored entries, 128 neighbours; ties (float32, and more in float16) where the head ends."""
    import bertknn.service.interpolate as interp

    rng = np.random.default_rng(11)
    vocab = 30522
    logits = (rng.standard_normal(vocab) * 2.5).astype(np.float32)
    logits[rng.integers(0, vocab, 60)] = logits[np.argsort(-logits)[120]]  # a tie around the head's end
    log_probs = logits - np.float32(np.log(np.exp(logits.astype(np.float64)).sum()))
    enc = QueryEncoding.from_log_probs(rng.standard_normal(8), log_probs, 2048)
    p_mlm = enc.p_mlm()
    assert enc.rest_p_mlm() == p_mlm[np.setdiff1d(np.arange(vocab), enc.top_ids)[0]]
    sizes: list[int] = []
    ranked = interp._ranked
    interp._ranked = lambda p_m, cand, *a: sizes.append(len(cand)) or ranked(p_m, cand, *a)  # type: ignore[assignment]
    try:
        for lam in (0.0, 0.3, 1.0):
            for k in (1, 10, 30):
                d = np.sort(rng.uniform(0, 40, 128))
                labels = np.concatenate((rng.choice(enc.ranked_ids()[:300], 100), rng.integers(0, vocab, 28)))
                ids, probs = knn_sparse(d, labels, 6.0)
                sizes.clear()
                best, mlm = interpolated_top_k(p_mlm, enc.top_ids, ids, probs, lam, k, mlm_rest=enc.rest_p_mlm())
                p = interpolate(knn_distribution(d, labels, vocab, 6.0), p_mlm, lam)
                assert best == reference_top(p, k) and mlm == reference_top(p_mlm, k)
                assert len(sizes) == 1 and sizes[0] < 2048  # the head answered: not every stored entry
    finally:
        interp._ranked = ranked  # type: ignore[assignment]


def test_top_k_among_declines_when_the_rest_could_rank() -> None:
    ids, values = np.array([3, 5]), np.array([0.5, 0.2], dtype=np.float32)
    assert top_k_among(ids, values, 2, rest=0.1) == [(3, 0.5), (5, pytest.approx(0.2))]
    assert top_k_among(ids, values, 2, rest=0.2) is None  # a tie with the rest: lower ids outside could win
    assert top_k_among(ids, values, 3, rest=0.1) is None  # fewer listed than asked for
    assert top_k_among(ids, values, 3, rest=None) == [(3, 0.5), (5, pytest.approx(0.2))]


def test_interpolated_top_k_declines_when_the_remainder_outranks_the_stored_head() -> None:
    # a hand-made encoding whose stored entries hold little mass: every id not stored has a larger p_MLM
    top = np.array([0.02, 0.015, 0.012, 0.011, 0.0105, 0.0102, 0.0101, 0.0100, 0.0099, 0.0098], np.float16)
    enc = QueryEncoding(np.zeros(8, np.float16), np.arange(10, dtype=np.int32), top, 20)
    p_mlm = enc.p_mlm()
    assert enc.rest_p_mlm() == pytest.approx(p_mlm[15]) and p_mlm[15] > p_mlm[0]
    no_knn = np.zeros(0, np.int64), np.zeros(0, np.float32)
    assert interpolated_top_k(p_mlm, enc.top_ids, *no_knn, 0.3, 1, mlm_rest=enc.rest_p_mlm()) is None
    assert top_k(p_mlm, 1)[0][0] == 10  # the dense path's answer: the first id not stored


def test_top_k_breaks_ties_at_the_boundary_by_lower_id() -> None:
    p = np.zeros(5000, np.float32)
    p[[4321, 17, 999]] = 0.25
    p[3000] = 0.5
    assert [i for i, _ in top_k(p, 3)] == [3000, 17, 999]
    assert [i for i, _ in top_k(np.full(6, 0.1, np.float32), 2)] == [0, 1]


def test_weighted_vote_hand_computed() -> None:
    # vote 0.6 / 0.4 for words 1 and 2; p_MLM 0.01 and 0.09: with exponent 0.5 the weights are 0.6*0.1 and 0.4*0.3
    probs = np.array([0.6, 0.4], dtype=np.float32)
    w = weigh_vote(probs, np.array([0.01, 0.09]), 0.5)
    z = 0.6 * 0.1 + 0.4 * 0.3
    assert w[0] == pytest.approx(0.06 / z, rel=1e-6)
    assert w[1] == pytest.approx(0.12 / z, rel=1e-6)  # the word that fits the question now wins the vote
    assert float(w.sum()) == pytest.approx(1.0, abs=1e-6)


def test_weighted_vote_zero_is_the_papers_vote_and_keeps_total_mass() -> None:
    probs = np.array([0.5, 0.2, 0.0], dtype=np.float32)  # a dense vote that does not sum to one
    assert weigh_vote(probs, np.array([0.3, 0.1, 0.6]), 0.0) is probs
    w = weigh_vote(probs, np.array([0.3, 0.1, 0.6]), 1.0)
    assert w[2] == 0  # a word no neighbour voted for gets nothing, however well it fits
    assert float(w.sum()) == pytest.approx(0.7, rel=1e-6)
    with pytest.raises(ValueError, match="mlm_prior"):
        weigh_vote(probs, probs, -1.0)


def test_weighted_vote_survives_tiny_p_mlm() -> None:
    # p_MLM of 1e-300 for every word: a linear-space product would underflow to an all-zero vote
    w = weigh_vote(np.array([0.7, 0.3]), np.array([1e-300, 1e-301]), 2.0)
    assert np.isfinite(w).all() and float(w.sum()) == pytest.approx(1.0, abs=1e-6)
    assert w[0] > w[1]
    # a word with p_MLM exactly 0 keeps no vote; when every word has 0, the plain vote stands
    assert weigh_vote(np.array([0.7, 0.3]), np.array([0.0, 0.5]), 1.0).tolist() == [0.0, pytest.approx(1.0)]
    assert weigh_vote(np.array([0.7, 0.3]), np.array([0.0, 0.0]), 1.0).tolist() == pytest.approx([0.7, 0.3])


def test_article_offsets_hand_computed() -> None:
    # three articles scored 8, 8, 4: the second loses nothing, the third half its score -> -sharpness / 2
    off = article_offsets(np.array([0, 1, 2, 2]), [8.0, 8.0, 4.0], 10.0)
    assert off is not None
    assert off.tolist() == pytest.approx([0.0, 0.0, -5.0, -5.0])
    # in the softmax: a neighbour of the third article at the same distance weighs exp(-5) as much
    ids, probs = knn_sparse(np.array([1.0, 1.0]), np.array([3, 4]), 6.0, article_offsets(np.array([0, 2]), [8.0, 8.0, 4.0], 10.0))
    assert probs[1] / probs[0] == pytest.approx(math.exp(-5.0), rel=1e-5)


def test_article_offsets_off_when_nothing_ranks() -> None:
    arts = np.array([0, 1])
    assert article_offsets(arts, [8.0, 4.0], 0.0) is None  # the paper's: every article counts the same
    assert article_offsets(arts, [None, None], 10.0) is None  # the subject's own article: no scores
    assert article_offsets(np.array([0, 0]), [8.0], 10.0) is None  # one article
    assert article_offsets(arts, [0.0, 0.0], 10.0) is None  # no positive score
    assert article_offsets(None, [8.0, 4.0], 10.0) is None  # neighbours without their article (global search)
    with pytest.raises(ValueError, match="article_sharpness"):
        article_offsets(arts, [8.0, 4.0], -1.0)


def test_article_offsets_of_two_articles_and_of_scores_below_one() -> None:
    # BM25 gives scores above 1, TF-IDF's cosine below: both are weighted, from two articles on
    assert article_offsets(np.array([0, 1, 1]), [0.5, 0.25], 10.0).tolist() == pytest.approx([0.0, -5.0, -5.0])
    assert article_offsets(np.array([1, 0]), [3.0, 12.0], 4.0).tolist() == pytest.approx([0.0, -3.0])


def test_a_zero_temperature_is_refused() -> None:
    with pytest.raises(ValueError, match="temperature"):
        knn_sparse(np.array([1.0, 2.0]), np.array([0, 1]), 0.0)


def test_the_log_space_vote_weighs_as_the_linear_one_would() -> None:
    """Where the linear products underflow, the weights are still probs x p_MLM^prior, rescaled: the ratio of two
    words' votes is the ratio of those products, however small p_MLM is; a word with p_MLM 0 still gets none."""
    probs = np.array([0.5, 0.3, 0.2])
    p_mlm = np.array([1e-300, 4e-300, 0.0])
    w = weigh_vote(probs, p_mlm, 2.0)  # p_MLM^2 underflows to 0 in float64
    assert w[2] == 0.0 and float(w.sum()) == pytest.approx(1.0, rel=1e-6)
    assert w[1] / w[0] == pytest.approx((0.3 * 16) / 0.5, rel=1e-5)  # (4e-300 / 1e-300)^2 = 16: the better fit wins
    linear = weigh_vote(probs, p_mlm * 1e290, 2.0)  # the same ratios where nothing underflows
    assert w.tolist() == pytest.approx(linear.tolist(), rel=1e-5)


def test_the_sparse_ranking_refuses_a_lambda_outside_0_1() -> None:
    p_mlm = np.array([0.5, 0.3, 0.2], np.float32)
    for lam in (-0.1, 1.5):
        with pytest.raises(ValueError, match="lambda"):
            interpolated_top_k(p_mlm, np.arange(3), np.array([1]), np.array([1.0], np.float32), lam, 2, mlm_rest=None)


def test_a_temperature_below_one_is_taken_and_sharpens_the_vote() -> None:
    # d = [0, 1] at l = 0.5: weights e^0 and e^-2, against e^0 and e^-1/6 at the paper's l = 6
    ids, probs = knn_sparse(np.array([0.0, 1.0]), np.array([4, 9]), 0.5)
    assert ids.tolist() == [4, 9]
    assert probs.tolist() == pytest.approx(
        [1 / (1 + math.exp(-2)), math.exp(-2) / (1 + math.exp(-2))], rel=1e-6
    )
    assert knn_sparse(np.array([0.0, 1.0]), np.array([4, 9]), 6.0)[1][0] < probs[0]


def test_top_k_keeps_zero_entries_unless_asked_and_k_zero_is_an_empty_ranking() -> None:
    p = np.array([0.0, 0.5, 0.5], np.float32)
    assert top_k(p, 3) == [(1, 0.5), (2, 0.5), (0, 0.0)]  # a vocabulary's ranking lists every asked-for id
    assert top_k_among(np.array([3, 5]), np.array([0.5, 0.2], np.float32), 0, rest=0.9) == []  # not None
