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


def test_a_result_records_the_command_and_the_commit_that_made_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess

    import bench.common as common

    tree = tmp_path / "tree"
    (tree / "bench" / "results").mkdir(parents=True)

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(tree), *args], check=True, capture_output=True, text=True).stdout

    git("init", "-q")
    (tree / "a.py").write_text("x = 1\n")
    (tree / "bench" / "results" / "x.json").write_text("{}\n")  # a result committed before, which the run rewrites
    git("add", "a.py", "bench/results/x.json")
    git("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-qm", "a")
    head = git("rev-parse", "--short=12", "HEAD").strip()
    monkeypatch.setattr(common, "REPO", tree)
    monkeypatch.setattr(common, "RESULTS", tree / "bench" / "results")
    monkeypatch.setattr(common.sys, "orig_argv", ["/venv/bin/python", "-m", "bench.x", "--name", "two words"])
    monkeypatch.setenv("BERT_KNN_SOURCE", "from-the-pack")
    data = json.loads(common.write_result("x", {"a": 1}).read_text())
    assert data["command"] == "python -m bench.x --name 'two words'" and data["source"] == head
    # a rewritten result is no change to the source; an edited tracked file is, and is said
    assert common.source_commit() == head
    (tree / "a.py").write_text("x = 2\n")
    assert common.source_commit() == head + "+changes"
    # what the payload says itself wins (bench.retrieval records its own command)
    assert json.loads(common.write_result("y", {"command": "mine"}).read_text())["command"] == "mine"
    # no git checkout (a lent GPU machine's copy): the commit scripts/gpu_pack.sh recorded
    monkeypatch.setattr(common, "REPO", tmp_path / "copy")
    (tmp_path / "copy").mkdir()
    monkeypatch.setenv("GIT_CEILING_DIRECTORIES", str(tmp_path))
    assert common.source_commit() == "from-the-pack"
    monkeypatch.delenv("BERT_KNN_SOURCE")
    assert common.source_commit() is None


# JSON that benchmarks write for themselves, not results: bench.gpu's per-stage reports (merged into gpu.json), the
# steps probe's events (read back by bench.steps), bench.quality's record of what a kept datastore was built from
NOT_RESULTS = {"bench/gpu.py": "_report(", "bench/steps_probe.py": "json.dump(EVENTS", "bench/quality/__main__.py": "marker."}


def test_every_results_file_is_written_with_what_made_it() -> None:
    """A results file is written through `bench.common.write_json` (its command line and commit with it): no
    benchmark writes JSON by itself, except the files named in ``NOT_RESULTS``."""
    found = []
    for path in sorted(BENCH.rglob("*.py")):
        rel = path.relative_to(BENCH.parent).as_posix()
        if rel == "bench/common.py":
            continue
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if re.search(r"json\.dump\(|write_text\(json\.dumps", line) and NOT_RESULTS.get(rel, "\0") not in line:
                found.append(f"{rel}:{number}")
    assert found == []


def test_arguments_are_refused_with_a_hint(capsys: pytest.CaptureFixture[str]) -> None:
    assert listing.main(["serving"]) == 2
    assert "python -m bench.NAME" in capsys.readouterr().err
