"""Metric arithmetic on hand-made ranks whose answers are known: P@k, macro vs micro, datasets, overall, report."""

from __future__ import annotations

import json

import numpy as np
import pytest

from bertknn.evaluation.base import gold_rank
from bertknn.evaluation.metrics import (
    COLUMNS,
    QueryResult,
    format_table,
    macro,
    micro,
    precision_at,
    report_dict,
    score_relations,
    summarize,
)


def _r(rel: str, ds: str, mlm: int | None, knn: int | None = None, both: int | None = None) -> QueryResult:
    return QueryResult(rel, ds, f"{rel}-{mlm}-{knn}-{both}", mlm, knn, both)


# Relation A (T-REx, 4 facts): mlm ranks 1, 2, 6, never  -> P@1 25, P@5 50, P@10 75
# Relation B (T-REx, 1 fact):  mlm rank 1                -> P@1 100, P@5 100, P@10 100
# Relation C (Google-RE, 2):   mlm ranks 11, 3           -> P@1 0, P@5 50, P@10 50
RESULTS = [
    _r("A", "T-REx", 1, 1, 1),
    _r("A", "T-REx", 2, None, 1),
    _r("A", "T-REx", 6, None, 2),
    _r("A", "T-REx", None, None, 9),
    _r("B", "T-REx", 1, 4, 1),
    _r("C", "Google-RE", 11, 1, 1),
    _r("C", "Google-RE", 3, 1, 1),
]


def test_precision_at_k_counts_ranks_up_to_k_and_never_none():
    assert precision_at([1, 2, 6, None], 1) == 25.0
    assert precision_at([1, 2, 6, None], 5) == 50.0
    assert precision_at([1, 2, 6, None], 10) == 75.0
    assert precision_at([None, None], 10) == 0.0
    with pytest.raises(ValueError, match="empty"):
        precision_at([], 1)


def test_per_relation_scores():
    scores = {s.relation: s for s in score_relations(RESULTS)}
    assert scores["A"].facts == 4 and scores["A"].dataset == "T-REx"
    assert scores["A"].columns["mlm"] == {"p@1": 25.0, "p@5": 50.0, "p@10": 75.0}
    assert scores["B"].columns["mlm"] == {"p@1": 100.0, "p@5": 100.0, "p@10": 100.0}
    assert scores["C"].columns["mlm"] == {"p@1": 0.0, "p@5": 50.0, "p@10": 50.0}
    assert scores["A"].columns["knn"]["p@1"] == 25.0 and scores["A"].columns["bert_knn"]["p@1"] == 50.0


def test_macro_averages_relations_first_and_differs_from_micro():
    trex = [s for s in score_relations(RESULTS) if s.dataset == "T-REx"]
    # macro T-REx P@1 = mean(25, 100) = 62.5; micro over its 5 queries = 2/5 = 40
    assert macro(trex)["mlm"]["p@1"] == pytest.approx(62.5)
    assert micro([r for r in RESULTS if r.dataset == "T-REx"])["mlm"]["p@1"] == pytest.approx(40.0)
    # P@10 macro = mean(75, 100) = 87.5; micro = 4/5 = 80
    assert macro(trex)["mlm"]["p@10"] == pytest.approx(87.5)
    assert micro([r for r in RESULTS if r.dataset == "T-REx"])["mlm"]["p@10"] == pytest.approx(80.0)


def test_summary_datasets_and_overall_is_the_mean_over_all_relations():
    s = summarize(RESULTS)
    assert [d.dataset for d in s.datasets] == ["Google-RE", "T-REx"]  # LAMA's order
    gre, trex = s.datasets
    assert (gre.relations, gre.facts, trex.relations, trex.facts) == (1, 2, 2, 5)
    assert trex.columns["mlm"]["p@1"] == pytest.approx(62.5)
    # overall = mean over A, B, C = (25 + 100 + 0) / 3, not the mean of the dataset means (0 + 62.5) / 2
    assert s.overall["mlm"]["p@1"] == pytest.approx(125 / 3)
    assert s.overall["mlm"]["p@5"] == pytest.approx(200 / 3)
    assert s.micro["mlm"]["p@1"] == pytest.approx(200 / 7)
    # bert_knn: A 2/4 = 50, B 100, C 100 -> 250/3; knn: A 25, B 0 (rank 4), C 100 -> 125/3
    assert s.overall["bert_knn"]["p@1"] == pytest.approx(250 / 3)
    assert s.overall["knn"]["p@1"] == pytest.approx(125 / 3)
    assert s.overall["knn"]["p@5"] == pytest.approx((25 + 100 + 100) / 3)
    with pytest.raises(ValueError, match="filtered out"):
        summarize([])


def test_report_has_exactly_the_issue_structure_in_percent():
    report = report_dict(summarize(RESULTS), {"retriever": "bm25"})
    assert list(report) == ["macro", "datasets", "relations", "settings"]
    assert list(report["macro"]) == list(COLUMNS)
    for col in COLUMNS:
        assert list(report["macro"][col]) == ["p@1", "p@5", "p@10"]
    assert report["macro"]["mlm"]["p@1"] == pytest.approx(41.67)
    assert report["datasets"]["T-REx"]["mlm"] == {"p@1": 62.5, "p@5": 75.0, "p@10": 87.5}
    assert report["relations"]["C"] == {
        "dataset": "Google-RE",
        "facts": 2,
        "mlm": {"p@1": 0.0, "p@5": 50.0, "p@10": 50.0},
        "knn": {"p@1": 100.0, "p@5": 100.0, "p@10": 100.0},
        "bert_knn": {"p@1": 100.0, "p@5": 100.0, "p@10": 100.0},
    }
    assert report["settings"] == {"retriever": "bm25"}
    json.dumps(report)  # serialisable
    table = format_table(summarize(RESULTS), title="t")
    assert "macro overall" in table and "micro overall" in table and "macro T-REx" in table


def test_gold_rank_ties_zero_mass_and_restricted_vocabulary():
    p = np.array([0.1, 0.4, 0.1, 0.0, 0.4], dtype=np.float32)
    assert gold_rank(p, 1) == 1
    assert gold_rank(p, 4) == 2  # tie with id 1: the lower id ranks first, as in top_k
    assert gold_rank(p, 2) == 4
    assert gold_rank(p, 3) is None  # zero mass: an empty p_kNN ranks nothing
    assert gold_rank(np.zeros(5, np.float32), 0) is None
    allowed = np.array([0, 2, 4])  # ids 1 and 3 are outside the restricted vocabulary
    assert gold_rank(p, 4, allowed) == 1
    assert gold_rank(p, 2, allowed) == 3  # 0.1 ties with id 0 (lower id first)
    with pytest.raises(ValueError, match="outside the restricted"):
        gold_rank(p, 1, allowed)


def test_subjects_found_are_counted_per_relation_and_dataset_and_said_under_the_table():
    from dataclasses import replace

    flags = [True, False, True, True, False, True, False]
    found = [replace(r, subject_found=f) for r, f in zip(RESULTS, flags, strict=True)]
    summary = summarize(found)
    by_relation = {r.relation: r.subjects_found for r in summary.relations}
    want: dict[str, int] = {}
    for r, f in zip(RESULTS, flags, strict=True):
        want[r.relation] = want.get(r.relation, 0) + f
    assert by_relation == want and summary.subjects == (sum(flags), len(flags))
    report = report_dict(summary, {})
    assert {k: v["subjects_found"] for k, v in report["relations"].items()} == want
    assert sum(v["subjects_found"] for v in report["datasets"].values()) == sum(flags)
    line = format_table(summary).splitlines()[-1]
    assert line == (f"subjects with an article in the datastore: {sum(flags)} of {len(flags)} facts that name one "
                    f"({100 * sum(flags) / len(flags):.1f}%); for the others the retriever chose the articles")
    # relation C's facts name no subject (as SQuAD's): it counts none, and the line counts the others only
    mixed = summarize([r if r.relation != "C" else replace(r, subject_found=None) for r in found])
    assert {r.relation: r.subjects_found for r in mixed.relations}["C"] is None
    assert "subjects_found" not in report_dict(mixed, {})["relations"]["C"]
    assert mixed.subjects == (sum(f for r, f in zip(RESULTS, flags, strict=True) if r.relation != "C"), 5)
    assert "subjects with an article" not in format_table(summarize(list(RESULTS)))  # nothing known: no line
    none_found = summarize([replace(r, subject_found=False) for r in RESULTS])  # every subject asked, none held
    assert none_found.subjects == (0, len(RESULTS))
    assert format_table(none_found).splitlines()[-1].startswith(f"subjects with an article in the datastore: 0 of {len(RESULTS)} ")


def test_the_adaptive_column_is_scored_only_when_every_query_carries_it():
    from dataclasses import replace

    from bertknn.evaluation.metrics import ADAPTIVE, skipped_fraction

    # relation A: adaptive ranks 1, 3, None, 1 -> P@1 50; B: 2 -> P@1 0; C: 1, 1 -> P@1 100; macro P@1 50
    ranks, skipped = [1, 3, None, 1, 2, 1, 1], [True, False, False, True, False, False, True]
    adaptive = [replace(r, bert_knn_adaptive=a, knn_skipped=s) for r, a, s in zip(RESULTS, ranks, skipped, strict=True)]
    summary = summarize(adaptive)
    assert summary.columns == (*COLUMNS, ADAPTIVE)
    assert summary.overall[ADAPTIVE]["p@1"] == pytest.approx(50.0)
    assert summary.overall["bert_knn"] == summarize(RESULTS).overall["bert_knn"]  # the others unchanged
    assert skipped_fraction(adaptive) == pytest.approx(3 / 7)
    head = format_table(summary).splitlines()[0]
    assert [f"{c} P@1/5/10" in head for c in ("mlm", "knn", "bert_knn", "adaptive", "bert_knn_adaptive")] == [
        True, True, True, True, False]  # fmt: skip
    # one query without the rule's answer: the column is left out, not scored on the others
    partial = [*adaptive[:-1], RESULTS[-1]]
    assert summarize(partial).columns == COLUMNS
    assert skipped_fraction(partial) == pytest.approx(2 / 6)  # counted over the queries that carry it
    with pytest.raises(ValueError, match="not evaluated"):
        skipped_fraction(RESULTS)
