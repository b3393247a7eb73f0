"""bench.realtext: the facts it asks, their split, the cause of each miss, and the paired comparison of two votes."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import pytest

from bench.realtext import baseline_argv, main, paired_interval, same_rows


def test_the_difference_is_the_macro_average_per_relation() -> None:
    rels = ["P1", "P1", "P1", "P1", "P2"]
    a = [0, 0, 1, 1, 0]  # P1 50 %, P2 0 %: macro 25
    b = [1, 0, 1, 1, 1]  # P1 75 %, P2 100 %: macro 87.5
    diff, low, high = paired_interval(rels, a, b)
    assert diff == pytest.approx(62.5)
    assert low <= diff <= high


def test_identical_votes_differ_by_nothing_and_a_flip_everywhere_is_certain() -> None:
    rels = ["P1"] * 10 + ["P2"] * 10
    same = [1, 0] * 10
    assert paired_interval(rels, same, same) == (0.0, 0.0, 0.0)
    assert paired_interval(rels, [0] * 20, [1] * 20) == (100.0, 100.0, 100.0)


def test_the_interval_widens_with_disagreement_and_is_reproducible() -> None:
    rels = ["P1"] * 20
    a = [0] * 20
    b = [1] * 10 + [0] * 10  # half the facts flip: +50, with sampling noise
    diff, low, high = paired_interval(rels, a, b)
    assert diff == 50.0 and low < 50.0 < high
    assert paired_interval(rels, a, b) == (diff, low, high)  # a fixed seed


def test_a_miss_is_put_down_to_its_first_cause() -> None:
    from bench.realtext import CAUSES, miss_cause

    assert miss_cause(False, True, False, False) == "retrieval"  # nothing else counts when the article was missed
    assert miss_cause(True, True, True, True) == "subject_echo"
    assert miss_cause(True, False, False, False) == "not_in_neighbours"
    assert miss_cause(True, False, True, False) == "outvoted"
    assert miss_cause(True, False, True, True) == "interpolation"
    causes = {miss_cause(*flags) for flags in itertools.product([False, True], repeat=4)}
    assert causes == set(CAUSES)


def _relation_file(tmp_path: Path, rows: list[tuple[str, str]]) -> Path:
    path = tmp_path / "P19.jsonl"  # a relation of LAMA's relations.jsonl: "[X] was born in [Y] ."
    path.write_text("".join(json.dumps({"sub_label": s, "obj_label": o}) + "\n" for s, o in rows), encoding="utf-8")
    return path


def test_a_fact_is_asked_only_when_its_object_is_written_as_a_whole_word_in_the_subjects_lead(
    tmp_path: Path, bert_tokenizer: Any
) -> None:
    from bench.realtext import load_facts
    from bertknn.core.wordmodel import WordModel

    words = WordModel(bert_tokenizer)
    leads = {
        "Albert Einstein": "Albert Einstein was a physicist who grew up in Munich.",
        "Hans Grau": "Hans Grau was a painter whom the Munichers loved.",  # "Munich" only inside a longer word
        "Zora Quimbleton": "Zora Quimbleton was born in Zanzibar.",  # an object of several wordpieces
    }
    rows = [("Albert Einstein", "Munich"), ("Albert Einstein", "Munich"), ("Albert Einstein", "Berlin"),
            ("Hans Grau", "Munich"), ("Zora Quimbleton", "Zanzibar"), ("No Lead", "Paris")]  # fmt: skip
    facts = load_facts(words, leads, [_relation_file(tmp_path, rows)])
    assert [(f.subject, f.obj) for f in facts] == [("Albert Einstein", "Munich")]  # once, though listed twice
    (f,) = facts
    assert f.text == "albert einstein was born in [MASK] ."  # uncased: lowercased, the mask token kept
    assert f.relation == "P19" and f.word == "munich"
    assert f.gold == bert_tokenizer.convert_tokens_to_ids("munich") and f.split in {"dev", "test"}
    assert len(bert_tokenizer.tokenize("zanzibar")) > 1
    whole = load_facts(words, leads, [_relation_file(tmp_path, rows)], whole_words=True)
    assert [(f.obj, f.gold) for f in whole] == [("Munich", f.gold), ("Zanzibar", -1)]


def test_the_split_is_by_subject_and_the_same_in_every_run(tmp_path: Path, bert_tokenizer: Any) -> None:
    from bench.realtext import load_facts, split_of_subject
    from bertknn.core.wordmodel import WordModel

    subjects = [f"Person {i}" for i in range(40)]
    leads = {s: f"{s} was born in Paris and lived in Rome." for s in subjects}
    rows = [(s, o) for s in subjects for o in ("Paris", "Rome")]
    facts = load_facts(WordModel(bert_tokenizer), leads, [_relation_file(tmp_path, rows)])
    assert len(facts) == 80
    by_subject: dict[str, set[str]] = {}
    for f in facts:
        by_subject.setdefault(f.subject, set()).add(f.split)
        assert f.split == split_of_subject(f.subject)
    assert all(len(s) == 1 for s in by_subject.values())  # no subject on both sides
    assert {f.split for f in facts} == {"dev", "test"}
    assert load_facts(WordModel(bert_tokenizer), leads, [_relation_file(tmp_path, rows)], "heldout")[0].split == "heldout"


def test_the_baselines_run_takes_the_same_options_but_its_own_work_directory() -> None:
    argv = ["--sweep", "--baseline", "96ce685", "--work", "/tmp/w", "--split=test", "--work=/tmp/x", "--baseline=abc"]
    assert baseline_argv(argv) == ["--sweep", "--split=test"]


def test_rows_are_the_same_only_when_every_figure_is() -> None:
    row = {"facts": 10, "p@1": {"bert_knn": 40.0, "knn": 30.0, "mlm": 10.0}, "miss_causes": {"outvoted": 80.0}}
    other = {**row, "miss_causes": {"outvoted": 70.0}}  # the same P@1, another cause of misses
    ours = {"dev": {"a": row, "b": row, "c": row}, "test": {"a": row}}
    theirs = {"dev": {"a": dict(row), "b": other}, "test": {"a": {**row, "p@1": {**row["p@1"], "bert_knn": 41.0}}}}
    got = same_rows(ours, theirs, "abc")
    assert (got["rows"], got["identical"]) == (4, 1)
    assert got["differing"] == ["dev b: BERT-kNN 40.0 against 40.0", "test a: BERT-kNN 40.0 against 41.0"]
    assert got["missing"] == ["dev c"]


def test_a_baseline_that_is_no_commit_is_refused_before_anything_runs(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as err:
        main(["--baseline", "no-such-commit-anywhere"])
    assert err.value.code == 2 and "no such commit" in capsys.readouterr().err
