"""Evaluation plots: drawn from a report, as PNG and SVG, the same bytes for the same report."""

from __future__ import annotations

from pathlib import Path

from bertknn.evaluation.plots import relations_plot


def _report(p1: float) -> dict:
    relations = {
        r: {"dataset": "T-REx", "facts": 30, "mlm": {"p@1": 5.0}, "knn": {"p@1": p1}, "bert_knn": {"p@1": p1 - 2}}
        for r in ("P19", "P27", "P101")
    }
    macro = {c: {"p@1": relations["P19"][c]["p@1"]} for c in ("mlm", "knn", "bert_knn")}
    return {"relations": relations, "macro": macro}


def test_the_same_report_draws_the_same_svg_bytes(tmp_path: Path) -> None:
    first = relations_plot(_report(40.0), tmp_path / "a", title="t")
    second = relations_plot(_report(40.0), tmp_path / "b", title="t")
    assert [p.suffix for p in first] == [".png", ".svg"]
    svg_a, svg_b = first[1].read_bytes(), second[1].read_bytes()
    assert b"clip-path" in svg_a  # the ids that used to be random are there
    assert svg_a == svg_b
    assert first[0].read_bytes() == second[0].read_bytes()


def test_another_report_draws_another_svg(tmp_path: Path) -> None:
    a = relations_plot(_report(40.0), tmp_path / "a")[1].read_bytes()
    b = relations_plot(_report(60.0), tmp_path / "b")[1].read_bytes()
    assert a != b
