"""Japanese, Ukrainian and Vietnamese Wikipedia, end to end: each real (truncated) dump in ../shared/data/wiki-i18n
built with the defaults and no language flag, by a tiny XLM-R-style model whose tokenizer is trained on that dump's
own text; then its stored text, targets, self-probe, retrieval and a served question checked against the targets
of docs/languages.md."""

from __future__ import annotations

import unicodedata
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlencode

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from bench.languages import RESIDUE, is_fragment, other_pages
from bertknn.builder.build import build
from bertknn.builder.corpus import CorpusStats, read_corpora
from bertknn.builder.settings import BuildSettings
from bertknn.core.format import validate_datastore
from bertknn.core.format.reader import Datastore
from bertknn.core.text import is_word_break
from bertknn.evaluation.common import open_pipeline
from bertknn.evaluation.selfprobe import sample_items, self_probe
from bertknn.service.pipeline import AnswerPipeline
from tests.support.browser import shot, wait
from tests.support.families import make_family_model, train_tokenizer
from tests.support.neighbours import assert_same_neighbours
from tests.support.processes import service_process

DUMPS = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "wiki-i18n"
LANGUAGES = ("ja", "uk", "vi")


def dump(language: str) -> Path:
    return DUMPS / f"{language}wiki-truncated-100k.xml.xz"


@pytest.fixture(scope="module", params=LANGUAGES)
def built(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    language = request.param
    work = tmp_path_factory.mktemp(f"wiki-{language}")
    texts = [a.text for _, a in zip(range(80), read_corpora([dump(language)], CorpusStats()), strict=False)]
    tokenizer = train_tokenizer("xlm-roberta", texts, vocab_size=3000)
    model = make_family_model(work / "model", "xlm-roberta", texts, tokenizer=tokenizer, positions=256)
    build(BuildSettings(corpus=[dump(language)], model=str(model), out=work / "ds"))  # no --language
    yield language, work / "ds"


@pytest.fixture(scope="module")
def pipeline(built: tuple[str, Path]) -> Iterator[AnswerPipeline]:
    pipe = open_pipeline(built[1], model=None, device="cpu", threads=1, cache_items=1 << 10)
    yield pipe
    pipe.close()


def test_the_dump_builds_in_its_own_language_and_says_it_was_cut(built: tuple[str, Path]) -> None:
    language, root = built
    ds = Datastore(root)
    manifest = ds.manifest
    assert manifest.language == language and validate_datastore(root, hashes=False) == []
    assert [w for w in manifest.warnings if "ends inside a page" in w] == manifest.warnings[:1]
    assert len(manifest.warnings) == 1, manifest.warnings  # the cut end, and nothing else is wrong
    titles = {a["title"] for s in ds.shards for a in s.articles()}
    assert not titles & other_pages(dump(language))


def test_stored_text_is_clean_and_its_contexts_are_words(built: tuple[str, Path]) -> None:
    language, root = built
    ds = Datastore(root)
    sentences = [s.sentence(i) for s in ds.shards for i in range(len(s.sentence_offsets) - 1)]
    assert sum(bool(RESIDUE.search(s)) for s in sentences) / len(sentences) < 0.005
    assert sum(map(is_fragment, sentences)) / len(sentences) < 0.02
    dropped = sum(ds.manifest.counts.dropped_sentences.values())
    assert dropped / (dropped + len(sentences)) <= 0.20
    rows = words = glued = 0
    for shard in ds.shards:
        labels, spans, sids = np.asarray(shard.labels), np.asarray(shard.spans), np.asarray(shard.sentence_ids)
        rows += len(labels)
        for r in np.flatnonzero(labels >= 0)[:20000]:
            words += 1
            word = shard.sentence(int(sids[r]))[spans[r][0] : spans[r][1]]
            glued += is_word_break(word[0]) or is_word_break(word[-1])
    assert np.count_nonzero(np.concatenate([np.asarray(s.labels) for s in ds.shards]) >= 0) / rows >= 0.30
    assert glued == 0
    if language == "ja":  # sentences end at "。" (or a closing bracket after one), not mid-clause
        assert sum(s.endswith(("。", "」", "）", "』")) for s in sentences) / len(sentences) > 0.8


def test_self_probe_and_bm25_find_the_stored_sentences(pipeline: AnswerPipeline) -> None:
    result = self_probe(pipeline, 100, retriever="bm25", num_articles=3)
    assert result.knn_top1 >= 0.95, result.misses
    assert result.retrieval_top is not None and result.retrieval_top >= 0.80


def test_a_subject_in_another_case_or_unicode_form_finds_its_article(pipeline: AnswerPipeline) -> None:
    from bertknn.service.results import Query

    titles = [a["title"] for s in pipeline.datastore.shards for a in s.articles()]
    forms = [(t, unicodedata.normalize("NFD", t[0].lower() + t[1:])) for t in titles[:40]]
    forms = [(t, f) for t, f in forms if f != t]
    assert forms
    for title, form in forms:
        hits, _ = pipeline.articles.retrieve(Query(text="[MASK] .", subject=form, num_articles=1))
        assert hits[0].title == title and hits[0].rule == "subject", (title, form)


def test_the_knn_on_the_device_over_kept_rows_finds_the_hosts_neighbours(pipeline: AnswerPipeline) -> None:
    """``model.knn_device: model`` with the rows kept on the device (here the CPU's torch), on each language's
    datastore: stored sentences asked back find the host's FAISS neighbours among their article's rows."""
    from bertknn.service.results import Query
    from bertknn.service.retrieval.device_knn import DeviceKnn
    from bertknn.service.retrieval.resident_rows import ResidentRows

    ds = pipeline.datastore
    kept = ResidentRows("cpu", lambda nbytes: True)
    assert kept.advance(ds) == ds.total_rows
    queries = [Query(item.question, subject=item.title, k=16) for item in sample_items(ds, 6, seed=2)]
    encs, _ = pipeline.queries.encode([pipeline.check_query(q) for q in queries])
    items = []
    for q, enc in zip(queries, encs, strict=True):
        search = pipeline.neighbours_of.prepare_search(q, pipeline.articles.retrieve(q)[0], read=False)
        assert search is not None and len(search)
        items.append((enc.embedding, search, q.k))
    for (e, s, k), got in zip(items, DeviceKnn("cpu", resident=kept).search(items, [ds] * len(items)), strict=True):
        assert_same_neighbours(got, s.search(e.astype(np.float32), k))


def test_a_question_is_served_in_the_datastore_s_language(built: tuple[str, Path], pipeline: AnswerPipeline) -> None:
    from bertknn.service.main import create_app
    from bertknn.service.settings import ServiceSettings

    language, root = built
    item = sample_items(pipeline.datastore, 1, seed=1)[0]
    app = create_app(ServiceSettings(datastore=root, model={"device": "cpu"}))
    with TestClient(app) as client:
        r = client.post("/predict", json={"text": item.question, "subject": item.title, "top_k": 3})
        assert r.status_code == 200, r.text
        body = r.json()
        assert body["warnings"] == [] and body["predictions"]
        assert body["articles"][0]["title"] == item.title
        foreign = client.post("/predict", json={"text": "Paris is the capital of [MASK] ."} if language != "vi"
                              else {"text": "東京は日本の[MASK]である。"})  # fmt: skip
        assert foreign.status_code == 200 and "script" in " ".join(foreign.json()["warnings"])
        page = client.get("/ui")
        assert page.status_code == 200 and "<html" in page.text.lower()


def test_the_playground_shows_the_answer_in_the_datastore_s_language(
    built: tuple[str, Path], pipeline: AnswerPipeline, browser: Any
) -> None:
    """The playground in a real browser (`test_playground`'s), asked a stored sentence of this language."""
    from selenium.webdriver.common.by import By

    language, root = built
    item = sample_items(pipeline.datastore, 1, seed=2)[0]
    question = {"text": item.question, "subject": item.title}
    with service_process(root, env={"BERTKNN_MODEL__DEVICE": "cpu"}) as svc:
        api = httpx.post(f"{svc.url}/predict", json=question, timeout=60).json()
        browser.get(f"{svc.url}/ui?{urlencode(question)}")
        rows = wait(browser, "#answers .answer")
        assert [r.get_attribute("data-token") for r in rows] == [p["token"] for p in api["predictions"]]
        # shown as asked, to the character (WebDriver's .text shows a no-break space as a space: "2\xa0%")
        assert browser.find_element(By.CSS_SELECTOR, "#preview").get_attribute("textContent") == item.question
        shot(browser, f"playground-{language}")


def test_the_warm_up_runs_every_question_in_the_dump_s_language(built: tuple[str, Path], pipeline: AnswerPipeline):
    """Japanese writes no spaces: a question's opening is cut by characters too, and each question runs through
    the language's own analyzer, the kNN and the vote like a client's."""
    from bertknn.service.settings import ServiceSettings
    from bertknn.service.warmup import warm_questions, warm_up

    settings = ServiceSettings(datastore=built[1])
    questions = warm_questions(pipeline, settings, 9)
    assert len(questions) == 9 and all(len(q.text) <= 200 + len(" <mask> .") for q in questions)
    assert warm_up(pipeline, settings) == 9
