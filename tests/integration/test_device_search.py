"""``model.knn_device: model``: a batch's restricted kNN searched in one product on the model's device right after
its forward pass (here the CPU's torch, the same code a GPU runs), and with ``model.vote_device: model`` its vote
there too. The answers are the host's; queries it cannot take (retrieval still running, adaptive interpolation)
and a failing device search or vote fall back to the host."""

from __future__ import annotations

import asyncio
import logging
import threading
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from bertknn.service.answer import TokenAnswerer
from bertknn.service.device_vote import DeviceVote
from bertknn.service.main import create_app
from bertknn.service.metrics import Metrics
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.results import Answer, Query
from bertknn.service.retrieval.device_knn import DeviceKnn
from bertknn.service.retrieval.knn import ArticleSearch
from bertknn.service.retrieval.resident_rows import ResidentRows
from bertknn.service.serving import AsyncAnswerer
from bertknn.service.settings import BatchingSettings, ServiceSettings
from tests.support.batches import answer_as_one_batch

QUERIES = [
    # first in its batch: it finds the model thread merely held (not batching), so its retrieval starts with the
    # batch's forward, not on arrival as the others' do; adaptive, it is the host's anyway
    Query("[MASK] is a large city with a famous bridge .", interpolation="adaptive"),
    Query("zorblat was born in [MASK] .", subject="zorblat"),
    Query("quimby is a small [MASK] near the sea .", k=16),
    Query("the bridge of [MASK] is large .", retriever="tfidf", num_articles=2),
]


class Recording(DeviceKnn):
    """A `DeviceKnn` on the CPU that records the queries it searched, or fails when told to."""

    def __init__(self, fail: bool = False, resident: ResidentRows | None = None):
        super().__init__("cpu", resident=resident)
        self.searched: list[int] = []
        self.fail = fail

    def search(self, items, datastores=None):
        if self.fail:
            raise RuntimeError("device lost")
        self.searched.append(len(items))
        return super().search(items, datastores)


class RecordingVote(DeviceVote):
    """A `DeviceVote` on the CPU that records the questions it voted, or fails when told to."""

    def __init__(self, pipe: AnswerPipeline, fail: bool = False):
        super().__init__(torch.device("cpu"), pipe.encoder.words.vocab.non_words)
        self.voted: list[int] = []
        self.fail = fail

    def vote(self, items):
        if self.fail:
            raise RuntimeError("device lost while voting")
        self.voted.append(len(items))
        return super().vote(items)


def _batched(
    pipe: AnswerPipeline, knn: DeviceKnn, queries: list[Query], *, until: threading.Event | None = None,
    metrics: Metrics | None = None, vote: DeviceVote | None = None,
) -> list[Answer]:
    """The queries answered as one batch: queued while the model thread is held, then released together once the
    retrievals they started on arrival have ended (or, given ``until``, once it is set)."""

    async def main() -> list[Answer]:
        answerer = AsyncAnswerer(
            pipe, BatchingSettings(max_wait_ms=0), metrics or Metrics(), device_knn=knn, device_vote=vote
        )
        answerer.start()

        async def wait() -> None:
            if until is not None:
                assert await asyncio.to_thread(until.wait, 10)
            else:  # the retrieval thread takes one client's work in order: this runs after theirs
                await asyncio.wrap_future(answerer._retrieval_thread.submit(lambda: None))

        try:
            return await answer_as_one_batch(answerer, queries, before_release=wait)
        finally:
            await answerer.stop()

    return asyncio.run(main())


def _same(got: Answer, want: Answer) -> None:
    assert [p.token for p in got.predictions] == [p.token for p in want.predictions]
    np.testing.assert_allclose([p.prob for p in got.predictions], [p.prob for p in want.predictions], rtol=1e-4, atol=1e-6)
    assert [[c.rank for c in p.contexts] for p in got.predictions] == [[c.rank for c in p.contexts] for p in want.predictions]
    assert [a.title for a in got.articles] == [a.title for a in want.articles]


@pytest.fixture(scope="module")
def reference(tiny_datastore: Path):
    pipe = AnswerPipeline.open(tiny_datastore, device="cpu")
    yield pipe
    pipe.close()


@pytest.fixture
def pipes(tiny_datastore: Path, reference: AnswerPipeline):
    """The reference (the host's search, one query at a time) and a new pipeline: a cache of its own, empty."""
    pipe = AnswerPipeline.open(tiny_datastore, device="cpu")
    yield reference, pipe
    pipe.close()


def test_a_batch_is_searched_on_the_device_in_one_go_with_the_hosts_answers(pipes, monkeypatch):
    reference, pipe = pipes
    host_searches: list[str] = []
    search = ArticleSearch.search
    monkeypatch.setattr(ArticleSearch, "search", lambda self, q, k: (host_searches.append(self.titles), search(self, q, k))[1])
    knn, metrics = Recording(), Metrics()
    answers = _batched(pipe, knn, QUERIES, metrics=metrics)
    assert knn.searched == [3]  # the three fixed-interpolation queries, in one search; the adaptive one on the host
    assert 'bertknn_knn_on_device_total{outcome="searched"} 3.0' in metrics.exposition().decode()
    assert len(host_searches) == (0 if answers[0].knn_skipped else 1)
    for q, got in zip(QUERIES, answers, strict=True):
        _same(got, reference.predict(q))
        assert got.cache["encoding"] == "miss" and (got.knn_skipped or got.timings_ms["knn"] > 0)


def _same_rankings(got: Answer, want: Answer) -> None:
    """Everything a question's answer ranks: its predictions with their p_MLM and p_kNN, the MLM's and the
    neighbours' own top answers, the kNN weight."""
    _same(got, want)
    for side in ("mlm", "knn"):
        assert [t.token for t in getattr(got, side)] == [t.token for t in getattr(want, side)], side
        np.testing.assert_allclose([t.prob for t in getattr(got, side)], [t.prob for t in getattr(want, side)], rtol=1e-5)
    for attr in ("p_mlm", "p_knn"):
        np.testing.assert_allclose([getattr(p, attr) for p in got.predictions], [getattr(p, attr) for p in want.predictions],
                                   rtol=1e-5, atol=1e-9)  # fmt: skip
    assert got.lambda_used == want.lambda_used
    # (auto: from the neighbours' distances, which a device's product rounds a little differently from FAISS)
    assert got.temperature_used == pytest.approx(want.temperature_used, rel=1e-5)


def test_a_batch_voted_on_the_device_gets_the_hosts_answers(pipes, monkeypatch):
    reference, pipe = pipes
    host_votes: list[int] = []
    answer = TokenAnswerer.answer
    monkeypatch.setattr(TokenAnswerer, "answer", lambda self, *a, **kw: (host_votes.append(1), answer(self, *a, **kw))[1])
    vote, metrics = RecordingVote(pipe), Metrics()
    answers = _batched(pipe, Recording(), QUERIES, metrics=metrics, vote=vote)
    assert vote.voted == [3]  # the three searched on the device, in one vote; the adaptive one on the host
    assert len(host_votes) == 1
    assert 'bertknn_vote_on_device_total{outcome="voted"} 3.0' in metrics.exposition().decode()
    monkeypatch.setattr(TokenAnswerer, "answer", answer)
    for q, got in zip(QUERIES, answers, strict=True):
        _same_rankings(got, reference.predict(q))
        cached = reference.predict(q)  # answered again from the cache's encoding, on the host
        assert cached.cache["encoding"] == "hit"
        _same_rankings(got, cached)


def test_a_failing_device_vote_leaves_the_batch_to_the_host(pipes, caplog):
    reference, pipe = pipes
    metrics = Metrics()
    with caplog.at_level(logging.ERROR, "bertknn.service.device_search"):
        answers = _batched(pipe, Recording(), QUERIES, metrics=metrics, vote=RecordingVote(pipe, fail=True))
    assert "device lost while voting" in caplog.text
    for q, got in zip(QUERIES, answers, strict=True):
        _same_rankings(got, reference.predict(q))
    counted = metrics.exposition().decode()
    assert 'bertknn_vote_on_device_total{outcome="failed"} 3.0' in counted
    assert 'bertknn_knn_on_device_total{outcome="searched"} 3.0' in counted


def test_a_batch_over_rows_kept_on_the_device_reads_none_of_them_on_the_host(pipes, monkeypatch):
    from bertknn.service.retrieval import knn as knn_module

    reference, pipe = pipes
    reads: list[int] = []
    gather = knn_module._gather
    monkeypatch.setattr(knn_module, "_gather", lambda slices, out: (reads.append(len(out)), gather(slices, out))[1])
    kept = ResidentRows("cpu", lambda nbytes: True)
    kept.advance(pipe.datastore)
    knn = Recording(resident=kept)
    answers = _batched(pipe, knn, QUERIES)
    assert knn.searched == [3]
    assert len(reads) == (0 if answers[0].knn_skipped else 1)  # the adaptive question's rows, searched on the host
    for q, got in zip(QUERIES, answers, strict=True):
        _same(got, reference.predict(q))


def test_a_query_whose_retrieval_is_still_running_is_searched_on_the_host(pipes, monkeypatch):
    reference, pipe = pipes
    retrieve = pipe.articles.retrieve
    entered, slow = threading.Event(), threading.Event()

    def slow_retrieve(query):
        if query.text == QUERIES[2].text:  # held until the batch's device search ran
            entered.set()
            slow.wait(10)
        return retrieve(query)

    monkeypatch.setattr(pipe.articles, "retrieve", slow_retrieve)
    knn = Recording()
    original = knn.search

    def search(items, datastores=None):
        slow.set()
        return original(items, datastores)

    knn.search = search
    # released once the slow retrieval began: the one before it (the second query's) has ended
    answers = _batched(pipe, knn, QUERIES, until=entered)
    # the first query's retrieval started with the batch and the fourth's waits behind the slow third one: only
    # the second query's rows were there to search on the device
    assert knn.searched == [1]
    for q, got in zip(QUERIES, answers, strict=True):
        _same(got, reference.predict(q))


def test_a_failing_device_search_leaves_the_batch_to_the_host(pipes, caplog):
    reference, pipe = pipes
    metrics = Metrics()
    with caplog.at_level(logging.ERROR, "bertknn.service.device_search"):
        answers = _batched(pipe, Recording(fail=True), QUERIES, metrics=metrics)
    assert "searched on the host" in caplog.text and "device lost" in caplog.text
    for q, got in zip(QUERIES, answers, strict=True):
        _same(got, reference.predict(q))
    counted = metrics.exposition().decode()
    assert 'bertknn_knn_on_device_total{outcome="failed"} 3.0' in counted
    assert 'bertknn_knn_on_device_total{outcome="searched"} 0.0' in counted


def test_a_device_that_keeps_failing_is_logged_once_a_minute(caplog, monkeypatch):
    from bertknn.service import device_search

    now = [1000.0]
    monkeypatch.setattr(device_search.time, "monotonic", lambda: now[0])
    log = device_search.FailureLog(every_s=60)
    with caplog.at_level(logging.ERROR, "bertknn.service.device_search"):
        for step in (0, 1, 30, 29.5, 0.5, 10):  # at 0, 1, 31, 60.5, 61, 71 s
            now[0] += step
            try:
                raise RuntimeError("device lost")
            except RuntimeError:
                log.failed()
    assert len(caplog.records) == 2 and all(r.exc_info for r in caplog.records)  # at 0 s and at 61 s


def test_the_setting_serves_the_same_answers_through_the_api(tiny_datastore: Path):
    questions = [{"text": q.text, **({"subject": q.subject} if q.subject else {})} for q in QUERIES[1:]]
    bodies = {}
    variants = [("host", "auto", "host"), ("model", "auto", "host"), ("model", "resident", "host"), ("model", "auto", "model")]
    for where, rows, vote in variants:
        model = {"device": "cpu", "knn_device": where, "knn_device_rows": rows, "vote_device": vote}
        app = create_app(ServiceSettings(datastore=tiny_datastore, model=model))
        with TestClient(app) as c:
            on_device = app.state.resources.answerer.on_device
            knn = None if on_device is None else on_device.knn
            assert (knn is not None) == (where == "model")
            assert (on_device is not None and on_device.vote is not None) == (vote == "model")
            if knn is not None:  # auto keeps rows on a GPU only; resident loads them all before the service is ready
                resident = knn.resident
                assert (resident is not None) == (rows == "resident")
                assert resident is None or resident.loaded == app.state.resources.pipeline.datastore.total_rows
            bodies[where, rows, vote] = [c.post("/predict", json=q).json() for q in questions]
            if vote == "model":
                assert 'bertknn_vote_on_device_total{outcome="voted"}' in c.get("/metrics").text
    for key in variants[1:]:
        for got, want in zip(bodies[key], bodies["host", "auto", "host"], strict=True):
            assert [p["token"] for p in got["predictions"]] == [p["token"] for p in want["predictions"]]
            np.testing.assert_allclose([p["prob"] for p in got["predictions"]], [p["prob"] for p in want["predictions"]], rtol=1e-4)
    with pytest.raises(ValueError, match="knn_device"):
        ServiceSettings(datastore=tiny_datastore, model={"knn_device": "gpu"})
    with pytest.raises(ValueError, match="knn_device_rows"):
        ServiceSettings(datastore=tiny_datastore, model={"knn_device_rows": "gpu"})
    with pytest.raises(ValueError, match="set model.knn_device to model as well"):
        ServiceSettings(datastore=tiny_datastore, model={"vote_device": "model"})
