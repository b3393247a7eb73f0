"""`bert-knn serve --layout split`: API processes that send their forward passes to one model process answer as
the model run in one process does, and the service outlives either kind of process killed with SIGKILL."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from bertknn.builder.settings import AddSettings
from bertknn.builder.update import add_articles
from bertknn.service.pipeline import AnswerPipeline
from bertknn.service.results import Query
from tests.conftest import write_jsonl
from tests.integration.test_live_update import BRINDLE, TOKEN, UPDATE
from tests.integration.test_workers import ENV, ask, metric, served_versions, workers_of
from tests.support.processes import ServiceProcess, service_process

SPLIT = ("--workers", "2", "--layout", "split")
EAGER = {**ENV, "BERTKNN_MODEL__BACKEND": "eager"}  # the forward the pipeline below runs
QUESTIONS = [
    {"text": "zorblat was born in [MASK] ."},
    {"text": "quimby is a small [MASK] near the sea .", "k": 16},
    {"text": "[MASK] wrote many songs about rivers .", "top_k": 5},
    {"text": "zorblat was born in [MASK] .", "subject": "Zorblat"},
]


def model_pid(svc: ServiceProcess) -> int:
    """The model process now serving, as the parent recorded it in the run directory."""
    from bertknn.service.processes import RUN_DIR_ENV

    for pid in workers_of(svc.proc):
        env = dict(kv.split("=", 1) for kv in Path(f"/proc/{pid}/environ").read_text().split("\0") if "=" in kv)
        if RUN_DIR_ENV in env:
            return int((Path(env[RUN_DIR_ENV]) / "model.pid").read_text())
    raise AssertionError("no process of the service has its run directory")


def api_pids(svc: ServiceProcess, n: int, timeout_s: float = 120) -> list[int]:
    """The ``n`` API processes, once all of them are ready (the model process is a child of the parent too)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pids = [p for p in workers_of(svc.proc) if p != model_pid(svc)]
        if len(pids) == n and metric(svc.url, "bertknn_ready") == n:
            return pids
        time.sleep(0.2)
    raise AssertionError(f"{n} ready API processes expected")


def gone(pid: int, timeout_s: float = 30) -> None:
    """Wait until ``pid`` is dead and reaped (its sockets closed): a kill signal is delivered asynchronously."""
    deadline = time.monotonic() + timeout_s
    while Path(f"/proc/{pid}").exists():
        assert time.monotonic() < deadline, f"process {pid} still there"
        time.sleep(0.05)


def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of one process so far, all its threads (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def same_answers(got: httpx.Response, want: list[tuple[str, float, float]]) -> bool:
    """The same tokens in the same order, their p and p_MLM within float rounding (other batch shapes)."""
    have = [(p["token"], p["prob"], p["p_mlm"]) for p in got.json()["predictions"]]
    return [t for t, _, _ in have] == [t for t, _, _ in want] and all(
        abs(a - c) < 1e-5 and abs(b - d) < 1e-5 for (_, a, b), (_, c, d) in zip(have, want, strict=True))  # fmt: skip


def test_split_layout_answers_as_one_process_and_outlives_sigkill_of_either_process(ds: Path):
    pipe = AnswerPipeline.open(ds, device="cpu")
    want = [[(p.token, p.prob, p.p_mlm) for p in pipe.predict(Query(**q, retriever="tfidf")).predictions]
            for q in QUESTIONS]  # fmt: skip
    pipe.close()
    # a replacement model process imports torch and loads the model: on a slow host longer than the default
    # deadline, which would then (rightly) stop the requests that wait for it
    with service_process(ds, env={**EAGER, "BERTKNN_LIMITS__DEADLINE_MS": "60000"}, args=SPLIT) as svc:
        first_api = api_pids(svc, 2)
        for q, expected in zip(QUESTIONS, want, strict=True):
            answers = ask(svc.url, q, 4)
            assert all(same_answers(r, expected) for r in answers), (q, [r.json() for r in answers], expected)
        assert metric(svc.url, "bertknn_model_batch_rows_count") >= 1  # the model process's passes, counted
        # its CPU seconds: counted, and no more than the kernel says that process has used
        assert 0 < metric(svc.url, "bertknn_model_process_cpu_seconds_total") <= process_cpu_s(model_pid(svc))
        assert metric(svc.url, 'bertknn_requests_total{path="/predict",status="200"}') == 16
        # the model process by its name in `ps` and `top`, a thread per API process reading its asks
        assert Path(f"/proc/{model_pid(svc)}/comm").read_text().strip() == "bertknn-model"
        peers = [p.read_text().strip() for p in Path(f"/proc/{model_pid(svc)}/task").glob("*/comm")]
        assert sorted(n for n in peers if n.startswith("api-peer")) == ["api-peer-1", "api-peer-2"], peers

        model = model_pid(svc)
        os.kill(model, signal.SIGKILL)  # idle: nothing in flight, so no request may fail
        gone(model)
        answers = ask(svc.url, {"text": "quimby was born in [MASK] ."}, 10)
        assert [r.status_code for r in answers] == [200] * 10, [r.text for r in answers[:2]]  # they wait for the replacement
        assert model_pid(svc) != model

        os.kill(first_api[0], signal.SIGKILL)
        assert [r.status_code for r in ask(svc.url, QUESTIONS[0], 10)] == [200] * 10
        replaced = api_pids(svc, 2)
        assert first_api[0] not in replaced and first_api[1] in replaced
        assert all(same_answers(r, want[0]) for r in ask(svc.url, QUESTIONS[0], 3))


def test_split_layout_reload_switches_every_api_process(ds: Path, tmp_path: Path):
    with service_process(ds, env=ENV, args=SPLIT) as svc:
        api_pids(svc, 2)
        model = model_pid(svc)
        add_articles(AddSettings(datastore=ds, corpus=[write_jsonl(tmp_path / "u.jsonl", UPDATE)], device="cpu"))
        r = httpx.post(f"{svc.url}/admin/reload", headers={"Authorization": f"Bearer {TOKEN}"}, timeout=120)
        assert r.status_code == 200, r.text
        assert (r.json()["status"], r.json()["datastore"]["version"], r.json()["processes"]) == ("reloaded", 2, 2)
        assert sorted(served_versions(svc).values()) == [2, 2]
        after = ask(svc.url, BRINDLE, 10)
        assert {x.json()["predictions"][0]["token"] for x in after} == {"zandor"}
        assert model_pid(svc) == model  # a new datastore version, the same model process


def test_a_model_that_cannot_load_stops_the_split_layout_before_any_api_process(ds: Path, model: Path,
                                                                                  tmp_path: Path):  # fmt: skip
    broken = tmp_path / "broken-model"
    shutil.copytree(model, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    cmd = [sys.executable, "-m", "service", "--datastore", str(ds), "--model", str(broken), *SPLIT]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, **ENV})
    assert done.returncode == 2
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and "cannot load the masked LM" in last, done.stderr
    assert "Started parent process" not in done.stderr  # no API process was started


def test_split_layout_settings_that_need_the_model_in_the_serving_process_are_refused(ds: Path):
    for setting in ("--model-knn-device", "model"), ("--batching-on-event-loop",):
        cmd = [sys.executable, "-m", "service", "--datastore", str(ds), "--layout", "split", *setting]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env={**os.environ, **ENV})
        assert done.returncode == 2 and "layout split runs the model in a process of its own" in done.stderr


def test_every_process_of_the_service_logs_json_lines_that_name_it(ds: Path, tmp_path: Path):
    """``--log-format json``: each line of the supervisor, the API processes, the model process and uvicorn is one
    JSON object; a request's line carries its fields; ``role`` and ``pid`` say which process wrote it."""
    log = tmp_path / "service.log"
    with log.open("wb") as sink, service_process(
        ds, env=ENV, args=(*SPLIT, "--log-level", "info", "--log-format", "json"), stderr=sink
    ) as svc:
        apis, model = api_pids(svc, 2), model_pid(svc)
        answers = [httpx.post(f"{svc.url}/predict", json=QUESTIONS[0], headers={"X-Request-ID": f"json-{i}"},
                              timeout=30) for i in range(4)]  # fmt: skip
        assert {r.status_code for r in answers} == {200}
        supervisor = svc.proc.pid
    lines = [json.loads(line) for line in log.read_text().splitlines()]  # (a line that is not JSON fails here)
    roles = {(line.get("role"), line["pid"]) for line in lines}
    assert {("supervisor", supervisor), ("model", model)} <= roles and {("worker", p) for p in apis} <= roles
    uvicorn = [line for line in lines if line["logger"] == "uvicorn.error"]
    assert any(line["message"] == f"Started parent process [{supervisor}]" for line in uvicorn)
    assert {line["role"] for line in uvicorn} == {"supervisor", "worker"}
    requests = [line for line in lines if line["message"] == "request" and line["id"].startswith("json-")]
    assert sorted(line["id"] for line in requests) == [f"json-{i}" for i in range(4)]
    assert all(line["role"] == "worker" and line["pid"] in apis and line["status"] == 200 for line in requests)
    assert {"embedding", "retrieval", "knn", "interpolation", "total"} <= requests[0]["stages_ms"].keys()
    ready = [line for line in lines if line["message"] == "ready"]
    served = answers[0].json()["datastore"]["contexts"]
    assert len(ready) == 2 and {line["datastore"]["contexts"] for line in ready} == {served}
