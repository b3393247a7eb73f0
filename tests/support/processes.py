"""Processes the tests (and the benchmarks) run for real: the service, a redis-server, on free loopback ports."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO

REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def host_port(url: str) -> tuple[str, int]:
    """(host, port) of an ``http://host:port`` URL."""
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    return host, int(port)


@dataclass
class ServiceProcess:
    url: str
    proc: subprocess.Popen


@contextlib.contextmanager
def service_process(
    datastore: Path,
    *,
    env: dict[str, str] | None = None,
    timeout_s: float = 300,
    args: tuple[str, ...] = (),
    cwd: Path = REPO,
    as_pid1: bool = False,
    module: str = "service",
    stderr: IO[bytes] | None = None,
) -> Iterator[ServiceProcess]:
    """Start ``python -m service`` on a free loopback port and wait until /readyz answers 200; stop it after.

    ``cwd``: the source tree to serve from (another commit's worktree, for a before/after benchmark). ``as_pid1``:
    SIGTERM's default action ignored, as the kernel does for a container's PID 1, so that the signal uvicorn
    re-raises after its shutdown does not end the process and the interpreter exits normally. ``module``: what
    ``python -m`` runs (the service, or a wrapper of it that takes its arguments). ``stderr``: a file its log
    goes to (else the test's own)."""
    import httpx

    port = free_port()
    full_env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    cmd = [sys.executable, "-m", module, "--datastore", str(datastore), "--port", str(port), "--log-level", "warning"]
    preexec = (lambda: signal.signal(signal.SIGTERM, signal.SIG_IGN)) if as_pid1 else None  # inherited by exec
    proc = subprocess.Popen([*cmd, *args], env=full_env, cwd=cwd, preexec_fn=preexec, stderr=stderr)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"service exited with {proc.returncode}")
            try:
                if httpx.get(f"{url}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        else:
            raise RuntimeError("service did not become ready")
        yield ServiceProcess(url, proc)
    finally:
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()


@contextlib.contextmanager
def running_service(datastore: Path, *, env: dict[str, str] | None = None, timeout_s: float = 300) -> Iterator[str]:
    """`service_process`, yielding only its URL."""
    with service_process(datastore, env=env, timeout_s=timeout_s) as svc:
        yield svc.url


class RedisServer:
    """A real redis-server on a free loopback port, owned by the test."""

    def __init__(self, port: int | None = None, password: str | None = None, maxmemory: str | None = None):
        self.port = port or free_port()
        self.password = password
        self.maxmemory = maxmemory
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        import redis

        exe = shutil.which("redis-server")
        if exe is None:
            raise RuntimeError("redis-server is not installed (scripts/bootstrap.sh installs it)")
        cmd = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--enable-debug-command", "local"]  # DEBUG SLEEP simulates a stalled Redis
        if self.password:
            cmd += ["--requirepass", self.password]
        if self.maxmemory:
            cmd += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis.from_url(self.url)
        for _ in range(100):
            try:
                if client.ping():
                    return self
            except redis.RedisError:
                time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc = None
