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


def _pre_file(tmp_path: Path) -> Path:
    per_core = {"decompress_bytes_per_s": 25e6, "parse_bytes_per_s": 50e6, "markup_bytes_per_s": 5e6,
                "split_contexts_per_s": 1e5, "targets_contexts_per_s": 1e4, "write_bytes_per_s": 1e9}  # fmt: skip
    path = tmp_path / "preprocess.json"
    path.write_text(json.dumps({"per_core": per_core}))
    return path


def test_durations_are_written_as_the_docs_write_them() -> None:
    assert [capacity.shown(h) for h in (0.001, 0.72, 1.0, 2.94, 57.87, 115.7, 925.9)] == [
        "1 min", "43 min", "1.0 h", "2.9 h", "57.9 h", "116 h", "926 h"]  # fmt: skip


def test_the_tables_follow_from_the_measured_rates(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(common, "RESULTS", tmp_path / "results")
    gpu = _gpu_file(tmp_path, build=36_000.0, bare=72_000.0, per_context=1_600.0)
    pre = _pre_file(tmp_path)
    assert capacity.main(["--gpu", str(gpu), "--preprocess", str(pre), "--pods", "1,8", "--contexts", "2e9"]) == 0
    out = json.loads((tmp_path / "results" / "capacity.json").read_text())
    rows = {row["rate"]: row for row in out["hours"]}
    # 2e9 contexts at 36,000/s: 15.4 GPU hours; on 8 GPUs 1.9 h; the bare forward's twice the rate, half the time
    assert rows["Some GPU, the measured build"]["gpu_hours"] == "15.4"
    assert rows["Some GPU, the measured build"]["wall"] == {"1": "15.4 h", "8": "1.9 h"}
    assert rows["Some GPU, the measured bare forward"]["wall"] == {"1": "7.7 h", "8": "58 min"}
    assert rows["the paper"]["contexts_per_s"] == 300  # from published.json, not from the GPU file
    assert out["disk"]["shards"] == "3.20 TB (2.91 TiB)"
    b = out["building"]
    # 90e9 bytes of XML at 25 MB/s per core: 1.0 core-h; 2e9 contexts at 10,000/s per core: 55.6 core-h; writing
    # 2e9 x 1,600 bytes at 1 GB/s: 0.9 core-h
    assert b["core_hours"] == {"decompress": 1.0, "parse": 0.5, "markup": 5.0, "split": 5.6, "targets": 55.6,
                               "write": 0.9}  # fmt: skip
    assert (b["forward_gpu_hours"], b["forward_gpu_hours_bare"], b["workers_core_hours"]) == (15.4, 7.7, 66.1)
    # the workers' 66.1 core-h over the Job's 6 workers per GPU; reading: 1.5 core-h per slice, or the whole dump in each
    assert b["wall"]["1"] == {"embedding": "15.4 h", "preprocessing": "11.0 h", "reading_multistream": "1.5 h",
                              "reading_whole_dump": "1.5 h"}  # fmt: skip
    assert b["wall"]["8"] == {"embedding": "1.9 h", "preprocessing": "1.4 h", "reading_multistream": "11 min",
                              "reading_whole_dump": "1.5 h"}  # fmt: skip


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
    gpu = _gpu_file(tmp_path, build=36_000.0, bare=72_000.0, per_context=1_600.0)
    with pytest.raises(SystemExit):
        capacity.main(["--gpu", str(gpu), "--preprocess", str(tmp_path / "none.json")])
    assert "run `python -m bench.preprocess` first" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("gpu", "pre", "says"),
    [
        ("{}", None, "no builder_bfloat16 run"),
        ('{"builder_bfloat16": {"runs": [{"embed_span_ctx_per_s": 1}]}}', None, "lacks 'bare_forward_ctx_per_s'"),
        ("not json", None, "not a readable JSON results file"),
        (None, '{"per_core": {"split_contexts_per_s": 1}}', "per_core lacks a positive decompress_bytes_per_s"),
        (None, '{"per_core": {"markup_bytes_per_s": 0}}', "markup_bytes_per_s"),
        (None, "[1, 2]", "a JSON object was expected"),
    ],
)
def test_a_malformed_results_file_gets_one_line_naming_what_is_missing(tmp_path: Path, gpu: str | None,
                                                                        pre: str | None, says: str) -> None:
    """A GPU or preprocess file without what the tables need stops with a message, not a traceback."""
    gpu_path = _gpu_file(tmp_path, build=36_000.0, bare=72_000.0, per_context=1_600.0)
    pre_path = _pre_file(tmp_path)
    if gpu is not None:
        gpu_path.write_text(gpu)
    if pre is not None:
        pre_path.write_text(pre)
    with pytest.raises(SystemExit, match=says):
        capacity.main(["--gpu", str(gpu_path), "--preprocess", str(pre_path)])
