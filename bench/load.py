"""Bounded load test (loopback only; it stops by itself): many concurrent clients against a running service with
Redis. Reports errors (other than deliberate 503s from the full queue), p50/p99, RSS over time, and checks every
answer against the single-client answer for the same query. One command::

    python -m bench.load [--clients 64] [--duration 60] [--datastore DIR]
    python -m bench.load --abuse --datastore DIR_WITH_LINKS [--clients 16] [--duration 30]

Writes bench/results/load.json. Exit status 1 when an answer differs, an unexpected error occurs or memory grows.
``--abuse``: fairness while one client sends only the costliest requests (`bench.abuse`); writes
bench/results/load-abuse.json and exits 1 when an ordinary client saw an error, any response was a 5xx, a request
got no answer, or the ordinary clients' p99 more than doubled.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from pathlib import Path

import httpx
import numpy as np

from bench.common import (
    PROXY_MODEL,
    REPO,
    RUNS,
    RedisServer,
    build_datastore,
    httpx_clients,
    lama_queries,
    machine,
    run_async,
    service_process,
    write_result,
)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _key(body: dict) -> list:
    return [(p["token"], round(p["prob"], 6)) for p in body["predictions"]]


async def _run(url: str, queries: list[dict], reference: dict[str, list], clients: int, duration: float, pid: int) -> dict:
    stats = {"ok": 0, "overloaded_503": 0, "errors": 0, "mismatches": 0}
    latencies: list[float] = []
    rss: list[tuple[float, float]] = []
    t_end = time.monotonic() + duration

    async def client(i: int, http: httpx.AsyncClient) -> None:
        n = i
        while time.monotonic() < t_end:
            q = queries[n % len(queries)]
            n += clients
            t = time.perf_counter()
            try:
                r = await http.post("/predict", json=q)
            except httpx.HTTPError:
                stats["errors"] += 1
                continue
            latencies.append(time.perf_counter() - t)
            if r.status_code == 200:
                stats["ok"] += 1
                if _key(r.json()) != reference[q["text"]]:
                    stats["mismatches"] += 1
            elif r.status_code == 503 and r.headers.get("retry-after"):
                stats["overloaded_503"] += 1
                await asyncio.sleep(float(r.headers["retry-after"]) / 10)
            else:
                stats["errors"] += 1

    async def sampler() -> None:
        t0 = time.monotonic()
        while time.monotonic() < t_end:
            rss.append((time.monotonic() - t0, rss_mb(pid)))
            await asyncio.sleep(1.0)

    async with httpx_clients(url, clients) as https:  # a client and a connection for each simulated user
        await asyncio.gather(sampler(), *(client(i, http) for i, http in enumerate(https)))
    lat = np.asarray(latencies) * 1000
    mem = np.asarray([m for _, m in rss])
    quarter = max(1, len(mem) // 4)
    return {
        **stats,
        "requests": len(latencies),
        "requests_per_s": len(latencies) / duration,
        "p50_ms": float(np.percentile(lat, 50)) if len(lat) else None,
        "p99_ms": float(np.percentile(lat, 99)) if len(lat) else None,
        "rss_mb_first_quarter": float(mem[:quarter].mean()) if len(mem) else None,
        "rss_mb_last_quarter": float(mem[-quarter:].mean()) if len(mem) else None,
        "rss_samples": [(round(t, 1), round(m, 1)) for t, m in rss],
    }


def run_load(datastore: Path, *, clients: int, duration: float, n_queries: int = 40, max_queue: int = 32,
             lama: Path | None = None) -> dict:
    """Start Redis and the service, take single-client reference answers, then load it; return the figures."""
    queries = [{"text": t, "subject": s} for t, s in lama_queries(n_queries, seed=3, lama=lama)]
    redis = RedisServer(password="load-test", maxmemory="256mb").start()
    try:
        env = {"BERTKNN_MODEL__DEVICE": "cpu", "BERTKNN_BATCHING__MAX_QUEUE": str(max_queue)}
        with service_process(datastore, env=env, args=("--redis-url", redis.url)) as svc:
            with httpx.Client(base_url=svc.url, timeout=60) as http:
                reference = {q["text"]: _key(http.post("/predict", json=q).json()) for q in queries}
            result = run_async(_run(svc.url, queries, reference, clients, duration, svc.proc.pid))
    finally:
        redis.stop()
    first, last = result["rss_mb_first_quarter"], result["rss_mb_last_quarter"]
    result["rss_growth"] = (last / first - 1.0) if first else None
    result.update({"clients": clients, "duration_s": duration, "max_queue": max_queue, "queries": len(queries)})
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__)
    p.add_argument("--datastore", type=Path)
    p.add_argument("--model", default=str(PROXY_MODEL))
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--duration", type=float, default=60.0)
    p.add_argument("--max-queue", type=int, default=32)
    p.add_argument("--abuse", action="store_true", help="the fairness test (a datastore with links: --datastore)")
    args = p.parse_args(argv)
    if args.abuse:
        return _abuse(args.datastore, args.clients, args.duration, p)
    ds = args.datastore or build_datastore([REPO / "data" / "sample_wiki.jsonl"], RUNS / "bench-serving" / "ds", args.model,
                                           limit=150)
    r = run_load(ds, clients=args.clients, duration=args.duration, max_queue=args.max_queue)
    r["machine"] = machine()
    r["datastore"] = str(ds)
    path = write_result("load", r)
    print(f"{args.clients} clients for {args.duration:.0f}s: {r['requests']} requests ({r['requests_per_s']:.1f}/s), "
          f"ok {r['ok']}, 503 overloaded {r['overloaded_503']}, errors {r['errors']}, answers differing {r['mismatches']}")
    print(f"latency p50 {r['p50_ms']:.1f} ms p99 {r['p99_ms']:.1f} ms; RSS {r['rss_mb_first_quarter']:.0f} -> "
          f"{r['rss_mb_last_quarter']:.0f} MB ({100 * r['rss_growth']:+.1f}%)")
    print(f"wrote {path}")
    bad = r["errors"] or r["mismatches"] or (r["rss_growth"] is not None and r["rss_growth"] > 0.05)
    return 1 if bad else 0


def _abuse(datastore: Path | None, clients: int, duration: float, p: argparse.ArgumentParser) -> int:
    from bench.abuse import run_abuse

    if datastore is None or not (datastore / "manifest.json").is_file():
        p.error("--abuse needs --datastore: a datastore built with links (e.g. bench.entity_cost's)")
    r = run_abuse(datastore, clients=clients, duration=duration)
    r["machine"] = machine()
    path = write_result("load-abuse", r)
    alone, abused = r["alone"], r["with_abuser"]
    print(f"{clients} ordinary clients, {duration:.0f}s alone then {duration:.0f}s beside one abuser")
    print(f"ordinary p50/p99 alone {alone['ordinary_p50_ms']:.1f}/{alone['ordinary_p99_ms']:.1f} ms, with the abuser "
          f"{abused['ordinary_p50_ms']:.1f}/{abused['ordinary_p99_ms']:.1f} ms: p99 x{r['ordinary_p99_ratio']:.2f}")
    print(f"codes {abused['codes']}; ordinary errors {r['ordinary_errors']}, 5xx {r['responses_5xx']}, lost {r['lost']}")
    print(f"wrote {path}")
    bad = r["ordinary_errors"] or r["responses_5xx"] or r["lost"] or not (r["ordinary_p99_ratio"] or 9) <= 2.0
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
