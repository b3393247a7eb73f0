"""Paired A/B of two checkouts of this project: which one answers uncached /predict faster. One command::

    python -m bench.ab --a ../other-checkout [--b .] [--queries 1000] [--datastore DIR]

This machine's speed drifts by up to 2x within minutes, so two benchmark runs one after the other cannot tell
apart changes of a few tenths of a millisecond. Here both versions run at once (``python -m service`` from each
checkout, the same datastore and settings), and one client sends every query to both in turn, alternating which
goes first; each query is new to both (uncached). The paired differences (a - b per query) share the host's phase,
so their median, with a bootstrap 95% interval, measures the change. Writes bench/results/ab.json.
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

import numpy as np

from bench.common import (
    PROXY_MODEL,
    REPO,
    RUNS,
    build_datastore,
    host_port,
    lama_queries,
    service_process,
    write_result,
)
from bench.rawhttp import RawClient


def paired_summary(a_ms: list[float], b_ms: list[float], *, seed: int = 0, resamples: int = 2000) -> dict[str, float]:
    """Median of the paired differences a - b, with a bootstrap 95% interval, and both sides' p50s (ms)."""
    if len(a_ms) != len(b_ms) or not a_ms:
        raise ValueError("a and b need the same, non-zero number of samples")
    diffs = np.asarray(a_ms, dtype=np.float64) - np.asarray(b_ms, dtype=np.float64)
    rng = np.random.default_rng(seed)
    boots = np.median(diffs[rng.integers(0, len(diffs), size=(resamples, len(diffs)))], axis=1)
    return {
        "a_p50_ms": float(np.median(a_ms)),
        "b_p50_ms": float(np.median(b_ms)),
        "median_a_minus_b_ms": float(np.median(diffs)),
        "ci95_low_ms": float(np.percentile(boots, 2.5)),
        "ci95_high_ms": float(np.percentile(boots, 97.5)),
        "mean_a_minus_b_ms": float(diffs.mean()),
        "n": len(diffs),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--a", type=Path, required=True, help="checkout A (a directory with service/ in it)")
    p.add_argument("--b", type=Path, default=REPO, help="checkout B (default: this one)")
    p.add_argument("--queries", type=int, default=1000, help="distinct queries, each sent to both (default 1000)")
    p.add_argument("--warmup", type=int, default=40)
    p.add_argument("--datastore", type=Path, help="default: the benchmarks' sample datastore (built once)")
    p.add_argument("--model", default=str(PROXY_MODEL), help="model for the default datastore")
    args = p.parse_args(argv)
    trees = {"a": args.a.resolve(), "b": args.b.resolve()}
    for name, tree in trees.items():
        if not (tree / "service" / "__main__.py").is_file():
            p.error(f"--{name} {tree}: not a checkout of this project (no service/__main__.py)")
    if args.queries < 20 or args.warmup < 0:
        p.error("--queries must be at least 20 and --warmup at least 0")
    ds = args.datastore or build_datastore([REPO / "data" / "sample_wiki.jsonl"], RUNS / "bench-serving" / "ds",
                                           args.model, limit=150)  # fmt: skip
    if not (ds / "manifest.json").is_file():
        p.error(f"--datastore {ds}: no datastore here (manifest.json missing)")

    lat: dict[str, list[float]] = {"a": [], "b": []}
    queries = lama_queries(args.queries + args.warmup, seed=7)
    with contextlib.ExitStack() as stack:
        clients = {}
        for name, tree in trees.items():
            svc = stack.enter_context(service_process(ds.resolve(), checkout=tree))
            clients[name] = stack.enter_context(RawClient(*host_port(svc.url)))
        for i, (text, subject) in enumerate(queries):
            for name in ("a", "b") if i % 2 == 0 else ("b", "a"):
                t = time.perf_counter()
                status, body = clients[name].post_json(
                    "/predict", {"text": text, "subject": subject, "return_contexts": True}
                )
                elapsed = time.perf_counter() - t
                if status != 200:
                    raise SystemExit(f"checkout {name} answered {status}: {body[:300]!r}")
                if i >= args.warmup:
                    lat[name].append(elapsed * 1000.0)
    summary = paired_summary(lat["a"], lat["b"])
    result = {"a": str(trees["a"]), "b": str(trees["b"]), "datastore": str(ds), **summary}
    path = write_result("ab", result)
    print(f"a {trees['a']}: p50 {summary['a_p50_ms']:.2f} ms; b {trees['b']}: p50 {summary['b_p50_ms']:.2f} ms")
    print(f"paired median a - b: {summary['median_a_minus_b_ms']:+.3f} ms (bootstrap 95% interval "
          f"{summary['ci95_low_ms']:+.3f} to {summary['ci95_high_ms']:+.3f}; mean {summary['mean_a_minus_b_ms']:+.3f}; "
          f"{summary['n']} queries): positive means b is faster")  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
