"""bench.stages: every thread of the second service pinned; the stages' sum set beside the service's CPU."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from bench import stages


def _allowed(pid: int) -> dict[int, str]:
    out = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        status = Path(f"/proc/{pid}/task/{tid}/status").read_text()
        out[int(tid)] = next(line.split(":", 1)[1].strip() for line in status.splitlines()
                             if line.startswith("Cpus_allowed_list"))  # fmt: skip
    return out


def test_pin_threads_pins_every_thread_of_a_running_process_and_those_it_starts_later() -> None:
    script = ("import sys, threading, time\n"
              "[threading.Thread(target=time.sleep, args=(60,), daemon=True).start() for _ in range(3)]\n"
              "sys.stdin.readline()\n"
              "threading.Thread(target=time.sleep, args=(60,), daemon=True).start()\n"
              "time.sleep(60)\n")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 30
        while len(os.listdir(f"/proc/{proc.pid}/task")) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        core = max(os.sched_getaffinity(0))
        assert stages.pin_threads(proc.pid, {core}) == 4
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
        while len(os.listdir(f"/proc/{proc.pid}/task")) < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
        allowed = _allowed(proc.pid)
        assert len(allowed) == 5 and set(allowed.values()) == {str(core)}
    finally:
        proc.kill()
        proc.wait()


def test_the_service_s_cpu_less_the_stages_is_the_rest_and_the_pinned_service_is_compared(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    written: dict[str, Any] = {}
    pinned: list[int] = []
    asked: dict[str, Any] = {}

    @contextlib.contextmanager
    def service(ds: Path, env: dict[str, str]) -> Any:
        yield type("Svc", (), {"url": f"u{len(pinned) + len(asked)}", "proc": type("P", (), {"pid": 7})})()

    def measure(services: dict, payloads: list, clients: int, blocks: int) -> dict:
        asked.update(services=list(services), n=len(payloads), clients=clients, blocks=blocks)
        return {"service": {"requests_per_s": 200.0, "server_cpu_ms_per_request": 4.0, "rows_per_batch": 27.6},
                "one_core": {"requests_per_s": 210.0, "server_cpu_ms_per_request": 3.0, "rows_per_batch": 27.0}}

    def stage_ms(ds: Path, texts: list[str], rounds: int, batch: int) -> dict[str, float]:
        asked.update(stage_texts=len(texts), rounds=rounds, batch=batch)
        return dict.fromkeys(stages.STAGES, 0.25)

    monkeypatch.setattr(stages, "make", lambda path, shape: path)
    monkeypatch.setattr(stages, "build_datastore", lambda *a, **k: tmp_path)
    monkeypatch.setattr(stages, "lama_queries", lambda n, seed: [(f"q{i} [MASK] .", "s") for i in range(n)])
    monkeypatch.setattr(stages, "service_process", service)
    monkeypatch.setattr(stages, "pin_threads", lambda pid, cores: pinned.append(pid) or 9)
    monkeypatch.setattr(stages, "measure", measure)
    monkeypatch.setattr(stages, "stage_ms", stage_ms)
    monkeypatch.setattr(stages, "write_result", lambda name, payload: written.update(payload) or tmp_path / name)
    assert stages.main(["--rounds", "2", "--questions", "50", "--requests", "100", "--clients", "8"]) == 0
    assert pinned == [7] and asked["services"] == ["service", "one_core"] and asked["n"] == 108
    assert (asked["stage_texts"], asked["rounds"], asked["batch"]) == (50 * 2 + 64, 2, 28)  # the service's batch
    assert written["stages_total_ms"] == 0.25 * len(stages.STAGES)
    assert written["service_rest_ms"] == 4.0 - 0.25 * len(stages.STAGES)
    assert written["share_of_service_cpu"]["forward"] == round(0.25 / 4.0, 3)
    assert written["share_of_service_cpu"]["stages"] == round(0.25 * len(stages.STAGES) / 4.0, 3)
    assert written["service_on_one_core"]["cpu_vs_service"] == 0.75
    assert written["service_on_one_core"]["requests_per_s_vs_service"] == 1.05
