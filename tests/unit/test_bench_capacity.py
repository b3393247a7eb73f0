"""``python -m bench.capacity``: the build's arithmetic from a GPU run's measured rates, as the docs quote it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import bench.capacity as capacity
from bench import common


def _gpu_file(tmp_path: Path, build: float, bare: float, per_context: float) -> Path:
    run = {"embed_span_ctx_per_s": build, "bare_forward_ctx_per_s": bare, "bytes_per_context_dir": per_context}
    path = tmp_path / "gpu.json"
    path.write_text(json.dumps({"device": "Some GPU", "builder_bfloat16": {"runs": [run]}}))
    return path


def test_durations_are_written_as_the_docs_write_them() -> None:
    assert [capacity.shown(h) for h in (0.001, 0.72, 1.0, 2.94, 57.87, 115.7, 925.9)] == [
        "1 min", "43 min", "1.0 h", "2.9 h", "57.9 h", "116 h", "926 h"]  # fmt: skip


def test_the_tables_follow_from_the_measured_rates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    gpu = _gpu_file(tmp_path, build=36_000.0, bare=72_000.0, per_context=1_600.0)
    assert capacity.main(["--gpu", str(gpu), "--pods", "1,8", "--contexts", "2e9"]) == 0
    out = json.loads((tmp_path / "results" / "capacity.json").read_text())
    rows = {row["rate"]: row for row in out["hours"]}
    # 2e9 contexts at 36,000/s: 15.4 GPU hours; on 8 GPUs 1.9 h; the bare forward's twice the rate, half the time
    assert rows["Some GPU, the measured build"]["gpu_hours"] == "15.4"
    assert rows["Some GPU, the measured build"]["wall"] == {"1": "15.4 h", "8": "1.9 h"}
    assert rows["Some GPU, the measured bare forward"]["wall"] == {"1": "7.7 h", "8": "58 min"}
    assert rows["the paper"]["contexts_per_s"] == 300  # from published.json, not from the GPU file
    assert out["disk"]["shards"] == "3.20 TB (2.91 TiB)"


def test_a_missing_or_empty_gpu_run_is_named(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        capacity.main(["--gpu", str(tmp_path / "nothing.json")])
    assert "run `python -m bench.gpu` on a GPU first" in capsys.readouterr().err
    empty = tmp_path / "gpu.json"
    empty.write_text(json.dumps({"builder_bfloat16": {"runs": []}}))
    with pytest.raises(SystemExit, match="no builder_bfloat16 run"):
        capacity.main(["--gpu", str(empty)])
    with pytest.raises(SystemExit):
        capacity.main(["--pods", "eight"])
