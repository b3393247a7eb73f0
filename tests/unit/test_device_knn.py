"""The batched restricted kNN (`batch_knn`, the candidate for the device) against the service's search, on the
CPU: the same neighbours on random rows, and on a real datastore the same neighbours and the same answers."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch

from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.results import Query
from bertknn.service.retrieval.device_knn import batch_knn
from bertknn.service.retrieval.knn import Neighbours, fp16_search


def test_each_query_gets_the_exact_neighbours_of_its_own_rows():
    rng = np.random.default_rng(0)
    sizes = [300, 0, 5, 1_000, 128]  # one set empty, one smaller than k, one exactly k
    rows = [rng.normal(size=(n, 64)).astype(np.float16) for n in sizes]
    queries = rng.normal(size=(len(sizes), 64)).astype(np.float32)
    got = batch_knn(torch.from_numpy(queries), rows, k=128)
    for (dist, idx), r, q in zip(got, rows, queries, strict=True):
        assert len(idx) == min(128, len(r))
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
