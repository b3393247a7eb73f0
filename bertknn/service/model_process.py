"""The split layout's model process, seen from the parent: started before any API process, replaced when it dies.

`bert-knn serve --layout split` runs one model process (`bertknn.service.model_server`) beside the API processes
uvicorn's supervisor starts. The parent starts it first and waits until it serves, so that a model that cannot
load stops the service with its one line before any API process starts; then a thread of the parent replaces it
whenever it exits. Its socket lives in the run directory (`bertknn.service.processes`), and the API processes
prove with a key the parent made that they are the parent's.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import secrets
import signal
import threading
import time
from contextlib import suppress
from multiprocessing.connection import Connection, Listener
from pathlib import Path

from bertknn.core import logs
from bertknn.core.errors import BertKnnError
from bertknn.core.libc import name_os_thread
from bertknn.service.model_client import ADDRESS_ENV, AUTHKEY_ENV
from bertknn.service.settings import ServiceSettings

logger = logging.getLogger(__name__)
SOCKET_NAME = "model.sock"
PID_NAME = "model.pid"  # the model process now serving (for an operator, and the tests)
RESTART_PAUSE_S = 1.0  # between a replacement that failed to start and the next


def run_model_process(settings: ServiceSettings, address: str, authkey: bytes, status: Connection) -> None:
    """The model process's body: load the model, listen, say ready (or the one line why not), serve."""
    # Ctrl-C reaches the whole process group: the parent stops this process itself, after the API processes
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    name_os_thread("bertknn-model")  # (its main thread runs the model: `top` shows it by this name)
    logs.configure(settings.log_level, role="model", fmt=settings.log_format)
    from tqdm import tqdm

    # (as in an API process: the loader's progress bar would register a lock with the parent's resource tracker)
    tqdm.set_lock(threading.RLock())

    from bertknn.service.model_load import load_model
    from bertknn.service.model_server import ModelServer

    max_rows = settings.batching.merged_rows
    try:
        encoder = load_model(settings, max_rows=max_rows)
    except Exception as exc:  # the parent prints the line; a failure nobody explained keeps its traceback here
        if not isinstance(exc, BertKnnError):
            logging.getLogger(__name__).exception("the model process could not load its model")
        line = str(exc) if isinstance(exc, BertKnnError) else f"the model process failed: {type(exc).__name__}: {exc}"
        status.send(("error", line))
        raise SystemExit(2) from None
    with suppress(FileNotFoundError):
        os.unlink(address)  # a dead predecessor's socket
    listener = Listener(address, family="AF_UNIX", authkey=authkey)
    server = ModelServer(encoder, listener, max_rows=max_rows, on_batch=PassMeter())
    status.send(("ready", os.getpid()))
    status.close()
    server.serve()


class PassMeter:
    """The model process's metrics, updated after each forward pass: its rows (``bertknn_model_batch_rows``) and
    the CPU time the process has used so far, every thread of it (``bertknn_model_process_cpu_seconds_total``):
    against the wall clock, how much of a core the one process that feeds the device keeps busy."""

    def __init__(self) -> None:
        from prometheus_client import Counter, Histogram

        self.rows = Histogram("bertknn_model_batch_rows", "rows per forward pass of the model process (the split "
                              "layout)", buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256))  # fmt: skip
        self.cpu = Counter("bertknn_model_process_cpu_seconds", "CPU seconds the model process has used, all its "
                           "threads (the split layout; against wall time: how busy it is)")  # fmt: skip
        self._cpu_s = time.process_time()

    def __call__(self, rows: int) -> None:
        self.rows.observe(rows)
        now = time.process_time()
        self.cpu.inc(now - self._cpu_s)
        self._cpu_s = now


class ModelProcess:
    """The parent's handle on the model process (`start`, then `watch` replaces it whenever it exits)."""

    def __init__(self, settings: ServiceSettings, run_dir: Path):
        self.settings = settings
        self.address = str(run_dir / SOCKET_NAME)
        self._pid_file = run_dir / PID_NAME
        self.authkey = secrets.token_bytes(32)
        self._ctx = multiprocessing.get_context("spawn")
        self._proc: multiprocessing.process.BaseProcess | None = None
        self._stopping = threading.Event()
        self.starts = 0

    def env(self) -> dict[str, str]:
        """What the API processes read to reach it (`RemoteEncoder.from_env`)."""
        return {ADDRESS_ENV: self.address, AUTHKEY_ENV: self.authkey.hex()}

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def start(self, timeout_s: float = 600.0) -> str | None:
        """Start it and wait until it serves; the one line why it could not, else None."""
        theirs, ours = self._ctx.Pipe(duplex=False)
        proc = self._ctx.Process(target=run_model_process, name="bertknn-model",
                                 args=(self.settings, self.address, self.authkey, ours), daemon=True)  # fmt: skip
        proc.start()
        ours.close()
        self._proc, self.starts = proc, self.starts + 1
        deadline = time.monotonic() + timeout_s
        while not theirs.poll(0.2):
            if not proc.is_alive() or time.monotonic() > deadline:
                proc.kill()
                return f"the model process exited before it served (exit code {proc.exitcode}); see the log above"
        try:
            kind, detail = theirs.recv()
        except EOFError:
            proc.join(5)
            return f"the model process exited before it served (exit code {proc.exitcode})"
        if kind != "ready":
            proc.join(5)
            return str(detail)
        self._pid_file.write_text(f"{proc.pid}\n")
        logger.info("model process %d serves at %s", proc.pid, self.address)
        return None

    def watch(self) -> threading.Thread:
        """A thread that replaces the model process whenever it exits, until `stop`."""
        thread = threading.Thread(target=self._keep_alive, name="model-process-watch", daemon=True)
        thread.start()
        return thread

    def _keep_alive(self) -> None:
        name_os_thread()
        while not self._stopping.is_set():
            proc = self._proc
            if proc is None:
                return
            proc.join(0.5)
            if proc.exitcode is None or self._stopping.is_set():
                continue
            logger.warning("the model process %d exited (code %s); starting another", proc.pid, proc.exitcode)
            problem = self.start()
            if problem is not None:
                logger.error("the new model process did not start: %s", problem)
                self._stopping.wait(RESTART_PAUSE_S)

    def stop(self, timeout_s: float = 10.0) -> None:
        self._stopping.set()
        proc = self._proc
        if proc is not None and proc.is_alive():
            proc.terminate()
            proc.join(timeout_s)
            if proc.is_alive():
                proc.kill()
        with suppress(FileNotFoundError):
            os.unlink(self.address)
