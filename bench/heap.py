"""The served heap and the garbage collector: collections under load, a full one's pause, the exit as PID 1. ::

    python -m bench.heap [--baseline REV] [--requests 3000] [--stops 5] [--questions 200]

Two measures, on the datastore and the model of ``bench.hostwork`` (bert-base-uncased's shape and vocabulary at
hidden size 64; the heap is the vocabulary's, the tokenizer's and the indexes', not the weights').

- In this process: the app served through its lifespan, ``--questions`` answered, then a full collection timed
  with the heap given back to the collector and again with it frozen as start-up leaves it
  (`bertknn.service.heap`): the pause a request waits for when a full collection runs in the middle of it.
- Under load: ``--requests`` distinct uncached questions from 64 raw keep-alive clients (`bench.hostwork`'s
  load), with every collection in the service timed by a ``gc.callbacks`` hook that this benchmark puts on the
  service's path (a ``sitecustomize`` module): collections and milliseconds per generation, GC milliseconds per
  request, beside req/s and server CPU per request.
- In service processes: the seconds from SIGTERM to the process's end with SIGTERM's default action ignored, as
  for a container's PID 1 (uvicorn re-raises the signal after its shutdown; ignored there, the interpreter
  finalizes). ``--baseline REV`` measures another commit the same way in the same run, turn about.
"""

from __future__ import annotations

import argparse
import gc
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.bert_base import make
from bench.common import REPO, RUNS, baseline_or_exit, build_datastore, lama_queries, machine, write_result
from bench.hostwork import CORPUS, TINY, measure
from tests.support.processes import service_process

# Put on a service's path: every collection's generation and wall time, appended to $BENCH_GC_LOG.PID.
GC_HOOK = """
import gc, os, time
_log, _start = os.environ.get("BENCH_GC_LOG"), {}
def _timed(phase, info):
    if phase == "start":
        _start[info["generation"]] = time.perf_counter()
    elif info["generation"] in _start:
        with open(f"{_log}.{os.getpid()}", "a") as f:
            f.write(f"{info['generation']} {time.perf_counter() - _start.pop(info['generation'])}\\n")
if _log:
    gc.callbacks.append(_timed)
"""


def collection_us(repeats: int = 5) -> float:
    """The median wall time of a full collection, µs."""
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        gc.collect()
        times.append((time.perf_counter() - t) * 1e6)
    return statistics.median(times)


def pauses(ds: Path, questions: list[str]) -> dict[str, float]:
    """A full collection of the served heap, thawed and frozen, after ``questions`` were answered."""
    from fastapi.testclient import TestClient

    from bertknn.service import heap
    from bertknn.service.main import create_app
    from bertknn.service.settings import ServiceSettings

    settings = ServiceSettings(datastore=ds, model={"device": "cpu", "threads": 1},
                               defaults={"retriever": "tfidf"})  # fmt: skip
    with TestClient(create_app(settings)) as client:
        for q in questions:
            client.post("/predict", json={"text": q}).raise_for_status()
        heap.thaw()
        tracked = len(gc.get_objects())
        thawed = collection_us()
        frozen_objects = heap.settle()
        frozen = collection_us()
    return {"objects_tracked": tracked, "objects_frozen": frozen_objects,
            "full_collection_ms_thawed": round(thawed / 1000, 1), "full_collection_us_frozen": round(frozen, 1),
            "thawed_over_frozen": round(thawed / frozen)}  # fmt: skip


def under_load(ds: Path, tree: Path, payloads: list[dict], hook: Path) -> dict:
    """req/s, server CPU and every collection's time in a service served from ``tree`` at 64 clients."""
    log = hook / f"gc-{tree.name}"
    env = {"BERTKNN_DEFAULTS__RETRIEVER": "tfidf", "BERTKNN_MODEL__THREADS": "1", "PYTHONPATH": f"{hook}:{tree}",
           "BENCH_GC_LOG": str(log)}  # fmt: skip
    with service_process(ds, env=env, cwd=tree) as svc:
        for old in hook.glob(f"{log.name}.*"):
            old.unlink()  # start-up's collections are not the load's
        row: dict[str, Any] = dict(measure({"one": (svc.url, svc.proc.pid)}, payloads, 64, blocks=1)["one"])
    per_gen: dict[str, list[float]] = {}
    for part in hook.glob(f"{log.name}.*"):
        for line in part.read_text().splitlines():
            gen, secs = line.split()
            per_gen.setdefault(gen, []).append(float(secs) * 1000)
        part.unlink()
    row["gc"] = {g: {"collections": len(v), "ms": round(sum(v), 1)} for g, v in sorted(per_gen.items())}
    row["gc_ms_per_request"] = round(sum(sum(v) for v in per_gen.values()) / max(1, row["requests"]), 3)
    return row


def stop_s(ds: Path, tree: Path, questions: list[str]) -> float:
    """Seconds from SIGTERM to the end of a service process served from ``tree``, as PID 1 would see it."""
    import httpx

    env = {"BERTKNN_DEFAULTS__RETRIEVER": "tfidf", "BERTKNN_MODEL__THREADS": "1", "PYTHONPATH": str(tree)}
    with service_process(ds, env=env, cwd=tree, as_pid1=True) as svc:
        for q in questions:
            httpx.post(f"{svc.url}/predict", json={"text": q}, timeout=60).raise_for_status()
        t = time.perf_counter()
        svc.proc.send_signal(signal.SIGTERM)
        try:
            code = svc.proc.wait(120)
        except subprocess.TimeoutExpired as exc:
            raise SystemExit(f"{tree}: the service did not end within 120 s of SIGTERM") from exc
        took = time.perf_counter() - t
    if code != 0:
        raise SystemExit(f"{tree}: the service ended with {code} after SIGTERM, not 0")
    return took


def _medians(rows: list[dict]) -> dict[str, float]:
    keys = ("requests_per_s", "server_cpu_ms_per_request", "gc_ms_per_request")
    return {k: round(statistics.median(r[k] for r in rows), 3) for k in keys}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default=None, help="a commit whose exit after SIGTERM is timed beside this tree's")
    p.add_argument("--requests", type=int, default=3000, help="distinct questions of the load (the same in every round)")
    p.add_argument("--rounds", type=int, default=2, help="load runs per tree, turn about")
    p.add_argument("--stops", type=int, default=5, help="service processes started and stopped per tree")
    p.add_argument("--questions", type=int, default=200, help="questions answered before measuring")
    p.add_argument("--articles", type=int, default=40, help="articles of the sample corpus in the datastore")
    p.add_argument("--work", type=Path, default=RUNS / "bench-hostwork")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if min(args.stops, args.questions, args.rounds) < 1 or args.requests < 100:
        p.error("--stops, --questions and --rounds take numbers of at least 1, --requests at least 100")
    model = make(args.work / "bert-base-h64", shape=TINY)
    ds = build_datastore([CORPUS], args.work / f"ds-{args.articles}", model, limit=args.articles, bm25=False)
    questions = [t for t, _ in lama_queries(args.questions, seed=11)]
    result: dict = {"model": "bert-base-uncased's shape at hidden size 64", "machine": machine(),
                    "articles": args.articles, "questions": args.questions}  # fmt: skip
    result["pause"] = pauses(ds, questions)
    print(f"full collection of the served heap: {result['pause']}", flush=True)
    trees = {"this tree": REPO, **({f"baseline {args.baseline}": baseline_or_exit(p, args.baseline)} if args.baseline else {})}
    # the same questions in every service process (each starts with an empty cache): both trees see the same load
    pool = [{"text": t} for t, _ in lama_queries(args.requests + 64, seed=12)]
    if len(pool) < args.requests + 64:
        p.error(f"--requests: the LAMA templates give {len(pool) - 64} distinct questions at most")
    result["load"] = []
    with tempfile.TemporaryDirectory() as tmp:
        hook = Path(tmp)
        (hook / "sitecustomize.py").write_text(GC_HOOK)
        for r in range(args.rounds):
            for name, tree in trees.items():
                row = {"tree": name, "round": r, **under_load(ds, tree, pool, hook)}
                result["load"].append(row)
                print(f"{name:>20}: {row['requests_per_s']} req/s, server CPU {row['server_cpu_ms_per_request']} "
                      f"ms/request, GC {row['gc_ms_per_request']} ms/request {row['gc']}", flush=True)
    result["load_median"] = {name: _medians([r for r in result["load"] if r["tree"] == name]) for name in trees}
    times: dict[str, list[float]] = {name: [] for name in trees}
    for _ in range(args.stops):
        for name, tree in trees.items():  # turn about: both see the same machine
            times[name].append(stop_s(ds, tree, questions[:20]))
    result["stop_s"] = {name: {"median": round(statistics.median(v), 2), "runs": [round(x, 2) for x in v]}
                        for name, v in times.items()}  # fmt: skip
    for name, row in result["stop_s"].items():
        print(f"{name:>20}: SIGTERM to exit as PID 1, median {row['median']} s of {args.stops}", flush=True)
    if len(trees) == 2:
        base, ours = (result["stop_s"][n]["median"] for n in (list(trees)[1], "this tree"))
        result["stop_ratio_baseline_over_this"] = round(base / max(ours, 0.01), 1)
        print(f"baseline / this tree: {result['stop_ratio_baseline_over_this']}x")
    print(f"wrote {write_result('heap', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
