"""Live updates: ``datastore_builder add`` + a service that picks the new version up without a restart.

The tiny model's vocabulary covers the update's words ("zandor", "kelbo"), which appear in no article of the
first build: before the update no stored context can answer them, after it only the new rows can.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from bertknn.builder.__main__ import main
from bertknn.builder.settings import AddSettings
from bertknn.builder.update import add_articles
from bertknn.core.calibration import sample_neighbours
from bertknn.core.errors import BuildError, UpdateError
from bertknn.core.format import (
    MANIFEST,
    SHARDS_DIR,
    Datastore,
    read_manifest,
    validate_datastore,
    write_manifest,
)
from bertknn.service.main import create_app
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.results import Query
from bertknn.service.retrieval.global_knn import IvfPqKnn
from bertknn.service.settings import ServiceSettings
from tests.conftest import REPO, TINY_ARTICLES, build_tiny, corpus_words, make_tiny_bert, write_jsonl

NEW_ARTICLE = {"id": "7", "title": "Brindle Pax", "text": "Brindle Pax was born in zandor. Brindle Pax wrote many songs about boats."}
CHANGED_ZORBLAT = {"id": "1", "title": "Zorblat", "text": "Zorblat was born in kelbo. Zorblat wrote many songs about mountains."}
UPDATE = [NEW_ARTICLE, CHANGED_ZORBLAT, TINY_ARTICLES[1]]  # new, changed, unchanged (Quimby, same text)
BRINDLE: dict[str, Any] = {"text": "brindle pax was born in [MASK] .", "subject": "Brindle Pax"}
ZORBLAT: dict[str, Any] = {"text": "zorblat was born in [MASK] .", "subject": "Zorblat"}
TOKEN = "s3cret-admin-token"


UK_DUMP = Path(__file__).resolve().parents[2] / ".." / "shared" / "data" / "wiki-i18n" / "ukwiki-truncated-100k.xml.xz"


@pytest.fixture(scope="module")
def live_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_bert(tmp_path_factory.mktemp("live-bert"), corpus_words(TINY_ARTICLES + UPDATE))


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, live_model: Path) -> Path:
    tmp = tmp_path_factory.mktemp("live-base")
    return build_tiny(tmp / "ds", [write_jsonl(tmp / "base.jsonl", TINY_ARTICLES)], live_model, ivfpq=True)


@pytest.fixture
def ds(base: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(base, tmp_path / "ds"))


@pytest.fixture
def update_corpus(tmp_path: Path) -> Path:
    return write_jsonl(tmp_path / "update.jsonl", UPDATE)


def _add(ds: Path, corpus: Path, **kw: object) -> object:
    return add_articles(AddSettings(datastore=ds, corpus=[corpus], device="cpu", batch_size=16, **kw))  # type: ignore[arg-type]


def _snapshot(root: Path) -> dict[str, bytes | None]:
    """Every path under the datastore, with the bytes of its files (the datastore is tiny)."""
    return {
        p.relative_to(root).as_posix(): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))
    }


def _top(pipe: AnswerPipeline, q: dict, **kw: object) -> str:
    return pipe.predict(Query(**q, **kw)).predictions[0].token  # type: ignore[arg-type]


def test_add_embeds_new_and_changed_articles_and_supersedes_old_rows(ds: Path, update_corpus: Path):
    before = Datastore(ds)
    old_zorblat = before.articles["Zorblat"]
    old_rows = set(range(old_zorblat.row_start, old_zorblat.row_end))  # shard 0 comes first: global = local
    pipe_old = AnswerPipeline.open(ds, device="cpu")
    assert _top(pipe_old, ZORBLAT) == "quimby"
    assert _top(pipe_old, BRINDLE) != "zandor"  # no stored context says zandor yet
    pipe_old.close()

    result = _add(ds, update_corpus)
    assert (result.added, result.replaced, result.unchanged) == (1, 1, 1)  # type: ignore[attr-defined]
    assert validate_datastore(ds) == []  # checksums, counts, update record, superseded counts
    man = read_manifest(ds)
    assert man.version == 2 and man.updates[-1].shards == ["shard-00003"] and man.datastore_id != before.id
    d = Datastore(ds)
    assert d.articles["Zorblat"].shard == 3 and d.articles["Quimby"] == before.articles["Quimby"]
    assert [e.title for e in d.table.superseded()] == ["Zorblat"]
    assert set(d.superseded_rows.tolist()) == old_rows
    assert man.counts.articles == len(d.articles) == 7
    assert man.counts.contexts == sum(e.rows for e in d.articles.values())
    assert man.counts.superseded_contexts == len(old_rows) > 0
    assert man.counts.contexts + man.counts.superseded_contexts == d.total_rows
    assert sorted(t for t, _ in d.iter_article_texts()) == sorted(d.articles)  # no stale duplicate for the indexes
    # the temperature statistic (`bert-knn calibrate` after an add) samples live rows only: none of the old rows
    drawn = sample_neighbours(d, sample=d.total_rows, k=16)
    assert len(drawn.rows) > len(old_rows) and not set(drawn.rows) & old_rows
    assert all(v.startswith("index/v2/") for v in man.indexes.values()) and set(man.indexes) == {"bm25", "tfidf", "ivfpq"}

    pipe = AnswerPipeline.open(ds, device="cpu")
    try:
        answer = pipe.predict(Query(**BRINDLE))
        assert answer.predictions[0].token == "zandor"
        assert answer.predictions[0].contexts[0].article == "Brindle Pax"
        changed = pipe.predict(Query(**ZORBLAT))
        assert changed.predictions[0].token == "kelbo"
        assert "quimby" not in {t.token for t in changed.knn}  # the old fact is gone from the article's rows
        # BM25 and TF-IDF: one document per current article, the new text indexed, the old text not
        for name in ("bm25", "tfidf"):
            ranker = pipe.retrievers[name]
            assert ranker.top_articles("zandor", 3)[0][0] == "Brindle Pax"  # type: ignore[attr-defined]
            assert "Zorblat" not in [t for t, _ in ranker.top_articles("rivers", 10)]  # type: ignore[attr-defined]
        assert pipe.retrievers["bm25"].num_docs == 7  # type: ignore[attr-defined]
        assert sorted(pipe.retrievers["tfidf"].titles()) == sorted(d.articles)  # type: ignore[attr-defined]
        # whole-datastore kNN (IVF-PQ path; a flat index at this size, so exact): every row but the superseded
        knn = IvfPqKnn(d)
        _, rows = knn.search(np.asarray(d.shards[0].vectors[0], dtype=np.float32), d.total_rows)
        assert set(rows.tolist()) == set(range(d.total_rows)) - old_rows
        none = pipe.predict(Query(**ZORBLAT, retriever="none", k=64))
        assert all(c.sentence != "Zorblat was born in **quimby**." for p in none.predictions for c in p.contexts)
    finally:
        pipe.close()


def test_validate_after_add_still_catches_corruption(ds: Path, update_corpus: Path, live_model: Path):
    _add(ds, update_corpus)
    with pytest.raises(BuildError, match="that `add` updated"):  # a re-run of `build` would drop the update
        build_tiny(ds, [update_corpus], live_model)
    good = read_manifest(ds)
    vectors = ds / SHARDS_DIR / "shard-00003" / "vectors.npy"
    data = vectors.read_bytes()
    vectors.write_bytes(data[:-4] + b"\x00\x00\x00\x01")
    assert "shard-00003/vectors.npy: sha256 mismatch" in validate_datastore(ds)[0]
    vectors.write_bytes(data)

    tampered = good.model_copy(deep=True)
    tampered.updates = []  # the new shard repeats a title, and now no `add` vouches for it
    tampered.version = 1
    write_manifest(ds, tampered)
    assert "no `add` made shard-00003" in validate_datastore(ds)[0]
    tampered = good.model_copy(deep=True)
    tampered.counts.superseded_contexts += 1
    write_manifest(ds, tampered)
    assert "superseded counts" in validate_datastore(ds)[0]
    tampered = good.model_copy(deep=True)
    tampered.version = 3  # the last update made version 2
    write_manifest(ds, tampered)
    assert "the last update made version 2" in validate_datastore(ds)[0]
    write_manifest(ds, good)
    assert validate_datastore(ds) == []


def test_a_crash_before_the_manifest_write_leaves_the_old_version(
    ds: Path, update_corpus: Path, monkeypatch: pytest.MonkeyPatch
):
    manifest_before = (ds / MANIFEST).read_bytes()

    def crash(*_: object) -> None:
        raise KeyboardInterrupt("killed before the commit")

    monkeypatch.setattr("bertknn.builder.update.write_manifest", crash)
    with pytest.raises(KeyboardInterrupt):
        _add(ds, update_corpus)
    assert (ds / "shards" / "shard-00003").is_dir() and (ds / "index" / "v2" / "bm25").is_dir()  # work was done
    assert (ds / MANIFEST).read_bytes() == manifest_before
    assert validate_datastore(ds) == []
    old = Datastore(ds)
    assert old.version == 1 and "Brindle Pax" not in old.articles and not old.table.superseded()
    pipe = AnswerPipeline.open(ds, device="cpu")  # the old version is served as before
    assert _top(pipe, ZORBLAT) == "quimby"
    pipe.close()

    monkeypatch.undo()
    result = _add(ds, update_corpus)  # the same command again finishes the update
    assert result.manifest.version == 2 and validate_datastore(ds) == []  # type: ignore[attr-defined]
    assert sorted(p.name for p in (ds / SHARDS_DIR).iterdir()) == [s.name for s in result.manifest.shards]  # type: ignore[attr-defined]


def test_sigkill_during_add_leaves_a_valid_datastore(ds: Path, update_corpus: Path):
    cmd = [sys.executable, "-m", "datastore_builder", "add", "--datastore", str(ds), "--corpus", str(update_corpus),
           "--device", "cpu"]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=REPO, env=dict(os.environ),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    try:
        # killed once its new shard exists: while the sparse indexes are written, before the manifest
        deadline = time.monotonic() + 120
        while not (ds / SHARDS_DIR / "shard-00003").exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.005)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait()
    assert validate_datastore(ds) == []
    version = read_manifest(ds).version
    assert version in (1, 2)  # 2 only if the add won the race and finished before the kill
    assert ("Brindle Pax" in Datastore(ds).articles) == (version == 2)


def test_add_refuses_bad_input_and_changes_nothing(
    ds: Path, update_corpus: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
):
    before = _snapshot(ds)
    other = make_tiny_bert(tmp_path / "other", corpus_words(TINY_ARTICLES + UPDATE), seed=1)
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    cases = [
        (["--corpus", str(update_corpus), "--model", str(other)], "is not the model this datastore was built with"),
        (["--corpus", str(tmp_path / "missing.jsonl")], "no such corpus file"),
        (["--corpus", str(empty)], "empty.jsonl: no article in it (the file is empty"),
        (["--corpus", str(tmp_path / "notes.txt")], None),
        (["--corpus", str(UK_DUMP)], f"the dump is in 'uk' (its <mediawiki xml:lang>), the datastore {ds} in 'en'"),
    ]
    (tmp_path / "notes.txt").write_text("not a corpus")
    for extra, needle in cases:
        capsys.readouterr()
        assert main(["add", "--datastore", str(ds), "--device", "cpu", *extra]) == 1
        err = capsys.readouterr().err
        errors = [line for line in err.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1 and "Traceback" not in err, err  # one line says what is wrong (after the log)
        if needle:
            assert needle in errors[0], err
        assert _snapshot(ds) == before, extra
    assert main(["add", "--datastore", str(tmp_path / "nowhere"), "--corpus", str(update_corpus)]) == 1
    assert "no such datastore directory" in capsys.readouterr().err
    with pytest.raises(UpdateError, match="another stopword list|stopword list"):
        stop = tmp_path / "stop.txt"
        stop.write_text("the\n")
        _add(ds, update_corpus, stopwords=stop)
    assert _snapshot(ds) == before

    # a corpus with nothing new: a no-op, the version stays
    assert main(["add", "--datastore", str(ds), "--corpus", str(write_jsonl(tmp_path / "same.jsonl", TINY_ARTICLES))]) == 0
    summary = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert (summary["version"], summary["added"], summary["replaced"], summary["unchanged"]) == (1, 0, 0, 6)
    assert _snapshot(ds) == before


def test_add_refuses_a_slice_a_damaged_datastore_a_corpus_of_no_article_and_a_second_add(
    ds: Path, update_corpus: Path, tmp_path: Path
) -> None:
    """Each refused with one line that says what to do, and the datastore left as it was."""
    import fcntl

    from bertknn.core.format.contract import SliceInfo
    from tests.integration.test_builder import wiki_page

    before = _snapshot(ds)
    with pytest.raises(UpdateError, match=f"^{ds}: another `add` is updating this datastore; wait for it to finish$"):
        fd = os.open(ds, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # as a running `add` holds it
            _add(ds, update_corpus)
        finally:
            os.close(fd)
    redirects_only = tmp_path / "redirects.xml"
    redirects_only.write_text(
        '<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.11/" version="0.11" xml:lang="en">\n'
        + wiki_page("Zorb", "#REDIRECT [[Zorblat]]", 90, redirect="Zorblat") + "</mediawiki>\n"
    )  # fmt: skip
    with pytest.raises(UpdateError, match=f"^{redirects_only}: no articles found; nothing was added$"):
        _add(ds, redirects_only)
    assert _snapshot(ds) == before

    labels = ds / SHARDS_DIR / "shard-00001" / "labels.npy"
    labels.write_bytes(labels.read_bytes()[:-4])
    before = _snapshot(ds)
    with pytest.raises(UpdateError, match=f"^{ds} failed validation, so nothing was added: {labels}: .* bytes, "):
        _add(ds, update_corpus)
    assert _snapshot(ds) == before

    sliced = Path(shutil.copytree(ds, tmp_path / "slice"))
    write_manifest(sliced, read_manifest(sliced).model_copy(update={"slice": SliceInfo(index=0, count=2)}))
    before = _snapshot(sliced)
    with pytest.raises(UpdateError, match=f"^{sliced} is slice 0 of 2; merge the slices first, then add to the merge$"):
        _add(sliced, update_corpus)
    assert _snapshot(sliced) == before


def test_an_article_whose_sentences_the_build_drops_is_unchanged_when_added_again(
    live_model: Path, tmp_path: Path
) -> None:
    """The build leaves out short sentences, fragments, markup and hatnotes; `add` compares what the build
    keeps, so the same article again is unchanged: no new version, no shard, nothing embedded."""
    article = {"id": "9", "title": "Plonk Bridge", "text": "Plonk has a red bridge near the market. Main article: "
               "Plonk. Plonk, a city. Plonk is a large city with a famous bridge."}  # fmt: skip
    corpus = write_jsonl(tmp_path / "one.jsonl", [article])
    ds = build_tiny(tmp_path / "ds", [corpus], live_model)
    dropped = read_manifest(ds).counts.dropped_sentences
    assert dropped.get("hatnote") == 1 and dropped.get("fragment") == 1, dropped  # the case this is about
    before = _snapshot(ds)
    result = _add(ds, corpus)
    assert (result.added, result.replaced, result.unchanged) == (0, 0, 1)  # type: ignore[attr-defined]
    assert _snapshot(ds) == before

def test_running_service_switches_versions_without_failing_a_request(ds: Path, update_corpus: Path):
    """The service keeps answering from two client threads while `add` runs and while /admin/reload swaps."""
    with TestClient(create_app(_settings(ds, admin_token=TOKEN))) as c:
        first = c.post("/predict", json=ZORBLAT).json()
        assert first["datastore"]["version"] == 1 and first["predictions"][0]["token"] == "quimby"
        brindle_v1 = c.post("/predict", json=BRINDLE).json()["predictions"][0]["token"]
        assert brindle_v1 != "zandor"

        results: list[tuple[int, int, str, str]] = []  # status, version (-1: failed), question, top token
        stop = threading.Event()

        def traffic(question: dict, name: str) -> None:
            while not stop.is_set():
                try:
                    r = c.post("/predict", json=question)
                except Exception as exc:  # an error escaping the app is a failed request too
                    results.append((0, -1, name, repr(exc)))
                    continue
                body = r.json()
                version = body["datastore"]["version"] if r.status_code == 200 else -1
                top = body["predictions"][0]["token"] if r.status_code == 200 else r.text
                results.append((r.status_code, version, name, top))
                time.sleep(0.01)  # steady traffic that leaves the small test machine room for the add

        threads = [threading.Thread(target=traffic, args=(q, n)) for q, n in ((ZORBLAT, "zorblat"), (BRINDLE, "brindle"))]
        for t in threads:
            t.start()
        try:
            assert main(["add", "--datastore", str(ds), "--corpus", str(update_corpus), "--device", "cpu"]) == 0
            assert c.post("/admin/reload").status_code == 401
            wrong = c.post("/admin/reload", headers={"Authorization": "Bearer nope"})
            assert wrong.status_code == 403 and wrong.json()["error"]["code"] == "forbidden"
            during = len(results)
            retired = weakref.ref(c.app.state.resources.pipeline)  # type: ignore[attr-defined]
            r = c.post("/admin/reload", headers={"Authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 200, r.text
            body = r.json()
            assert (body["status"], body["previous"]["version"], body["datastore"]["version"]) == ("reloaded", 1, 2)
            deadline = time.monotonic() + 60
            while sum(1 for _, v, _, _ in results[during:] if v == 2) < 6 and time.monotonic() < deadline:
                time.sleep(0.05)
        finally:
            stop.set()
            for t in threads:
                t.join()

        failed = [x for x in results if x[0] != 200]
        assert not failed, failed[:3]
        assert {v for _, v, _, _ in results} == {1, 2}  # requests ran on both sides of the switch
        expected = {(1, "zorblat"): "quimby", (1, "brindle"): brindle_v1, (2, "zorblat"): "kelbo", (2, "brindle"): "zandor"}
        assert all(top == expected[(v, name)] for _, v, name, top in results)  # each answered wholly by one version
        for name in ("zorblat", "brindle"):
            versions = [v for _, v, n, _ in results if n == name]
            assert versions == sorted(versions)  # once on version 2, never back
        ready = c.get("/readyz").json()
        assert ready["datastore"]["version"] == 2 and ready["datastore"]["articles"] == 7
        again = c.post("/admin/reload", headers={"Authorization": f"Bearer {TOKEN}"}).json()
        assert again["status"] == "unchanged" and again["datastore"]["version"] == 2
        deadline = time.monotonic() + 30
        while retired() is not None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert retired() is None  # the old version's memory is given back, not frozen with the heap


def _settings(path: Path, **kw: object) -> ServiceSettings:
    return ServiceSettings(datastore=path, model={"device": "cpu"}, batching={"max_wait_ms": 1}, **kw)  # type: ignore[arg-type]


def test_reload_refuses_another_model_or_a_damaged_datastore_and_keeps_serving(
    ds: Path, tmp_path: Path, live_model: Path
):
    other_model = make_tiny_bert(tmp_path / "other", corpus_words(TINY_ARTICLES + UPDATE), seed=1)
    other = build_tiny(tmp_path / "other-ds", [write_jsonl(tmp_path / "c.jsonl", TINY_ARTICLES)], other_model,
                       sparse_indexes=False)  # fmt: skip
    damaged = Path(shutil.copytree(ds, tmp_path / "damaged"))
    vectors = damaged / SHARDS_DIR / "shard-00001" / "vectors.npy"
    vectors.write_bytes(vectors.read_bytes()[:-8])
    link = tmp_path / "current"
    link.symlink_to(ds)
    auth = {"Authorization": f"Bearer {TOKEN}"}
    with TestClient(create_app(_settings(link, admin_token=TOKEN))) as c:
        assert c.post("/predict", json=ZORBLAT).json()["predictions"][0]["token"] == "quimby"
        for target, needle in ((other, "not the model this datastore was built with"), (damaged, "vectors.npy")):
            link.unlink()
            link.symlink_to(target)
            r = c.post("/admin/reload", headers=auth)
            assert r.status_code == 409, r.text
            err = r.json()["error"]
            assert err["code"] == "reload_failed" and needle in err["message"] and "still serving version 1" in err["message"]
            served = c.post("/predict", json=ZORBLAT).json()  # the old version keeps answering
            assert served["predictions"][0]["token"] == "quimby" and served["datastore"]["id"] == read_manifest(ds).datastore_id
        link.unlink()
        link.symlink_to(ds)
        assert c.post("/admin/reload", headers=auth).json()["status"] == "unchanged"
    disabled = TestClient(create_app(_settings(ds)))  # no admin token configured: no lifespan needed to refuse
    r = disabled.post("/admin/reload", headers=auth)
    assert r.status_code == 403 and r.json()["error"]["code"] == "admin_disabled"
    assert "BERTKNN_ADMIN_TOKEN" in r.json()["error"]["message"]


def test_file_watch_serves_the_new_version(ds: Path, update_corpus: Path):
    with TestClient(create_app(_settings(ds, reload_poll_s=0.05))) as c:
        v1 = c.post("/predict", json=BRINDLE).json()
        assert v1["datastore"]["version"] == 1 and v1["predictions"][0]["token"] != "zandor"
        _add(ds, update_corpus)
        deadline = time.monotonic() + 60
        while c.get("/readyz").json()["datastore"]["version"] != 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        v2 = c.post("/predict", json=BRINDLE).json()
        assert v2["datastore"]["version"] == 2 and v2["predictions"][0]["token"] == "zandor"
        assert v2["cache"]["retrieval"] == "miss"  # retrieval cache keys carry the datastore id and version


def test_rows_kept_on_the_device_follow_a_live_update(ds: Path, update_corpus: Path, monkeypatch):
    """``model.knn_device_rows: resident``: the rows loaded at start-up stay after `add` and a reload; only the new
    shard's rows are loaded, after the first batch on the new version, and the answers are the new version's."""
    from bertknn.service.retrieval.resident_rows import ResidentRows

    copies: list[tuple[int, int]] = []  # (first row, rows) of each load
    advance = ResidentRows.advance

    def recorded(self, datastore, max_bytes=None):
        start = self.loaded
        n = advance(self, datastore, max_bytes)
        if n:
            copies.append((start if start + n == self.loaded else 0, n))
        return n

    monkeypatch.setattr(ResidentRows, "advance", recorded)
    model = {"device": "cpu", "knn_device": "model", "knn_device_rows": "resident"}
    app = create_app(ServiceSettings(datastore=ds, model=model, batching={"max_wait_ms": 1}, admin_token=TOKEN))
    with TestClient(app) as c:
        kept = app.state.resources.answerer.device_knn.resident
        v1_rows = app.state.resources.pipeline.datastore.total_rows
        assert copies == [(0, v1_rows)]
        assert c.post("/predict", json=ZORBLAT).json()["predictions"][0]["token"] == "quimby"
        _add(ds, update_corpus)
        r = c.post("/admin/reload", headers={"Authorization": f"Bearer {TOKEN}"})
        assert r.status_code == 200 and r.json()["datastore"]["version"] == 2
        v2 = app.state.resources.pipeline.datastore
        for q, want in ((BRINDLE, "zandor"), (ZORBLAT, "kelbo"), (BRINDLE, "zandor")):
            body = c.post("/predict", json=q).json()
            assert body["datastore"]["version"] == 2 and body["predictions"][0]["token"] == want
        assert copies == [(0, v1_rows), (v1_rows, v2.total_rows - v1_rows)]  # the old rows kept, the new added
        assert kept.loaded == v2.total_rows and kept.covers(v2, np.arange(v2.total_rows))
        assert f"bertknn_knn_device_rows {float(v2.total_rows)}" in c.get("/metrics").text
