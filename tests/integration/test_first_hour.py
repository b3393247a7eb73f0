"""What a new user met in the first hour (issue: a new user's first hour), one test each, on real parts."""

from __future__ import annotations

import bz2
import gzip
import io
import json
import logging
import os
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import numpy as np
import pytest
from fastapi.testclient import TestClient

from bertknn.builder.corpus import CorpusStats, detect_format, read_corpora
from bertknn.builder.progress import BuildProgress
from bertknn.builder.writer import write_table
from bertknn.core.errors import CorpusError, ModelLoadError
from bertknn.core.format import read_manifest, write_manifest
from bertknn.core.model_ref import local_model_path, locate_model
from bertknn.core.wordmodel import WordModel
from bertknn.service.api.routes import to_query
from bertknn.service.api.schemas import PredictRequest
from bertknn.service.interpolate import top_k
from bertknn.service.main import create_app
from bertknn.service.settings import ServiceSettings

REPO = Path(__file__).resolve().parents[2]
Q = {"text": "zorblat was born in [MASK] .", "subject": "Zorblat"}


@pytest.fixture(scope="module")
def client(tiny_datastore: Path):
    settings = ServiceSettings(datastore=tiny_datastore, model={"device": "cpu"})
    with TestClient(create_app(settings)) as c:
        yield c


# ---- answers are words ----------------------------------------------------------------------------------------


def test_non_word_tokens_are_specials_pieces_and_punctuation(tmp_path: Path) -> None:
    from transformers import BertTokenizer

    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "paris", "##s", ".", ",", "[unused3]", "1921", "élan",
             "--", "x", "-"]  # fmt: skip
    (tmp_path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tok = BertTokenizer(vocab=str(tmp_path / "vocab.txt"), do_lower_case=True, strip_accents=False)
    got = WordModel(tok).vocab.non_words
    assert [t for t, bad in zip(vocab, got, strict=True) if bad] == [
        "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "##s", ".", ",", "[unused3]", "--", "-"]  # fmt: skip


@pytest.mark.parametrize("text", ["zorblat was born in [MASK] .", "he said [MASK]", "[MASK] ."])
def test_default_answers_are_words_and_any_token_ranks_the_whole_vocabulary(client: TestClient, text: str) -> None:
    resources = client.app.state.resources
    pipe = resources.pipeline
    special = set(pipe.encoder.tokenizer.all_special_tokens)
    body = client.post("/predict", json={"text": text, "top_k": 8}).json()
    for section in (body["predictions"], body["mlm"], body["knn"]):
        for item in section:
            assert item["token"] not in special and not item["token"].startswith("##"), item
            assert any(ch.isalnum() for ch in item["token"]), item
    # any_token: exactly LAMA's ranking of the full distribution (p = 0.3 p_kNN + 0.7 p_MLM over every id)
    full = client.post("/predict", json={"text": text, "top_k": 8, "any_token": True}).json()
    query = to_query(PredictRequest.model_validate({"text": text, "top_k": 8, "any_token": True}), resources.settings)
    dists = pipe.predict(query, with_distributions=True).distributions
    want = [pipe.token(i) for i, _ in top_k(dists.p, 8)]
    assert [p["token"] for p in full["predictions"]] == want
    # and the default ranking is the same distribution with the non-words left out
    words = np.where(pipe.answerer.non_words, 0, dists.p)
    assert [p["token"] for p in body["predictions"]] == [pipe.token(i) for i, _ in top_k(words, 8, nonzero=True)]


# ---- HTTP details ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("field", "value"), [("top_k", True), ("top_k", "5"), ("k", 1.5), ("return_contexts", "yes")])
def test_numbers_and_booleans_are_strict(client: TestClient, field: str, value: object) -> None:
    r = client.post("/predict", json={**Q, field: value})
    assert r.status_code == 422 and r.json()["error"]["message"].startswith(field), r.text


def test_wrong_method_names_the_allowed_one(client: TestClient) -> None:
    r = client.get("/predict")
    assert r.status_code == 405 and r.headers["allow"] == "POST"
    assert r.json()["error"]["code"] == "method_not_allowed" and "use POST" in r.json()["error"]["message"]


def test_a_trailing_slash_is_refused_with_the_right_path(client: TestClient) -> None:
    r = client.post("/predict/", json=Q, follow_redirects=False)
    assert r.status_code == 404 and "use /predict" in r.json()["error"]["message"]
    assert client.post("/predict", json=Q).status_code == 200


def test_an_unknown_field_names_the_closest_allowed_one(client: TestClient) -> None:
    r = client.post("/predict", json={**Q, "topk": 3})
    msg = r.json()["error"]["message"]
    assert r.status_code == 422 and msg.startswith("topk: unknown field; did you mean 'top_k'?"), msg
    batch = client.post("/predict/batch", json={"queries": [{**Q, "subjekt": "x"}]}).json()["error"]["message"]
    assert "did you mean 'subject'?" in batch


def test_docs_page_needs_no_cdn(client: TestClient) -> None:
    html = client.get("/docs").text
    assert "cdn" not in html.lower() and "/docs/assets/swagger-ui-bundle.js" in html
    for asset in ("swagger-ui-bundle.js", "swagger-ui.css"):
        r = client.get(f"/docs/assets/{asset}")
        assert r.status_code == 200 and len(r.content) > 10_000
    assert client.get("/redoc").status_code == 404  # ReDoc would load from a CDN: not installed


def test_metrics_label_every_route_by_its_template(client: TestClient) -> None:
    client.get("/docs")
    client.get("/openapi.json")
    client.get("/no/such/path")
    text = client.get("/metrics").text
    assert 'path="/docs"' in text and 'path="/openapi.json"' in text and 'path="unmatched"' in text


@pytest.mark.parametrize(
    ("subject", "status"),
    [("Zorblat", "found"), ("zorblat", "found"), ("EMILE GRUSK", "folded"), ("Nobody At All", "not_found"), (None, None)],
)
def test_subject_status_says_how_the_subject_was_found(client: TestClient, subject: str | None, status: str | None) -> None:
    body = client.post("/predict", json={"text": "zorblat was born in [MASK] .", "subject": subject}).json()
    assert body["subject_status"] == status
    if status == "not_found":
        assert {a["rule"] for a in body["articles"]} <= {"bm25"}  # fell back to the ranker, and says so


def test_subject_status_follows_a_redirect(tmp_path: Path, tiny_datastore: Path) -> None:
    ds = tmp_path / "ds"
    shutil.copytree(tiny_datastore, ds)
    (ds / "redirects.json").write_text(json.dumps({"Zorby": "Zorblat"}))
    manifest = read_manifest(ds)
    write_table(ds, manifest, [("Zorby", "Zorblat")])  # what the service reads: the article table
    write_manifest(ds, manifest)
    with TestClient(create_app(ServiceSettings(datastore=ds, model={"device": "cpu"}))) as c:
        assert c.post("/predict", json={**Q, "subject": "Zorby"}).json()["subject_status"] == "redirect"


# ---- real files users have ------------------------------------------------------------------------------------

XML = """<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/"><page><title>Ulm</title><ns>0</ns><id>8</id>
<revision><text>'''Ulm''' is a city in [[Germany]]. It lies on the river Danube.</text></revision></page></mediawiki>"""
LINE = json.dumps({"id": "1", "title": "Ulm", "text": "Ulm is a city in Germany. It lies on the river Danube."})


@pytest.mark.parametrize(
    ("name", "payload", "fmt"),
    [
        ("enwiki-latest-pages-articles1.xml-p000000010p000030302.bz2", bz2.compress(XML.encode()), "mediawiki-xml"),
        ("dump.bz2", bz2.compress(XML.encode()), "mediawiki-xml"),
        ("pages.gz", gzip.compress(XML.encode()), "mediawiki-xml"),
        ("export", XML.encode(), "mediawiki-xml"),
        ("articles.txt.gz", gzip.compress(LINE.encode()), "jsonl"),
        ("articles.data", ("\ufeff" + LINE).encode(), "jsonl"),
    ],
)
def test_corpus_format_comes_from_the_content(tmp_path: Path, name: str, payload: bytes, fmt: str) -> None:
    path = tmp_path / name
    path.write_bytes(payload)
    assert detect_format(path) == fmt
    assert [a.title for a in read_corpora([path], CorpusStats())] == ["Ulm"]


def test_unknown_content_is_named_with_what_it_starts_with(tmp_path: Path) -> None:
    path = tmp_path / "enwiki.xml.bz2"
    path.write_bytes(bz2.compress(b"hello, not a dump"))
    with pytest.raises(CorpusError, match=r"enwiki\.xml\.bz2: unknown corpus format \(the content starts with b'hello"):
        detect_format(path)


def test_a_relative_model_directory_is_found_from_anywhere(tmp_path: Path, tiny_model_dir: Path) -> None:
    (tmp_path / "models").mkdir()
    shutil.copytree(tiny_model_dir, tmp_path / "models" / "m")
    rel = "models/m"
    import os

    cwd = os.getcwd()
    os.chdir(tmp_path)
    try:
        recorded = local_model_path(rel)
    finally:
        os.chdir(cwd)
    assert recorded == str((tmp_path / "models" / "m").resolve())
    assert locate_model(rel, recorded) == recorded  # from another directory, the absolute path
    assert locate_model(rel, recorded, "/other/model") == "/other/model"  # the caller's choice wins
    assert locate_model("bert-base-uncased", None) == "bert-base-uncased"  # a hub name is left to the loader
    shutil.rmtree(tmp_path / "models")
    with pytest.raises(ModelLoadError, match=r"'models/m' \(.*\), which is not there from here; pass the same model with --model"):
        locate_model(rel, recorded)


def test_the_service_says_in_one_line_when_the_model_is_gone(tmp_path: Path, tiny_datastore: Path) -> None:
    ds = tmp_path / "ds"
    shutil.copytree(tiny_datastore, ds)
    manifest = json.loads((ds / "manifest.json").read_text())
    manifest["model"]["name"], manifest["model"]["path"] = "../models/gone", str(tmp_path / "models" / "gone")
    (ds / "manifest.json").write_text(json.dumps(manifest))
    run = subprocess.run([sys.executable, "-m", "service", "--datastore", str(ds)], capture_output=True, text=True,
                         cwd=tmp_path, timeout=120, check=False)  # fmt: skip
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and "pass the same model with --model DIR" in lines[0], run.stderr


def test_a_build_off_a_terminal_logs_progress_at_an_interval(caplog: pytest.LogCaptureFixture) -> None:
    progress = BuildProgress(interval_s=0.0, total_articles=10, stream=io.StringIO())
    assert not progress.interactive
    with caplog.at_level(logging.INFO, logger="bertknn.builder"):
        progress.prepared(5, 300)  # half the articles, before any part is written
        progress.embedded(120)
        progress.close()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress:")]
    assert lines and "120 contexts embedded of 300 prepared from 5 articles" in lines[-1], lines
    assert "0 parts written" in lines[-1] and "contexts/s" in lines[-1]
    assert "of about 600 contexts; from --limit-articles" in lines[-1].split("ETA")[1], lines[-1]


def test_the_eta_of_a_streamed_corpus_comes_from_the_share_read() -> None:
    share = [0.25]
    progress = BuildProgress(interval_s=1e9, stream=io.StringIO(), read_fraction=lambda: share[0])
    assert progress.eta() == "after the first contexts"
    progress.prepared(12, 1000)  # a quarter of the corpus read: about 4,000 contexts in all
    progress.embedded(500)
    assert progress.total_contexts() == pytest.approx(4000)
    assert "of about 4,000 contexts; from the share of the corpus read" in progress.eta()
    share[0] = 1.0
    assert progress.total_contexts() == pytest.approx(1000)
    assert BuildProgress(stream=io.StringIO()).eta() == "unknown"


def test_a_real_builds_eta_is_known_with_limit_articles_and_without(
    tmp_path: Path, tiny_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A dump read as a stream: the ETA comes from the bytes of the (compressed) file read; with --limit-articles
    from the articles."""
    import bz2 as bz2_mod

    from tests.conftest import TINY_ARTICLES, build_tiny

    corpus = tmp_path / "c.jsonl.bz2"
    corpus.write_bytes(bz2_mod.compress("".join(json.dumps(a) + "\n" for a in TINY_ARTICLES * 3).encode()))
    for extra, basis in (({}, "the share of the corpus read"), ({"limit_articles": 4}, "--limit-articles")):
        with caplog.at_level(logging.INFO, logger="bertknn.builder"):
            caplog.clear()
            build_tiny(tmp_path / f"ds-{basis[:5]}", [corpus], tiny_model_dir, sparse_indexes=False, **extra)
        lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress:")]
        assert lines and basis in lines[-1] and "ETA unknown" not in lines[-1], lines


def test_the_license_is_an_spdx_string() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"


# ---- one clean line for each first-run mistake (#35) -----------------------------------------------------------


def _serve(ds: Path, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "service", "--datastore", str(ds), "--device", "cpu", *args]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=180, check=False)


def _errors(run: subprocess.CompletedProcess[str]) -> list[str]:
    """The lines that say something went wrong (uvicorn's and the service's INFO lines left out)."""
    return [ln for ln in run.stderr.splitlines() if "ERROR" in ln or ln.startswith(("error", "Traceback", "  File"))]


def test_serve_without_a_datastore_says_how_to_build_one(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from bertknn.service.__main__ import main

    assert main(["--datastore", str(tmp_path / "nowhere")]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: {tmp_path / 'nowhere'}: no datastore here (manifest.json missing); build one with "
        "`bert-knn build --corpus FILE --out DIR` and pass --datastore DIR"
    ]


@pytest.mark.parametrize("given", [None, "true"])
def test_serve_runs_the_tokenizer_without_its_thread_pool_unless_told_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, given: str | None
) -> None:
    """A bare `bert-knn serve` tokenises as the images and the benchmarks do (`TOKENIZERS_PARALLELISM=false`, which
    its worker and model processes inherit); an operator's own value stands."""
    from bertknn.service.__main__ import main

    if given is None:
        monkeypatch.delenv("TOKENIZERS_PARALLELISM", raising=False)
    else:
        monkeypatch.setenv("TOKENIZERS_PARALLELISM", given)
    assert main(["--datastore", str(tmp_path / "nowhere")]) == 2
    assert os.environ["TOKENIZERS_PARALLELISM"] == (given or "false")


@pytest.mark.parametrize("workers", ["1", "2"])
def test_serve_with_a_directory_that_holds_no_model_says_so_before_any_process_starts(
    tmp_path: Path, tiny_datastore: Path, workers: str
) -> None:
    """``--model DIR`` naming a directory without a model (the parent of the model's folder, say) is one line
    before anything loads, in one process or several, as a missing one is."""
    (tmp_path / "notes.txt").write_text("not a model")
    run = _serve(tiny_datastore, "--model", str(tmp_path), "--workers", workers, cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    assert run.stderr.strip().splitlines() == [
        f"error: {tmp_path} is not a Hugging Face model directory: it has no config.json (a masked LM's directory "
        "holds config.json, its tokenizer's files and its weights)"
    ]


def test_serve_on_a_busy_port_says_so_before_loading_anything(tmp_path: Path, tiny_datastore: Path) -> None:
    import socket

    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen(1)
        port = holder.getsockname()[1]
        run = _serve(tiny_datastore, "--host", "127.0.0.1", "--port", str(port), cwd=tmp_path)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines() == [
        f"error: cannot listen on 127.0.0.1:{port} (Address already in use): another process serves there; stop it "
        "or pass --port"
    ]


def test_serve_on_a_truncated_shard_says_it_in_one_line_without_a_traceback(tmp_path: Path, tiny_datastore: Path) -> None:
    from tests.conftest import free_port

    ds = tmp_path / "ds"
    shutil.copytree(tiny_datastore, ds)
    vectors = next(ds.rglob("vectors.npy"))
    vectors.write_bytes(vectors.read_bytes()[:-64])
    run = _serve(ds, "--host", "127.0.0.1", "--port", str(free_port()), cwd=tmp_path)
    assert run.returncode == 2, run.stderr
    errors = _errors(run)
    assert len(errors) == 1 and "start-up failed" in errors[0] and "vectors.npy" in errors[0], run.stderr


def test_a_missing_model_directory_is_one_line(tmp_path: Path, tiny_corpus: Path) -> None:
    cmd = [sys.executable, "-m", "bertknn.cli", "build", "--corpus", str(tiny_corpus), "--model",
           str(tmp_path / "missing" / "dir"), "--out", str(tmp_path / "ds"), "--device", "cpu"]  # fmt: skip
    run = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, timeout=180, check=False)
    assert run.returncode == 2, run.stderr
    errors = _errors(run)
    assert len(errors) == 1 and "does not exist" in errors[0] and "missing/dir" in errors[0], run.stderr


def test_validation_messages_are_in_the_projects_words(client: TestClient) -> None:
    msg = client.post("/predict", json={**Q, "temperature": "hot"}).json()["error"]["message"]
    assert msg.startswith("temperature: Input should be") and "'auto'" in msg, msg
    assert "constrained" not in msg and "literal[" not in msg and msg.count("temperature") == 1, msg
    msg = client.post("/predict", json={**Q, "topk": 3}).json()["error"]["message"]
    assert "queries" not in msg and "relations" not in msg and "top_k" in msg, msg  # /predict's fields only
    msg = client.post("/follow", json={"subject": "x", "relations": ["[X] r [Y] ."], "topk": 3}).json()["error"]["message"]
    assert "did you mean 'top_k'" in msg and "text" not in [f.strip() for f in msg.split("allowed:")[1].split(",")]
    r = client.post("/predict", json={**Q, "retriever": "none"})
    if r.status_code == 422:
        msg = r.json()["error"]["message"]
        assert "bert-knn ivfpq" in msg and "/" not in msg.split("bert-knn ivfpq")[1], msg  # no machine path


# ---- nothing of the machine in a response (#36) ----------------------------------------------------------------


def test_responses_name_the_model_without_a_machine_path(client: TestClient, tiny_model_dir: Path) -> None:
    body = client.post("/predict", json=Q).json()
    assert body["model"]["name"] == tiny_model_dir.name and "/" not in body["model"]["name"]
    assert "/" not in body["datastore"]["model_name"]
    ready = client.get("/readyz").json()
    assert "/" not in json.dumps(ready["model"]) and ready["cache"]["detail"] == ""


def test_a_batch_may_hold_as_many_queries_as_the_setting_allows(tiny_datastore: Path) -> None:
    settings = ServiceSettings(datastore=tiny_datastore, model={"device": "cpu"}, limits={"max_batch_queries": 80})
    with TestClient(create_app(settings)) as c:
        assert c.post("/predict/batch", json={"queries": [Q] * 80}).status_code == 200
        r = c.post("/predict/batch", json={"queries": [Q] * 81})
        assert r.status_code == 422 and "limit of 80" in r.json()["error"]["message"]


@pytest.mark.parametrize(("content", "says"), [('{"format_version": 4, "model": ', "not JSON: EOF while parsing"),
                                               ('{"format_version": 4}', "model: Field required; 4 more")])
def test_a_corrupt_manifest_is_named_in_one_line_without_pydantics_url(
    tmp_path: Path, tiny_datastore: Path, content: str, says: str, capsys: pytest.CaptureFixture[str]
) -> None:
    from bertknn.builder.__main__ import main as builder

    ds = tmp_path / "ds"
    shutil.copytree(tiny_datastore, ds)
    (ds / "manifest.json").write_text(content)
    assert builder(["validate", str(ds)]) == 1
    out = capsys.readouterr()
    lines = (out.out + out.err).strip().splitlines()
    assert len(lines) == 1 and says in lines[0] and "pydantic" not in lines[0] and "http" not in lines[0], lines
