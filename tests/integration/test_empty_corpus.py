"""A corpus that gives nothing to store: an empty file is refused before the model loads; a dump whose pages are
all left out builds a datastore that says, wherever it is read, that it holds no context, until an ``add`` fills it."""

from __future__ import annotations

import gzip
import json
import logging
import shutil
from pathlib import Path
from xml.sax.saxutils import escape, quoteattr

import pytest
from fastapi.testclient import TestClient

from bertknn.builder.__main__ import datastore_warnings
from bertknn.builder.build import build, check_corpus_files
from bertknn.builder.corpus import CorpusStats, read_corpora
from bertknn.builder.settings import AddSettings, BuildSettings
from bertknn.builder.update import add_articles
from bertknn.core.errors import CorpusError, EvaluationError
from bertknn.core.format import read_manifest
from bertknn.core.format.contract import Counts
from bertknn.core.format.health import empty_warning, with_empty_warning
from bertknn.evaluation.selfprobe import self_probe
from bertknn.service.assemble import NO_CONTEXTS
from bertknn.service.main import create_app
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.settings import ServiceSettings
from tests.conftest import TINY_ARTICLES, build_tiny, write_jsonl

HEADER = (
    '<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.11/" version="0.11" xml:lang="en">\n'
    "<siteinfo><sitename>Wikipedia</sitename></siteinfo>\n"
)


def page(title: str, text: str, page_id: int, redirect: str | None = None) -> str:
    redirect_el = f"<redirect title={quoteattr(redirect)} />" if redirect else ""
    return (
        f"<page><title>{escape(title)}</title><ns>0</ns><id>{page_id}</id>{redirect_el}<revision><id>{page_id}0</id>"
        f'<text xml:space="preserve">{escape(text)}</text></revision></page>\n'
    )


@pytest.mark.parametrize("content", [b"", b"\n\n  \n", b"\xef\xbb\xbf\n"], ids=["empty", "blank lines", "a BOM"])
def test_an_empty_corpus_file_is_refused_before_the_model_loads(tmp_path: Path, content: bytes) -> None:
    corpus = tmp_path / "articles.jsonl"
    corpus.write_bytes(content)
    settings = BuildSettings(corpus=[corpus], model=str(tmp_path / "no-such-model"), out=tmp_path / "ds", device="cpu")
    # the model directory does not exist: an error about the model would mean the corpus was not checked first
    with pytest.raises(CorpusError, match=r"articles\.jsonl: no article in it \(the file is empty"):
        build(settings)
    assert not (tmp_path / "ds" / "manifest.json").exists()


def test_a_long_run_of_blank_lines_is_refused_when_read(tmp_path: Path) -> None:
    corpus = tmp_path / "blank.jsonl.gz"
    corpus.write_bytes(gzip.compress(b"\n" * 10_000))  # longer than the first read of a file
    with pytest.raises(CorpusError, match=r"blank\.jsonl\.gz: no article in it"):
        list(read_corpora([corpus], CorpusStats()))
    # and articles after such a run are read
    corpus.write_bytes(gzip.compress(b"\n" * 10_000 + b'{"title": "Quimby", "text": "Quimby is a town."}\n'))
    check_corpus_files([corpus])  # the check before the model takes it too
    assert [a.title for a in read_corpora([corpus], CorpusStats())] == ["Quimby"]


def test_a_dump_with_no_page_is_refused(tmp_path: Path) -> None:
    dump = tmp_path / "enwiki-pages-articles.xml"
    dump.write_text(HEADER + "</mediawiki>\n", encoding="utf-8")
    with pytest.raises(CorpusError, match=r"no <page> in this dump"):
        list(read_corpora([dump], CorpusStats()))


def test_the_warning_follows_the_counts() -> None:
    assert empty_warning(Counts(articles=2, contexts=5)) is None
    none = empty_warning(Counts(skipped_pages=3))
    assert none is not None and "holds no article" in none and "3 disambiguation or list pages" in none
    silent = empty_warning(Counts(articles=2, sentences=4))
    assert silent is not None and "2 articles but no context" in silent and "4 kept sentences" in silent
    other = "x.xml: the dump ends inside a page"
    assert with_empty_warning([other, none], Counts(articles=1, contexts=1)) == [other]  # filled: said no more
    assert with_empty_warning([other], Counts()) == [other, empty_warning(Counts())]


@pytest.fixture(scope="module")
def empty_datastore(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    """Built from a dump whose every page is left out: a redirect, a disambiguation page, a list page."""
    root = tmp_path_factory.mktemp("empty")
    pages = [
        page("Zorb", "#REDIRECT [[Zorblat]]", 1, redirect="Zorblat"),
        page("Mercury", "'''Mercury''' may refer to:\n* [[Mercury (planet)]]\n{{Disambiguation}}", 2),
        page("List of towns", "This is a list of towns such as quimby and plonk.", 3),
    ]
    dump = root / "enwiki-pages-articles.xml"
    dump.write_text(HEADER + "".join(pages) + "</mediawiki>\n", encoding="utf-8")
    return build_tiny(root / "ds", [dump], tiny_model_dir)


def test_a_datastore_without_context_says_so_wherever_it_is_read(
    empty_datastore: Path, caplog: pytest.LogCaptureFixture
) -> None:
    manifest = read_manifest(empty_datastore)
    assert manifest.counts.articles == 0 and manifest.counts.contexts == 0
    [line] = [w for w in manifest.warnings if "holds no article" in w]
    assert "2 disambiguation or list pages" in line
    assert line in datastore_warnings(empty_datastore)  # what `bert-knn validate` prints
    settings = ServiceSettings(datastore=empty_datastore, model={"device": "cpu"})
    with TestClient(create_app(settings)) as client:
        body = client.post("/predict", json={"text": "zorblat was born in [MASK] ."}).json()
    assert body["warnings"] == [NO_CONTEXTS]
    assert body["predictions"] and all(p["p_knn"] == 0.0 for p in body["predictions"])

    def logged() -> list[str]:
        return [r.getMessage() for r in caplog.records if "holds no article" in r.getMessage()]

    assert len(logged()) == 1 and str(empty_datastore) in logged()[0]  # the service's start-up log
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="bertknn.service.pipeline"):
        pipe = AnswerPipeline.open(empty_datastore, device="cpu")
        again = pipe.for_datastore(empty_datastore)  # a reload opens it the same way
    assert len(logged()) == 2, logged()
    assert again.assembler.datastore_warnings == [NO_CONTEXTS]
    with pytest.raises(EvaluationError, match="holds no context to probe"):
        self_probe(pipe, 5)


def test_an_add_fills_it_and_the_warning_goes(tmp_path: Path, tiny_model_dir: Path) -> None:
    dump = tmp_path / "enwiki-pages-articles.xml"
    dump.write_text(HEADER + page("Zorb", "#REDIRECT [[Zorblat]]", 1, redirect="Zorblat") + "</mediawiki>\n")
    ds = build_tiny(tmp_path / "ds", [dump], tiny_model_dir)
    assert any("holds no article" in w for w in read_manifest(ds).warnings)
    more = write_jsonl(tmp_path / "more.jsonl", TINY_ARTICLES[:2])
    add_articles(AddSettings(datastore=ds, corpus=[more], device="cpu", batch_size=16))  # type: ignore[arg-type]
    manifest = read_manifest(ds)
    assert manifest.counts.contexts > 0
    assert not any(w.startswith("the datastore holds") for w in manifest.warnings), manifest.warnings
    settings = ServiceSettings(datastore=ds, model={"device": "cpu"})
    with TestClient(create_app(settings)) as client:
        body = client.post("/predict", json={"text": "zorblat was born in [MASK] .", "subject": "Zorblat"}).json()
    assert NO_CONTEXTS not in body["warnings"]
    assert any(p["contexts"] for p in body["predictions"])  # the answers now have stored sentences behind them


def test_calibrate_says_that_it_had_nothing_to_measure(
    empty_datastore: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bertknn.builder.__main__ import main

    ds = tmp_path / "ds"
    shutil.copytree(empty_datastore, ds)
    assert main(["calibrate", str(ds)]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out.strip().splitlines()[-1])["distance_scale"] is None
    assert f"warning: {ds}: nothing to measure a distance scale from" in err
    assert "temperature auto uses the paper's l = 6 until articles are added" in err
