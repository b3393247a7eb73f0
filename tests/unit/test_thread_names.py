"""Threads by name in the operating system (`bertknn.core.libc.name_os_thread`), and the benchmarks' CPU by kind
of thread over a process tree (`bench.common.thread_cpu_s`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from bench.common import cpu_between, ms_per_request, thread_cpu_s
from bertknn.core.libc import name_os_thread

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread names in /proc are Linux's")


def os_name_of(thread: threading.Thread) -> str:
    return Path(f"/proc/self/task/{thread.native_id}/comm").read_text().strip()


def test_a_thread_takes_its_python_name_or_the_one_given() -> None:
    seen: dict[str, str] = {}
    hold = threading.Event()

    def body(given: str | None) -> None:
        name_os_thread(given)
        seen[threading.current_thread().name] = os_name_of(threading.current_thread())
        hold.wait(10)

    threads = [threading.Thread(target=body, args=(given,), name=name)
               for name, given in [("model_0", None), ("a-very-long-thread-name", None), ("x", "given-name")]]  # fmt: skip
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while len(seen) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    hold.set()
    for t in threads:
        t.join()
    # Linux keeps 15 bytes of a name
    assert seen == {"model_0": "model_0", "a-very-long-thread-name": "a-very-long-thr", "x": "given-name"}


SPINNER = textwrap.dedent("""
    import subprocess, sys, threading, time
    from bertknn.core.libc import name_os_thread

    def spin(seconds, done):
        name_os_thread()
        end = time.thread_time() + seconds
        while time.thread_time() < end:
            pass
        done.release()
        time.sleep(60)  # alive, so that its CPU still counts

    kid = subprocess.Popen([sys.executable, "-c", sys.argv[2], "child"]) if sys.argv[1] == "parent" else None
    done = threading.Semaphore(0)
    threads = [threading.Thread(target=spin, args=(0.3, done), name=f"spin_{i}", daemon=True) for i in range(2)]
    threads.append(threading.Thread(target=spin, args=(0.2, done), name="other-7", daemon=True))
    for t in threads:
        t.start()
    for t in threads:
        done.acquire()
    print("done", kid.pid if kid else 0, flush=True)
    time.sleep(60)
""")


def test_cpu_by_kind_of_thread_over_a_process_tree() -> None:
    proc = subprocess.Popen([sys.executable, "-c", SPINNER, "parent", SPINNER], stdout=subprocess.PIPE, text=True,
                            cwd=Path(__file__).resolve().parents[2])  # fmt: skip
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline().split() for _ in range(2)]  # the parent's and its child's
        assert sorted(word for word, _ in lines) == ["done", "done"]
        by_kind = thread_cpu_s(proc.pid)
        # the spin_N threads of both processes are one kind, the numbers dropped; each main thread is "main"
        assert by_kind["spin"] == pytest.approx(1.2, abs=0.25) and by_kind["other"] == pytest.approx(0.4, abs=0.15)
        assert "main" in by_kind and not any(k.startswith("spin_") for k in by_kind)
        later = thread_cpu_s(proc.pid)
        assert cpu_between(by_kind, later)["spin"] == pytest.approx(0.0, abs=0.02)
        assert ms_per_request({"spin": 0.6, "idle": 0.0, "main": 0.9}, 300) == {"main": 3.0, "spin": 2.0}
    finally:
        subprocess.run(["pkill", "-P", str(proc.pid)], check=False)  # its child
        proc.kill()
        proc.wait()
