"""Entities from links, end to end on a tiny corpus of made-up entities whose names are several wordpieces: the
builder keeps the links (JSON lines and a MediaWiki dump with a redirect), /predict answers entities, /follow
follows two relations, and add/merge keep the entity table right."""

from __future__ import annotations

import bz2
import logging
import shutil
import sqlite3
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from bertknn.builder.merge import merge_slices
from bertknn.builder.settings import AddSettings
from bertknn.builder.update import add_articles
from bertknn.core.format import Datastore, read_manifest, validate_datastore
from bertknn.core.format.table import EntityRef
from bertknn.core.logs import Event
from bertknn.service.main import create_app
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.results import DEFAULT_BEAM, Query
from bertknn.service.retrieval.knn import RestrictedKnn
from bertknn.service.settings import ServiceSettings
from tests.conftest import build_tiny, corpus_words, make_tiny_bert, write_jsonl
from tests.integration.test_builder import wiki_page
from tests.support.hits import answer_hits


def linked(page_id: str, title: str, text: str, anchors: list[tuple[str, str]]) -> dict:
    """An article with ``"links"``: every occurrence of each anchor links to its target."""
    links = []
    for anchor, target in anchors:
        start = 0
        while (i := text.find(anchor, start)) >= 0:
            links.append({"start": i, "end": i + len(anchor), "target": target})
            start = i + len(anchor)
    return {"id": page_id, "title": title, "text": text, "links": links}


# A person born in a made-up city that lies in a made-up country (twice, so that answers must be told apart).
ARTICLES = [
    linked("1", "Orvin Tasker", "Orvin Tasker was born in New Quellport. Orvin Tasker paints tall ships and "
           "harbours.", [("New Quellport", "New Quellport")]),
    linked("2", "New Quellport", "New Quellport is a city in the Kingdom of Zembla. New Quellport has a busy "
           "harbour.", [("Kingdom of Zembla", "Kingdom_of_Zembla")]),
    linked("3", "Kingdom of Zembla", "The Kingdom of Zembla is a country in the north. Its capital is New "
           "Quellport.", [("New Quellport", "New Quellport")]),
    linked("4", "Mira Dolan", "Mira Dolan was born in Port Ambrel. Mira Dolan writes long novels about islands.",
           [("Port Ambrel", "Port Ambrel")]),
    linked("5", "Port Ambrel", "Port Ambrel is a city in the Republic of Tessaly. Port Ambrel has an old bridge.",
           [("Republic of Tessaly", "Republic of Tessaly")]),
    linked("6", "Republic of Tessaly", "The Republic of Tessaly is a country in the south. Its capital is Port "
           "Ambrel.", [("Port Ambrel", "Port Ambrel")]),
]  # fmt: skip


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    extra = [{"title": "x", "text": "Quellport is known for its port. Zembla"}]
    return make_tiny_bert(tmp_path_factory.mktemp("ent-model"), corpus_words(ARTICLES + extra))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_jsonl(tmp_path_factory.mktemp("ent-corpus") / "linked.jsonl", ARTICLES)


@pytest.fixture(scope="module")
def ds(tmp_path_factory: pytest.TempPathFactory, model: Path, corpus: Path) -> Path:
    return build_tiny(tmp_path_factory.mktemp("ent-ds") / "ds", [corpus], model)


@pytest.fixture(scope="module")
def client(ds: Path):
    with TestClient(create_app(ServiceSettings(datastore=ds, model={"device": "cpu"}))) as c:
        yield c


def _entities(root: Path) -> dict[str, int]:
    m = read_manifest(root)
    assert m.article_table is not None
    con = sqlite3.connect(root / m.article_table)
    try:
        return dict(con.execute("SELECT title, popularity FROM entities").fetchall())
    finally:
        con.close()


def test_the_builder_keeps_links_as_rows_and_an_entity_table(ds: Path, model: Path) -> None:
    assert validate_datastore(ds, hashes=True, deep=True) == []
    m = read_manifest(ds)
    assert m.format_version == 4 and m.links is not None
    # every anchor is in a kept sentence: New Quellport x2, Kingdom of Zembla, Port Ambrel x2, Republic of Tessaly
    assert _entities(ds) == {"New Quellport": 2, "Kingdom of Zembla": 1, "Port Ambrel": 2, "Republic of Tessaly": 1}
    assert (m.links.mentions, m.links.entities, m.links.anchor_rows) == (6, 4, 6)
    store = Datastore(ds)
    _, labels, rows = store.article_rows(["New Quellport"], "entity")
    (row,) = rows.tolist()
    ref = store.context(row)
    assert ref.sentence[ref.span[0] : ref.span[1]] == "Kingdom of Zembla"  # the whole anchor is the row's span
    assert store.links.entity_at(row) is not None and store.links.entity_at(row).title == "Kingdom of Zembla"  # type: ignore[union-attr]
    # word answers never see an anchor-only row
    _, word_labels, word_rows = store.article_rows(["New Quellport"])
    assert row not in word_rows.tolist() and (word_labels >= 0).all()


@pytest.mark.parametrize("answer", ["word", "entity"])
def test_the_restricted_knn_copies_the_articles_rows_once_and_finds_the_exact_neighbours(ds: Path, answer: str) -> None:
    store = Datastore(ds)
    titles = ["Orvin Tasker", "No such article", "New Quellport", "Port Ambrel"]
    search = RestrictedKnn(store).prepare(titles, answer)
    per = [store.article_rows([t], answer) for t in titles]
    vectors = np.concatenate([p[0] for p in per]).astype(np.float32)
    assert search.rows.tolist() == np.concatenate([p[2] for p in per]).tolist()
    assert search.labels.tolist() == np.concatenate([p[1] for p in per]).tolist()
    assert search.row_article is not None
    assert search.row_article.tolist() == [i for i, p in enumerate(per) for _ in p[2]]
    stored = sum(store.articles[t].rows for t in titles if t in store.articles)
    assert 0 < len(search.rows) < stored  # rows left out: anchors only (word), rows without a link (entity)
    q = vectors[1] + np.random.default_rng(0).normal(0, 0.5, vectors.shape[1]).astype(np.float32)
    found = search.search(q, 100)  # more than there are: all of them, nearest first
    exact = ((vectors - q) ** 2).sum(axis=1)
    order = np.argsort(exact, kind="stable")
    assert found.rows.tolist() == search.rows[order].tolist()
    np.testing.assert_allclose(found.distances, exact[order], rtol=1e-5)
    assert RestrictedKnn(store).prepare(["Orvin Tasker"], answer).row_article is None  # one article: no weighing
    assert len(RestrictedKnn(store).prepare(["No such article"], answer).rows) == 0


def test_word_answers_are_those_of_a_build_without_links(ds: Path, model: Path, corpus: Path, tmp_path: Path) -> None:
    plain = build_tiny(tmp_path / "plain", [corpus], model, links=False)
    assert read_manifest(plain).links is None
    q = {"text": "orvin tasker was born in [MASK] .", "subject": "Orvin Tasker", "top_k": 5}
    answers = []
    for root in (ds, plain):
        with TestClient(create_app(ServiceSettings(datastore=root, model={"device": "cpu"}))) as c:
            answers.append(c.post("/predict", json=q).json()["predictions"])
    strip = [[{k: v for k, v in p.items() if k != "entity"} for p in preds] for preds in answers]
    assert strip[0] == strip[1]
    assert all(p["entity"] is None for p in answers[1])
    with TestClient(create_app(ServiceSettings(datastore=plain, model={"device": "cpu"}))) as c:
        r = c.post("/predict", json={**q, "answer": "entity"})
        assert r.status_code == 422 and "entity links" in r.json()["error"]["message"]
        r = c.post("/follow", json={"subject": "Orvin Tasker", "relations": ["[X] was born in [Y] ."]})
        assert r.status_code == 422 and "entity links" in r.json()["error"]["message"]


def test_answer_words_find_the_entity_titled_like_them_all_at_once(ds: Path) -> None:
    """The batched lookup gives what one lookup per word gives: the exact title through a redirect, else the
    first article whose title folds alike, else None."""
    from bertknn.core.titles import fold_title, normalize_title
    from bertknn.service.entities import _titled

    store = Datastore(ds)

    def one(word: str) -> EntityRef | None:
        folded = store.articles.folded(fold_title(word))
        return store.links.entity(normalize_title(word)) or (store.links.entity(folded[0].title) if folded else None)

    words = ["New Quellport", "new quellport", "KINGDOM OF ZEMBLA", "Kingdom_of_Zembla", "Orvin Tasker",
             "Quellport", "New Quellport", "port ambrel"]  # fmt: skip
    got = _titled(store, words)
    assert got == [one(w) for w in words]
    assert got[0] == got[1] == got[6] == EntityRef("New Quellport", 2) and got[5] is None
    assert got[2] is not None and got[2].title == "Kingdom of Zembla" and got[7] == EntityRef("Port Ambrel", 2)
    assert _titled(store, []) == []


def test_predict_answers_an_entity_of_several_wordpieces(client: TestClient) -> None:
    r = client.post("/predict", json={"text": "orvin tasker was born in [MASK] .", "subject": "Orvin Tasker",
                                      "answer": "entity", "top_k": 3})  # fmt: skip
    assert r.status_code == 200, r.text
    top = r.json()["predictions"][0]
    assert top["token"] == "New Quellport" and top["entity"] == {"title": "New Quellport", "popularity": 2}
    assert top["pieces"] >= 2 and top["p_knn"] > 0.99  # the subject's article links only this entity
    assert top["contexts"][0]["sentence"] == "Orvin Tasker was born in **New Quellport**."
    r = client.post("/predict", json={"text": "mira dolan was born in [MASK] .", "subject": "Mira Dolan",
                                      "answer": "entity"})  # fmt: skip
    assert r.json()["predictions"][0]["entity"]["title"] == "Port Ambrel"
    bad = client.post("/predict", json={"text": "x [MASK] .", "answer": "entity", "retriever": "none"})
    assert bad.status_code == 422
    bad = client.post("/predict", json={"text": "x [MASK] .", "answer": "title"})
    assert bad.status_code == 422 and "answer" in bad.json()["error"]["message"]


def test_follow_two_hops_reaches_the_country_through_the_city(client: TestClient, caplog) -> None:
    body = {"subject": "orvin tasker", "relations": ["[X] was born in [Y] .", "[X] is a city in the [Y] ."],
            "top_k": 3, "beam": 2}  # fmt: skip
    caplog.set_level(logging.INFO, logger="service")
    r = client.post("/follow", json=body)
    assert r.status_code == 200, r.text
    # its log line: the hops, and the questions asked (one for the subject, one per entity of the beam after it)
    logged = [rec.msg.fields for rec in caplog.records if isinstance(rec.msg, Event) and rec.msg.name == "request"]
    assert len(logged) == 1 and logged[0]["path"] == "/follow" and logged[0]["hops"] == 2
    assert logged[0]["questions"] == 1 + len(r.json()["hops"][0]["entities"][: body["beam"]])
    out = r.json()
    assert out["subject"] == "Orvin Tasker"  # resolved (folded) like /predict's subject
    assert [h["relation"] for h in out["hops"]] == body["relations"]
    assert out["hops"][0]["entities"][0]["title"] == "New Quellport"
    best = out["answers"][0]
    assert best["title"] == "Kingdom of Zembla"
    assert [s["title"] for s in best["path"]] == ["Orvin Tasker", "New Quellport", "Kingdom of Zembla"]
    # each step says which sentence supports it; the answer's mass is the product along its only path
    assert best["path"][1]["contexts"][0]["sentence"] == "Orvin Tasker was born in **New Quellport**."
    assert best["path"][2]["contexts"][0]["sentence"] == "New Quellport is a city in the **Kingdom of Zembla**."
    hop2 = client.post("/predict", json={"text": "new quellport is a city in the [MASK] .", "subject": "New Quellport",
                                         "answer": "entity"}).json()["predictions"][0]  # fmt: skip
    assert best["prob"] == pytest.approx(best["path"][1]["prob"] * hop2["prob"], rel=1e-5)
    other = client.post("/follow", json={**body, "subject": "Mira Dolan"}).json()
    assert [s["title"] for s in other["answers"][0]["path"]] == ["Mira Dolan", "Port Ambrel", "Republic of Tessaly"]


def test_follow_errors_say_what_to_fix(client: TestClient) -> None:
    cases = [
        ({"subject": "Nobody Here", "relations": ["[X] was born in [Y] ."]}, "unknown_subject", "neither an article"),
        ({"subject": "Mira Dolan", "relations": ["[X] was born in [MASK] ."]}, "invalid_request", "relations.0"),
        ({"subject": "Mira Dolan", "relations": ["[X] r [Y] ."] * 5}, "invalid_request", "limit of 4"),
        ({"subject": "Mira Dolan", "relations": []}, "invalid_request", "relations"),
        ({"subject": "Mira Dolan", "relations": ["[X] r [Y] ."], "beam": 0}, "invalid_request", "beam"),
    ]
    for body, code, says in cases:
        r = client.post("/follow", json=body)
        assert r.status_code == 422, body
        assert r.json()["error"]["code"] == code and says in r.json()["error"]["message"], r.json()


def _bz2_dump(folder: Path, pages: list[str]) -> Path:
    """``pages`` (`wiki_page`) as a bz2 pages-articles dump in ``folder``."""
    xml = ('<mediawiki xmlns="http://www.mediawiki.org/xml/export-0.11/" version="0.11" xml:lang="en">\n'
           "<siteinfo><sitename>Wikipedia</sitename></siteinfo>\n" + "".join(pages) + "</mediawiki>\n")  # fmt: skip
    dump = folder / "enwiki-pages-articles.xml.bz2"
    dump.write_bytes(bz2.compress(xml.encode()))
    return dump


def test_a_dump_s_wikilinks_resolve_through_its_redirects(model: Path, tmp_path: Path) -> None:
    pages = [
        wiki_page("Orvin Tasker", "'''Orvin Tasker''' was born in [[Quellport|New Quellport]]. "
                  "{{Infobox person|birth_place=[[Port Ambrel]]}}Orvin Tasker paints tall ships.", 1),
        wiki_page("New Quellport", "'''New Quellport''' is a city in the [[Kingdom of Zembla]].", 2),
        wiki_page("Quellport", "#REDIRECT [[New Quellport]]", 3, redirect="New Quellport"),
        wiki_page("Mira Dolan", "'''Mira Dolan''' was born in [[new Quellport]] and [[Quellport#Harbour|harbour]].", 4),
    ]  # fmt: skip
    dump = _bz2_dump(tmp_path, pages)
    out = build_tiny(tmp_path / "ds", [dump], model, sparse_indexes=False)
    assert validate_datastore(out) == []
    # "Quellport" (a redirect) and "new Quellport" (first letter) are New Quellport; the infobox's link is dropped
    assert _entities(out) == {"New Quellport": 3, "Kingdom of Zembla": 1}
    store = Datastore(out)
    _, _, rows = store.article_rows(["Orvin Tasker"], "entity")
    assert [store.links.entity_at(r).title for r in rows.tolist()] == ["New Quellport"]  # type: ignore[union-attr]
    # every link's entity looked up together: through the redirect, with the popularity
    wheres = [w for w in store.links.entity_indexes(list(range(store.manifest.counts.contexts))) if w is not None]
    assert "Quellport" in {store.shards[pos].entity_title(local) for pos, local in wheres}
    assert {(r.title, r.popularity) for r in store.links.entities_of(wheres)} == {("New Quellport", 3), ("Kingdom of Zembla", 1)}
    assert store.table.entities(["Nowhere", "Quellport", "Nowhere"]) == [
        EntityRef("Nowhere", 0), EntityRef("New Quellport", 3), EntityRef("Nowhere", 0)
    ]


def test_bench_entity_cost_reports_each_round_over_a_linked_dump(
    model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``python -m bench.entity_cost``'s run end to end on a tiny linked dump: every kind asked in every round, the
    ratios over all rounds and per round."""
    from bench import entity_cost

    pages = [
        wiki_page("Orvin Tasker", "'''Orvin Tasker''' was born in [[New Quellport]]. Orvin Tasker paints ships.", 1),
        wiki_page("Mira Dolan", "'''Mira Dolan''' was born in [[Port Ambrel]]. She is a member of [[Zembla]].", 2),
        wiki_page("New Quellport", "'''New Quellport''' is a city in the [[Kingdom of Zembla]].", 3),
        wiki_page("Port Ambrel", "'''Port Ambrel''' is a city in the [[Republic of Tessaly]].", 4),
    ]  # fmt: skip
    dump = _bz2_dump(tmp_path, pages)
    written: dict[str, dict] = {}

    def write_result(name: str, payload: dict) -> Path:  # into the test's folder, not bench/results
        written[name] = payload
        return tmp_path / f"{name}.json"

    monkeypatch.setattr(entity_cost, "write_result", write_result)
    argv = ["--dump", str(dump), "--model", str(model), "--articles", "4", "--subjects", "2", "--rounds", "2",
            "--beams", "2", "--work", str(tmp_path / "work"), "--stages"]  # fmt: skip
    assert entity_cost.main(argv) == 0
    (report,) = written.values()
    assert report["datastore"]["articles"] == 4 and report["datastore"]["entities"] >= 4
    # 2 rounds x 2 subjects x 4 templates, and a follow per subject and round
    assert report["queries"] == {"word": 16, "entity": 16, "follow (beam 2)": 4}
    assert set(report["over_word"]) == {"entity", "follow (beam 2)"}
    assert all(len(v) == 2 and min(v) > 0 for v in report["over_word_per_round"].values())
    # --stages: the pipeline's stages timed per word answer and per follow, the rest beside them
    stages = report["stages_ms"]
    assert set(stages) == {"word", "follow (beam 2)"}
    for kind, ms in stages.items():
        assert set(ms) == {*entity_cost.STAGES, "other", "total"} and min(ms.values()) >= 0, ms
        assert abs(sum(ms[k] for k in (*entity_cost.STAGES, "other")) - ms["total"]) < 0.1, (kind, ms)
        assert ms["encode"] > 0 and ms["neighbours"] > 0 and ms["answer"] > 0, (kind, ms)
    assert stages["word"]["fill_names"] == 0  # a word answer runs no fill pass

def test_add_counts_the_live_articles_links_only(ds: Path, model: Path, tmp_path: Path) -> None:
    root = Path(shutil.copytree(ds, tmp_path / "ds"))
    changed = [
        # Orvin Tasker now links to Port Ambrel (his old link to New Quellport is superseded)
        linked("1", "Orvin Tasker", "Orvin Tasker was born in Port Ambrel. Orvin Tasker paints tall ships.",
               [("Port Ambrel", "Port Ambrel")]),
        linked("7", "Ada Vell", "Ada Vell was born in New Quellport and lives in the Kingdom of Zembla.",
               [("New Quellport", "New Quellport"), ("Kingdom of Zembla", "Kingdom of Zembla")]),
    ]  # fmt: skip
    add_articles(AddSettings(datastore=root, corpus=[write_jsonl(tmp_path / "add.jsonl", changed)], device="cpu",
                             batch_size=16))  # type: ignore[arg-type]  # fmt: skip
    assert validate_datastore(root) == []
    assert _entities(root) == {"New Quellport": 2, "Kingdom of Zembla": 2, "Port Ambrel": 3, "Republic of Tessaly": 1}
    assert read_manifest(root).links.mentions == 8  # type: ignore[union-attr]


def test_merged_slices_have_the_single_build_s_entities(ds: Path, model: Path, corpus: Path, tmp_path: Path) -> None:
    slices = [
        build_tiny(tmp_path / f"s{i}", [corpus], model, shard_index=i, num_shards=2, sparse_indexes=False)
        for i in range(2)
    ]
    merged = tmp_path / "merged"
    merge_slices(slices, merged, sparse_indexes=False)
    assert validate_datastore(merged) == []
    assert _entities(merged) == _entities(ds)
    assert read_manifest(merged).links == read_manifest(ds).links
    a, b = Datastore(merged), Datastore(ds)
    assert np.array_equal(a.article_rows(["Port Ambrel"], "entity")[1], b.article_rows(["Port Ambrel"], "entity")[1])


# ---- the evaluations (python -m evaluation lama --answer entity | --by-popularity, follow) ------------------------


@pytest.fixture(scope="module")
def lama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A LAMA-format probe about the corpus: birthplaces (P19) and the country a city lies in (P138's slot here:
    the relation id only keys the composed template of the pair P19 -> P138)."""
    import json

    root = tmp_path_factory.mktemp("ent-lama")
    (root / "TREx").mkdir()
    rows = [{"relation": "P19", "template": "[X] was born in [Y] ."},
            {"relation": "P138", "template": "[X] is a city in the [Y] ."}]  # fmt: skip
    (root / "relations.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    facts = {
        "P19": [("Orvin Tasker", "New Quellport"), ("Mira Dolan", "Port Ambrel")],
        "P138": [("New Quellport", "Kingdom of Zembla"), ("Port Ambrel", "Republic of Tessaly")],
    }
    for rel, pairs in facts.items():
        lines = [{"uuid": f"{rel}-{i}", "sub_label": s, "obj_label": o, "evidences": []} for i, (s, o) in enumerate(pairs)]
        (root / "TREx" / f"{rel}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return root


def test_entity_level_lama_and_two_hop_evaluations(lama_dir: Path, ds: Path, tmp_path: Path, capsys) -> None:
    import json

    from bertknn.evaluation.__main__ import main as evaluate

    common = ["--data", str(lama_dir), "--datastore", str(ds), "--device", "cpu", "--quiet"]
    assert evaluate(["lama", "--answer", "entity", *common, "--out", str(tmp_path / "lama.json")]) == 0
    lama = json.loads((tmp_path / "lama.json").read_text())
    # every object is several wordpieces: the word-level probe would drop all four facts; here each counts
    assert lama["relations"]["P19"]["BERT-kNN (entity)"] == {"n": 2, "p@1": 100.0, "p@10": 100.0}
    assert lama["macro"]["BERT-kNN (entity)"]["p@1"] == 100.0 and lama["macro"]["kNN (entity)"]["relations"] == 2
    # a word answer ("new") stands for no entity with this tiny model: the entity row is what finds the city
    assert lama["macro"]["MLM word -> entity"]["p@1"] < 100.0
    assert "LAMA, entity answers" in capsys.readouterr().out

    assert evaluate(["follow", "--pairs", "P19:P138", *common, "--out", str(tmp_path / "follow.json")]) == 0
    follow = json.loads((tmp_path / "follow.json").read_text())
    assert follow["settings"]["questions"] == 2
    assert follow["relations"]["P19->P138"]["hop 1 (follow)"]["p@1"] == 100.0
    assert follow["relations"]["P19->P138"]["hop 2 (follow)"]["p@1"] == 100.0
    # the one-shot question is restricted to the person's article, which does not say where the city lies
    assert follow["relations"]["P19->P138"]["one shot (composed)"]["p@1"] == 0.0
    out = capsys.readouterr().out
    assert "Two hops" in out

    assert evaluate(["follow", "--pairs", "P19:P999", *common]) == 1
    assert "--pairs 'P19:P999'" in capsys.readouterr().err


def test_popularity_buckets_split_the_subjects_by_inbound_links() -> None:
    from bertknn.evaluation.entities import popularity_buckets

    ranks = {"MLM": [1, None, 1, 2, None, 1, 1, 1, None], "kNN": [1, 1, 1, 1, 1, 1, None, None, 1]}
    out = popularity_buckets(ranks, [0, 0, 1, 1, 5, 5, 40, 40, 0], buckets=2)
    buckets = out["buckets"]
    # nothing links to three subjects: a bucket of their own; the others split at their median (5)
    assert out["zero"] == 3 and out["edges"] == [1.0, 5.0, 40.0]
    assert [b["popularity"] for b in buckets] == [[0.0, 0.0], [1.0, 5.0], [5.0, 40.0]]  # type: ignore[index]
    assert [b["n"] for b in buckets] == [3, 2, 4]  # type: ignore[index]
    assert [b["MLM"] for b in buckets] == pytest.approx([100 / 3, 50.0, 75.0])  # type: ignore[index]
    assert [b["kNN"] for b in buckets] == pytest.approx([100.0, 100.0, 50.0])  # type: ignore[index]
    assert popularity_buckets(ranks, [0] * 9)["buckets"] == [  # nobody linked: one bucket
        {"popularity": [0.0, 0.0], "n": 9, "MLM": pytest.approx(500 / 9), "kNN": pytest.approx(700 / 9)}
    ]


def test_an_adaptive_rule_weighs_the_subject_s_popularity(ds: Path) -> None:
    rule = {"bias": 0.0, "knn_weight": 0.0, "mlm_weight": 0.0, "popularity_weight": 4.0, "skip_threshold": None}
    settings = ServiceSettings(datastore=ds, model={"device": "cpu"}, defaults={"adaptive_rule": rule})
    with TestClient(create_app(settings)) as c:
        def lam(subject: str) -> float:
            body = {"text": f"{subject.lower()} is a [MASK] .", "subject": subject, "interpolation": "adaptive"}
            r = c.post("/predict", json=body)
            assert r.status_code == 200, r.text
            return r.json()["lambda_used"]

        assert lam("Orvin Tasker") == pytest.approx(0.5)  # nothing links to him: log(1 + 0) = 0
        assert lam("New Quellport") == pytest.approx(1 / (1 + 3.0**4), rel=1e-4)  # 2 inbound links: sigmoid(-4 log 3)


def test_an_interrupted_build_with_links_resumes_to_the_same_bytes(ds: Path, model: Path, corpus: Path, tmp_path: Path) -> None:
    from bertknn.core.format import MANIFEST, SHARDS_DIR

    out = Path(shutil.copytree(ds, tmp_path / "ds"))
    # as if killed before its last shard and the manifest: the finished shards are kept, the rest is made again
    (out / MANIFEST).unlink()
    kept = {p.name: (p / "entity_labels.npy").stat().st_ino for p in (out / SHARDS_DIR).glob("shard-*")}
    shutil.rmtree(out / SHARDS_DIR / "shard-00002")
    del kept["shard-00002"]
    build_tiny(out, [corpus], model)
    assert validate_datastore(out, hashes=True) == []
    for name in ("shard-00000", "shard-00001", "shard-00002"):
        for f in ("entity_labels.npy", "entities.txt", "entity_offsets.npy", "labels.npy"):
            assert (out / SHARDS_DIR / name / f).read_bytes() == (ds / SHARDS_DIR / name / f).read_bytes()
    assert {n: (out / SHARDS_DIR / n / "entity_labels.npy").stat().st_ino for n in kept} == kept  # not redone
    assert _entities(out) == _entities(ds) and read_manifest(out).links == read_manifest(ds).links
    # a resume with links off is refused: the finished shards were made with them
    from bertknn.core.errors import BuildError

    (out / MANIFEST).unlink()
    with pytest.raises(BuildError, match=r"\(links differ\)"):
        build_tiny(out, [corpus], model, links=False)


def test_the_distance_scale_is_measured_on_word_rows_only(ds: Path) -> None:
    """Anchor-only rows are never a word query's neighbour, so the temperature statistic leaves them out (it once
    took one as a query and compared it with the wrong row)."""
    from bertknn.core.calibration import measure_distance_scale

    m = read_manifest(ds)
    store = Datastore(ds)
    anchors = sum(int((store.shards[i].labels < 0).sum()) for i in range(len(store.shards)))
    assert anchors == 6  # the case at hand: the sample draws from all 60 rows, 6 of them anchors
    # a sampled anchor row would trip the check that every query is among its article's word rows
    scale = measure_distance_scale(ds, m, sample=10_000)
    assert scale is not None and 0 < scale.sample <= store.total_rows - anchors
    assert m.distance_scale is not None and m.distance_scale.value == measure_distance_scale(ds, m).value  # type: ignore[union-attr]


# ---- no silent fallbacks (#35) -----------------------------------------------------------------------------------


def test_a_datastore_without_links_refuses_entity_answers_and_follow_saying_how_to_get_links(
    tiny_datastore: Path,
) -> None:
    """The quick start's kind of datastore: built with links kept, from a corpus that has none."""
    assert not Datastore(tiny_datastore).links.has_entities
    with TestClient(create_app(ServiceSettings(datastore=tiny_datastore, model={"device": "cpu"}))) as c:
        r = c.post("/predict", json={"text": "zorblat was born in [MASK] .", "subject": "Zorblat", "answer": "entity"})
        assert r.status_code == 422 and "no entity links" in r.json()["error"]["message"], r.text
        assert "corpus with links" in r.json()["error"]["message"]
        r = c.post("/follow", json={"subject": "Zorblat", "relations": ["[X] was born in [Y] ."]})
        assert r.status_code == 422 and "no entity links" in r.json()["error"]["message"], r.text
        r = c.post("/predict", json={"text": "zorblat was born in [MASK] .", "subject": "Nobody Known"})
        assert r.status_code == 200 and r.json()["subject_status"] == "not_found"
        assert r.json()["warnings"] == [
            "subject 'Nobody Known' has no article in this datastore; bm25 ranked the articles instead"
        ]
        r = c.post("/predict", json={"text": "zorblat was born in [MASK] .", "subject": "Zorblat"})
        assert r.json()["warnings"] == []


def test_a_hop_whose_entity_has_no_article_says_which_rule_found_its_articles(model: Path, tmp_path: Path) -> None:
    articles = [
        linked("1", "Orvin Tasker", "Orvin Tasker was born in Port Ambrel. Orvin Tasker paints ships.",
               [("Port Ambrel", "Port Ambrel")]),
        linked("2", "Mira Dolan", "Mira Dolan lives in Port Ambrel. Port Ambrel is a city in the Kingdom of Zembla.",
               [("Port Ambrel", "Port Ambrel"), ("Kingdom of Zembla", "Kingdom of Zembla")]),
    ]  # fmt: skip  (Port Ambrel and the Kingdom have no article of their own)
    ds = build_tiny(tmp_path / "ds", [write_jsonl(tmp_path / "c.jsonl", articles)], model)
    with TestClient(create_app(ServiceSettings(datastore=ds, model={"device": "cpu"}))) as c:
        body = {"subject": "Orvin Tasker", "relations": ["[X] was born in [Y] .", "[X] is a city in the [Y] ."],
                "beam": 1}  # fmt: skip
        out = c.post("/follow", json=body).json()
    assert out["hops"][0]["entities"][0]["title"] == "Port Ambrel"
    assert out["hops"][0]["entities"][0]["found_by"] == "subject"  # Orvin Tasker's own article
    assert all(e["found_by"] == "bm25" for e in out["hops"][1]["entities"])
    assert out["warnings"] == ["hop 2: 'Port Ambrel' has no article in this datastore; its articles were ranked by bm25"]
    assert [s["found_by"] for s in out["answers"][0]["path"]] == [None, "subject", "bm25"]


def test_entity_answers_fill_only_the_entities_the_neighbours_weigh_most(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Thirty linked names of two pieces around the neighbours: one fill pass scores at most FILL_CANDIDATES."""
    from bertknn.service.entities import FILL_CANDIDATES
    from bertknn.service.fill import WordFill

    first = ["alpha", "beta", "gamma", "delta", "omega", "sigma"]
    second = ["north", "south", "east", "west", "hill"]
    names = [f"{a.title()} {b.title()}" for a in first for b in second]  # 30 names of two words
    text = " ".join(f"Ravel met {n} in the hall." for n in names)
    corpus = write_jsonl(tmp_path / "c.jsonl", [linked("1", "Ravel", text, [(n, n) for n in names])])
    model = make_tiny_bert(tmp_path / "m", corpus_words([{"title": "Ravel", "text": text}]))
    ds = build_tiny(tmp_path / "ds", [corpus], model)
    filled: list[int] = []
    real = WordFill.one_pass_probs  # entity names are read from one pass

    def counting(self: WordFill, requests: list, **kw: Any) -> list[np.ndarray]:
        filled.extend(len(words) for _, words in requests)
        return real(self, requests, **kw)

    monkeypatch.setattr(WordFill, "one_pass_probs", counting)
    with TestClient(create_app(ServiceSettings(datastore=ds, model={"device": "cpu"}))) as c:
        body = c.post("/predict", json={"text": "ravel met [MASK] in the hall .", "subject": "Ravel",
                                        "answer": "entity", "top_k": 5}).json()  # fmt: skip
    assert len(body["knn"]) == 5 and body["predictions"]
    assert filled and max(filled) <= FILL_CANDIDATES < 30, filled


def _names_per_fill_pass(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, body: dict) -> tuple[list[int], dict]:
    """Thirty linked names of two pieces in one article: a /follow over it, and the names each fill pass scored."""
    from bertknn.service.fill import WordFill

    first = ["alpha", "beta", "gamma", "delta", "omega", "sigma"]
    second = ["north", "south", "east", "west", "hill"]
    names = [f"{a.title()} {b.title()}" for a in first for b in second]
    text = " ".join(f"Ravel met {n} in the hall." for n in names)
    corpus = write_jsonl(tmp_path / "c.jsonl", [linked("1", "Ravel", text, [(n, n) for n in names])])
    model = make_tiny_bert(tmp_path / "m", corpus_words([{"title": "Ravel", "text": text}]))
    ds = build_tiny(tmp_path / "ds", [corpus], model)
    passes: list[int] = []  # names scored by each fill pass
    real = WordFill.one_pass_probs

    def counting(self: WordFill, requests: list, **kw: Any) -> list[np.ndarray]:
        passes.append(sum(len(words) for _, words in requests))
        return real(self, requests, **kw)

    monkeypatch.setattr(WordFill, "one_pass_probs", counting)
    with TestClient(create_app(ServiceSettings(datastore=ds, model={"device": "cpu"}))) as c:
        out = c.post("/follow", json={"subject": "Ravel", "relations": ["[X] met [Y] in the hall ."] * 2, **body})
    assert out.status_code == 200, out.text
    return passes, out.json()


def test_follow_fills_each_hop_s_names_in_one_pass_bounded_by_what_it_hands_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each hop of a /follow runs one fill pass, for at most beam (hop 1) and top_k (the last hop) names over all
    its queries; the hop's queries fill nothing themselves."""
    passes, out = _names_per_fill_pass(tmp_path, monkeypatch, {"beam": 3, "top_k": 4})
    assert len(out["hops"]) == 2 and out["answers"], out
    assert len(passes) == 2 and 0 < passes[0] <= 3 and 0 < passes[1] <= 4, passes
    hop1 = out["hops"][0]["entities"]
    assert all(a["prob"] >= b["prob"] for a, b in zip(hop1, hop1[1:], strict=False))  # ranked after the fill


@pytest.mark.parametrize(("beam", "handed_on"), [(None, DEFAULT_BEAM), (5, 5)])
def test_a_follow_s_first_hop_hands_on_the_default_beam_unless_asked_for_another(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, beam: int | None, handed_on: int
) -> None:
    """Thirty two-piece entities at hop 1: its fill scores exactly the names it hands on, the request's beam or,
    without one, the default."""
    passes, out = _names_per_fill_pass(tmp_path, monkeypatch, {} if beam is None else {"beam": beam})
    assert passes[0] == handed_on, passes
    assert len(out["hops"][0]["entities"]) >= handed_on


def test_an_entity_name_longer_than_max_name_pieces_is_left_to_its_neighbours(
    ds: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The fill pass scores names of 2 to MAX_NAME_PIECES pieces; a longer name is not sent to it and scores 0."""
    from bertknn.service.entities import MAX_NAME_PIECES
    from bertknn.service.fill import WordFill
    from bertknn.service.pipeline import AnswerPipeline

    sent: list[list[int]] = []
    real = WordFill.one_pass_probs

    def recording(self: WordFill, requests: list, **kw: Any) -> list[np.ndarray]:
        sent.extend([len(p) for p in names] for _, names in requests)
        return real(self, requests, **kw)

    monkeypatch.setattr(WordFill, "one_pass_probs", recording)
    pipe = AnswerPipeline.open(ds, device="cpu")
    try:
        ea = pipe.entity_answerer
        assert ea is not None
        short, long = "New Quellport", " ".join(["Port Ambrel"] * MAX_NAME_PIECES)
        assert 1 < len(ea.pieces(short)) <= MAX_NAME_PIECES < len(ea.pieces(long))
        (probs,) = ea.fill_names([("orvin tasker was born in [MASK] .", [short, long])])
    finally:
        pipe.close()
    assert sent == [[len(ea.pieces(short))]], sent  # only the short name went to the fill pass
    assert probs[0] > 0 and probs[1] == 0.0, probs


@pytest.mark.parametrize("case", ["copied", "kept", "voted"])
def test_entity_answers_are_the_same_with_the_knn_on_the_models_device(ds: Path, case: str) -> None:
    """``model.knn_device: model``: entity questions batched together have their entity rows (a subset of their
    articles' rows) searched in one product on the device (here the CPU's torch), the rows copied there or kept
    there, and their answers are the host's. ``voted``: the same questions as word answers, voted on the device
    too (``model.vote_device: model``), get the host's words and the entity each names (if any)."""
    import asyncio
    from dataclasses import replace

    import torch

    from bertknn.service.device_vote import DeviceVote
    from bertknn.service.metrics import Metrics
    from bertknn.service.retrieval.device_knn import DeviceKnn
    from bertknn.service.retrieval.resident_rows import ResidentRows
    from bertknn.service.serving import AsyncAnswerer
    from bertknn.service.settings import BatchingSettings
    from tests.support.batches import answer_as_one_batch

    questions = [Query("the capital is [MASK] .", answer="entity"),  # first: its retrieval starts with its batch
                 Query("orvin tasker was born in [MASK] .", subject="Orvin Tasker", answer="entity", top_k=3),
                 Query("mira dolan was born in [MASK] .", subject="Mira Dolan", answer="entity")]  # fmt: skip
    kept, voted = case == "kept", case == "voted"
    if voted:
        questions = [replace(q, answer="word") for q in questions]
    reference, pipe = AnswerPipeline.open(ds, device="cpu"), AnswerPipeline.open(ds, device="cpu")
    metrics = Metrics()
    resident = ResidentRows("cpu", lambda nbytes: True) if kept else None
    if resident is not None:
        assert resident.advance(pipe.datastore) == pipe.datastore.total_rows

    async def main() -> list:
        knn = DeviceKnn("cpu", resident=resident)
        vote = DeviceVote(torch.device("cpu"), pipe.encoder.words.vocab.non_words) if voted else None
        answerer = AsyncAnswerer(pipe, BatchingSettings(max_wait_ms=0), metrics, device_knn=knn, device_vote=vote)
        answerer.start()

        async def retrieved() -> None:  # the retrieval thread takes one client's work in order
            await asyncio.wrap_future(answerer._retrieval_thread.submit(lambda: None))

        try:
            return await answer_as_one_batch(answerer, questions, before_release=retrieved)
        finally:
            await answerer.stop()

    try:
        answers = asyncio.run(main())
        # the two subject questions' retrievals ended before the batch; the first one's started with the batch
        # and may or may not have ended with its forward: 2 or 3 searched on the device
        counted = metrics.exposition().decode()
        assert any(f'bertknn_knn_on_device_total{{outcome="searched"}} {n}.0' in counted for n in (2, 3)), counted
        assert (f"bertknn_knn_device_rows {float(pipe.datastore.total_rows)}" in counted) == kept
        assert any(f'bertknn_vote_on_device_total{{outcome="voted"}} {n}.0' in counted for n in (2, 3)) == voted
        for q, got in zip(questions, answers, strict=True):
            want = reference.predict(q)
            assert [(p.token, p.entity) for p in got.predictions] == [(p.token, p.entity) for p in want.predictions]
            np.testing.assert_allclose([p.prob for p in got.predictions], [p.prob for p in want.predictions], rtol=1e-4)
        if not voted:
            assert answers[1].predictions[0].token == "New Quellport"
    finally:
        pipe.close()
        reference.close()


def test_entity_answers_and_follow_are_the_same_in_the_split_layout(
    ds: Path, client: TestClient, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``layout: split``: the API process's fill passes (entity names, a /follow's hops) go to the model process
    as asks of their own, and give the answers of the model run in the serving process."""
    from bertknn.service.model_client import RemoteEncoder
    from tests.support.split import model_process_here

    settings = ServiceSettings(datastore=ds, model={"device": "cpu"})
    asks = [("/predict", {"text": "orvin tasker was born in [MASK] .", "subject": "Orvin Tasker", "answer": "entity",
                          "top_k": 3}),
            ("/predict", {"text": "the capital is [MASK] .", "answer": "entity"}),
            ("/follow", {"subject": "orvin tasker", "relations": ["[X] was born in [Y] .", "[X] is a city in the [Y] ."],
                         "top_k": 3, "beam": 2})]  # fmt: skip
    with model_process_here(settings, tmp_path, monkeypatch), TestClient(create_app(settings)) as split:
        # no model in this process: every forward pass, the fill passes too, is the model process's
        assert isinstance(split.app.state.resources.pipeline.encoder, RemoteEncoder)  # type: ignore[attr-defined]
        for path, body in asks:
            got, want = split.post(path, json=body).json(), client.post(path, json=body).json()
            key_of = "predictions" if path == "/predict" else "answers"
            assert [p.get("token", p.get("title")) for p in got[key_of]] == [
                p.get("token", p.get("title")) for p in want[key_of]], body  # fmt: skip
            for a, b in zip(got[key_of], want[key_of], strict=True):
                assert a["prob"] == pytest.approx(b["prob"], abs=1e-5)


def test_an_entity_answers_cache_hit_is_finished_off_the_event_loop(ds: Path) -> None:
    """An entity answer runs forward passes of its own (its names' fill) through the model thread, so a cache hit
    of one is finished by the finisher, never on the event loop, which a word answer's hit on the same datastore
    is (`Finisher.hit`); both answer as the synchronous pipeline does."""
    queries = [Query("orvin tasker was born in [MASK] .", subject="Orvin Tasker", answer="entity", retriever="tfidf"),
               Query("mira dolan was born in [MASK] .", subject="Mira Dolan", retriever="tfidf")]  # fmt: skip
    got = answer_hits(ds, queries, finish_s=0.001)
    assert got.finished == ["knn", "MainThread"] and got.retrieved == ["knn", "MainThread"]
    assert got.answers[0].predictions[0].entity is not None
    for hit, want in zip(got.answers, got.expected, strict=True):
        assert hit.cache["encoding"] == "hit"
        assert [(p.token, p.prob, p.entity, p.contexts) for p in hit.predictions] == [
            (p.token, p.prob, p.entity, p.contexts) for p in want.predictions]
