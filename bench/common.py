"""Shared helpers for the benchmarks: datastores, LAMA-template queries, a service subprocess, percentiles."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from tests.support.processes import (  # noqa: F401
    RedisServer,
    ServiceProcess,
    free_port,
    host_port,
    running_service,
    service_process,
)

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


def process_tree(pid: int) -> Iterator[int]:
    """A process and its live descendants (Linux /proc), each pid once; one that ends meanwhile is skipped."""
    todo = [pid]
    while todo:
        p = todo.pop()
        try:
            kids = Path(f"/proc/{p}/task/{p}/children").read_text().split()
        except OSError:  # it ended meanwhile
            continue
        todo += [int(k) for k in kids]
        yield p


def tree_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a process and all its live descendants so far (Linux /proc)."""
    total, tick = 0.0, os.sysconf("SC_CLK_TCK")
    for p in process_tree(pid):
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def thread_cpu_s(pid: int) -> dict[str, float]:
    """User + system CPU seconds so far of each kind of thread in a process and its live descendants (Linux
    /proc), by the threads' operating-system names (`bertknn.core.libc.name_os_thread`) without their numbers
    (``model_0`` and ``model_1`` are ``model``). A process's main thread is ``main`` (a service process's event
    loop), whatever its name; an unnamed thread keeps the interpreter's name (``python``). A thread that ended
    is not counted: compare with `tree_cpu_s`."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for p in process_tree(pid):
        try:
            tids = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for tid in tids:
            try:
                stat = Path(f"/proc/{p}/task/{tid}/stat").read_text()
            except OSError:
                continue
            name, fields = stat.split("(", 1)[1].rsplit(")", 1)
            kind = "main" if tid == str(p) else re.sub(r"[-_]\d+$", "", name) or name
            cpu = fields.split()
            out[kind] = out.get(kind, 0.0) + (int(cpu[11]) + int(cpu[12])) / tick
    return out


def cpu_between(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Each kind's CPU seconds from one `thread_cpu_s` to a later one (a kind whose threads all ended: left out)."""
    return {kind: s - before.get(kind, 0.0) for kind, s in after.items()}


def ms_per_request(seconds: dict[str, float], requests: float) -> dict[str, float]:
    """CPU seconds by kind of thread -> ms per answered request, most first (kinds that used none left out)."""
    ms = {kind: round(s * 1000 / max(1.0, requests), 3) for kind, s in seconds.items()}
    return dict(sorted(((k, v) for k, v in ms.items() if v > 0), key=lambda kv: -kv[1]))


def tree_rss_mb(pid: int) -> float:
    """Resident memory of a process and all its live descendants, MiB (Linux /proc; pages they share count once
    per process)."""
    total = 0.0
    for p in process_tree(pid):
        try:
            status = Path(f"/proc/{p}/status").read_text()
        except OSError:
            continue
        total += next((int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")), 0) / 1024
    return total


def cpu_model() -> str | None:
    """The host CPU's model name (Linux), so that figures from two hosts of one machine kind can be told apart."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            return next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), None)
    except OSError:
        return None


def python_loop_ms(n: int = 200_000) -> float:
    """Milliseconds of a fixed pure-Python loop, best of 3: the host's single-thread speed for interpreter work,
    which bounds the service's per-request overhead (smaller is faster)."""
    best = float("inf")
    for _ in range(3):
        t = time.perf_counter()
        acc = 0
        for i in range(n):
            acc += i * i % 7
        best = min(best, time.perf_counter() - t)
    return round(1000 * best, 2)


def machine() -> dict[str, object]:
    import torch

    return {
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "python_loop_ms": python_loop_ms(),
        "cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def lama_queries(n: int, *, seed: int = 0, lama: Path | None = None) -> list[tuple[str, str]]:
    """Distinct (query text, subject) pairs from the T-REx templates and subjects, deterministic."""
    from bertknn.evaluation.lama import fill_template

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
    # how many distinct questions there are: asked for more, it stops there (drawing on would find nothing new)
    possible = len({fill_template(templates[f.stem], fact["sub_label"], lowercase=True)
                    for f, facts in zip(files, per_file, strict=True) if templates.get(f.stem) for fact in facts})  # fmt: skip
    attempts = 0
    while len(out) < min(n, possible) and attempts < 100 * n:
        attempts += 1
        i = int(rng.integers(len(files)))
        facts = per_file[i]
        fact = facts[int(rng.integers(len(facts)))]
        tmpl = templates.get(files[i].stem)
        if not tmpl:
            continue
        text = fill_template(tmpl, fact["sub_label"], lowercase=True)
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


def build_datastore(
    corpus: list[Path], out: Path, model: Path | str, *, limit: int | None = None, ivfpq: bool = False,
    targets: str = "single-piece", bm25: bool = True,
) -> Path:  # fmt: skip
    """Build once (resumable, reused when the manifest exists); ``bm25`` off: TF-IDF alone (no Java needed)."""
    if (out / "manifest.json").is_file():
        return out
    cmd = [sys.executable, "-m", "datastore_builder", "build", "--model", str(model), "--out", str(out), "--device", "cpu"]
    for c in corpus:
        cmd += ["--corpus", str(c)]
    if limit:
        cmd += ["--limit-articles", str(limit)]
    if ivfpq:
        cmd += ["--ivfpq"]
    if targets != "single-piece":
        cmd += ["--targets", targets]
    if not bm25:
        cmd += ["--no-bm25"]
    subprocess.run(cmd, check=True, cwd=REPO, env=dict(os.environ))
    return out


def result_name(name: str, model: Path | str) -> str:
    """``name`` for the proxy model's results; another model's go to a file of their own beside them."""
    return name if Path(model).resolve() == PROXY_MODEL.resolve() else f"{name}-{Path(model).name}"


def process_wall_s() -> float:
    """Seconds since this process started (Linux /proc): how long the benchmark that writes a result ran."""
    try:
        started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
        uptime = float(Path("/proc/uptime").read_text().split()[0])
        return round(uptime - started, 1)
    except (OSError, ValueError, IndexError):
        return round(time.perf_counter() - _IMPORTED, 1)


_IMPORTED = time.perf_counter()


def device_sync(device: str) -> Callable[[], None]:
    """Waits for the device's queued work (on CUDA), so that a timer reads the work's end."""
    import torch

    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def device_timing_args(prog: str, doc: str | None, argv: list[str] | None) -> argparse.Namespace:
    """The arguments of a benchmark that times one device against the host (``--device``, ``--threads``,
    ``--calls``), checked, with torch's threads set: what to fix is said before anything runs."""
    p = argparse.ArgumentParser(prog=prog, description=doc)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--threads", type=int, default=1, help="torch threads (the service's model thread's, on a CPU)")
    p.add_argument("--calls", type=int, default=20, help="timed calls per shape and side")
    args = p.parse_args(argv)
    if args.threads < 1 or args.calls < 1:
        p.error("--threads and --calls must be at least 1")
    import torch

    if args.device == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: torch sees no CUDA device here")
    torch.set_num_threads(args.threads)
    return args


def write_result(name: str, payload: dict) -> Path:
    """``bench/results/NAME.json``: `write_json`."""
    return write_json(RESULTS / f"{name}.json", payload)


def baseline_tree(rev: str) -> Path:
    """A git worktree of ``rev`` under runs/ (made once), whose ``../shared`` is this checkout's. `ValueError`: no
    such commit here."""
    found = subprocess.run(["git", "rev-parse", "--verify", "--quiet", "--short", f"{rev}^{{commit}}"], cwd=REPO,
                           capture_output=True, text=True)  # fmt: skip
    if found.returncode != 0:
        raise ValueError(f"--baseline {rev}: no such commit in this repository (git log names them)")
    sha = found.stdout.strip()
    tree = RUNS / f"worktree-{sha}"
    if not (tree / "bertknn").is_dir():
        subprocess.run(["git", "worktree", "add", "--detach", "-f", str(tree), sha], cwd=REPO, check=True)
    shared = RUNS / "shared"  # the worktree's REPO.parent / "shared"
    if not shared.exists() and SHARED.exists():
        shared.symlink_to(SHARED.resolve())
    return tree


def baseline_or_exit(parser: argparse.ArgumentParser, rev: str) -> Path:
    """`baseline_tree`, or the benchmark's usage error when ``rev`` is no commit (before anything runs)."""
    try:
        return baseline_tree(rev)
    except ValueError as exc:
        parser.error(str(exc))


def run_from(rev: str, module: str, argv: list[str], result: str) -> dict:
    """``python -m MODULE ARGV`` run from a worktree of ``rev`` (`baseline_tree`: its own runs/ and results), and
    the results file ``bench/results/RESULT.json`` it wrote there."""
    tree = baseline_tree(rev)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run([sys.executable, "-m", module, *argv], cwd=tree, env=env, check=True)
    return json.loads((tree / "bench" / "results" / f"{result}.json").read_text(encoding="utf-8"))


def write_json(path: Path, payload: dict) -> Path:
    """A results file at ``path``: ``payload`` with what made it (`provenance`: the command line and the source's
    commit) and the run's wall time (``wall_s``, which ``python -m bench`` lists) where it has none."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = {**provenance(), **payload, "wall_s": payload.get("wall_s", process_wall_s())}
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    return path


def provenance() -> dict[str, str | None]:
    """What made a results file: ``command``, this process's command line (``python -m bench.NAME ...``), and
    ``source``, `source_commit`."""
    argv = getattr(sys, "orig_argv", sys.argv)
    return {"command": shlex.join(["python", *argv[1:]]), "source": source_commit()}


def source_commit() -> str | None:
    """The commit this tree is at, ``+changes`` appended where tracked files outside bench/results/ differ from
    it. Where the tree is no git checkout (the copy on a lent GPU machine): ``BERT_KNN_SOURCE``, which
    ``scripts/gpu_lease.sh`` sets from what ``scripts/gpu_pack.sh`` recorded; else None."""

    def git(*args: str) -> str:
        with subprocess.Popen(["git", *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True) as proc:  # (not subprocess.run, which tests of a bench replace)
            out, _ = proc.communicate(timeout=60)
        if proc.returncode:
            raise subprocess.CalledProcessError(proc.returncode, ["git", *args])
        return out.strip()

    try:
        sha = git("rev-parse", "--short=12", "HEAD")
        changed = git("status", "--porcelain", "--untracked-files=no", "--", ".", ":(exclude)bench/results")
    except (OSError, subprocess.SubprocessError):
        return os.environ.get("BERT_KNN_SOURCE") or None
    return sha + ("+changes" if changed else "")
