"""bench.bert_base (a model in bert-base-uncased's shape, for timings) and where benchmarks write other models' results."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import BertConfig

from bench.bert_base import BERT_BASE, TOKENIZER, make
from bench.common import PROXY_MODEL, result_name
from bertknn.core.encoder import MaskedLMEncoder


def test_the_shape_is_bert_base_uncased() -> None:
    # BertConfig's defaults are bert-base-uncased's configuration
    defaults = BertConfig()
    assert {k: getattr(defaults, k) for k in BERT_BASE} == BERT_BASE


def test_make_writes_a_loadable_model_with_the_real_tokenizer(tmp_path: Path) -> None:
    small = {**BERT_BASE, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 2, "intermediate_size": 64}
    out = make(tmp_path / "m", shape=small)
    assert (out / "vocab.txt").read_bytes() == (TOKENIZER / "vocab.txt").read_bytes()
    enc = MaskedLMEncoder.load(str(out), device="cpu", dtype="float32")
    assert (enc.num_layers, enc.layer, enc.hidden_size, enc.vocab_size) == (3, 2, 32, 30522)
    got = enc.encode([enc.query_input("albert einstein was born in [MASK] .")], with_mlm=True)
    assert got.embeddings.shape == (1, 32) and got.mlm_log_probs is not None
    assert got.mlm_log_probs.shape == (1, 30522)
    before = (out / "model.safetensors").stat().st_mtime_ns
    assert make(out, shape=small) == out and (out / "model.safetensors").stat().st_mtime_ns == before  # reused
    assert not (tmp_path / "m.partial").exists()


def test_other_models_results_do_not_overwrite_the_proxys() -> None:
    assert result_name("serving", PROXY_MODEL) == "serving"
    assert result_name("serving", "runs/bert-base-shaped") == "serving-bert-base-shaped"


def test_bench_gpu_without_a_device_says_so_in_one_line_with_its_own_exit_code() -> None:
    import subprocess
    import sys

    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: there bench.gpu measures instead of refusing")
    repo = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-m", "bench.gpu"], capture_output=True, text=True, timeout=120, cwd=repo)
    assert run.returncode == 3, run.stderr
    lines = [line for line in run.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "no CUDA device" in lines[0], run.stderr


def test_bench_gpu_times_the_planned_ivfpq_training() -> None:
    """The IVF-PQ part of bench.gpu, on a size this machine trains in seconds (on the CPU: faiss-cpu here)."""
    from bench.gpu import time_ivfpq_training

    got = time_ivfpq_training(20_000, 16)
    assert got["on"] == "cpu" and got["nlist"] == 512 and got["train_rows"] == 20_000  # the plan for 20,000 rows
    assert isinstance(got["train_s"], float) and got["train_s"] >= 0


def test_bench_gpu_tabulates_its_measured_report() -> None:
    """The table that docs/performance.md takes, from the report bench.gpu wrote on a GPU (bench/results)."""
    import json

    from bench.common import RESULTS
    from bench.gpu import gpu_table

    report = json.loads((RESULTS / "gpu.json").read_text())
    table = gpu_table(report).splitlines()
    assert table[0].startswith(report["device"]) and table[2] == "| figure | value |"
    runs = report["builder_bfloat16"]["runs"]
    assert sum("| builder bfloat16, budget" in row for row in table) == len(runs)
    first = runs[0]
    rates = f"{first['build_ctx_per_s']:,.0f} / {first['embed_span_ctx_per_s']:,.0f} / {first['bare_forward_ctx_per_s']:,.0f}"
    assert any(rates in row for row in table)
    shapes = [row for row in table if row.startswith("| builder forward on a new batch shape")]
    assert len(shapes) == sum(isinstance(v, dict) for v in report["new_shapes"].values()) == 3
    older = {**report["builder_bfloat16"], "runs": [{k: v for k, v in first.items() if k != "embed_span_ctx_per_s"}]}
    assert " / n/a / " in gpu_table({**report, "builder_bfloat16": older})  # a report from before that rate
    assert sum("/predict uncached p50" in row for row in table) == len(report["serving"]["clients"])
    broken = gpu_table({**report, "serving": {"error": "Command '...' returned non-zero exit status 1."}})
    assert "- serving: Command" in broken and "/predict" not in broken


def test_bench_gpu_refuses_a_stage_it_does_not_have() -> None:
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-m", "bench.gpu", "--only", "serving,warp"], capture_output=True,
                         text=True, timeout=120, cwd=repo)  # fmt: skip
    assert run.returncode == 2 and "no stage warp" in run.stderr


def test_every_stage_bench_gpu_runs_can_be_asked_for_and_the_documented_lease_command_is_accepted() -> None:
    """The lease's one command names its stages with --only: a name the parser refuses would spend a lease on a
    usage error, so the command as the docs write it must get as far as the device check."""
    import importlib
    import re
    import subprocess
    import sys

    import torch

    from bench import gpu

    args = gpu.build_parser().parse_args([])
    commands = gpu._stage_commands(args)
    assert list(commands) == list(gpu.STAGES)
    for name, cmd in commands.items():  # each stage's own command line parses in its module's parser
        assert cmd[1] == "-m", name
        importlib.import_module(cmd[2]).build_parser().parse_args(cmd[3:])
    repo = Path(__file__).resolve().parents[2]
    documented = set()
    for doc in ("docs/performance.md", "docs/decisions/cuda-graphs.md"):
        text = " ".join((repo / doc).read_text().split())
        documented |= set(re.findall(r"gpu_lease\.sh --only ([a-z0-9_,]+)", text))
    assert documented, "no lease command found in the docs"
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: there bench.gpu would run the stages")
    for only in documented:
        run = subprocess.run([sys.executable, "-m", "bench.gpu", "--only", only], capture_output=True, text=True,
                             timeout=120, cwd=repo)  # fmt: skip
        assert run.returncode == gpu.NO_DEVICE, f"--only {only}: {run.stderr}"


def test_bench_builder_times_the_build_from_its_first_batch_to_its_last() -> None:
    """bench.builder's recording encoder: every batch kept, the forward's time summed, and the span from the first
    batch asked to the last batch's rows taken (the rate a long build runs at, its start left out)."""
    import time

    import numpy as np

    from bench.builder import RecordingEncoder

    class Slow:
        def encode_async(self, items):  # type: ignore[no-untyped-def]
            time.sleep(0.01)
            return lambda: np.zeros((len(items), 2), np.float16)

    rec = RecordingEncoder(Slow())  # type: ignore[arg-type]
    assert rec.first_start is None
    t0 = time.perf_counter()
    first = rec.encode_async([1, 2])  # type: ignore[list-item]
    time.sleep(0.02)  # the build's own work between batches counts in the span, not in the forward's time
    second = rec.encode_async([3])  # type: ignore[list-item]
    assert first().shape == (2, 2) and second().shape == (1, 2)
    assert rec.first_start is not None and t0 <= rec.first_start < rec.last_end <= time.perf_counter()
    assert len(rec.batches) == 2 and 0.02 <= rec.seconds < rec.last_end - rec.first_start


def test_bench_reports_name_the_host_cpu_and_its_interpreter_speed() -> None:
    """Every benchmark's `machine` record tells two hosts of one machine kind apart: the CPU's model name and the
    time of a fixed Python loop (the host speed that bounds per-request overhead)."""
    from bench.common import machine, python_loop_ms

    m = machine()
    assert m["cpu_model"] is None or (isinstance(m["cpu_model"], str) and m["cpu_model"])
    assert isinstance(m["python_loop_ms"], float) and m["python_loop_ms"] > 0
    assert python_loop_ms(20_000) < python_loop_ms(400_000)  # it measures the work, not a constant


def test_bench_gpu_times_the_cuda_graphs_stage_in_a_cpu_rehearsal(tiny_model_dir: Path) -> None:
    """The ``cuda_graphs`` stage end to end on the CPU, with a capture that replays by running the forward: every
    batch size timed both ways, outputs equal, its buckets listed, and its rows in the table."""
    from bench.gpu import gpu_table, time_graphs
    from tests.unit.test_graphs import replaying_capture

    calls: list[int] = []
    got = time_graphs(tiny_model_dir, rows=(1, 3), calls=3, device="cpu", dtype="float32",
                      capture=replaying_capture(calls))  # fmt: skip
    # every row bucket (the largest is max_rows) at the two widths use_graphs warms, before any timed call
    assert got["captured"] is True and got["buckets_captured"] == {f"{r}x{w}": True for r in (1, 2, 3) for w in (16, 32)}
    assert isinstance(got["start_up_s"], float) and got["start_up_s"] > 0
    for n in (1, 3):
        r = got[f"rows_{n}"]
        assert isinstance(r, dict) and r["eager_ms_p50"] > 0 and r["graphs_ms_p50"] > 0 and r["max_relative_difference"] < 1e-4
    import json

    from bench.common import RESULTS

    table = gpu_table({**json.loads((RESULTS / "gpu.json").read_text()), "cuda_graphs": got})
    assert sum("eager / CUDA graphs" in row for row in table.splitlines()) == 2
    assert f"captured at start-up (every row bucket up to 3 questions, 16 and 32 tokens) | {got['start_up_s']} s" in table


def test_the_lease_script_runs_bench_gpu_and_keeps_its_log(tmp_path: Path) -> None:
    """scripts/gpu_lease.sh as a lease runs it, the install left out (the carried wheels are for the device's
    Python): bench.gpu runs with the arguments given, its log lands in $OUT, and without CUDA it exits 3."""
    import os
    import subprocess
    import sys

    import torch

    repo = Path(__file__).resolve().parents[2]
    env = {**os.environ, "GPU_LEASE_INSTALL": "0", "PYTHON": sys.executable, "OUT": str(tmp_path)}
    run = subprocess.run(["bash", "scripts/gpu_lease.sh", "--only", "cuda_graphs"], cwd=repo, env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    log = (tmp_path / "bench-gpu.log").read_text()
    if torch.cuda.is_available():
        assert run.returncode == 0 and (tmp_path / "gpu.json").is_file(), run.stdout[-2000:]
    else:
        assert run.returncode == 3 and "no CUDA device on this machine" in log
    assert f"bench.gpu exited {run.returncode}; results in {tmp_path}" in run.stdout


def test_bench_gpu_times_the_device_knn_stage_in_a_cpu_rehearsal() -> None:
    """The ``device_knn`` stage end to end on the CPU: both ways timed per batch, the same neighbours, its rows in
    the table."""
    import json

    from bench.common import RESULTS
    from bench.gpu import gpu_table
    from bench.knn_batch import time_device_knn

    got = time_device_knn(rows=(40, 300), batches=(1, 3), hidden=32, k=16, calls=2, device="cpu")
    keys = [k for k in got if k.startswith("rows_")]
    assert keys == ["rows_40_batch_1", "rows_40_batch_3", "rows_300_batch_1", "rows_300_batch_3"]
    for key in keys:
        r = got[key]
        assert isinstance(r, dict) and r["same_neighbours"] is True and r["device_ms_p50"] > 0 and r["host_ms_p50"] > 0
        # the ratio of the unrounded times: within what rounding each to 0.001 ms leaves (a 0.05 ms time moves 1%)
        res, host, half = r["resident_ms_p50"], r["host_ms_p50"], 0.0005
        assert res > 0 and (res - half) / (host + half) - half <= r["resident_over_host"] <= (res + half) / (host - half) + half
    table = gpu_table({**json.loads((RESULTS / "gpu.json").read_text()), "device_knn": got})
    assert sum("restricted kNN of" in row and "kept there" in row for row in table.splitlines()) == 4


def test_bench_gpu_times_the_device_vote_stage_in_a_cpu_rehearsal(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The ``device_vote`` stage on the CPU: both ways timed per batch size, the same answers, its rows in the
    table; ``python -m bench.vote_batch`` writes its file for the device it ran on and refuses a bad argument."""
    import functools
    import json

    import bench.common as common
    import bench.vote_batch as vote_batch
    from bench.common import RESULTS
    from bench.gpu import gpu_table

    got = vote_batch.time_device_vote(batches=(1, 4), vocab=3000, k=32, calls=2, device="cpu")
    for key in ("batch_1", "batch_4"):
        r = got[key]
        assert isinstance(r, dict) and r["same_answers"] is True and r["device_ms_p50"] > 0 and r["host_ms_p50"] > 0
    table = gpu_table({**json.loads((RESULTS / "gpu.json").read_text()), "device_vote": got})
    assert sum("vote, interpolation and top-k of" in row for row in table.splitlines()) == 2
    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(vote_batch, "time_device_vote",
                        functools.partial(vote_batch.time_device_vote, batches=(2,), vocab=2500, k=16))  # fmt: skip
    assert vote_batch.main(["--device", "cpu", "--calls", "2"]) == 0
    data = json.loads((tmp_path / "vote-batch-cpu.json").read_text())
    assert data["device"] == "cpu" and data["batch_2"]["same_answers"] is True
    with pytest.raises(SystemExit):
        vote_batch.main(["--calls", "0"])


def test_bench_gpu_reads_back_only_what_the_stage_itself_wrote(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A serving stage's file is told from the one-process stage's by name, and an older run's file (one written
    before the stage started) is never read back as this run's: the stage is then recorded as failed."""
    import json
    import os
    import time

    import bench.gpu as gpu

    monkeypatch.setattr(gpu, "RESULTS", tmp_path)
    model = Path("runs/bert-base-shaped")
    default, one = tmp_path / "serving-cuda-bert-base-shaped.json", tmp_path / "serving-cuda-1w-bert-base-shaped.json"
    default.write_text(json.dumps({"workers": "auto"}))
    one.write_text(json.dumps({"workers": 1}))
    (tmp_path / "serving-cuda-knn-model-bert-base-shaped.json").write_text(json.dumps({"knn_device": "model"}))
    (tmp_path / "serving-cuda-knn-model-vote-model-bert-base-shaped.json").write_text(json.dumps({"vote_device": "model"}))
    (tmp_path / "serving-cuda-loop-bert-base-shaped.json").write_text(json.dumps({"on_event_loop": True}))
    since = time.time() - 1
    assert gpu._stage_result("serving", model, since) == {"workers": "auto"}
    assert gpu._stage_result("serving_one_process", model, since) == {"workers": 1}
    assert gpu._stage_result("serving_device_knn", model, since) == {"knn_device": "model"}
    assert gpu._stage_result("serving_device_vote", model, since) == {"vote_device": "model"}
    assert gpu._stage_result("serving_event_loop", model, since) == {"on_event_loop": True}
    os.utime(one, (since - 3600, since - 3600))  # left by an earlier lease: this run's one-process stage wrote nothing
    with pytest.raises(ValueError, match="wrote no result"):
        gpu._stage_result("serving_one_process", model, since)
    assert gpu._stage_result("serving", model, since) == {"workers": "auto"}
    with pytest.raises(ValueError, match="wrote no result"):
        gpu._stage_result("cuda_graphs", model, since)


def test_bench_gpu_runs_the_stages_in_the_order_only_names_them(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lease may end before its last stage: the lease command lists the stages that matter most first, and
    they run in that order; each one's result is written as it ends."""
    import json
    import subprocess

    import bench.gpu as gpu

    ran: list[str] = []

    def fake_run(cmd: list[str], **kwargs: object) -> None:
        ran.append(next(n for n, c in gpu._stage_commands(args).items() if c == cmd))

    monkeypatch.setattr(gpu, "RESULTS", tmp_path)
    monkeypatch.setattr(subprocess, "run", fake_run)
    monkeypatch.setattr(gpu, "_stage_result", lambda name, model, since: {"stage": name})
    args = gpu.build_parser().parse_args(["--only", "serving,steps,cuda_graphs,serving,device_vote"])
    out: dict = {"device": "a device", "driver": "1", "torch_cuda": "13", "model": "m", "machine": {"torch": "2", "cores": 2}}
    gpu.run_stages(args, out)
    assert ran == ["serving", "steps", "cuda_graphs", "device_vote"]  # a repeated name runs once
    assert list(json.loads((tmp_path / "gpu.json").read_text())["stage_seconds"]) == ran
    assert (tmp_path / "gpu.md").read_text().startswith("a device, driver 1")  # the table of the stages done
    ran.clear()
    gpu.run_stages(gpu.build_parser().parse_args(["--ivfpq-rows", "0"]), out)
    assert ran == [s for s in gpu.STAGES if s != "ivfpq_training"]


def test_bench_gpu_tabulates_each_serving_stage_under_its_processes() -> None:
    import json

    from bench.common import RESULTS
    from bench.gpu import gpu_table

    report = json.loads((RESULTS / "gpu.json").read_text())
    serving = {**report["serving"], "workers": "auto"}
    table = gpu_table({**report, "serving": serving, "serving_one_process": {**serving, "workers": 1},
                       "serving_device_knn": {**serving, "knn_device": "model"},
                       "serving_device_vote": {**serving, "vote_device": "model"}})  # fmt: skip
    clients = len(serving["clients"])
    assert sum("/predict uncached p50 / p99, auto processes," in row for row in table.splitlines()) == clients
    assert sum("/predict uncached p50 / p99, one process," in row for row in table.splitlines()) == clients
    assert sum("/predict uncached p50 / p99, kNN on the device," in row for row in table.splitlines()) == clients
    assert sum("/predict uncached p50 / p99, kNN and vote on the device," in row for row in table.splitlines()) == clients


def test_bench_serving_refuses_more_distinct_questions_than_lama_has() -> None:
    import subprocess
    import sys

    repo = Path(__file__).resolve().parents[2]
    run = subprocess.run([sys.executable, "-m", "bench.serving", "--concurrency", "64", "--per-client", "500"],
                         capture_output=True, text=True, timeout=120, cwd=repo)  # fmt: skip
    assert run.returncode == 2 and "distinct questions" in run.stderr and "ask for fewer" in run.stderr


def test_bench_knn_batch_writes_its_figures_for_the_device_it_ran_on(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``python -m bench.knn_batch``: its result file named for the device, one row per shape, and a refused
    argument says what to fix."""
    import functools
    import json

    import bench.common as common
    import bench.knn_batch as knn_batch

    monkeypatch.setattr(common, "RESULTS", tmp_path)
    monkeypatch.setattr(knn_batch, "time_device_knn",
                        functools.partial(knn_batch.time_device_knn, rows=(30,), batches=(1, 2), hidden=16, k=8))  # fmt: skip
    assert knn_batch.main(["--device", "cpu", "--calls", "2"]) == 0
    data = json.loads((tmp_path / "knn-batch-cpu.json").read_text())
    assert data["threads"] == 1 and data["device"] == "cpu" and data["machine"]["cores"]
    assert {k for k in data if k.startswith("rows_")} == {"rows_30_batch_1", "rows_30_batch_2"}
    assert all(data[k]["same_neighbours"] for k in ("rows_30_batch_1", "rows_30_batch_2"))
    with pytest.raises(SystemExit):
        knn_batch.main(["--calls", "0"])


def test_bench_serving_gives_several_processes_one_redis_cache() -> None:
    """Several service processes share a redis-server of the run's own (a question one process answered is a hit
    in the other), stopped after; one process keeps its in-process cache."""
    import redis

    from bench.serving import _cache_for

    env: dict[str, str] = {}
    with _cache_for(False, env):
        assert env == {}
    with _cache_for(True, env):
        client = redis.Redis.from_url(env["BERTKNN_CACHE__REDIS_URL"])
        assert client.ping()
    with pytest.raises(redis.ConnectionError):
        client.ping()


def test_bench_serving_reads_the_device_knns_share_from_the_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the kNN on the device, a throughput level records how many of its questions were searched there and
    how many rows the service kept there, from the service's own /metrics."""
    import types

    import bench.serving as serving

    pages = iter([
        'bertknn_stage_seconds_sum{stage="knn"} 1.0\nbertknn_stage_seconds_count{stage="knn"} 10.0\n'
        'bertknn_knn_on_device_total{outcome="searched"} 4.0\nbertknn_knn_on_device_total{outcome="failed"} 0.0\n'
        "bertknn_knn_device_rows 2019.0\n",
        'bertknn_stage_seconds_sum{stage="knn"} 1.5\nbertknn_stage_seconds_count{stage="knn"} 20.0\n'
        'bertknn_knn_on_device_total{outcome="searched"} 13.0\nbertknn_knn_on_device_total{outcome="failed"} 1.0\n'
        'bertknn_vote_on_device_total{outcome="voted"} 7.0\nbertknn_vote_on_device_total{outcome="failed"} 0.0\n'
        "bertknn_knn_device_rows 2019.0\n",
    ])
    monkeypatch.setattr(serving.httpx, "get", lambda url, timeout: types.SimpleNamespace(text=next(pages)))
    before, after = serving.scrape_stages("http://x"), serving.scrape_stages("http://x")
    got = serving.stage_means(before, after)
    assert got == {"knn": 50.0, "knn_on_device_searched": 9.0, "knn_on_device_failed": 1.0, "knn_device_rows": 2019.0,
                   "vote_on_device_voted": 7.0, "vote_on_device_failed": 0.0}  # (counters new since `before`)
    host = serving.stage_means({"stage:knn:sum": 1.0, "stage:knn:count": 1.0}, {"stage:knn:sum": 2.0, "stage:knn:count": 2.0})
    assert host == {"knn": 1000.0}  # the host's search: no device figures


def test_bench_serving_reports_the_split_layout_s_model_process_load(monkeypatch: pytest.MonkeyPatch) -> None:
    """A level's model-process CPU comes from its metric's difference across the level: per answered request and
    as cores kept busy, tabulated by `bench.gpu`; the full layout (no such metric) reports neither."""
    import bench.serving as serving
    from bench.gpu import _serving_rows

    pages = iter([
        "bertknn_model_batch_rows_sum 10.0\nbertknn_model_batch_rows_count 5.0\n"
        "bertknn_model_process_cpu_seconds_total 2.5\n",
        "bertknn_model_batch_rows_sum 90.0\nbertknn_model_batch_rows_count 10.0\n"
        "bertknn_model_process_cpu_seconds_total 4.0\n",
    ])  # fmt: skip
    monkeypatch.setattr(serving.httpx, "get", lambda *a, **k: type("R", (), {"text": next(pages)})())
    means = serving.stage_means(serving.scrape_stages("http://x"), serving.scrape_stages("http://x"))
    assert means["rows_per_model_pass"] == 16.0 and means["model_process_cpu_s"] == 1.5
    load = serving.model_process_load(means.pop("model_process_cpu_s"), ok=500, secs=2.0)
    assert load == {"model_process_cpu_ms_per_request": 3.0, "model_process_busy_cores": 0.75}
    assert serving.model_process_load(None, ok=500, secs=2.0) == {}
    level = {"requests_per_s": 250.0, "bare_batched_per_s": 900.0, "errors": 0, "server_cpu_ms_per_request": 9.0,
             **load}  # fmt: skip
    rows = _serving_rows({"dtype": "bfloat16", "clients": {"raw": {"throughput": {"64": level}}}}, "split")
    assert "| - the model process: CPU per request, cores busy (split, 64 raw clients) | 3.00 ms, 0.75 |" in rows


def test_bench_serving_sets_the_service_batch_size_beside_the_clients_count(capsys: pytest.CaptureFixture[str]) -> None:
    """A throughput level is compared with the bare forward twice: in batches of one per client, and in batches
    of the size the service itself formed (its mean rows per batch, rounded); the report prints both."""
    from bench.serving import _report, service_batch_rows

    assert service_batch_rows({"rows_per_batch": 15.9}, 32) == 16
    assert service_batch_rows({"rows_per_batch": 0.3}, 8) == 1  # never a batch of none
    assert service_batch_rows({}, 32) == 32  # no metrics: the clients' count
    level = {"requests": 768, "requests_per_s": 75.0, "errors": 0, "bare_batched_per_s": 80.0, "ratio": 0.9375,
             "service_batch_rows": 16, "bare_at_service_batch_per_s": 70.0, "ratio_at_service_batch": 75.0 / 70.0,
             "server_cpu_ms_per_request": 15.4, "load_generator_cpu_ms_per_request": 0.1}  # fmt: skip
    older = {k: v for k, v in level.items() if "service_batch" not in k}  # a report from before the second figure
    result = {"model": "m", "datastore": {"contexts": 10}, "machine": {}, "device": "cpu", "dtype": "float32",
              "bare_forward_ms": {"p50": 38.0}, "bare_forward_eager_ms": {"p50": 70.0},
              "clients": {"raw": {"throughput": {32: level}}, "httpx": {"throughput": {32: older}}}}  # fmt: skip
    _report(result, "onnx", 1)
    lines = capsys.readouterr().out.splitlines()
    assert "the bare forward in the service's batch size (16 rows): 70.0/s -> 1.07x" in lines[3]
    assert sum("service's batch size" in line for line in lines) == 1
    assert "[raw client] clients  32: 75.0 req/s vs bare batched 80.0/s -> 0.94x" in lines[2]


def test_bench_gpu_shows_the_bare_forward_in_the_service_batch_size_where_the_report_has_it() -> None:
    import copy
    import json

    from bench.common import RESULTS
    from bench.gpu import gpu_table

    report = json.loads((RESULTS / "gpu.json").read_text())
    assert "service's batch size" not in gpu_table(report)  # that lease's report predates the figure
    newer = copy.deepcopy(report)
    client = next(iter(newer["serving"]["clients"].values()))
    level, t = next(iter(client["throughput"].items()))
    t.update(service_batch_rows=12, bare_at_service_batch_per_s=1234.4)
    rows = [r for r in gpu_table(newer).splitlines() if "service's batch size" in r]
    assert len(rows) == 1 and rows[0].endswith("12 rows) | 1,234/s |") and f"{level} " in rows[0]
