"""A server process warms itself before it is ready: its model, retriever, kNN and vote run a few questions of its
own, and nothing of them is left behind (no cache entry, no metric, no batch counted)."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from bertknn.service.main import create_app
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.settings import ServiceSettings
from bertknn.service.warmup import warm_questions, warm_up


def counted(metrics: str, name: str) -> float:
    return sum(float(v) for v in re.findall(rf"^{name}(?:{{[^}}]*}})? (\S+)$", metrics, re.M))


@pytest.mark.parametrize("warmup", [True, False])
def test_the_warm_up_runs_before_ready_and_leaves_nothing_behind(tiny_datastore: Path, warmup: bool,
                                                                 caplog: pytest.LogCaptureFixture):  # fmt: skip
    settings = ServiceSettings(datastore=tiny_datastore, model={"device": "cpu", "backend": "eager"},
                               defaults={"retriever": "tfidf"}, warmup=warmup)  # fmt: skip
    with caplog.at_level(logging.INFO, logger="bertknn.service.warmup"), TestClient(create_app(settings)) as c:
        assert c.get("/readyz").status_code == 200
        metrics = c.get("/metrics").text
        pipe = c.app.state.resources.pipeline  # type: ignore[attr-defined]
        assert not pipe.cache._data  # neither encodings nor retrieved articles were kept
        for name in ("bertknn_batch_size_count", "bertknn_stage_seconds_count"):
            assert counted(metrics, name) == 0, name
        assert 'path="/predict"' not in metrics  # (the /readyz above is the only request counted)
        assert counted(metrics, "bertknn_cache_events_total") == 0
        body = c.post("/predict", json={"text": "zorblat was born in [MASK] ."}).json()
        assert body["cache"] == {"encoding": "miss", "retrieval": "miss"}  # the first client's question, as ever
    ran = [r.getMessage().split(" in ")[0] for r in caplog.records if r.getMessage().startswith("warmed up with")]
    articles = sum(1 for _ in pipe.datastore.iter_article_texts())
    assert ran == ([f"warmed up with {min(9, articles)} questions"] if warmup else [])


def test_warm_questions_come_from_the_datastore_s_articles_and_a_failing_one_never_stops_a_start(
    tiny_datastore: Path, caplog: pytest.LogCaptureFixture
):
    pipe = AnswerPipeline.open(tiny_datastore, device="cpu")
    try:
        settings = ServiceSettings(datastore=tiny_datastore, defaults={"retriever": "tfidf"})
        questions = warm_questions(pipe, settings, 3)
        first = next(pipe.datastore.iter_article_texts())[1].split()[:3]
        assert len(questions) == 3 and questions[0].text.startswith(" ".join(first))
        assert all(q.text.endswith("[MASK] .") and q.retriever == "tfidf" for q in questions)
        assert warm_up(pipe, settings) == min(9, sum(1 for _ in pipe.datastore.iter_article_texts()))

        def broken(*_: object) -> None:
            raise RuntimeError("no rows today")

        pipe.neighbours_of.neighbours = broken  # type: ignore[method-assign]
        with caplog.at_level(logging.WARNING, logger="bertknn.service.warmup"):
            assert warm_up(pipe, settings) == 0
        assert any("warm-up stopped after 0 questions: no rows today" in r.getMessage() for r in caplog.records)
    finally:
        pipe.close()
