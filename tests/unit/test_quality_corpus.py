"""The quality benchmark's corpus: evidence sentences restored, grouped per subject, capped, merged by title."""

from __future__ import annotations

import json
from pathlib import Path

from bench.quality.corpus import evidence_sentence, sample_by_hash, trex_evidence_articles, write_corpus


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def _ev(sentence: str, surface: str) -> dict:
    return {"sub_surface": "x", "obj_surface": surface, "masked_sentence": sentence}


def _layout(tmp: Path) -> tuple[Path, Path]:
    lama, wiki = tmp / "lama", tmp / "wiki"
    _jsonl(
        lama / "TREx" / "P19.jsonl",
        [
            {"uuid": "a", "sub_label": "Zorblat", "obj_label": "Quimby",
             "evidences": [_ev(f"Zorblat, born {i} in [MASK], sang.", "Quimby") for i in range(6)]},
            {"uuid": "b", "sub_label": "Plonk", "obj_label": "Vostok",
             "evidences": [_ev("Plonk lies near [MASK].", "Vostok"), _ev("Plonk lies near [MASK].", "Vostok")]},
        ],
    )  # fmt: skip
    _jsonl(
        lama / "TREx" / "P27.jsonl",
        [
            {"uuid": "c", "sub_label": "Zorblat", "obj_label": "Freedonia",
             "evidences": [_ev(f"Zorblat is a [MASK] citizen ({i}).", "Freedonian") for i in range(4)]},
        ],
    )  # fmt: skip
    _jsonl(
        lama / "Google_RE" / "place_of_birth_test.jsonl",
        [
            {"uuid": "g1", "sub_label": "Frelle Dax", "obj_label": "Vostok",
             "evidences": [{"url": "http://en.wikipedia.org/wiki/Frelle_Dax", "snippet": "..."}], "judgments": []},
            {"uuid": "g2", "sub_label": "Other", "obj_label": "Vostok",
             "evidences": [{"url": "http://en.wikipedia.org/wiki/Other_Person", "snippet": "..."}], "judgments": []},
        ],
    )  # fmt: skip
    _jsonl(
        wiki / "vital_articles.jsonl",
        [
            {"id": str(i), "title": t, "text": f"{t} is a place."}
            for i, t in enumerate(["Plonk", "Atlantis", "Mu"])
        ],
    )
    _jsonl(
        wiki / "google_re_articles.jsonl",
        [
            {"id": "gre-0", "title": "Frelle Dax", "text": "Frelle Dax was born in Vostok."},
            {"id": "gre-1", "title": "Other Person", "text": "Other Person was born in Vostok."},
        ],
    )
    return lama, wiki


def test_evidence_sentence_puts_the_object_surface_back():
    assert evidence_sentence(_ev("Born in [MASK], Australia.", "Alexandra, Victoria")) == (
        "Born in Alexandra, Victoria, Australia."
    )
    assert evidence_sentence(_ev("no mask here", "x")) is None
    assert evidence_sentence({"masked_sentence": "[MASK]"}) is None


def test_evidence_articles_group_per_subject_dedup_and_cap(tmp_path):
    lama, _ = _layout(tmp_path)
    everything = trex_evidence_articles(lama / "TREx")
    assert len(everything["Zorblat"]) == 10 and everything["Plonk"] == ["Plonk lies near Vostok."]
    capped = trex_evidence_articles(
        lama / "TREx", {"Zorblat"}, keep_uids={"a"}, max_fact_sentences=2, max_other_sentences=1
    )
    assert capped == {
        "Zorblat": [
            "Zorblat, born 0 in Quimby, sang.",
            "Zorblat, born 1 in Quimby, sang.",
            "Zorblat is a Freedonian citizen (0).",
        ]
    }


def test_corpus_merges_titles_selects_google_re_articles_and_samples_distractors(tmp_path):
    lama, wiki = _layout(tmp_path)
    out = tmp_path / "corpus.jsonl"
    stats = write_corpus(
        out, wiki_dir=wiki, lama_dir=lama, trex_subjects={"Zorblat", "Plonk"}, trex_uids={"a", "b"},
        google_re_uids={"g1"}, distractors=None, max_fact_sentences=1, max_other_sentences=0,
    )  # fmt: skip
    rows = {r["title"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert set(rows) == {"Plonk", "Atlantis", "Mu", "Frelle Dax", "Zorblat"}  # "Other Person" not selected
    assert (
        rows["Plonk"]["text"] == "Plonk is a place.\nPlonk lies near Vostok."
    )  # merged into the wiki article
    assert rows["Zorblat"]["text"] == "Zorblat, born 0 in Quimby, sang."
    assert stats.merged_titles == 1 and stats.by_source == {"vital": 3, "google_re": 1, "trex_evidence": 2}
    arts = [{"title": t} for t in "abcdefgh"]
    two = sample_by_hash(arts, 2)
    assert len(two) == 2 and two == [a for a in arts if a in two]  # file order kept
    assert {a["title"] for a in two} == {
        a["title"] for a in sample_by_hash(arts[::-1], 2)
    }  # order-independent
    assert sample_by_hash(arts, None) == arts
