"""How the neighbours vote, end to end on a built datastore: the vote weighted by p_MLM (``mlm_prior``) and the
neighbours of lower-ranked articles counting less (``article_sharpness``), each checked against a hand computation
from the plain vote's own parts, and through the API."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from bertknn.service.main import create_app
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.results import Query
from bertknn.service.settings import ServiceSettings

QUESTION = Query("zorblat was born in [MASK] .", subject="zorblat")
NO_SUBJECT = Query("plonk is a large [MASK] with a famous bridge .", num_articles=3)


@pytest.fixture(scope="module")
def pipe(tiny_datastore: Path):
    p = AnswerPipeline.open(tiny_datastore, device="cpu")
    yield p
    p.close()


def _plain(pipe: AnswerPipeline, query: Query):
    return pipe.predict(replace(query, mlm_prior=0.0, article_sharpness=0.0), with_distributions=True)


def test_the_weighted_vote_is_the_plain_vote_times_p_mlm_to_the_prior(pipe: AnswerPipeline) -> None:
    plain = _plain(pipe, QUESTION).distributions
    assert plain is not None
    for prior in (0.5, 2.0):
        got = pipe.predict(replace(QUESTION, mlm_prior=prior), with_distributions=True)
        d = got.distributions
        assert d is not None
        voted = plain.p_knn > 0
        want = np.where(voted, plain.p_knn.astype(np.float64) * plain.p_mlm.astype(np.float64) ** prior, 0.0)
        want /= want.sum()
        assert np.allclose(d.p_knn, want, atol=1e-6)
        assert set(np.flatnonzero(d.p_knn)) == set(np.flatnonzero(voted))  # the same words, re-weighted
        assert np.allclose(d.p, 0.3 * d.p_knn + 0.7 * d.p_mlm, atol=1e-6)  # the mixture is unchanged
        assert np.array_equal(d.p_mlm, plain.p_mlm)
        # the ranked answers are the dense distribution's (the fast path reads p_MLM at the voted ids only)
        fast = pipe.predict(replace(QUESTION, mlm_prior=prior, top_k=5))
        order = np.argsort(-np.where(pipe.answerer.non_words, -1.0, d.p), kind="stable")[:5]  # type: ignore[attr-defined]
        assert [p.token_id for p in fast.predictions] == order.tolist()


def test_lower_ranked_articles_count_less_by_their_score(pipe: AnswerPipeline) -> None:
    plain = _plain(pipe, NO_SUBJECT)
    assert len(plain.articles) >= 2 and all(a.rule == "bm25" and a.score for a in plain.articles)
    top = max(a.score or 0.0 for a in plain.articles)
    assert min(a.score or 0.0 for a in plain.articles) < top  # the test needs articles that score differently
    nbrs = pipe.neighbours_of.neighbours(NO_SUBJECT, pipe.queries.encode([pipe.check_query(NO_SUBJECT)])[0][0], plain.articles)
    score_of = {a.title: a.score for a in plain.articles}
    article = [ref.article for ref in pipe.datastore.contexts(nbrs.rows.tolist())]
    for sharpness in (2.0, 10.0):
        q = replace(NO_SUBJECT, mlm_prior=0.0, article_sharpness=sharpness)
        d = pipe.predict(q, with_distributions=True).distributions
        assert d is not None
        # by hand: softmax(-d / l + log w_article), w_article = exp(-sharpness * (1 - score / top score))
        logit = [-float(dist) / plain.temperature_used - sharpness * (1 - score_of[a] / top)
                 for dist, a in zip(nbrs.distances, article, strict=True)]  # fmt: skip
        m = max(logit)
        w = [math.exp(x - m) for x in logit]
        want = np.zeros_like(d.p_knn, dtype=np.float64)
        for weight, label in zip(w, nbrs.labels.tolist(), strict=True):
            want[label] += weight / sum(w)
        assert np.allclose(d.p_knn, want, atol=1e-6)
    # the subject's own article alone: nothing to weigh, the vote is the plain one
    with_subject = pipe.predict(replace(QUESTION, mlm_prior=0.0), with_distributions=True)
    assert with_subject.distributions is not None
    assert np.array_equal(with_subject.distributions.p_knn, _plain(pipe, QUESTION).distributions.p_knn)  # type: ignore[union-attr]


def test_the_api_takes_both_knobs_and_says_what_is_wrong(tiny_datastore: Path) -> None:
    settings = ServiceSettings(datastore=tiny_datastore, model={"device": "cpu"}, batching={"max_wait_ms": 1})
    with TestClient(create_app(settings)) as client:
        body = {"text": QUESTION.text, "subject": "zorblat"}
        default = client.post("/predict", json=body).json()
        paper = client.post("/predict", json={**body, "mlm_prior": 0, "article_sharpness": 0}).json()
        top = default["predictions"][0]
        assert top["prob"] == pytest.approx(0.3 * top["p_knn"] + 0.7 * top["p_mlm"], rel=1e-4)
        plain = {p["token"]: p["p_knn"] for p in paper["predictions"]}
        weighted = {p["token"]: p["p_knn"] for p in default["predictions"]}
        assert plain != weighted  # the vote moved towards the words the MLM prefers
        for field, value in (("mlm_prior", -1), ("mlm_prior", "high"), ("article_sharpness", -0.5)):
            r = client.post("/predict", json={**body, field: value})
            assert r.status_code == 422 and field in r.json()["error"]["message"], r.text


def test_the_client_cli_sends_the_prior(tiny_datastore: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    from bertknn.service import client as cli

    settings = ServiceSettings(datastore=tiny_datastore, model={"device": "cpu"}, batching={"max_wait_ms": 1})
    with TestClient(create_app(settings)) as http:
        monkeypatch.setattr(cli.BertKnnClient, "__init__", lambda self, *a, **k: self.__dict__.update(
            _http=http, retries=0, max_wait_s=0.0))  # fmt: skip
        monkeypatch.setattr(cli.BertKnnClient, "close", lambda self: None)
        body = {"text": QUESTION.text, "subject": "zorblat"}
        seen = []
        for prior in ("0", "2"):
            assert cli.main(["predict", QUESTION.text, "--subject", "zorblat", "--mlm-prior", prior, "--json"]) == 0
            got = json.loads(capsys.readouterr().out)
            want = http.post("/predict", json={**body, "mlm_prior": float(prior)}).json()
            seen.append([(p["token"], p["p_knn"]) for p in got["predictions"]])
            assert seen[-1] == [(p["token"], p["p_knn"]) for p in want["predictions"]]
        assert seen[0] != seen[1]  # the flag reached the server: the two votes differ
        assert cli.main(["predict", QUESTION.text, "--mlm-prior", "-1"]) == 2  # refused before any request
        assert capsys.readouterr().err.strip() == "error: --mlm-prior: Input should be greater than or equal to 0"
