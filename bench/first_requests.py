"""A fresh server process's first requests against its later ones, with and without its warm-up (``warmup``). ::

    python -m bench.first_requests [--starts 6] [--model DIR]

One service process (bert-base-uncased's shape at hidden size 64 by default, as `bench.hostwork`; TF-IDF) is
started again and again, the warm-up on and off taking turns. Once it is ready, one keep-alive connection asks it
``--questions`` distinct questions (every one uncached), one after another: the first request's milliseconds
against the median of the last half's, per start, and their medians per way. A replaced worker, each of several
workers and a restarted container all start cold this way; with several processes behind one port, a client's
first request may reach any of them.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import numpy as np

from bench.bert_base import make
from bench.common import RUNS, build_datastore, lama_queries, machine, write_result
from bench.hostwork import CORPUS, TINY
from bench.serving import http_latencies
from tests.support.processes import service_process

WAYS = {"warm-up on": "true", "warm-up off": "false"}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="a masked LM directory (default: bert-base's shape at "
                   "hidden size 64, written under --work)")  # fmt: skip
    p.add_argument("--starts", type=int, default=6, help="starts of each way")
    p.add_argument("--questions", type=int, default=12, help="questions asked of each start")
    p.add_argument("--articles", type=int, default=40, help="articles of the sample corpus in the datastore")
    p.add_argument("--work", type=Path, default=RUNS / "bench-hostwork")
    return p


def one_start(ds: Path, env: dict[str, str], questions: list[tuple[str, str]]) -> tuple[float, float]:
    """(the first request's ms, the median ms of the last half) of one fresh process."""
    with service_process(ds, env=env) as svc:
        times, _ = http_latencies(svc.url, questions, "raw")
    ms = np.asarray(times) * 1000
    return float(ms[0]), float(np.median(ms[len(ms) // 2 :]))


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    model = args.model or make(args.work / "bert-base-h64", shape=TINY)
    ds = build_datastore([CORPUS], args.work / f"ds-{args.articles}", model, limit=args.articles, bm25=False)
    pool = lama_queries(args.starts * len(WAYS) * args.questions, seed=5)
    got: dict[str, dict[str, list[float]]] = {way: {"first_ms": [], "later_ms": []} for way in WAYS}
    for i in range(args.starts):
        for j, (way, value) in enumerate(WAYS.items()):
            at = (i * len(WAYS) + j) * args.questions
            env = {"BERTKNN_MODEL__DEVICE": "cpu", "BERTKNN_DEFAULTS__RETRIEVER": "tfidf", "BERTKNN_WARMUP": value}
            first, later = one_start(ds, env, pool[at : at + args.questions])
            got[way]["first_ms"].append(round(first, 2))
            got[way]["later_ms"].append(round(later, 2))
    result: dict[str, Any] = {"model": model.name, "machine": machine(), "starts": args.starts,
                              "questions": args.questions, "ways": {}}  # fmt: skip
    for way, runs in got.items():
        first, later = float(np.median(runs["first_ms"])), float(np.median(runs["later_ms"]))
        result["ways"][way] = {**runs, "first_ms_median": round(first, 2), "later_ms_median": round(later, 2),
                               "first_over_later": round(first / later, 3)}  # fmt: skip
        print(f"{way:>12}: first request {first:.2f} ms, later ones {later:.2f} ms (medians of {args.starts} "
              f"starts) -> {first / later:.2f}x", flush=True)  # fmt: skip
    on, off = result["ways"]["warm-up on"], result["ways"]["warm-up off"]
    result["first_on_over_off"] = round(on["first_ms_median"] / off["first_ms_median"], 3)
    print(f"the first request with the warm-up: {result['first_on_over_off']}x its time without", flush=True)
    print(f"wrote {write_result('first_requests', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
