"""``python -m bench`` lists every benchmark a user runs, one line each, with its last recorded duration."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import bench.__main__ as listing

BENCH = Path(listing.__file__).parent
HELPERS = {"common", "rawhttp", "abuse", "steps_probe"}  # imported or started by the benchmarks, not run by a user


def _runnable() -> set[str]:
    modules = {p.stem for p in BENCH.glob("*.py") if "__main__" in p.read_text(encoding="utf-8")}
    packages = {p.parent.name for p in BENCH.glob("*/__main__.py")}
    return (modules | packages) - {"__main__"} - HELPERS


def test_every_runnable_benchmark_is_listed_and_every_listed_one_exists() -> None:
    assert {b.name for b in listing.BENCHMARKS} == _runnable()


def test_one_line_each(capsys: pytest.CaptureFixture[str]) -> None:
    assert listing.main([]) == 0
    out = capsys.readouterr().out.splitlines()
    for b in listing.BENCHMARKS:
        rows = [line for line in out if re.match(rf"\s+python -m bench\.{b.name}\s", line)]
        assert len(rows) == 1, b.name
        assert listing.summary(b.name) in rows[0]


def test_the_duration_is_the_kept_run_s_wall_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(listing, "RESULTS", tmp_path)
    assert listing.duration(listing.last_run_s("serving*.json")) == "not recorded"
    (tmp_path / "serving.json").write_text(json.dumps({"wall_s": 95.2}))
    (tmp_path / "serving-bert-base-shaped.json").write_text(json.dumps({"wall_s": 610.0}))
    assert listing.duration(listing.last_run_s("serving*.json")) == "10 min"
    (tmp_path / "quality.json").write_text(json.dumps({"timings_s": {"build": 40.0, "eval": 2.5}}))
    assert listing.duration(listing.last_run_s("quality.json")) == "42 s"


def test_write_result_records_the_wall_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import bench.common as common

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    data = json.loads(common.write_result("x", {"a": 1}).read_text())
    assert data["a"] == 1 and 0 < data["wall_s"] < 24 * 3600
    assert json.loads(common.write_result("y", {"wall_s": 3.0}).read_text())["wall_s"] == 3.0


def test_arguments_are_refused_with_a_hint(capsys: pytest.CaptureFixture[str]) -> None:
    assert listing.main(["serving"]) == 2
    assert "python -m bench.NAME" in capsys.readouterr().err
