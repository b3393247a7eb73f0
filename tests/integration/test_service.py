"""Builder -> datastore on disk -> app through TestClient (lifespan runs) with a real redis-server."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient

from bertknn.core.errors import DatastoreError, ModelLoadError
from bertknn.core.format import read_manifest, write_manifest
from bertknn.core.logs import Event
from bertknn.service.api import routes
from bertknn.service.api.schemas import BatchResponse, PredictRequest, PredictResponse
from bertknn.service.main import create_app
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.results import Query
from bertknn.service.settings import ServiceSettings
from tests.conftest import TINY_ARTICLES, corpus_words, make_tiny_bert
from tests.support.batches import answer_as_one_batch

QUESTION = {"text": "zorblat was born in [MASK] .", "subject": "zorblat"}


def _settings(ds: Path, **cache) -> ServiceSettings:
    return ServiceSettings(datastore=ds, model={"device": "cpu"}, cache=cache, batching={"max_wait_ms": 1})


@pytest.fixture(scope="module")
def client(tiny_datastore):
    with TestClient(create_app(_settings(tiny_datastore))) as c:
        yield c


def test_knn_makes_the_stored_fact_win_where_the_mlm_alone_does_not(client):
    r = client.post("/predict", json=QUESTION)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["predictions"][0]["token"] == "quimby"
    assert body["knn"][0]["token"] == "quimby"
    assert body["mlm"][0]["token"] != "quimby"
    # the MLM alone (lambda 0) does not answer quimby: the kNN path does real work
    alone = client.post("/predict", json={**QUESTION, "lambda": 0.0}).json()
    assert alone["predictions"][0]["token"] != "quimby"
    top = body["predictions"][0]
    assert top["prob"] == pytest.approx(0.3 * top["p_knn"] + 0.7 * top["p_mlm"], rel=1e-4)
    ctx = top["contexts"][0]
    assert ctx["article"] == "Zorblat" and "**quimby**" in ctx["sentence"] and ctx["rank"] == 1
    assert body["articles"][0] == {"title": "Zorblat", "score": None, "rule": "subject"}
    assert {"retrieval", "embedding", "knn", "interpolation", "total"} <= body["timings_ms"].keys()
    assert body["model"]["layer"] == 1 and body["datastore"]["id"]


def test_subject_lookup_ignores_case_and_accents(client):
    body = client.post(
        "/predict", json={"text": "emile grusk was born in [mask] .", "subject": "emile grusk"}
    ).json()
    assert body["articles"][0]["title"] == "Émile Grusk" and body["articles"][0]["rule"] == "subject"
    assert body["predictions"][0]["token"] == "plonk"


def test_unknown_subject_falls_back_to_the_ranker_and_says_so(client):
    body = client.post("/predict", json={**QUESTION, "subject": "nobody at all"}).json()
    assert body["articles"] and all(a["rule"] == "bm25" for a in body["articles"])
    tfidf = client.post("/predict", json={**QUESTION, "subject": None, "retriever": "tfidf"}).json()
    assert all(a["rule"] == "tfidf" for a in tfidf["articles"])


@pytest.mark.parametrize(
    ("payload", "code", "needle"),
    [
        ({"text": "zorblat was born in quimby ."}, "invalid_query", "the text must contain exactly one [MASK]; found 0"),
        ({"text": "[MASK] was born in [MASK] ."}, "invalid_query", "exactly one [MASK]; found 2"),
        ({"text": ""}, "invalid_request", "text: String should have at least 1 character"),
        ({"text": "[MASK]"}, "invalid_query", "the text has nothing but [MASK]; give the words around it"),
        ({"text": "x [MASK]", "subject": " \t "}, "invalid_query", "subject: blank"),
        ({"text": "a " * 1500 + "[MASK]"}, "invalid_request", "text: 3006 characters exceeds this server's limit of 2000"),
        ({"text": "x [MASK]", "retriever": "google"}, "invalid_request", "retriever: Input should be 'bm25', 'tfidf' or 'none'"),
        ({"text": "x [MASK]", "k": 0}, "invalid_request", "k: Input should be greater than or equal to 1"),
        ({"text": "x [MASK]", "lambda": 1.5}, "invalid_request", "lambda: Input should be less than or equal to 1"),
        ({"text": "x [MASK]", "top_k": 1000}, "invalid_request", "top_k: 1000 exceeds this server's limit of 100"),
        ({"text": "x [MASK]", "num_articles": 0}, "invalid_request", "num_articles: Input should be greater than or equal to 1"),
        ({"text": "x [MASK]", "temperature": -1}, "invalid_request", "temperature: Input should be greater than 0 or Input should be 'auto'"),
        ({"text": 5}, "invalid_request", "text: Input should be a valid string"),
        ({"text": "x [MASK]", "colour": "red"}, "invalid_request", "colour: unknown field; allowed: answer, any_token,"),
        ({"text": "x [MASK]", "lambda": 0.5, "interpolation": "adaptive"}, "invalid_request",
         "lambda: a fixed kNN weight does not apply to interpolation 'adaptive'; drop one of them"),
    ],
)
def test_bad_input_gets_a_clear_error(client, payload, code, needle):
    r = client.post("/predict", json=payload)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == code and needle in err["message"] and err["request_id"] == r.headers["x-request-id"]
    assert "Traceback" not in r.text


@pytest.mark.parametrize(
    ("content", "content_type", "needle"),
    [
        (b"", "application/json", "body: Field required"),
        (b'{"text": "x [MASK]"}', "text/plain", "Content-Type: application/json (got text/plain)"),
        (b'{"text": "x [MASK]"}', None, "(got no content type)"),
        (b"{not json", "application/json", "body: Invalid JSON"),
        (b"[1, 2]", "application/json", "body: Input should be an object"),
        (b'{"text": "x [MASK]", "top_k": "many"}', "application/json", "top_k: Input should be a valid integer"),
        (b'{"txt": "x [MASK]"}', "application/json", "text: Field required; txt: unknown field; did you mean 'text'?"),
        (b'{"text": "caf\xe9 [MASK]"}', "application/json", "body: not UTF-8 text (byte 13 is b'\\xe9')"),
        (b'{"text": "x [MASK]", "temperature": NaN}', "application/json", "temperature: must be a finite number, not NaN"),
        (b'{"text": "x [MASK]", "lambda": -Infinity}', "application/json", "lambda: must be a finite number, not -Infinity"),
    ],
)
def test_a_malformed_body_gets_a_422_that_says_what_to_fix(client, content, content_type, needle):
    headers = {"content-type": content_type} if content_type else {}
    r = client.post("/predict", content=content, headers=headers)
    assert r.status_code == 422, r.text
    err = r.json()["error"]
    assert err["code"] == "invalid_request" and needle in err["message"], err


@pytest.mark.parametrize("content_type", ["application/json; charset=utf-8", "Application/JSON", "application/x+json"])
def test_json_content_types_are_accepted(client, content_type):
    r = client.post("/predict", content=json.dumps(QUESTION).encode(), headers={"content-type": content_type})
    assert r.status_code == 200, r.text
    assert r.json()["predictions"][0]["token"] == "quimby"


def test_openapi_documents_the_predict_body(client):
    spec = client.get("/openapi.json").json()
    op = spec["paths"]["/predict"]["post"]
    body = op["requestBody"]
    ref = body["content"]["application/json"]["schema"]["$ref"]
    schema = spec["components"]["schemas"][ref.rsplit("/", 1)[-1]]
    assert body["required"] is True and schema["required"] == ["text"] and schema["additionalProperties"] is False
    assert set(schema["properties"]) == set(PredictRequest.model_json_schema(by_alias=True)["properties"])
    # the limits are the server's settings (checked per request), not caps written into the schema
    assert "lambda" in schema["properties"] and "maximum" not in schema["properties"]["k"]["anyOf"][0]
    assert op["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith("/PredictResponse")


@pytest.mark.parametrize(
    "extra",
    [
        {},
        {"return_contexts": False},
        {"contexts_per_answer": 0, "top_k": 3},
        {"subject": None, "retriever": "tfidf", "top_k": 25},
        {"interpolation": "adaptive"},
        {"lambda": 1.0},
    ],
)
def test_the_response_json_is_the_validated_models_json(client, extra):
    """What the routes send validates against the response schema, with nothing left out or added; the same answer
    through the pipeline gives the same predictions."""
    resources = client.app.state.resources
    pipe = resources.pipeline
    query = routes.to_query(PredictRequest.model_validate({**QUESTION, **extra}), resources.settings)
    direct = routes.to_response(pipe.predict(query), pipe.identity()).model_dump(mode="json")
    served = client.post("/predict", json={**QUESTION, **extra}).json()
    assert PredictResponse.model_validate(served).model_dump(mode="json") == served
    assert [p["token"] for p in served["predictions"]] == [p["token"] for p in direct["predictions"]]
    batch = client.post("/predict/batch", json={"queries": [{**QUESTION, **extra}]}).json()
    assert BatchResponse.model_validate(batch).model_dump(mode="json") == batch


@pytest.mark.parametrize("enabled", [False, True])
def test_opentelemetry_setting_switches_fastapis_tracing(tiny_datastore, monkeypatch, enabled):
    """Off (the default), FastAPI never asks for a tracer; on, it traces each request with the configured one."""
    from opentelemetry import trace

    asked: list[str] = []

    class Provider(trace.TracerProvider):  # a configured provider: neither the API's deferred proxy nor its no-op
        def get_tracer(self, name, *args, **kwargs):
            asked.append(name)
            return trace.NoOpTracer()

    monkeypatch.setattr(trace, "get_tracer_provider", Provider)
    settings = _settings(tiny_datastore).model_copy(update={"opentelemetry": enabled})
    with TestClient(create_app(settings)) as c:
        assert c.get("/healthz").status_code == 200
        assert c.post("/predict", json=QUESTION).status_code == 200
    assert bool(asked) is enabled


def test_retriever_none_without_ivfpq_index_is_a_clear_error(client):
    r = client.post("/predict", json={**QUESTION, "retriever": "none"})
    assert r.status_code == 422 and "ivfpq" in r.json()["error"]["message"]


def test_batch_answers_like_single(client):
    single = client.post("/predict", json=QUESTION).json()
    r = client.post("/predict/batch", json={"queries": [QUESTION, {"text": "frelle dax was born in [MASK] ."}]})
    assert r.status_code == 200
    res = r.json()["results"]
    assert [p["token"] for p in res[0]["predictions"]] == [p["token"] for p in single["predictions"]]
    bad = client.post("/predict/batch", json={"queries": [QUESTION, {"text": "no mask"}]})
    assert bad.status_code == 422 and bad.json()["error"]["message"].startswith("queries.1")
    # every bad query is named in one answer, so that a caller fixes them all at once
    worse = client.post("/predict/batch", json={"queries": [
        {"text": "no mask"}, QUESTION, {"text": "[MASK] and [MASK]"}, {**QUESTION, "lambda": 0.5, "interpolation": "adaptive"},
    ]})  # fmt: skip
    error = worse.json()["error"]
    assert worse.status_code == 422 and error["code"] == "invalid_query"  # the first bad one's kind
    parts = error["message"].split("; queries.")
    assert [p.split(":")[0] for p in parts] == ["queries.0", "2", "3"], error["message"]
    assert "found 2" in parts[1] and "lambda" in parts[2]


def _request_lines(caplog) -> list[Event]:
    return [r.msg for r in caplog.records if isinstance(r.msg, Event) and r.msg.name == "request"]


def test_each_request_logs_one_line_with_its_cache_use_and_stage_times(client, caplog):
    caplog.set_level(logging.INFO, logger="service")
    question = {"text": "quimby is the home of [MASK] .", "subject": "zorblat"}
    first = client.post("/predict", json=question, headers={"X-Request-ID": "log-test-1"})
    again = client.post("/predict", json=question)
    batch = client.post("/predict/batch", json={"queries": [question, {"text": "frelle dax lived in [MASK] ."}]})
    bad = client.post("/predict", json={"text": "no mask"})
    lines = _request_lines(caplog)
    assert [e.fields["status"] for e in lines] == [200, 200, 200, 422]
    one = lines[0].fields
    assert one["id"] == "log-test-1" and one["path"] == "/predict" and one["method"] == "POST"
    assert one["cache"] == first.json()["cache"] == {"encoding": "miss", "retrieval": "miss"}
    assert one["stages_ms"] == first.json()["timings_ms"] and one["latency_ms"] >= one["stages_ms"]["total"] - 1
    assert lines[1].fields["cache"] == again.json()["cache"] == {"encoding": "hit", "retrieval": "hit"}
    results = batch.json()["results"]
    assert lines[2].fields["queries"] == 2 and lines[2].fields["cache_hits"] == {
        stage: sum(r["cache"][stage] == "hit" for r in results) for stage in ("encoding", "retrieval")
    } == {"encoding": 1, "retrieval": 1}
    assert lines[2].fields["stages_ms"]["total"] == pytest.approx(sum(r["timings_ms"]["total"] for r in results))
    # a refused request: what the middleware knows, nothing a route would have added
    assert set(lines[3].fields) == {"id", "method", "path", "status", "latency_ms"}
    assert lines[3].fields["id"] == bad.json()["error"]["request_id"]
    assert "cache=encoding:hit,retrieval:hit" in str(lines[1])


def test_health_ready_metrics_and_unknown_route(client):
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz").json()
    assert ready["status"] == "ready" and ready["cache"]["backend"] == "memory"
    assert {"bm25", "tfidf"} <= set(ready["retrievers"])
    metrics = client.get("/metrics").text
    assert "bertknn_requests_total" in metrics and "bertknn_stage_seconds_bucket" in metrics
    missing = client.get("/nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "not_found"


def test_probabilities_sum_to_one(tiny_datastore):
    pipe = AnswerPipeline.open(tiny_datastore, device="cpu")
    try:
        ans = pipe.predict(Query(QUESTION["text"], subject="zorblat"), with_distributions=True)
        d = ans.distributions
        assert d is not None
        for p in (d.p_mlm, d.p_knn, d.p):
            assert float(np.sum(p, dtype=np.float64)) == pytest.approx(1.0, abs=1e-5)
        assert np.allclose(d.p, 0.3 * d.p_knn + 0.7 * d.p_mlm, atol=1e-7)
    finally:
        pipe.close()


def test_redis_cache_hit_then_redis_killed_answers_stay_correct(tiny_datastore, redis_server):
    import time

    import redis

    settings = _settings(tiny_datastore, redis_url=redis_server.url, key_prefix="t1")
    with TestClient(create_app(settings)) as c:
        first = c.post("/predict", json=QUESTION).json()
        # the encoding is written to Redis after the answer went out (off the request's path): wait for it
        r = redis.Redis.from_url(redis_server.url)
        deadline = time.monotonic() + 5
        while not r.keys("t1:enc:*") and time.monotonic() < deadline:
            time.sleep(0.005)
        second = c.post("/predict", json=QUESTION).json()
        assert first["cache"] == {"encoding": "miss", "retrieval": "miss"}
        assert second["cache"] == {"encoding": "hit", "retrieval": "hit"}
        assert second["predictions"] == first["predictions"]
        assert c.get("/readyz").json()["cache"] == {"backend": "redis", "state": "ok", "detail": ""}
        redis_server.stop()
        third = c.post("/predict", json=QUESTION).json()
        assert third["predictions"] == first["predictions"] and third["cache"]["encoding"] == "miss"
        ready = c.get("/readyz")
        assert ready.status_code == 200 and ready.json()["cache"]["state"] == "degraded"
        assert 'bertknn_cache_events_total{event="errors"}' in c.get("/metrics").text


def test_refuses_another_model(tiny_datastore, tmp_path):
    other = make_tiny_bert(tmp_path / "other", corpus_words(TINY_ARTICLES), seed=1)
    with pytest.raises(ModelLoadError, match="not the model this datastore was built with"):
        AnswerPipeline.open(tiny_datastore, model=str(other), device="cpu")
    app = create_app(ServiceSettings(datastore=tiny_datastore, model={"name": str(other), "device": "cpu"}))
    with pytest.raises(ModelLoadError), TestClient(app):
        pass


def test_refuses_bad_layer_and_invalid_datastore(tiny_datastore, tmp_path):
    bad_layer = tmp_path / "layer"
    shutil.copytree(tiny_datastore, bad_layer)
    man = read_manifest(bad_layer)
    man.layer = 7
    man.datastore_id = man.compute_id()  # a consistent manifest, only the layer is impossible
    write_manifest(bad_layer, man)
    with pytest.raises(ModelLoadError, match="layer 7 is out of range"):
        AnswerPipeline.open(bad_layer, device="cpu")
    broken = tmp_path / "broken"
    shutil.copytree(tiny_datastore, broken)
    vec = broken / "shards" / "shard-00000" / "vectors.npy"
    vec.write_bytes(vec.read_bytes()[:-10])
    with pytest.raises(DatastoreError, match="vectors.npy"):
        AnswerPipeline.open(broken, device="cpu")


def test_every_backend_serves_the_same_answers(tiny_datastore: Path) -> None:
    """The default (auto: onnx on a CPU) and the other backends against the eager reference, through the API."""
    questions = [QUESTION, {"text": "emile grusk was born in [MASK] .", "subject": "emile grusk"},
                 {"text": "the bridge of [MASK] is large ."}]
    bodies: dict[str, list[dict]] = {}
    for backend in ("eager", "onnx", "auto"):
        settings = ServiceSettings(datastore=tiny_datastore, model={"device": "cpu", "backend": backend})
        app = create_app(settings)
        with TestClient(app) as c:
            assert app.state.resources.pipeline.encoder.backend == ("onnx" if backend == "auto" else backend)
            bodies[backend] = [c.post("/predict", json=q).json() for q in questions]
    for backend, answers in bodies.items():
        for got, want in zip(answers, bodies["eager"], strict=True):
            assert [p["token"] for p in got["predictions"]] == [p["token"] for p in want["predictions"]], backend
            np.testing.assert_allclose([p["prob"] for p in got["predictions"]],
                                       [p["prob"] for p in want["predictions"]], rtol=1e-3, atol=1e-5)


def test_a_cached_query_does_not_wait_behind_a_busy_model(tiny_datastore: Path) -> None:
    """With the in-process cache, a repeated query skips the batcher: it is answered while the model thread is
    busy; a new query waits for the model. Both get the answers the model gave before."""
    import asyncio
    import threading

    from bertknn.service.metrics import Metrics
    from bertknn.service.serving import AsyncAnswerer
    from bertknn.service.settings import BatchingSettings

    pipe = AnswerPipeline.open(tiny_datastore, device="cpu")

    async def main() -> None:
        answerer = AsyncAnswerer(pipe, BatchingSettings(max_wait_ms=0), Metrics())
        answerer.start()
        try:
            q = Query(QUESTION["text"], subject="zorblat")
            first = await answerer.answer(q)
            gate, busy = threading.Event(), threading.Event()
            blocker = answerer.batcher.call(lambda: (busy.set(), gate.wait(10)))
            while not busy.is_set():
                await asyncio.sleep(0.001)
            again = await asyncio.wait_for(answerer.answer(q), 5)  # the model thread is blocked meanwhile
            new = asyncio.ensure_future(answerer.answer(Query("quimby is a small [MASK] near the sea .")))
            await asyncio.sleep(0.2)
            assert not new.done()  # an uncached query needs the model
            gate.set()
            await asyncio.wrap_future(blocker)
            assert (await new).predictions
            assert first.cache["encoding"] == "miss" and again.cache["encoding"] == "hit"
            assert [(p.token, p.prob) for p in again.predictions] == [(p.token, p.prob) for p in first.predictions]
        finally:
            await answerer.stop()

    try:
        asyncio.run(main())
    finally:
        pipe.close()


def test_contexts_are_each_answers_nearest_neighbours_in_rank_order(tiny_datastore: Path) -> None:
    """Every listed context is a neighbour labelled with that answer, nearest first, at most contexts_per_answer,
    and none is missing: checked against the neighbours themselves."""
    pipe = AnswerPipeline.open(tiny_datastore, device="cpu")
    try:
        for text, limit in (("[MASK] is a large city with a famous bridge .", 2), ("zorblat wrote many [MASK] .", 1)):
            q = Query(text, num_articles=6, k=40, top_k=8, contexts_per_answer=limit)
            inp = pipe.check_query(q)
            (enc,), _ = pipe.queries.encode([inp])
            articles, _ = pipe.articles.retrieve(q)
            nbrs = pipe.neighbours_of.neighbours(q, enc, articles)
            answer = pipe.predict(q)
            assert any(p.contexts for p in answer.predictions)
            for pred in answer.predictions:
                want = [int(r) + 1 for r in np.flatnonzero(nbrs.labels == pred.token_id)[:limit]]
                assert [c.rank for c in pred.contexts] == want
                for c in pred.contexts:
                    assert c.distance == pytest.approx(float(nbrs.distances[c.rank - 1]))
                    assert f"**{pred.token}**" in c.sentence.lower()
    finally:
        pipe.close()


def test_a_prepared_article_search_finds_what_the_exact_search_finds(tiny_datastore: Path) -> None:
    """`prepare_search` (run next to the retrieval, before the embedding exists) changes nothing: the same
    neighbours as an exact float32 search over the articles' rows; a search prepared for other articles is not used."""
    pipe = AnswerPipeline.open(tiny_datastore, device="cpu")
    try:
        q = Query("[MASK] is a large city with a famous bridge .", num_articles=4, k=10)
        (enc,), _ = pipe.queries.encode([pipe.check_query(q)])
        articles, _ = pipe.articles.retrieve(q)
        assert len(articles) >= 2
        search = pipe.neighbours_of.prepare_search(q, articles)
        assert search is not None and search.titles == tuple(a.title for a in articles)
        got = pipe.neighbours_of.neighbours(q, enc, articles, search)
        vectors, labels, rows = pipe.datastore.article_rows([a.title for a in articles])
        exact = ((vectors.astype(np.float32) - enc.embedding.astype(np.float32)) ** 2).sum(axis=1)
        assert len(got) == 10 and len(rows) > 10
        assert np.allclose(got.distances, np.sort(exact)[:10], rtol=1e-4, atol=1e-4)  # the 10 nearest, in order
        at = {int(r): i for i, r in enumerate(rows)}
        for row, dist, label in zip(got.rows.tolist(), got.distances, got.labels, strict=True):
            assert dist == pytest.approx(exact[at[row]], rel=1e-4, abs=1e-4) and label == labels[at[row]]
        assert np.array_equal(got.rows, pipe.neighbours_of.neighbours(q, enc, articles).rows)  # prepared or not: the same
        stale = pipe.neighbours_of.prepare_search(q, articles[:1])
        assert np.array_equal(pipe.neighbours_of.neighbours(q, enc, articles, stale).rows, got.rows)  # not used for others
        assert pipe.neighbours_of.prepare_search(q, []) is None
        assert pipe.neighbours_of.prepare_search(Query(q.text, retriever="none"), articles) is None
        nobody = pipe.neighbours_of.knn.prepare(["no such article"])
        assert len(nobody.search(enc.embedding, 5)) == 0
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:  # FAISS's one search thread is not left as torch's (they share OpenMP's setting)
            pipe.neighbours_of.knn.prepare([a.title for a in articles]).search(enc.embedding, 5)
            assert torch.get_num_threads() == 2
        finally:
            torch.set_num_threads(threads)
    finally:
        pipe.close()


def test_the_service_reads_the_articles_rows_on_the_retrieval_thread_once(tiny_datastore: Path) -> None:
    """The kNN's rows are read and indexed next to the retrieval, during the forward pass, and not again after it."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    with TestClient(create_app(_settings(tiny_datastore))) as c:
        knn = c.app.state.resources.pipeline.neighbours_of.knn
        threads: list[str] = []
        prepare = knn.prepare

        def recording(titles, answer="word", *, read=True):
            threads.append(threading.current_thread().name)
            return prepare(titles, answer, read=read)

        knn.prepare = recording
        for text in ("frelle dax was born in [MASK] .", "[MASK] is a large city with a famous bridge ."):
            threads.clear()
            r = c.post("/predict", json={"text": text})
            assert r.status_code == 200 and r.json()["cache"]["encoding"] == "miss" and r.json()["articles"]
            assert len(threads) == 1 and threads[0].startswith("retrieval"), threads
        # Queries batched together read their rows when their answers are made (on the model thread or in the
        # finisher pool, as `Pace` decides), not while they wait: queued queries do not each hold their rows.
        answerer = c.app.state.resources.answerer
        gate, busy = threading.Event(), threading.Event()
        blocker = answerer.batcher.call(lambda: (busy.set(), gate.wait(10)))
        assert busy.wait(10)
        threads.clear()
        texts = ["zorblat wrote many [MASK] .", "quimby is a small [MASK] near the sea ."]
        with ThreadPoolExecutor(2) as pool:
            waiting = [pool.submit(c.post, "/predict", json={"text": t}) for t in texts]
            deadline = time.monotonic() + 10
            while answerer.batcher.depth < 2 and time.monotonic() < deadline:
                time.sleep(0.01)
            assert answerer.batcher.depth == 2 and threads == []  # both wait; no rows read
            gate.set()
            answers = [w.result(10) for w in waiting]
        blocker.result(10)
        assert all(r.status_code == 200 and r.json()["cache"]["encoding"] == "miss" for r in answers)
        assert len(threads) == 2 and all(t.startswith(("model", "knn")) for t in threads), threads


@pytest.mark.parametrize("cache_kind", ["memory", "redis"])
@pytest.mark.parametrize("finisher", ["model", "knn"])
@pytest.mark.parametrize("ranker", ["tfidf", "bm25"])
def test_queries_batched_behind_a_busy_model_get_the_same_answers_wherever_they_are_finished(
    tiny_datastore: Path, cache_kind: str, finisher: str, ranker: str, request: pytest.FixtureRequest
) -> None:
    """Queries that queue while the model is busy go in one batch; their p_MLM heads (`QueryEncoder.complete`)
    and answers are made on the model's thread while its forward per query is the cheaper part, and handed to the
    finisher thread when it is the slower one (`Pace`). Their articles are retrieved on the model thread as it
    finishes them where a retrieval costs less than finishing one and is all this interpreter's work (TF-IDF, the
    in-process cache), else on the retrieval thread (Lucene in the JVM, Redis over the network). Either way,
    answers and cached encodings equal the synchronous pipeline's, with the in-process cache and with Redis
    (written after the answer)."""
    import asyncio
    import threading
    import time

    from bertknn.service.cache import InMemoryCache, RedisCache
    from bertknn.service.codec import QueryEncoding
    from bertknn.service.metrics import Metrics
    from bertknn.service.serving import AsyncAnswerer
    from bertknn.service.settings import BatchingSettings

    texts = ["zorblat was born in [MASK] .", "quimby is a small [MASK] near the sea .", "the bridge of [MASK] is large ."]
    queries = [Query(t, retriever=ranker) for t in texts]
    retriever = "model" if (finisher, ranker, cache_kind) == ("model", "tfidf", "memory") else "retrieval"
    reference = AnswerPipeline.open(tiny_datastore, device="cpu")
    cache = RedisCache(request.getfixturevalue("redis_server").url) if cache_kind == "redis" else InMemoryCache()
    pipe = AnswerPipeline.open(tiny_datastore, device="cpu", cache=cache, key_prefix=f"pool-{cache_kind}")
    completed, retrieved, batches = [], [], []
    complete, retrieve = pipe.queries.complete, pipe.articles.retrieve
    pipe.queries.complete = lambda p, **kw: (completed.append(threading.current_thread().name), complete(p, **kw))[1]  # type: ignore[method-assign]
    pipe.articles.retrieve = lambda q: (retrieved.append(threading.current_thread().name), retrieve(q))[1]  # type: ignore[method-assign]

    async def main() -> list:
        answerer = AsyncAnswerer(pipe, BatchingSettings(max_wait_ms=0), Metrics())
        answerer.batcher._on_batch = lambda n, s: batches.append(n)
        # as measured on earlier batches: the forward per query cheaper than finishing one, or dearer
        answerer.finisher.pace.forward_s, answerer.finisher.pace.finish_s = (0.001, 0.002) if finisher == "model" else (0.005, 0.001)
        answerer.finisher.pace.retrieval_cpu_s = 0.0005  # a query's retrieval, a quarter of finishing one
        answerer.finisher.pace.weight = 0.0  # (kept so for this test's one batch)
        answerer.start()
        try:
            return await answer_as_one_batch(answerer, queries)
        finally:
            await answerer.stop()

    try:
        answers = asyncio.run(main())
        assert batches == [3] and len(completed) == 3 and all(name.startswith(finisher) for name in completed)
        assert len(retrieved) == 3 and all(name.startswith(retriever) for name in retrieved), retrieved
        for q, got in zip(queries, answers, strict=True):
            want = reference.predict(q)
            assert got.cache["encoding"] == "miss"
            assert [(p.token, p.prob, p.p_mlm, p.p_knn) for p in got.predictions] == [
                (p.token, p.prob, p.p_mlm, p.p_knn) for p in want.predictions]
            inp = pipe.check_query(q)
            fresh, key = reference.queries.encode([inp])[0][0], pipe.queries.key(inp)
            deadline = time.monotonic() + 5  # (Redis: written after the answer, by the pool)
            while pipe.queries._lookup([key])[0] is None and time.monotonic() < deadline:
                time.sleep(0.005)
            stored = pipe.queries._lookup([key])[0]  # bytes in Redis, the object itself in the process
            assert stored is not None and stored.to_bytes() == fresh.to_bytes()
            if cache_kind == "memory":
                assert isinstance(cache.get_objects([key])[0], QueryEncoding)
    finally:
        pipe.close()
        reference.close()
