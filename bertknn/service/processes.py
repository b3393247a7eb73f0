"""Several server processes behind one port: the run directory they share, their slots, the worker count.

`bert-knn serve --workers N` starts uvicorn's own supervisor (stock uvicorn: it binds the port once, spawns N
workers, and replaces one that dies). The workers share one run directory, made by the parent before any
worker starts: Prometheus's multiprocess files (metrics summed over the workers), the cost gate's table (a
client's cap holds across processes: `bertknn.service.shared_gate`), and the reload generation with each
worker's served datastore (every worker switches: `bertknn.service.reload`). Each worker holds one slot, a
row of the gate's table, for its life: a lock the kernel releases when it dies, so its replacement takes the
slot over and clears what the dead one held. The parent holds the run directory's owner lock; a directory
whose owner and workers are all gone (a server killed without a clean stop) is removed by the next server.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import stat
import tempfile
import time
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


RUN_DIR_PREFIX = "bertknn-run-"
OWNER_LOCK = "owner.lock"  # held by the parent (the supervisor) for as long as it runs
STALE_AFTER_S = 60.0  # a run directory without an owner lock younger than this may be one being made


@dataclass
class RunDir:
    """One server's run directory, held by its parent: its owner lock tells a later server that it is in use."""

    root: Path
    _lock: IO[bytes]

    def remove(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)
        self._lock.close()


def make_run_dir(parent: Path | None = None) -> RunDir:
    """A fresh run directory for one server's workers (its metrics folder empty, as prometheus_client needs),
    its owner lock held by this process."""
    root = Path(tempfile.mkdtemp(prefix=RUN_DIR_PREFIX, dir=parent))
    lock = open(root / OWNER_LOCK, "ab")  # noqa: SIM115 (held open for the server's life)
    fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    (root / "metrics").mkdir()
    return RunDir(root, lock)


def remove_stale_run_dirs(parent: Path | None = None) -> list[Path]:
    """Remove the run directories that servers killed without a clean stop (SIGKILL, out of memory) left in the
    temporary folder (in a pod, an emptyDir that outlives the container: each would keep its metrics files and
    its cost table). A directory is left alone while its owner lock or any worker's slot lock is held."""
    removed = []
    for root in Path(parent or tempfile.gettempdir()).glob(f"{RUN_DIR_PREFIX}*"):
        with contextlib.suppress(OSError):
            st = root.lstat()  # a real directory of this user's, never one a link points to
            if stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid() and _remove_if_stale(root):
                removed.append(root)
    return removed


def _remove_if_stale(root: Path) -> bool:
    owner = root / OWNER_LOCK
    if not owner.exists() and time.time() - root.stat().st_mtime < STALE_AFTER_S:
        return False  # perhaps a server's, between making it and taking its lock
    with open(owner, "ab") as f:
        if not _locked_now(f) or live_slots(root):
            return False
        shutil.rmtree(root)
    return True


def _locked_now(f: IO[bytes]) -> bool:
    """Take ``f``'s lock if nobody holds it (True), without waiting."""
    try:
        fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return False
    return True


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
            if _locked_now(f):
                return cls(root, i, f)
            f.close()
        raise RuntimeError(f"more than {MAX_SLOTS} server processes share {root}")

    def release(self) -> None:
        self._lock.close()


def live_slots(root: Path) -> list[int]:
    """The slots a live worker holds now, in order (a slot's lock that can be taken is nobody's)."""
    live = []
    for path in root.glob("slot-*.lock"):
        with open(path, "ab") as f:
            if not _locked_now(f):
                live.append(int(path.stem.split("-")[1]))
    return sorted(live)


def run_dir_from_env() -> Path | None:
    value = os.environ.get(RUN_DIR_ENV)
    return Path(value) if value else None
