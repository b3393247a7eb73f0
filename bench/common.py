"""Shared helpers for the benchmarks: datastores, LAMA-template queries, a service subprocess, percentiles."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import platform
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Coroutine, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

if TYPE_CHECKING:
    from bertknn.core.encoder import MaskedLMEncoder

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
PROXY_MODEL = SHARED / "models" / "proxy-minilm-l6-mlm"
RUNS = REPO / "runs"
RESULTS = REPO / "bench" / "results"
T = TypeVar("T")


def percentiles(samples: list[float]) -> dict[str, float]:
    a = np.asarray(samples, dtype=np.float64)
    return {"p50": float(np.percentile(a, 50)), "p99": float(np.percentile(a, 99)), "mean": float(a.mean()), "n": len(a)}


def bare_forward(enc: MaskedLMEncoder, texts: list[str], batch: int = 1) -> list[float]:
    """Seconds per call of the model alone (embedding + p_MLM at [MASK]) on the same queries."""
    inputs = [enc.query_input(t) for t in texts]
    times = []
    for i in range(0, len(inputs), batch):
        chunk = inputs[i : i + batch]
        t = time.perf_counter()
        enc.encode(chunk, with_mlm=True)
        times.append(time.perf_counter() - t)
    return times


def machine() -> dict[str, object]:
    import torch

    return {
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def lama_queries(n: int, *, seed: int = 0, lama: Path | None = None) -> list[tuple[str, str]]:
    """Distinct (query text, subject) pairs from the T-REx templates and subjects, deterministic."""
    lama = lama or SHARED / "data" / "lama"
    templates = {}
    for line in (lama / "relations.jsonl").read_text().splitlines():
        r = json.loads(line)
        templates[r["relation"]] = r["template"]
    out: list[tuple[str, str]] = []
    seen: set[str] = set()
    files = sorted((lama / "TREx").glob("P*.jsonl"))
    per_file = [[json.loads(line) for line in f.read_text().splitlines()[:400]] for f in files]
    rng = np.random.default_rng(seed)
    attempts = 0
    while len(out) < n and attempts < 100 * n:
        attempts += 1
        i = int(rng.integers(len(files)))
        facts = per_file[i]
        fact = facts[int(rng.integers(len(facts)))]
        tmpl = templates.get(files[i].stem)
        if not tmpl:
            continue
        text = tmpl.replace("[X]", fact["sub_label"]).replace("[Y]", "[MASK]").lower().replace("[mask]", "[MASK]")
        if text not in seen:
            seen.add(text)
            out.append((text, fact["sub_label"]))
    return out


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop where it is installed (as the service's uvicorn uses it): a load generator
    shares the machine's cores with the server, so its own event loop should cost as little as the server's."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


@contextlib.asynccontextmanager
async def httpx_clients(url: str, n: int, *, timeout: float = 60) -> AsyncIterator[list[Any]]:
    """``n`` httpx clients, one connection each, as ``n`` independent users would have. (One shared pool of ``n``
    connections cost 3.2 ms of client CPU per request at 32 callers against 1.3 ms for a client each, measured
    against a trivial server: CPU a benchmark's load generator takes from the server it measures.)"""
    import httpx

    async with contextlib.AsyncExitStack() as stack:
        limits = httpx.Limits(max_connections=1)
        yield [
            await stack.enter_async_context(httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits))
            for _ in range(n)
        ]


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
    checkout: Path = REPO,
) -> Iterator[ServiceProcess]:
    """Start ``python -m service`` on a free loopback port and wait until /readyz answers 200; stop it after.

    ``checkout``: the copy of this project whose code runs (`bench.ab` serves two side by side)."""
    import httpx

    port = free_port()
    full_env = {**os.environ, "OPENAI_API_KEY": "unused", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    if checkout != REPO:
        full_env["PYTHONPATH"] = str(checkout)
    cmd = [sys.executable, "-m", "service", "--datastore", str(datastore), "--port", str(port), "--log-level", "warning"]
    proc = subprocess.Popen([*cmd, *args], env=full_env, cwd=checkout)  # the cwd is first on sys.path
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


def build_datastore(corpus: list[Path], out: Path, model: Path | str, *, limit: int | None = None, ivfpq: bool = False) -> Path:
    """Build once (resumable, reused when the manifest exists)."""
    if (out / "manifest.json").is_file():
        return out
    cmd = [sys.executable, "-m", "datastore_builder", "build", "--model", str(model), "--out", str(out), "--device", "cpu"]
    for c in corpus:
        cmd += ["--corpus", str(c)]
    if limit:
        cmd += ["--limit-articles", str(limit)]
    if ivfpq:
        cmd += ["--ivfpq"]
    subprocess.run(cmd, check=True, cwd=REPO, env={**os.environ, "OPENAI_API_KEY": "unused"})
    return out


def result_name(name: str, model: Path | str) -> str:
    """``name`` for the proxy model's results; another model's go to a file of their own beside them."""
    return name if Path(model).resolve() == PROXY_MODEL.resolve() else f"{name}-{Path(model).name}"


def write_result(name: str, payload: dict) -> Path:
    RESULTS.mkdir(parents=True, exist_ok=True)
    path = RESULTS / f"{name}.json"
    path.write_text(json.dumps(payload, indent=1) + "\n")
    return path
