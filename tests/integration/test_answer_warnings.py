"""An answer says what it could not use. Its kNN search found no neighbour: no article matched the question's words,
or the subject's article holds no stored context (for an entity answer, none that links an entity); the answer is
then the masked LM's alone. Or the question was longer than the window its datastore's contexts were embedded in.
The response, the client's table, ``/follow`` and the playground (which shows ``warnings``) tell the caller."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from bertknn.builder.ivfpq import add_ivfpq
from bertknn.service.api.schemas import PredictResponse
from bertknn.service.client import format_table
from bertknn.service.main import create_app
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.results import Query
from bertknn.service.settings import ServiceSettings
from tests.conftest import TINY_ARTICLES, build_tiny, corpus_words, make_tiny_bert, write_jsonl
from tests.integration.test_entities import linked

# every word of it is unknown to the tiny corpus: no ranker finds an article for it
UNMATCHED = "glarb [MASK] snorf ."
# an article whose sentences hold only stopwords and punctuation: stored, with no context to vote
BARE = {"id": "7", "title": "Ooo", "text": "It is the one. Of it, and it was."}


@pytest.fixture(scope="module")
def datastore(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("answer-warnings")
    ds = build_tiny(tmp / "ds", [write_jsonl(tmp / "c.jsonl", [*TINY_ARTICLES, BARE])], tiny_model_dir)
    add_ivfpq(ds)  # for the whole-datastore search (retriever none)
    return ds


@pytest.fixture(scope="module")
def client(datastore: Path):
    settings = ServiceSettings(datastore=datastore, model={"device": "cpu"}, batching={"max_wait_ms": 1})
    with TestClient(create_app(settings)) as c:
        yield c


@pytest.mark.parametrize("retriever", ["bm25", "tfidf"])
def test_no_article_for_the_words_is_said(client: TestClient, retriever: str) -> None:
    r = client.post("/predict", json={"text": UNMATCHED, "retriever": retriever})
    body = r.json()
    assert r.status_code == 200 and body["predictions"], r.text
    assert body["articles"] == [] and body["lambda_used"] == 0.0
    assert all(p["p_knn"] == 0.0 and p["contexts"] == [] for p in body["predictions"])
    assert body["warnings"] == [
        f"{retriever} found no article for the question's words, so no context voted: the answer is the model's "
        "alone; name the question's subject, or use words its article uses"
    ]
    # the same words with a subject: its article is searched, its contexts vote, nothing to warn of
    named = client.post("/predict", json={"text": UNMATCHED, "retriever": retriever, "subject": "Zorblat"}).json()
    assert named["warnings"] == [] and named["lambda_used"] > 0
    assert any(p["p_knn"] > 0 for p in named["predictions"])


def test_a_subject_whose_article_holds_no_context_is_said(client: TestClient) -> None:
    body = client.post("/predict", json={"text": "ooo was born in [MASK] .", "subject": "Ooo"}).json()
    assert body["subject_status"] == "found" and [a["title"] for a in body["articles"]] == ["Ooo"]
    assert body["lambda_used"] == 0.0
    assert body["warnings"] == [
        "the subject's article holds no stored context, so no context voted: the answer is the model's alone"
    ]


def test_a_matched_question_and_the_whole_datastore_warn_of_nothing(client: TestClient) -> None:
    for extra in ({}, {"retriever": "none"}, {"subject": "Quimby"}):
        body = client.post("/predict", json={"text": "zorblat was born in [MASK] .", **extra}).json()
        assert body["warnings"] == [] and body["lambda_used"] > 0, (extra, body)


def test_the_client_table_prints_the_warnings(client: TestClient) -> None:
    resp = PredictResponse.model_validate(client.post("/predict", json={"text": UNMATCHED}).json())
    lines = format_table(resp).splitlines()
    assert lines[-1] == f"warning: {resp.warnings[0]}" and "found no article" in lines[-1]
    quiet = PredictResponse.model_validate(client.post("/predict", json={"text": "zorblat was born in [MASK] ."}).json())
    assert not any(line.startswith("warning:") for line in format_table(quiet).splitlines())


def test_an_entity_answer_from_an_article_that_links_nothing_is_said(tmp_path: Path) -> None:
    articles = [
        linked("1", "Orvin Tasker", "Orvin Tasker was born in Port Ambrel. Orvin Tasker paints ships.",
               [("Port Ambrel", "Port Ambrel")]),
        linked("2", "Port Ambrel", "Port Ambrel is a city by the sea. Port Ambrel has an old bridge.", []),
    ]  # fmt: skip  (Port Ambrel's own sentences link nothing)
    model = make_tiny_bert(tmp_path / "model", corpus_words(articles))
    ds = build_tiny(tmp_path / "ds", [write_jsonl(tmp_path / "c.jsonl", articles)], model)
    with TestClient(create_app(ServiceSettings(datastore=ds, model={"device": "cpu"}))) as c:
        body = {"text": "port ambrel is a city by the [MASK] .", "answer": "entity"}
        unlinked = c.post("/predict", json={**body, "subject": "Port Ambrel"}).json()
        linking = c.post("/predict", json={**body, "subject": "Orvin Tasker"}).json()
        # two hops: Orvin Tasker's article links Port Ambrel, whose own article links nothing
        hops = c.post("/follow", json={"subject": "Orvin Tasker", "beam": 1,
                                       "relations": ["[X] was born in [Y] .", "[X] is a city by the [Y] ."]}).json()
    assert unlinked["subject_status"] == "found" and unlinked["lambda_used"] == 0.0, unlinked
    assert unlinked["warnings"] == ["the subject's article holds no stored context that links an entity, so no "
                                    "context voted: the answer is the model's alone"]  # fmt: skip
    assert linking["warnings"] == [] and linking["lambda_used"] > 0, linking
    assert hops["hops"][0]["entities"][0]["title"] == "Port Ambrel", hops
    assert hops["warnings"] == ["hop 2: 'Port Ambrel': the subject's article holds no stored context that links an "
                                "entity, so no context voted: the answer is the model's alone"]  # fmt: skip


def test_a_question_longer_than_the_window_is_said(client: TestClient, datastore: Path) -> None:
    """The tiny datastore's window is 64 tokens (`build_tiny`): the model reads the 62 around [MASK]."""
    ds = datastore
    padding = " ".join(["zorblat wrote many songs about rivers ."] * 12)  # 84 tokens before the question
    long = client.post("/predict", json={"text": f"{padding} zorblat was born in [MASK] ."}).json()
    cut = 84 + 6 - 62  # (every word is one token of the tiny model's vocabulary)
    assert long["warnings"] == [
        f"the question is longer than this datastore's window of 64 tokens: the model read the 62 around [MASK] "
        f"and left {cut} out (retrieval read all of it); a shorter question keeps what matters"
    ], long
    assert long["lambda_used"] > 0 and long["articles"]
    batch = client.post("/predict/batch", json={"queries": [{"text": f"{padding} zorblat was born in [MASK] ."},
                                                           {"text": "zorblat was born in [MASK] ."}]}).json()
    assert [r["warnings"] for r in batch["results"]] == [long["warnings"], []]
    # in process (the evaluation's and the command line's path), the same words
    pipe = AnswerPipeline.open(ds, device="cpu")
    try:
        asked = pipe.predict(Query(text=f"{padding} zorblat was born in [MASK] ."))
    finally:
        pipe.close()
    assert asked.warnings == long["warnings"]


def _unvoted(client: TestClient) -> dict[str, float]:
    text = client.get("/metrics").text
    return {r: float(m.group(1)) if (m := re.search(rf'^bertknn_unvoted_total{{reason="{r}"}} (\S+)$', text, re.M))
            else 0.0 for r in ("no_article", "no_context")}  # fmt: skip


def test_answers_no_context_voted_in_are_counted_by_why(client: TestClient) -> None:
    before = _unvoted(client)
    client.post("/predict", json={"text": UNMATCHED, "retriever": "tfidf"})
    client.post("/predict/batch", json={"queries": [{"text": UNMATCHED}, {"text": "ooo was born in [MASK] .",
                                                                          "subject": "Ooo"}]})  # fmt: skip
    client.post("/predict", json={"text": "zorblat was born in [MASK] ."})  # its contexts vote: not counted
    after = _unvoted(client)
    assert {r: after[r] - before[r] for r in after} == {"no_article": 2.0, "no_context": 1.0}
