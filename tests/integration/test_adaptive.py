"""Adaptive interpolation end to end: tiny BERT -> datastore -> app (lifespan, async path) and the sync pipeline.

The random tiny MLM is nearly uniform, so "confident" is relative: the rule's skip threshold is put between the
top-1 probabilities of two queries, measured first, so that one of them skips kNN and the other does not.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from bertknn.service.interpolate import AdaptiveRule, confidence
from bertknn.service.main import create_app, open_pipeline
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.results import Query
from bertknn.service.settings import ServiceSettings

KNN_TEXT = {"text": "zorblat was born in [MASK] .", "subject": "zorblat"}  # kNN knows the answer: quimby
SKIP_TEXT = {"text": "[MASK] is a small town near the sea ."}  # the MLM's top-1 is higher here


@pytest.fixture(scope="module")
def rule(tiny_datastore: Path) -> AdaptiveRule:
    pipe = AnswerPipeline.open(tiny_datastore, device="cpu")
    try:
        encs, _ = pipe.queries.encode([pipe.check_query(Query(t["text"])) for t in (KNN_TEXT, SKIP_TEXT)])
    finally:
        pipe.close()
    c_knn, c_skip = (confidence(e.p_mlm(), "top1") for e in encs)
    assert c_skip > c_knn, "test premise: the tiny model is more confident on SKIP_TEXT"
    return AdaptiveRule(measure="top1", bias=-0.5, knn_weight=3.0, mlm_weight=1.0,
                        skip_threshold=(c_knn + c_skip) / 2)  # fmt: skip


class Spy:
    """Counts the pipeline's retrievals and kNN searches; `gate` can hold retrievals until released."""

    def __init__(self) -> None:
        self.retrievals = 0
        self.searches = 0
        self.gate = threading.Event()
        self.gate.set()


@pytest.fixture(scope="module")
def served(tiny_datastore: Path, rule: AdaptiveRule):
    spy = Spy()

    def factory(settings: ServiceSettings) -> AnswerPipeline:
        pipe = open_pipeline(settings)
        retrieve, neighbours = pipe.articles.retrieve, pipe.neighbours_of.neighbours

        def counted_retrieve(query):  # type: ignore[no-untyped-def]
            spy.retrievals += 1
            assert spy.gate.wait(60), "retrieval held too long"
            return retrieve(query)

        def counted_neighbours(*args):  # type: ignore[no-untyped-def]
            spy.searches += 1
            return neighbours(*args)

        pipe.articles.retrieve, pipe.neighbours_of.neighbours = counted_retrieve, counted_neighbours  # type: ignore[method-assign]
        return pipe

    # this server answers adaptively unless a request says otherwise
    settings = ServiceSettings(
        datastore=tiny_datastore, model={"device": "cpu"}, batching={"max_wait_ms": 1},
        defaults={"interpolation": "adaptive", "adaptive_rule": rule},
    )  # fmt: skip
    with TestClient(create_app(settings, pipeline_factory=factory)) as client:
        yield client, spy


def test_adaptive_lambda_comes_from_the_rule(served, rule):
    client, _ = served
    body = client.post("/predict", json=KNN_TEXT).json()
    assert body["interpolation"] == "adaptive" and body["knn_skipped"] is False
    assert body["articles"] and body["knn"] and {"retrieval", "knn"} <= body["timings_ms"].keys()
    want = rule.lambda_for(body["mlm"][0]["prob"], body["knn"][0]["prob"])  # top-1 confidences of both sides
    assert body["lambda_used"] == pytest.approx(want, rel=1e-3)
    assert abs(body["lambda_used"] - 0.3) > 0.05  # not the fixed weight
    top = body["predictions"][0]
    assert top["token"] == "quimby"
    assert top["prob"] == pytest.approx(want * top["p_knn"] + (1 - want) * top["p_mlm"], rel=1e-3)
    fixed = client.post("/predict", json={**KNN_TEXT, "interpolation": "fixed"}).json()
    assert fixed["interpolation"] == "fixed" and fixed["lambda_used"] == 0.3 and fixed["knn_skipped"] is False


def test_a_confident_mlm_skips_retrieval_and_knn(served):
    client, spy = served
    searches = spy.searches
    body = client.post("/predict", json=SKIP_TEXT).json()
    assert body["interpolation"] == "adaptive" and body["knn_skipped"] is True and body["lambda_used"] == 0.0
    assert body["articles"] == [] and body["knn"] == [] and body["cache"]["retrieval"] == "none"
    assert "knn" not in body["timings_ms"] and "retrieval" not in body["timings_ms"]
    assert {"embedding", "interpolation", "total"} <= body["timings_ms"].keys()
    assert spy.searches == searches  # no kNN search ran
    # the answer is the MLM's alone
    assert [p["token"] for p in body["predictions"]] == [t["token"] for t in body["mlm"]]
    assert all(p["p_knn"] == 0.0 and p["contexts"] == [] for p in body["predictions"])
    # the decision comes from the cached p_MLM the same way on a cache hit
    again = client.post("/predict", json=SKIP_TEXT).json()
    assert again["cache"]["encoding"] == "hit" and again["knn_skipped"] is True
    assert again["predictions"] == body["predictions"]
    # the same question in fixed mode does the kNN work
    fixed = client.post("/predict", json={**SKIP_TEXT, "interpolation": "fixed"}).json()
    assert fixed["knn_skipped"] is False and fixed["articles"] and fixed["lambda_used"] == 0.3
    assert spy.searches == searches + 1
    assert "bertknn_knn_skipped_total 2.0" in client.get("/metrics").text


def test_a_skipped_query_does_not_wait_for_retrieval(served):
    client, spy = served
    spy.gate.clear()  # every retrieval now holds the (single) retrieval thread until released
    held: list[int] = []
    results: list[dict] = []
    # a question new to the cache (a hit whose articles are this interpreter's would retrieve them on the event
    # loop, which the gate would hold: `Finisher.hit`)
    new = {**KNN_TEXT, "text": "zorblat was born in the town of [MASK] .", "interpolation": "fixed"}
    fixed = threading.Thread(target=lambda: held.append(client.post("/predict", json=new).status_code))
    try:
        # A query that needs its articles takes the retrieval thread and is held there.
        started = spy.retrievals
        fixed.start()
        deadline = time.monotonic() + 30
        while spy.retrievals == started and time.monotonic() < deadline:
            time.sleep(0.001)
        assert spy.retrievals == started + 1, "the fixed query's retrieval did not start"
        before = spy.retrievals
        # A skipped query answers without waiting for it; a retrieval it queued behind the held one is cancelled
        # before it starts (and one answered by the model thread queues none).
        first = threading.Thread(target=lambda: results.append(client.post("/predict", json=SKIP_TEXT).json()))
        first.start()
        first.join(60)
        assert not first.is_alive(), "a skipped query waited for the retrieval it does not need"
        assert results[0]["knn_skipped"] is True
    finally:
        spy.gate.set()
    fixed.join(60)
    assert held == [200]
    assert spy.retrievals == before  # the skipped query's retrieval never ran


def test_request_options_and_their_errors(served):
    client, _ = served
    # a request that names its lambda is fixed, whatever the server's default
    named = client.post("/predict", json={**KNN_TEXT, "lambda": 0.5}).json()
    assert named["interpolation"] == "fixed" and named["lambda_used"] == 0.5
    r = client.post("/predict", json={**KNN_TEXT, "interpolation": "adaptive", "lambda": 0.5})
    assert r.status_code == 422 and "lambda" in r.json()["error"]["message"]
    r = client.post("/predict", json={**KNN_TEXT, "interpolation": "sometimes"})
    assert r.status_code == 422 and "interpolation" in r.json()["error"]["message"]
    batch = client.post("/predict/batch", json={"queries": [SKIP_TEXT, {**SKIP_TEXT, "interpolation": "fixed"}]})
    skipped, fixed = batch.json()["results"]
    assert skipped["knn_skipped"] is True and fixed["knn_skipped"] is False and fixed["articles"]
    r = client.post("/predict/batch", json={"queries": [KNN_TEXT, {**KNN_TEXT, "interpolation": "adaptive",
                                                                   "lambda": 0.2}]})  # fmt: skip
    assert r.status_code == 422 and "queries.1" in r.json()["error"]["message"]


def test_sync_pipeline_skips_before_retrieval(tiny_datastore, rule):
    pipe = AnswerPipeline.open(tiny_datastore, device="cpu")
    calls: list[str] = []
    retrieve = pipe.articles.retrieve
    pipe.articles.retrieve = lambda q: (calls.append(q.text), retrieve(q))[1]  # type: ignore[method-assign]
    try:
        skip, knn, fixed = pipe.predict_batch(
            [
                Query(SKIP_TEXT["text"], interpolation="adaptive", rule=rule),
                Query(KNN_TEXT["text"], subject="zorblat", interpolation="adaptive", rule=rule),
                Query(SKIP_TEXT["text"]),
            ],
            with_distributions=True,
        )
        assert calls == [KNN_TEXT["text"], SKIP_TEXT["text"]]  # the skipped query never retrieved
        assert skip.knn_skipped and skip.lambda_used == 0.0 and skip.interpolation == "adaptive"
        assert skip.distributions is not None and not skip.distributions.p_knn.any()
        assert not knn.knn_skipped and knn.lambda_used == pytest.approx(
            rule.lambda_for(knn.mlm[0].prob, knn.knn[0].prob), rel=1e-3
        )
        assert fixed.interpolation == "fixed" and not fixed.knn_skipped and fixed.lambda_used == 0.3
    finally:
        pipe.close()
