"""Real builder -> real Lucene (pyserini) and TF-IDF indexes -> retrievers; subject lookup; whole-datastore kNN."""

from __future__ import annotations

import os
import shutil
import unicodedata
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from bertknn.builder.ivfpq import add_ivfpq, read_ivfpq_meta
from bertknn.builder.sparse_index import build_sparse_indexes, write_sparse_indexes
from bertknn.core.errors import DatastoreError
from bertknn.core.format import BM25_DIR, IVFPQ_FILE, TFIDF_DIR, Datastore, validate_datastore
from bertknn.core.format.sparse import TFIDF_DATA
from bertknn.core.text import retrieval_text
from bertknn.service.retrieval.global_knn import IvfPqKnn
from bertknn.service.retrieval.sparse import Bm25Retriever, Retriever, TfidfRetriever
from bertknn.service.retrieval.subject import SubjectResolver
from tests.conftest import TINY_ARTICLES, build_tiny, write_jsonl

HARBOUR = "Ōtaru Harbour 🚢"  # accents, NFC and an astral character in a Lucene docid
EXTRA_ARTICLES = [
    {"id": "20", "title": "Dax", "text": "Dax is a town."},
    {
        "id": "21",
        "title": "Däx",
        "text": "Däx is a painter of rivers and mountains. Däx was born in quimby and moved to plonk. "
        "Däx wrote songs about the sea, the bridge and the market of plonk.",
    },
    {
        "id": "22",
        "title": HARBOUR,
        "text": "The harbour is a port where ships from plonk arrive. A lighthouse guards the harbour entrance.",
    },
]
# A MediaWiki dump: one article and redirects (one a chain, one dangling), as the builder reads them.
DUMP = """<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.10/">
  <page><title>Marlo Quist</title><ns>0</ns><id>30</id><revision><text>'''Marlo Quist''' is a painter of \
mountains. Marlo Quist was born in vostok.</text></revision></page>
  <page><title>Zorby</title><ns>0</ns><id>31</id><redirect title="Zorblat" /><revision><text>#REDIRECT \
[[Zorblat]]</text></revision></page>
  <page><title>Zorb</title><ns>0</ns><id>32</id><redirect title="Zorby" /><revision><text>#REDIRECT \
[[Zorby]]</text></revision></page>
  <page><title>Grusk</title><ns>0</ns><id>33</id><redirect title="Émile Grusk" /><revision><text>#REDIRECT \
[[Émile Grusk]]</text></revision></page>
  <page><title>Lost page</title><ns>0</ns><id>34</id><redirect title="Nowhere" /><revision><text>#REDIRECT \
[[Nowhere]]</text></revision></page>
</mediawiki>
"""


@pytest.fixture(scope="module")
def datastore_dir(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Path:
    tmp = tmp_path_factory.mktemp("retrieval")
    jsonl = write_jsonl(tmp / "articles.jsonl", TINY_ARTICLES + EXTRA_ARTICLES)
    dump = tmp / "dump.xml"
    dump.write_text(DUMP, encoding="utf-8")
    return build_tiny(tmp / "ds", [jsonl, dump], tiny_model_dir, articles_per_shard=3)


@pytest.fixture(scope="module")
def datastore(datastore_dir: Path) -> Datastore:
    return Datastore(datastore_dir)


@pytest.fixture(scope="module")
def bm25(datastore_dir: Path) -> Bm25Retriever:
    return Bm25Retriever(datastore_dir / BM25_DIR)


@pytest.fixture(scope="module")
def tfidf(datastore_dir: Path) -> TfidfRetriever:
    return TfidfRetriever(datastore_dir / TFIDF_DIR)


def test_the_build_lists_both_indexes_and_validates(datastore_dir: Path, datastore: Datastore) -> None:
    assert datastore.manifest.indexes == {"bm25": BM25_DIR, "tfidf": TFIDF_DIR}
    assert validate_datastore(datastore_dir) == []
    assert len(datastore.articles) == len(TINY_ARTICLES) + len(EXTRA_ARTICLES) + 1
    assert datastore.redirects["Zorby"] == "Zorblat"


@pytest.mark.parametrize("kind", ["bm25", "tfidf"])
@pytest.mark.parametrize(
    ("query", "expected"),
    [
        ("[MASK] plays the trumpet in a band .", "Émile Grusk"),
        ("The bridge of [MASK] is red .", "Plonk"),
        ("Frelle Dax was born in [MASK] .", "Frelle Dax"),
        ("Quimby is known for [MASK] and boats .", "Quimby"),
        ("A lighthouse guards the [MASK] entrance .", HARBOUR),
        ("Marlo Quist was born in [MASK] .", "Marlo Quist"),
    ],
)
def test_the_expected_article_ranks_first(
    kind: str, query: str, expected: str, bm25: Bm25Retriever, tfidf: TfidfRetriever
) -> None:
    retriever: Retriever = bm25 if kind == "bm25" else tfidf
    hits = retriever.top_articles(query, 3)
    assert hits, f"{kind} found nothing for {query!r}"
    assert hits[0][0] == expected
    assert [s for _, s in hits] == sorted((s for _, s in hits), reverse=True)
    assert len(hits) <= 3


def test_retrievers_satisfy_the_protocol(bm25: Bm25Retriever, tfidf: TfidfRetriever) -> None:
    assert isinstance(bm25, Retriever) and bm25.name == "bm25"
    assert isinstance(tfidf, Retriever) and tfidf.name == "tfidf"


def test_lucene_docids_round_trip_to_the_datastore_titles(bm25: Bm25Retriever, datastore: Datastore) -> None:
    hits = bm25.top_articles("plonk harbour lighthouse quimby vostok", 50)
    titles = {t for t, _ in hits}
    assert HARBOUR in titles
    assert titles <= set(datastore.articles)
    assert all(unicodedata.is_normalized("NFC", t) for t in titles)


def test_tfidf_ignores_accents_and_case(tfidf: TfidfRetriever) -> None:
    assert tfidf.top_articles("OTARU harbour", 1)[0][0] == HARBOUR
    assert tfidf.top_articles("emile grusk", 1)[0][0] == "Émile Grusk"


@pytest.mark.parametrize("kind", ["bm25", "tfidf"])
def test_mask_is_stripped_in_any_spelling(kind: str, bm25: Bm25Retriever, tfidf: TfidfRetriever) -> None:
    retriever: Retriever = bm25 if kind == "bm25" else tfidf
    assert retriever.top_articles("[MASK]", 3) == []
    assert retriever.top_articles("[mask] [ Mask ] .", 3) == []
    assert retriever.top_articles("  ", 3) == []
    plain = retriever.top_articles("trumpet band", 3)
    assert retriever.top_articles("[ mask ] trumpet [MASK] band", 3) == plain
    assert retriever.top_articles("<mask> trumpet < Mask > band", 3) == plain  # RoBERTa's spelling, any model
    # (the word "mask" itself is a query term: no spelling of the blank may leave it behind)
    assert retrieval_text("<mask> trumpet < Mask >  band [ MASK ]") == "trumpet band"
    assert retriever.top_articles("trumpet", 0) == []


def test_unknown_words_find_nothing(bm25: Bm25Retriever, tfidf: TfidfRetriever) -> None:
    assert bm25.top_articles("xylophonic quasars", 3) == []
    assert tfidf.top_articles("xylophonic quasars", 3) == []


def test_bm25_is_usable_from_several_threads(bm25: Bm25Retriever) -> None:
    from concurrent.futures import ThreadPoolExecutor

    queries = ["trumpet band", "bridge red", "lighthouse harbour", "painter mountains"] * 10
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(lambda q: bm25.top_articles(q, 2), queries))
    assert results == [bm25.top_articles(q, 2) for q in queries]


# ---- subject lookup ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("subject", "title", "rule"),
    [
        ("Zorblat", "Zorblat", "exact"),
        ("zorblat", "Zorblat", "exact"),  # normalised: first letter upper-cased
        (unicodedata.normalize("NFD", "Émile Grusk"), "Émile Grusk", "exact"),
        ("emile grusk", "Émile Grusk", "folded"),
        ("ÉMILE  GRUSK", "Émile Grusk", "folded"),
        ("frelle_dax", "Frelle Dax", "folded"),
        ("otaru harbour 🚢", HARBOUR, "folded"),
        ("Grusk", "Émile Grusk", "redirect"),
        ("zorby", "Zorblat", "redirect"),
        ("Zorb", "Zorblat", "redirect"),  # Zorb -> Zorby -> Zorblat
        ("ZORBY", "Zorblat", "folded_redirect"),
        ("DAX", "Dax", "folded"),  # same letters ignoring case beats the accented title
        ("DÄX", "Däx", "folded"),  # same accents ignoring case
    ],
)
def test_subject_resolution(subject: str, title: str, rule: str, datastore: Datastore) -> None:
    found = SubjectResolver(datastore).resolve_with_rule(subject)
    assert found is not None and (found.title, found.rule) == (title, rule)
    assert SubjectResolver(datastore).resolve(subject) == title


def test_subject_collision_falls_back_to_the_article_with_most_contexts(datastore: Datastore) -> None:
    assert datastore.articles["Däx"].rows > datastore.articles["Dax"].rows
    # "dáx" matches neither spelling exactly nor with its own accents: most stored contexts wins
    assert SubjectResolver(datastore).resolve("dáx") == "Däx"


@pytest.mark.parametrize("subject", ["Nobody Known", "Lost page", "", "   "])
def test_unknown_subjects_and_dangling_redirects_resolve_to_none(subject: str, datastore: Datastore) -> None:
    assert SubjectResolver(datastore).resolve(subject) is None


def test_the_subject_rule_wins_over_the_ranker(
    datastore: Datastore, bm25: Bm25Retriever, tiny_model_dir: Path
) -> None:
    from bertknn.core.encoder import MaskedLMEncoder
    from bertknn.service.pipeline import AnswerPipeline
    from bertknn.service.results import Query

    text = "Zorblat was born in [MASK] ."
    assert bm25.top_articles(text, 1)[0][0] == "Zorblat"
    encoder = MaskedLMEncoder.load(
        str(tiny_model_dir), layer=datastore.manifest.layer, device="cpu", max_seq_len=64
    )
    pipeline = AnswerPipeline(encoder, datastore, retrievers={"bm25": bm25})
    hits, _ = pipeline.articles.retrieve(Query(text=text, subject="frelle dax", retriever="bm25", num_articles=2))
    # the subject's own article alone (the paper's rule), although BM25 ranks another article first
    assert [(h.title, h.rule) for h in hits] == [("Frelle Dax", "subject")]
    unknown, _ = pipeline.articles.retrieve(Query(text=text, subject="nobody", retriever="bm25", num_articles=2))
    assert [h.rule for h in unknown] == ["bm25", "bm25"] and unknown[0].title == "Zorblat"


# ---- rebuilds -----------------------------------------------------------------------------------------------


def test_a_resumed_build_keeps_current_indexes(datastore_dir: Path, datastore: Datastore) -> None:
    postings = datastore_dir / TFIDF_DIR / TFIDF_DATA
    lucene_files = sorted(p.name for p in (datastore_dir / BM25_DIR).iterdir())
    before = postings.stat().st_mtime_ns
    assert build_sparse_indexes(datastore_dir, datastore.manifest) == {"bm25": BM25_DIR, "tfidf": TFIDF_DIR}
    assert postings.stat().st_mtime_ns == before
    assert sorted(p.name for p in (datastore_dir / BM25_DIR).iterdir()) == lucene_files


def test_new_content_replaces_the_indexes_atomically(tmp_path: Path) -> None:
    write_sparse_indexes(
        tmp_path, [("Alpha", "apples grow here"), ("Beta", "bananas grow there")], content_id="v1"
    )
    first = Bm25Retriever(tmp_path / BM25_DIR)
    assert [t for t, _ in first.top_articles("apples", 5)] == ["Alpha"]
    first.close()
    write_sparse_indexes(tmp_path, [("Gamma", "apples and grapes")], content_id="v2")
    second = Bm25Retriever(tmp_path / BM25_DIR)
    assert [t for t, _ in second.top_articles("apples", 5)] == ["Gamma"]
    second.close()
    assert TfidfRetriever(tmp_path / TFIDF_DIR).titles() == ["Gamma"]
    assert sorted(p.name for p in (tmp_path / "index").iterdir()) == ["bm25", "tfidf"]  # no temp dirs left


def test_a_build_without_bm25_needs_no_java_and_the_service_names_the_index_it_has(
    tmp_path: Path, tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import bertknn.builder.sparse_index as sparse_index
    from bertknn.core.encoder import MaskedLMEncoder
    from bertknn.core.errors import RetrieverUnavailable
    from bertknn.service.pipeline import AnswerPipeline
    from bertknn.service.results import Query
    from bertknn.service.retrieval.articles import open_retrievers

    def no_lucene(*args: object) -> None:
        raise AssertionError("Lucene ran although BM25 was turned off")

    monkeypatch.setattr(sparse_index, "_run_lucene_indexer", no_lucene)
    monkeypatch.setenv("PATH", str(tmp_path))  # no java on the PATH
    monkeypatch.delenv("JAVA_HOME", raising=False)
    root = build_tiny(tmp_path / "ds", [write_jsonl(tmp_path / "a.jsonl", TINY_ARTICLES)], tiny_model_dir, bm25=False)
    datastore = Datastore(root)
    assert datastore.manifest.indexes == {"tfidf": TFIDF_DIR}
    assert not (root / BM25_DIR).exists() and validate_datastore(root) == []
    encoder = MaskedLMEncoder.load(str(tiny_model_dir), layer=datastore.manifest.layer, device="cpu", max_seq_len=64)
    pipeline = AnswerPipeline(encoder, datastore, retrievers=open_retrievers(datastore))
    hits, _ = pipeline.articles.retrieve(Query(text="The bridge of [MASK] is red .", retriever="tfidf", num_articles=1))
    assert [(h.title, h.rule) for h in hits] == [("Plonk", "tfidf")]
    with pytest.raises(RetrieverUnavailable, match=r"'bm25' has no index in this datastore \(it has: tfidf\)"):
        pipeline.articles.retrieve(Query(text="The bridge of [MASK] is red .", retriever="bm25", num_articles=1))
    # served with the default retriever (bm25), the service says at start-up which setting fixes it
    import logging

    from fastapi.testclient import TestClient

    from bertknn.service.main import create_app
    from bertknn.service.settings import ServiceSettings

    with caplog.at_level(logging.WARNING, logger="service"), TestClient(
        create_app(ServiceSettings(datastore=root, model={"name": str(tiny_model_dir), "device": "cpu"}))
    ) as client:
        assert client.post("/predict", json={"text": "The bridge of [MASK] is red .", "retriever": "tfidf"}).status_code == 200
    assert any("BERTKNN_DEFAULTS__RETRIEVER" in r.getMessage() and "(it has: tfidf)" in r.getMessage()
               for r in caplog.records)  # fmt: skip
    # a live update keeps it TF-IDF alone (still no Java), with the new article ranked
    from bertknn.builder.settings import AddSettings
    from bertknn.builder.update import add_articles

    extra = [{"id": "99", "title": "Zanthor", "text": "Zanthor is a quiet glacier town with a red lighthouse."}]
    add_articles(AddSettings(datastore=root, corpus=[write_jsonl(tmp_path / "add.jsonl", extra)], device="cpu",
                             batch_size=16))  # type: ignore[arg-type]  # fmt: skip
    updated = Datastore(root)
    assert list(updated.manifest.indexes) == ["tfidf"] and validate_datastore(root) == []
    ranked = TfidfRetriever(root / updated.manifest.indexes["tfidf"]).top_articles("glacier town lighthouse", 1)
    assert [t for t, _ in ranked] == ["Zanthor"]


def test_turning_bm25_off_removes_an_earlier_bm25_index(tmp_path: Path) -> None:
    articles = [("Alpha", "apples grow here"), ("Beta", "bananas grow there"), ("Gamma", "grapes grow"),
                ("Delta", "plums grow")]  # fmt: skip
    assert write_sparse_indexes(tmp_path, articles, content_id="v1") == {"bm25": BM25_DIR, "tfidf": TFIDF_DIR}
    assert write_sparse_indexes(tmp_path, articles, content_id="v1", bm25=False) == {"tfidf": TFIDF_DIR}
    assert sorted(p.name for p in (tmp_path / "index").iterdir()) == ["tfidf"]
    assert [t for t, _ in TfidfRetriever(tmp_path / TFIDF_DIR).top_articles("apples", 5)] == ["Alpha"]


# ---- whole-datastore kNN ------------------------------------------------------------------------------------


def test_missing_ivfpq_index_says_how_to_build_it(datastore: Datastore) -> None:
    with pytest.raises(DatastoreError, match=r"bert-knn ivfpq"):
        IvfPqKnn(datastore)


def test_ivfpq_returns_the_exact_nearest_row_for_a_stored_vector(datastore_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "ds"
    shutil.copytree(datastore_dir, root)
    before = Datastore(root).manifest
    manifest = add_ivfpq(root)
    assert manifest.indexes["ivfpq"] == IVFPQ_FILE
    assert manifest.datastore_id == before.datastore_id
    assert validate_datastore(root) == []
    assert read_ivfpq_meta(root)["plan"]["rows"] == before.counts.contexts
    ds = Datastore(root)
    knn = IvfPqKnn(ds)
    for global_row in (0, ds.total_rows // 2, ds.total_rows - 1):
        pos, row = ds.locate(global_row)
        vec = np.asarray(ds.shards[pos].vectors[row], dtype=np.float32)
        dist, rows = knn.search(vec, 5)
        assert rows.dtype == np.int64 and dist.dtype == np.float32
        assert rows[0] == global_row and dist[0] == pytest.approx(0.0, abs=1e-6)
        assert np.all(np.diff(dist) >= 0) and len(rows) == 5
    dist, rows = knn.search(np.zeros(ds.manifest.model.hidden_size, np.float32), ds.total_rows + 10)
    assert len(rows) == ds.total_rows and sorted(rows.tolist()) == list(range(ds.total_rows))
    # a re-run with the same shards keeps the index
    mtime = (root / IVFPQ_FILE).stat().st_mtime_ns
    add_ivfpq(root)
    assert (root / IVFPQ_FILE).stat().st_mtime_ns == mtime


def test_ivfpq_refuses_an_index_of_other_shards(datastore_dir: Path, tmp_path: Path) -> None:
    root = tmp_path / "ds"
    shutil.copytree(datastore_dir, root)
    add_ivfpq(root)
    meta = root / "index" / "ivfpq.json"
    meta.write_text(meta.read_text().replace(Datastore(root).manifest.compute_id(), "0" * 16))
    with pytest.raises(DatastoreError, match="other shards"):
        IvfPqKnn(Datastore(root))
    assert os.path.exists(root / IVFPQ_FILE)


def test_a_subject_is_normalised_as_the_datastore_s_wiki_writes_titles(datastore: Datastore) -> None:
    """On a Turkish or Azerbaijani datastore a subject's first i upper-cases to İ, as the builder stored the
    titles and link targets (MediaWiki's LanguageTr); elsewhere to I."""
    turkish = SimpleNamespace(articles=datastore.articles, redirects=datastore.redirects,
                              manifest=SimpleNamespace(language="tr"))  # fmt: skip
    assert SubjectResolver(turkish).normalize("istanbul") == "İstanbul"  # type: ignore[arg-type]
    assert SubjectResolver(datastore).normalize("istanbul") == "Istanbul"
    assert SubjectResolver(turkish).resolve("zorblat") == "Zorblat"  # type: ignore[arg-type]
