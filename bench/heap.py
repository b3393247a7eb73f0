"""The served heap and the garbage collector: a full collection's pause and the exit after SIGTERM as PID 1. ::

    python -m bench.heap [--baseline REV] [--stops 5] [--questions 200]

Two measures, on the datastore and the model of ``bench.hostwork`` (bert-base-uncased's shape and vocabulary at
hidden size 64; the heap is the vocabulary's, the tokenizer's and the indexes', not the weights').

- In this process: the app served through its lifespan, ``--questions`` answered, then a full collection timed
  with the heap given back to the collector and again with it frozen as start-up leaves it
  (`bertknn.service.heap`): the pause a request waits for when a full collection runs in the middle of it.
- In service processes: the seconds from SIGTERM to the process's end with SIGTERM's default action ignored, as
  for a container's PID 1 (uvicorn re-raises the signal after its shutdown; ignored there, the interpreter
  finalizes). ``--baseline REV`` times another commit the same way in the same run, turn about.
"""

from __future__ import annotations

import argparse
import gc
import signal
import statistics
import subprocess
import time
from pathlib import Path

from bench.bert_base import make
from bench.common import REPO, RUNS, build_datastore, lama_queries, machine, write_result
from bench.hostwork import CORPUS, TINY, baseline_tree
from tests.support.processes import service_process


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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--baseline", default=None, help="a commit whose exit after SIGTERM is timed beside this tree's")
    p.add_argument("--stops", type=int, default=5, help="service processes started and stopped per tree")
    p.add_argument("--questions", type=int, default=200, help="questions answered before measuring")
    p.add_argument("--articles", type=int, default=40, help="articles of the sample corpus in the datastore")
    p.add_argument("--work", type=Path, default=RUNS / "bench-hostwork")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.stops < 1 or args.questions < 1:
        p.error("--stops and --questions take numbers of at least 1")
    model = make(args.work / "bert-base-h64", shape=TINY)
    ds = build_datastore([CORPUS], args.work / f"ds-{args.articles}", model, limit=args.articles, bm25=False)
    questions = [t for t, _ in lama_queries(args.questions, seed=11)]
    result: dict = {"model": "bert-base-uncased's shape at hidden size 64", "machine": machine(),
                    "articles": args.articles, "questions": args.questions}  # fmt: skip
    result["pause"] = pauses(ds, questions)
    print(f"full collection of the served heap: {result['pause']}", flush=True)
    trees = {"this tree": REPO, **({f"baseline {args.baseline}": baseline_tree(args.baseline)} if args.baseline else {})}
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
