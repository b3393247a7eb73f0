"""Several server processes behind one port: the run directory they share, their slots, the worker count.

`bert-knn serve --workers N` starts uvicorn's own supervisor (stock uvicorn: it binds the port once, spawns N
workers, and replaces one that dies). The workers share one run directory, made by the parent before any
worker starts: Prometheus's multiprocess files (metrics summed over the workers), the cost gate's table (a
client's cap holds across processes: `bertknn.service.shared_gate`), and the reload generation with each
worker's served datastore (every worker switches: `bertknn.service.reload`). Each worker holds one slot, a
row of the gate's table, for its life: a lock the kernel releases when it dies, so its replacement takes the
slot over and clears what the dead one held.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import IO

RUN_DIR_ENV = "BERTKNN_RUN_DIR"  # set by the parent for its workers; absent in a single-process server
ARGV_ENV = "BERTKNN_SERVE_ARGV"  # the command line the workers rebuild their settings from (secrets included)
METRICS_ENV = "PROMETHEUS_MULTIPROC_DIR"  # read by prometheus_client when it is imported
MAX_SLOTS = 64  # workers (and replacements being started) at once


def default_workers(device: str, cpus: int) -> int:
    """Server processes when ``--workers`` is 0 (auto).

    On a CPU one: the forward pass takes every core already (its threads are split between the workers
    otherwise). On a GPU several, so that the host work of requests (HTTP, tokenisation, retrieval, the vote)
    runs in parallel while the device computes; half the cores, at most 8, at least 2
    (docs/decisions/serving-processes.md).
    """
    if device == "cpu":
        return 1
    return max(2, min(8, cpus // 2))


def make_run_dir() -> Path:
    """A fresh run directory for one server's workers (its metrics folder empty, as prometheus_client needs)."""
    root = Path(tempfile.mkdtemp(prefix="bertknn-run-"))
    (root / "metrics").mkdir()
    return root


def remove_run_dir(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)


def worker_env(root: Path, argv: list[str]) -> dict[str, str]:
    """What the parent exports before its workers start (spawned: they inherit the environment)."""
    return {RUN_DIR_ENV: str(root), ARGV_ENV: json.dumps(argv), METRICS_ENV: str(root / "metrics")}


@dataclass
class WorkerSlot:
    """One worker's place in the run directory: ``index`` (its row of the shared tables) held by a lock."""

    root: Path
    index: int
    _lock: IO[bytes]

    @classmethod
    def claim(cls, root: Path) -> WorkerSlot:
        """The first slot no live process holds (a dead worker's, or a new one)."""
        for i in range(MAX_SLOTS):
            f = open(root / f"slot-{i}.lock", "ab")  # noqa: SIM115 (held open for the process's life)
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                f.close()
                continue
            return cls(root, i, f)
        raise RuntimeError(f"more than {MAX_SLOTS} server processes share {root}")

    def release(self) -> None:
        self._lock.close()


def live_slots(root: Path) -> list[int]:
    """The slots a live worker holds now (a slot's lock that can be taken is nobody's)."""
    live = []
    for path in sorted(root.glob("slot-*.lock")):
        with open(path, "ab") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                live.append(int(path.stem.split("-")[1]))
                continue
            fcntl.flock(f, fcntl.LOCK_UN)
    return live


def run_dir_from_env() -> Path | None:
    value = os.environ.get(RUN_DIR_ENV)
    return Path(value) if value else None
