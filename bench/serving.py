"""Serving benchmark: /predict latency and throughput over HTTP as ratios to the bare model forward, and
latency on datastores 10x and 100x larger (synthetic extra articles). One command::

    python -m bench.serving [--model DIR] [--articles 150] [--queries 80]

Prints a table and writes bench/results/serving.json (with ``--backend`` or ``--threads``:
serving-BACKEND-Nt.json). All ratios are measured in the same run. Latency and throughput are measured with two
load generators against the same server: a lean keep-alive HTTP/1.1 client (``raw``, bench/rawhttp.py) and
httpx, each simulated client with its own connection. Both share this machine's cores with the server; the CPU
each spends per request is printed beside it. Each throughput level is compared with the bare forward twice: in
batches of one row per client, and in batches of the size the service itself formed (clients that wait for each
answer before asking again reach the model in cohorts, so its batches hold fewer rows than there are clients).
With several service processes (``--workers`` above 1, or auto on a GPU) the service's cache is a redis-server
of the run's own, as a deployment's processes share Redis.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import json
import shutil
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import torch

from bench.common import (
    PROXY_MODEL,
    REPO,
    RUNS,
    RedisServer,
    bare_forward,
    build_datastore,
    cpu_between,
    host_port,
    httpx_clients,
    lama_queries,
    machine,
    ms_per_request,
    percentiles,
    result_name,
    run_async,
    running_service,
    service_process,
    thread_cpu_s,
    tree_cpu_s,
    write_result,
)
from bench.rawhttp import AsyncRawClient, RawClient
from bertknn.builder.writer import ShardData, write_shard, write_table
from bertknn.core.encoder import MaskedLMEncoder
from bertknn.core.format import Datastore, write_manifest

CLIENTS = ("raw", "httpx")  # the lean client (bench/rawhttp.py) and httpx, measured in the same run
LOAD_CLIENTS = CLIENTS


_Post = Callable[[dict], tuple[int, bytes]]
_AsyncPost = Callable[[dict], Awaitable[tuple[int, bytes]]]


@contextlib.contextmanager
def _poster(url: str, kind: str) -> Iterator[_Post]:
    """POST /predict over one keep-alive connection of a `CLIENTS` kind: payload -> (status, body)."""
    if kind == "raw":
        with RawClient(*host_port(url)) as raw:
            yield lambda payload: raw.post_json("/predict", payload)
        return
    with httpx.Client(base_url=url, timeout=60) as c:

        def post(payload: dict) -> tuple[int, bytes]:
            r = c.post("/predict", json=payload)
            return r.status_code, r.content

        yield post


@contextlib.asynccontextmanager
async def _async_posters(url: str, kind: str, n: int) -> AsyncIterator[list[_AsyncPost]]:
    """``n`` concurrent POST /predict callers of a `CLIENTS` kind, each with its own client and connection, as
    ``n`` independent users would have (see `httpx_clients`)."""
    if kind == "raw":
        conns = [AsyncRawClient(*host_port(url)) for _ in range(n)]
        try:
            yield [functools.partial(c.post_json, "/predict") for c in conns]
        finally:
            for c in conns:
                await c.close()
        return
    async with httpx_clients(url, n, timeout=120) as clients:

        def poster(client: httpx.AsyncClient) -> _AsyncPost:
            async def post(payload: dict) -> tuple[int, bytes]:
                r = await client.post("/predict", json=payload)
                return r.status_code, r.content

            return post

        yield [poster(c) for c in clients]


def http_latencies(url: str, queries: list[tuple[str, str]], client: str = "httpx") -> tuple[list[float], list[dict]]:
    """Seconds per sequential /predict over one keep-alive connection, and the response bodies."""
    out, bodies = [], []
    with _poster(url, client) as post:
        for text, subject in queries:
            t = time.perf_counter()
            status, body = post({"text": text, "subject": subject, "return_contexts": True})
            out.append(time.perf_counter() - t)
            if status != 200:
                raise RuntimeError(f"/predict answered {status}: {body[:200]!r}")
            bodies.append(json.loads(body))
    return out, bodies


async def _load(
    url: str, queries: list[tuple[str, str]], concurrency: int, kind: str = "httpx", latencies: list[float] | None = None
) -> tuple[float, int, int]:
    """Every query once, `concurrency` clients (of `CLIENTS`' ``kind``) at a time; returns (seconds, ok, errors).
    ``latencies``: where each answered request's seconds go."""
    it = iter(queries)
    ok = err = 0

    async def worker(post: _AsyncPost) -> None:
        nonlocal ok, err
        for text, subject in it:
            t0 = time.perf_counter()
            status, _ = await post({"text": text, "subject": subject})
            if status == 200:
                ok += 1
                if latencies is not None:
                    latencies.append(time.perf_counter() - t0)
            else:
                err += 1

    async with _async_posters(url, kind, concurrency) as posters:
        t = time.perf_counter()
        await asyncio.gather(*(worker(p) for p in posters))
        return time.perf_counter() - t, ok, err


def scaled_copy(base: Path, factor: int, out: Path, seed: int = 0) -> Path:
    """A copy of ``base`` (shards hard-linked) plus synthetic articles making it ``factor`` times larger."""
    if (out / "manifest.json").is_file():
        return out
    if out.exists():
        shutil.rmtree(out)
    shutil.copytree(base, out, copy_function=lambda s, d: Path(d).hardlink_to(s))
    ds = Datastore(out)
    man = ds.manifest.model_copy(deep=True)
    rows_base = man.counts.contexts
    extra_rows = rows_base * (factor - 1)
    per_article = max(1, rows_base // max(1, man.counts.articles))
    per_shard_articles = man.articles_per_shard
    rng = np.random.default_rng(seed)
    base_vecs = np.concatenate([np.asarray(s.vectors) for s in ds.shards]).astype(np.float32)
    mu, sd = base_vecs.mean(0), base_vecs.std(0)
    next_index = max(s.index for s in man.shards) + 1
    article_no = 0
    while extra_rows > 0:
        arts: list[dict[str, Any]] = []
        sent: list[str] = []
        rows = 0
        for _ in range(per_shard_articles):
            n = min(per_article, extra_rows)
            if n <= 0:
                break
            arts.append({"title": f"Synthetic article {article_no:07d}", "id": f"syn-{article_no}", "source": "synthetic",
                         "row_start": rows, "row_end": rows + n, "sent_start": len(sent), "sent_end": len(sent) + 1})
            sent.append(f"Synthetic sentence {article_no}.")
            rows += n
            extra_rows -= n
            article_no += 1
        vec = (rng.standard_normal((rows, len(mu))) * sd + mu).astype(np.float16)
        sids = np.repeat(np.arange(len(arts), dtype=np.int32), [a["row_end"] - a["row_start"] for a in arts])
        linked = man.links is not None  # (a datastore with links: the synthetic rows link to nothing)
        data = ShardData(vec, rng.integers(1000, man.model.vocab_size, rows).astype(np.int32), sids,
                         np.zeros((rows, 2), np.int32), sent, arts,
                         entity_labels=np.full(rows, -1, np.int32) if linked else None, entities=[] if linked else None)
        man.shards.append(write_shard(out, next_index, data))
        next_index += 1
    man.counts.articles = sum(s.articles for s in man.shards)
    man.counts.sentences = sum(s.sentences for s in man.shards)
    man.counts.contexts = sum(s.rows for s in man.shards)
    redirects = out / "redirects.json"
    # the article table of every shard, the synthetic ones too (replacing the hard link to the base's, not it)
    write_table(out, man, sorted(json.loads(redirects.read_text()).items()) if redirects.is_file() else [])
    man.datastore_id = man.compute_id()
    write_manifest(out, man)
    return out


def int_list(minimum: int) -> Any:
    """An argparse type: comma-separated integers >= ``minimum`` ('' for none), checked before anything runs."""

    def parse(text: str) -> list[int]:
        try:
            values = [int(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"{text!r}: give comma-separated whole numbers, e.g. 1,8,32 (an empty string for none)"
            ) from None
        if any(v < minimum for v in values):
            raise argparse.ArgumentTypeError(f"{text!r}: every value must be at least {minimum}")
        return values

    return parse


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.serving", description=__doc__)
    p.add_argument("--model", default=str(PROXY_MODEL))
    p.add_argument("--corpus", type=Path, default=REPO / "data" / "sample_wiki.jsonl")
    p.add_argument("--articles", type=int, default=150)
    p.add_argument("--queries", type=int, default=80, help="distinct queries for the latency runs")
    p.add_argument("--concurrency", type=int_list(1), default="1,8,32", help="concurrent clients per throughput run")
    p.add_argument("--per-client", type=int, default=24, help="measured requests per simulated client at each "
                   "throughput level (at least 96 a level); each level is warmed first with 8 per client, unmeasured")
    p.add_argument("--scale", type=int_list(2), default="10,100", help="datastore size factors ('' to skip)")
    p.add_argument("--work", type=Path, default=RUNS / "bench-serving")
    p.add_argument("--threads", type=int, default=0, help="torch threads for the bare forward and the service (0 = "
                   "the service's default: the CPU quota less one)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto",
                   help="device of the bare forward and the service (default: the service's, auto: a GPU when torch "
                   "sees one); the dtype is the service's default for it (float32 on the CPU, bf16/fp16 on a GPU)")
    p.add_argument("--backend", choices=["auto", "eager", "onnx"], default="auto",
                   help="forward backend of the bare forward and the service (default: the service's, auto)")
    p.add_argument("--workers", type=int, default=0, help="the service's processes (--workers; 0 = its auto: 1 on a "
                   "CPU, 2-8 on a GPU); server CPU is summed over all of them")
    p.add_argument("--knn-device", choices=["host", "model"], default="host", help="where the service runs a batch's "
                   "restricted kNN (model.knn_device): host, its default, or the model's device")
    p.add_argument("--knn-device-rows", choices=["auto", "resident", "copied"], default="auto", help="with "
                   "--knn-device model: the rows kept on the device or copied each batch (model.knn_device_rows)")
    p.add_argument("--vote-device", choices=["host", "model"], default="host", help="with --knn-device model: where "
                   "the questions searched on the device are voted (model.vote_device)")
    p.add_argument("--cuda-wait", choices=["spin", "block"], default="spin", help="how each service process waits "
                   "for its forward on a GPU (model.cuda_wait)")
    p.add_argument("--layout", choices=["full", "split"], default="full", help="the service's layout: full processes, "
                   "or API processes beside one model process (split)")
    p.add_argument("--on-event-loop", action="store_true", help="each service process runs its batches on its "
                   "event loop's thread (batching.on_event_loop) instead of a model thread")
    p.add_argument("--retriever", choices=["bm25", "tfidf"], default="bm25", help="the service's default article "
                   "ranker, for subjects without an article (tfidf: the datastore is built without BM25, no Java)")
    return p


def _ms(p: dict[str, float]) -> dict[str, float]:
    return {k: v * 1000 if k != "n" else v for k, v in p.items()}


def _latency(url: str, enc: MaskedLMEncoder, lat_q: dict[str, list], result: dict) -> list[float]:
    """Per client, uncached and cached ``/predict`` against the bare forward, in alternating blocks of 10 (the
    machine's drift falls on both sides); the bare forward's times. A cached answer is the uncached one (with the
    kNN on the device, up to the distances' float rounding: the cached one is searched on the host)."""
    all_bare: list[float] = []
    for client in CLIENTS:
        bare_s, unc, bodies = [], [], []
        for i in range(0, len(lat_q[client]), 10):
            block = lat_q[client][i : i + 10]
            bare_s += bare_forward(enc, [t for t, _ in block])
            times, got = http_latencies(url, block, client)
            unc += times
            bodies += got
        cached, bodies2 = http_latencies(url, lat_q[client], client)
        assert all(b["cache"]["encoding"] == "hit" for b in bodies2)
        same_answers(bodies, bodies2, exact=result["knn_device"] == "host")
        all_bare += bare_s
        bare, unc_p, cached_p = percentiles(bare_s), percentiles(unc), percentiles(cached)
        result["clients"][client] = {
            "bare_forward_ms": _ms(bare), "uncached_ms": _ms(unc_p), "cached_ms": _ms(cached_p),
            "uncached_p50_over_bare_p50": unc_p["p50"] / bare["p50"],
            "uncached_p99_over_bare_p50": unc_p["p99"] / bare["p50"], "throughput": {},
        }  # fmt: skip
    return all_bare


def same_answers(first: list[dict], again: list[dict], *, exact: bool) -> None:
    """AssertionError unless each pair of bodies has the same predictions: exactly, or (``exact`` False) the same
    tokens with probabilities within 1e-5."""
    if exact:
        assert [b["predictions"] for b in first] == [b["predictions"] for b in again]
        return
    for a, b in zip(first, again, strict=True):
        assert [p["token"] for p in a["predictions"]] == [p["token"] for p in b["predictions"]]
        assert all(abs(p["prob"] - q["prob"]) <= 1e-5 for p, q in zip(a["predictions"], b["predictions"], strict=True))


def scrape_stages(url: str) -> dict[str, float]:
    """The service's running sums from /metrics: per pipeline stage its seconds and requests
    (``stage:NAME:sum``, ``stage:NAME:count``), the forward batches' rows and count (``batch:sum``,
    ``batch:count``), and with the kNN on the device its questions by outcome (``knn_on_device_total:OUTCOME``,
    and voted there: ``vote_on_device_total:OUTCOME``) and the rows kept there (``knn_device_rows``)."""
    out: dict[str, float] = {}
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        name, _, value = line.rpartition(" ")
        if name.startswith(("bertknn_knn_on_device_total{", "bertknn_vote_on_device_total{")) or name == "bertknn_knn_device_rows":
            out[name.removeprefix("bertknn_").replace('{outcome="', ":").rstrip('"}')] = float(value)
        if name == "bertknn_model_process_cpu_seconds_total":  # the split layout's model process
            out["model_cpu_s"] = float(value)
        for metric, key in (("bertknn_stage_seconds", "stage"), ("bertknn_batch_size", "batch"),
                            ("bertknn_model_batch_rows", "model_batch")):  # (the last: the split layout's)
            for part in ("sum", "count"):
                if name.startswith(f"{metric}_{part}"):
                    label = name.partition('stage="')[2].partition('"')[0]
                    out[f"{key}:{label}:{part}" if label else f"{key}:{part}"] = float(value)
    return out


def stage_means(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Between two `scrape_stages`: mean milliseconds per request of each stage (they overlap: the stages do not
    add up to the latency), the mean rows per forward batch, and with the kNN on the device the questions searched
    there (or failed there) and the rows kept there."""
    def delta(key: str) -> float:
        return after.get(key, 0.0) - before.get(key, 0.0)

    out = {k.split(":")[1]: round(1000 * delta(k) / delta(k[:-3] + "count"), 3) for k in after
           if k.startswith("stage:") and k.endswith(":sum") and delta(k[:-3] + "count") > 0}  # fmt: skip
    if delta("batch:count") > 0:
        out["rows_per_batch"] = round(delta("batch:sum") / delta("batch:count"), 2)
    if delta("model_batch:count") > 0:  # the split layout: the model process's merged passes, and its CPU
        out["rows_per_model_pass"] = round(delta("model_batch:sum") / delta("model_batch:count"), 2)
        out["model_process_cpu_s"] = round(delta("model_cpu_s"), 3)
    for side, outcome in (("knn", "searched"), ("knn", "failed"), ("vote", "voted"), ("vote", "failed")):
        key = f"{side}_on_device_total:{outcome}"  # with the kNN (or the vote) on the device: the level's share
        if key in after:
            out[f"{side}_on_device_{outcome}"] = delta(key)
    if "knn_device_rows" in after:
        out["knn_device_rows"] = after["knn_device_rows"]
    return out


def model_process_load(cpu_s: float | None, ok: int, secs: float) -> dict[str, float]:
    """The split layout's model process during a level (its CPU seconds ``cpu_s``): its CPU ms per answered
    request, and the cores it kept busy (CPU seconds per wall second; near 1.0, its one interpreter is what
    limits the service). Empty in the full layout."""
    if cpu_s is None:
        return {}
    return {"model_process_cpu_ms_per_request": round(cpu_s * 1000 / max(1, ok), 3),
            "model_process_busy_cores": round(cpu_s / secs, 3)}  # fmt: skip


def service_batch_rows(stages: dict[str, float], clients: int) -> int:
    """The batch size the service formed in a level: its mean rows per forward batch, rounded (at least 1);
    ``clients`` where the metrics give none."""
    return max(1, round(stages.get("rows_per_batch", clients)))


WARM_PER_CLIENT = 8  # unmeasured requests per simulated client before each throughput level


def level_sizes(levels: list[int], per_client: int) -> dict[int, int]:
    """Measured requests per concurrency level: ``per_client`` per simulated client, at least 96."""
    return {c: max(96, per_client * c) for c in levels}


def _throughput(svc: Any, enc: MaskedLMEncoder, levels: list[int], per_level: dict[int, int], rest: list,
                result: dict) -> None:  # fmt: skip
    """Each concurrency level, every load client back to back, each against the bare batched forward measured
    right before and after its run (averaged: the host's drift during the run falls on both sides).

    Each run is warmed first at its own concurrency with distinct questions, unmeasured: the batch shapes it
    brings (a GPU's CUDA graphs are captured at a shape's first batch, in every process) and its connections."""
    offset = 0
    for c in levels:
        for client in LOAD_CLIENTS:
            warm = WARM_PER_CLIENT * c
            run_async(_load(svc.url, rest[offset : offset + warm], c, client))
            offset += warm
            qs = rest[offset : offset + per_level[c]]
            offset += per_level[c]
            texts = [t for t, _ in qs]
            bare_before = sum(bare_forward(enc, texts, batch=c))
            stages0 = scrape_stages(svc.url)
            by0, server0, client0 = thread_cpu_s(svc.proc.pid), tree_cpu_s(svc.proc.pid), time.process_time()
            latencies: list[float] = []
            secs, ok, err = run_async(_load(svc.url, qs, c, client, latencies))
            client_cpu = time.process_time() - client0
            stages = stage_means(stages0, scrape_stages(svc.url))
            server_ms = (tree_cpu_s(svc.proc.pid) - server0) * 1000 / max(1, ok)
            by_thread = ms_per_request(cpu_between(by0, thread_cpu_s(svc.proc.pid)), ok)
            client_ms = client_cpu * 1000 / max(1, ok)
            bare_tput = 2 * len(qs) / (bare_before + sum(bare_forward(enc, texts, batch=c)))
            # the bare forward again in batches of the size the service formed (closed-loop clients split into
            # cohorts: one in the forward while the other is answered): how much of the ratio is the batches' size
            own = service_batch_rows(stages, c)
            bare_own = bare_tput if own == c else len(qs) / sum(bare_forward(enc, texts, batch=own))
            # both share this machine's cores: the load generator's CPU per request is part of the picture
            result["clients"].setdefault(client, {"throughput": {}})["throughput"][c] = {
                "requests": ok + err, "requests_per_s": ok / secs, "errors": err, "bare_batched_per_s": bare_tput,
                "ratio": (ok / secs) / bare_tput, "service_batch_rows": own, "bare_at_service_batch_per_s": bare_own,
                "ratio_at_service_batch": (ok / secs) / bare_own, "server_cpu_ms_per_request": server_ms,
                "server_cpu_ms_per_request_by_thread": by_thread,
                "load_generator_cpu_ms_per_request": client_ms, "stage_ms_mean": stages,
                "latency_ms": _ms(percentiles(latencies)),
                **model_process_load(stages.pop("model_process_cpu_s", None), ok, secs),
            }  # fmt: skip


def _scale(ds: Path, factors: list[int], work: Path, env: dict[str, str], scale_q: list) -> dict:
    """All sizes served at once (one process each) and queried in alternating blocks of 10: the machine's drift
    falls on every size alike. Each process answers the same queries, uncached, once."""
    stores = {"base": ds, **{f"x{f}": scaled_copy(ds, f, work / f"ds-x{f}") for f in factors}}
    with contextlib.ExitStack() as stack:
        urls = {name: stack.enter_context(running_service(path, env=env)) for name, path in stores.items()}
        for i, url in enumerate(urls.values()):
            http_latencies(url, lama_queries(30, seed=97 + i), "raw")  # warm-up
        by_size: dict[str, list[float]] = {name: [] for name in stores}
        for i in range(0, len(scale_q), 10):
            for name, url in urls.items():
                by_size[name] += http_latencies(url, scale_q[i : i + 10], "raw")[0]
    base_p50 = percentiles(by_size["base"])["p50"]
    scale: dict = {"base_p50_ms": base_p50 * 1000}
    for f in factors:
        p50 = percentiles(by_size[f"x{f}"])["p50"]
        scale[f"x{f}"] = {"contexts": Datastore(stores[f"x{f}"]).manifest.counts.contexts, "p50_ms": p50 * 1000,
                          "ratio": p50 / base_p50}  # fmt: skip
    return scale


def _report(result: dict, backend: str, threads: int) -> None:
    print(f"model {result['model']}, {result['datastore']['contexts']} contexts, machine {result['machine']}")
    print(f"bare forward p50 {result['bare_forward_ms']['p50']:.1f} ms ({backend} on {result['device']} "
          f"{result['dtype']}, {threads} torch threads; eager, before the service started: "
          f"{result['bare_forward_eager_ms']['p50']:.1f} ms)")  # fmt: skip
    for client, r in result["clients"].items():
        if "uncached_ms" in r:
            print(f"[{client} client] /predict uncached p50 {r['uncached_ms']['p50']:.1f} ms p99 {r['uncached_ms']['p99']:.1f} ms"
                  f" vs bare forward p50 {r['bare_forward_ms']['p50']:.1f} ms -> p50 ratio {r['uncached_p50_over_bare_p50']:.2f}x, p99 ratio {r['uncached_p99_over_bare_p50']:.2f}x; "
                  f"cached p50 {r['cached_ms']['p50']:.2f} ms p99 {r['cached_ms']['p99']:.2f} ms")  # fmt: skip
        for c, t in r["throughput"].items():
            print(f"[{client} client] clients {c:>3}: {t['requests_per_s']:.1f} req/s vs bare batched "
                  f"{t['bare_batched_per_s']:.1f}/s -> {t['ratio']:.2f}x ({t['requests']} requests, {t['errors']} errors;"
                  f" CPU per request: server {t['server_cpu_ms_per_request']:.1f} ms, load generator "
                  f"{t['load_generator_cpu_ms_per_request']:.1f} ms)")  # fmt: skip
            if "ratio_at_service_batch" in t:
                print(f"    the bare forward in the service's batch size ({t['service_batch_rows']} rows): "
                      f"{t['bare_at_service_batch_per_s']:.1f}/s -> {t['ratio_at_service_batch']:.2f}x")  # fmt: skip
            print(f"    mean ms per request by stage (they overlap), rows per batch: {t.get('stage_ms_mean')}")
            if t.get("server_cpu_ms_per_request_by_thread"):
                print(f"    server CPU ms per request by kind of thread: {t['server_cpu_ms_per_request_by_thread']}")
            if "model_process_busy_cores" in t:
                print(f"    the model process: {t['model_process_cpu_ms_per_request']:.2f} ms of CPU per request, "
                      f"{t['model_process_busy_cores']:.2f} cores busy")  # fmt: skip
            if "latency_ms" in t:
                print(f"    latency under this load: p50 {t['latency_ms']['p50']:.1f} ms p99 {t['latency_ms']['p99']:.1f} ms")
    for k, v in result.get("scale", {}).items():
        if k.startswith("x"):
            print(f"datastore {k} ({v['contexts']} contexts): p50 {v['p50_ms']:.1f} ms -> {v['ratio']:.2f}x")


@contextlib.contextmanager
def _cache_for(several: bool, env: dict[str, str]) -> Iterator[None]:
    """With ``several`` service processes, a redis-server for the run, named in ``env``
    (``BERTKNN_CACHE__REDIS_URL``); else the service's in-process cache."""
    if not several:
        yield
        return
    redis = RedisServer().start()
    env["BERTKNN_CACHE__REDIS_URL"] = redis.url
    try:
        yield
    finally:
        redis.stop()


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.queries < 10 or args.articles < 1 or args.threads < 0 or not 0 <= args.workers <= 64 or args.per_client < 1:
        p.error("--queries must be at least 10, --articles at least 1, --threads at least 0, --workers 0 to 64, "
                "--per-client at least 1")
    if args.vote_device == "model" and args.knn_device != "model":
        p.error("--vote-device model votes the questions searched on the device: add --knn-device model")

    levels: list[int] = args.concurrency
    per_level = level_sizes(levels, args.per_client)
    loads = len(LOAD_CLIENTS) * sum(n + WARM_PER_CLIENT * c for c, n in per_level.items())
    need = 3 * args.queries + loads  # latency (two load clients), scale, throughput
    pool = lama_queries(need, seed=1)
    if len(pool) < need:
        p.error(f"--concurrency, --per-client and --queries ask for {need} distinct questions (every request "
                f"uncached); the LAMA templates give {len(pool)}: ask for fewer")
    lat_q = {"raw": pool[: args.queries], "httpx": pool[args.queries : 2 * args.queries]}
    scale_q, rest = pool[2 * args.queries : 3 * args.queries], pool[3 * args.queries :]

    from bertknn.service.model_load import default_threads

    threads = args.threads or default_threads(max(1, args.workers))  # split between the processes
    torch.set_num_threads(threads)
    env = {"BERTKNN_MODEL__THREADS": str(threads), "BERTKNN_MODEL__BACKEND": args.backend,
           "BERTKNN_MODEL__DEVICE": args.device, "BERTKNN_DEFAULTS__RETRIEVER": args.retriever, "BERTKNN_WORKERS": str(args.workers),
           "BERTKNN_MODEL__KNN_DEVICE": args.knn_device, "BERTKNN_MODEL__KNN_DEVICE_ROWS": args.knn_device_rows,
           "BERTKNN_MODEL__VOTE_DEVICE": args.vote_device,
           "BERTKNN_BATCHING__ON_EVENT_LOOP": "true" if args.on_event_loop else "false", "BERTKNN_LAYOUT": args.layout,
           "BERTKNN_MODEL__CUDA_WAIT": args.cuda_wait}  # fmt: skip
    ds = build_datastore([args.corpus], args.work / ("ds" if args.retriever == "bm25" else "ds-tfidf"), args.model, limit=args.articles,
                         bm25=args.retriever == "bm25")  # fmt: skip
    man = Datastore(ds).manifest

    # the service's device and dtype (its defaults: auto for both), so that both sides run the same forward
    enc = MaskedLMEncoder.load(args.model, layer=man.layer, device=args.device, dtype="auto", max_seq_len=man.max_seq_len)
    lat_texts = [t for t, _ in lat_q["raw"] + lat_q["httpx"]]
    bare_forward(enc, lat_texts[:5])  # warm-up
    eager = percentiles(bare_forward(enc, lat_texts))  # for reference: what the backend changes
    backend = enc.set_backend(args.backend)  # the same backend as the service's (same process setting)
    bare_forward(enc, lat_texts[:5])
    result: dict = {"model": Path(args.model).name, "machine": machine(), "device": str(enc.device),
        "dtype": str(enc.dtype).removeprefix("torch."), "datastore": {
        "articles": man.counts.articles, "contexts": man.counts.contexts}, "backend": backend,
        "retriever": args.retriever, "workers": args.workers or "auto", "knn_device": args.knn_device,
        "knn_device_rows": args.knn_device_rows, "vote_device": args.vote_device, "on_event_loop": args.on_event_loop,
        "layout": args.layout, "cuda_wait": args.cuda_wait, "bare_forward_eager_ms": _ms(eager), "clients": {}}  # fmt: skip
    # Several processes share one cache, as a deployment's share Redis (each process's own in-process cache would
    # miss a question the other process answered): a redis-server of the run's own.
    several = args.workers > 1 or (args.workers == 0 and enc.device.type == "cuda")
    result["cache"] = "redis" if several else "in-process"
    with _cache_for(several, env):
        # The machine's speed drifts (shared host): the bare forward is measured in the same time windows as the
        # requests it is compared with (the service idles during the bare blocks, the bench process during the
        # HTTP ones).
        with service_process(ds, env=env) as svc:
            for client in CLIENTS:
                http_latencies(svc.url, lama_queries(30, seed=99 if client == "raw" else 96), client)  # warm-up
            all_bare = _latency(svc.url, enc, lat_q, result)
            _throughput(svc, enc, levels, per_level, rest, result)
        if args.scale:
            result["scale"] = _scale(ds, args.scale, args.work, env, scale_q)
    result["bare_forward_ms"] = _ms(percentiles(all_bare))
    # the default settings write serving.json; other backends, thread counts or a GPU their own file beside it
    default = args.backend == "auto" and not args.threads and args.retriever == "bm25" and not args.workers
    default = default and args.knn_device == "host" and not args.on_event_loop and args.layout == "full"
    default = default and args.cuda_wait == "spin"
    name = "serving" if default else f"serving-{backend}-{threads}t" + ("" if args.retriever == "bm25" else "-tfidf")
    if result["device"] != "cpu":
        name = f"serving-{result['device']}"
    if args.workers:
        name += f"-{args.workers}w"
    if args.knn_device != "host":
        name += f"-knn-{args.knn_device}" + ("" if args.knn_device_rows == "auto" else f"-{args.knn_device_rows}")
        name += "-vote-model" if args.vote_device == "model" else ""
    name += "-loop" if args.on_event_loop else ""
    name += "-split" if args.layout == "split" else ""
    name += "-block" if args.cuda_wait == "block" else ""
    path = write_result(result_name(name, args.model), result)
    _report(result, backend, threads)
    print(f"wrote {path}")
    print(json.dumps({c: r["uncached_p50_over_bare_p50"] for c, r in result["clients"].items() if c in CLIENTS}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
