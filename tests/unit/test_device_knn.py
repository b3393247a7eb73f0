"""The batched restricted kNN (`batch_knn`, `DeviceKnn`: the service's search on the model's device) against the
host's search, on the CPU: the same neighbours on random rows, and on a real datastore the same neighbours and the
same answers."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.results import Query
from bertknn.service.retrieval.device_knn import DeviceKnn, Staging, _groups, batch_knn
from bertknn.service.retrieval.knn import ArticleSearch, Neighbours, fp16_search


def test_each_query_gets_the_exact_neighbours_of_its_own_rows():
    rng = np.random.default_rng(0)
    sizes = [300, 0, 5, 1_000, 128]  # one set empty, one smaller than k, one exactly k
    rows = [rng.normal(size=(n, 64)).astype(np.float16) for n in sizes]
    queries = rng.normal(size=(len(sizes), 64)).astype(np.float32)
    got = batch_knn(torch.from_numpy(queries), rows, k=128)
    for (dist, idx), r, q in zip(got, rows, queries, strict=True):
        assert len(idx) == len(dist) == min(128, len(r))
        assert idx.dtype == np.int64 and dist.dtype == np.float32
        if not len(r):
            continue
        want_d, want_i = fp16_search(r, q, 128)
        np.testing.assert_array_equal(idx, want_i)
        np.testing.assert_allclose(dist, want_d, rtol=1e-4, atol=1e-3)
        assert np.all(np.diff(dist) >= 0)


def test_bad_arguments_are_refused_or_give_nothing():
    with pytest.raises(ValueError, match="2 queries but 1 row sets"):
        batch_knn(torch.zeros((2, 4)), [np.zeros((3, 4), np.float16)], k=2)
    assert [len(i) for _, i in batch_knn(torch.zeros((1, 4)), [np.zeros((3, 4), np.float16)], k=0)] == [0]


@pytest.fixture(scope="module")
def pipe(tiny_datastore: Path) -> AnswerPipeline:
    p = AnswerPipeline.open(tiny_datastore, device="cpu")
    yield p
    p.close()


def test_on_a_datastore_it_finds_the_services_neighbours_and_answers(pipe: AnswerPipeline):
    """The questions' retrieved articles' rows, searched in one batch, give the neighbours the service's
    `ArticleSearch` finds, and the answers assembled from them are the service's answers."""
    questions = [Query("zorblat was born in [MASK] .", retriever="bm25", num_articles=3, k=8),
                 Query("the bridge of plonk is [MASK] .", retriever="tfidf", num_articles=2, k=8)]  # fmt: skip
    encs, _ = pipe.queries.encode([pipe.check_query(q) for q in questions])
    prepared = []
    for q, enc in zip(questions, encs, strict=True):
        hits, _ = pipe.articles.retrieve(q)
        search = pipe.neighbours_of.prepare_search(q, hits)
        assert search is not None and len(search.rows) > q.k
        slices = [s for s in pipe.datastore.row_slices(list(search.titles)) if s is not None]
        prepared.append((q, enc, hits, search, np.concatenate([s.taken() for s in slices])))
    vectors = torch.from_numpy(np.stack([enc.embedding.astype(np.float32) for enc in encs]))
    found = batch_knn(vectors, [r for *_, r in prepared], k=8)
    for (q, enc, hits, search, _), (dist, idx) in zip(prepared, found, strict=True):
        cpu = pipe.neighbours_of.neighbours(q, enc, hits, search)
        article = search.row_article[idx] if search.row_article is not None else None
        batched = Neighbours(dist, search.rows[idx], search.labels[idx].astype(np.int32), article)
        np.testing.assert_array_equal(batched.rows, cpu.rows)
        np.testing.assert_allclose(batched.distances, cpu.distances, rtol=1e-4, atol=1e-3)
        want = pipe.assembler.answer(replace(q), enc, hits, cpu)
        got = pipe.assembler.answer(replace(q), enc, hits, batched)
        assert [(p.token, round(p.prob, 5)) for p in got.predictions] == [(p.token, round(p.prob, 5)) for p in want.predictions]


def test_a_batch_over_the_group_budget_is_searched_in_groups_with_the_same_neighbours():
    rng = np.random.default_rng(1)
    sizes = [40, 700, 3, 0, 250, 700]
    rows = [rng.normal(size=(n, 32)).astype(np.float16) for n in sizes]
    queries = torch.from_numpy(rng.normal(size=(len(sizes), 32)).astype(np.float32))
    whole = batch_knn(queries, rows, k=16)
    budget = 2 * 700 * 32 * 4  # two of the widest sets per group
    assert _groups(sizes, 32, budget) == [[1, 5], [4, 0, 2]]  # widest first, padded to their widest; no empty set
    assert _groups(sizes, 32, 1) == [[1], [5], [4], [0], [2]]  # a set over the budget goes alone
    grouped = batch_knn(queries, rows, k=16, group_bytes=budget)
    for (d1, i1), (d2, i2) in zip(whole, grouped, strict=True):
        np.testing.assert_array_equal(i1, i2)
        np.testing.assert_allclose(d1, d2, rtol=1e-6)


def test_the_services_device_knn_gives_each_query_its_article_searchs_neighbours(pipe: AnswerPipeline):
    """`DeviceKnn.search` over prepared `ArticleSearch`es (their rows read as float16 from the index's codes) gives
    what each search's own FAISS search gives, with each query's own k, the rows' articles included."""
    questions = [Query("zorblat was born in [MASK] .", num_articles=3, k=5),
                 Query("the bridge of plonk is [MASK] .", retriever="tfidf", num_articles=2, k=12)]  # fmt: skip
    encs, _ = pipe.queries.encode([pipe.check_query(q) for q in questions])
    searches = [pipe.neighbours_of.prepare_search(q, pipe.articles.retrieve(q)[0]) for q in questions]
    assert all(s is not None and DeviceKnn.searchable(s) for s in searches)
    for s in searches:
        slices = [r for r in pipe.datastore.row_slices(list(s.titles)) if r is not None]
        np.testing.assert_array_equal(s.float16_rows(), np.concatenate([r.taken() for r in slices]))
    got = DeviceKnn("cpu").search([(e.embedding, s, q.k) for q, e, s in zip(questions, encs, searches, strict=True)])
    for q, e, s, nbrs in zip(questions, encs, searches, got, strict=True):
        want = s.search(e.embedding.astype(np.float32), q.k)
        assert len(nbrs) == q.k
        np.testing.assert_array_equal(nbrs.rows, want.rows)
        np.testing.assert_array_equal(nbrs.labels, want.labels)
        np.testing.assert_array_equal(nbrs.article, want.article)
        np.testing.assert_allclose(nbrs.distances, want.distances, rtol=1e-4, atol=1e-3)
    assert DeviceKnn("cpu").search([]) == []


def test_rows_that_are_not_float16_are_left_to_the_host():
    float32 = ArticleSearch(("A",), np.zeros(2, np.int32), np.arange(2), None, np.zeros((2, 4), np.float32))
    assert float32.float16_rows() is None and not DeviceKnn.searchable(float32)
    with pytest.raises(ValueError, match="float16 rows only"):
        DeviceKnn("cpu").search([(np.zeros(4, np.float16), float32, 1)])


def test_the_staging_buffer_is_kept_and_what_it_held_before_changes_nothing():
    rng = np.random.default_rng(2)
    rows = [rng.normal(size=(n, 16)).astype(np.float16) for n in (50, 7, 120)]
    queries = torch.from_numpy(rng.normal(size=(3, 16)).astype(np.float32))
    staging = Staging(torch.device("cpu"))
    staging.take((4, 200, 16)).fill_(float("nan"))  # what an earlier batch could leave in the padding
    kept = staging._buffer
    got = batch_knn(queries, rows, k=10, staging=staging)
    assert staging._buffer is kept  # big enough: not allocated again
    for (dist, idx), r, q in zip(got, rows, queries.numpy(), strict=True):
        want_d, want_i = fp16_search(r, q, 10)
        np.testing.assert_array_equal(idx, want_i)
        assert np.isfinite(dist).all()
    staging.take((8, 200, 16))
    assert staging._buffer is not kept and staging._buffer.numel() == 8 * 200 * 16  # grown to what was asked


def test_long_vectors_keep_their_distances_digits():
    """Rows and queries far from the origin beside their distances (some families' hidden states): the distances
    are the differences' own, as FAISS's are, not |x|^2 - 2 x.q + |q|^2 with its digits cancelled away."""
    rng = np.random.default_rng(3)
    centre = np.full(64, 40.0, np.float32)
    rows = [(centre + rng.normal(size=(200, 64))).astype(np.float16)]
    query = (centre + rng.normal(size=64)).astype(np.float32)
    (dist, idx), = batch_knn(torch.from_numpy(query[None, :]), rows, k=20)
    want_d, want_i = fp16_search(rows[0], query, 20)
    np.testing.assert_array_equal(idx, want_i)
    np.testing.assert_allclose(dist, want_d, rtol=1e-5)
