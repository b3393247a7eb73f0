"""The service's host work per request: req/s, server CPU per uncached request and how much of it the forward is. ::

    python -m bench.hostwork [--workers 1,2] [--baseline REV] [--requests 1500] [--threads 1]

The model is bert-base-uncased's shape (12 layers, its vocabulary and tokenizer) at hidden size 64, so that its
forward costs little and most of what is left is what every request costs the host's Python: HTTP, validation,
tokenisation, caching, retrieval, the kNN, the vote and the response. After the load, the bare forward with the
service's backend is timed at each run's mean batch size (rows per forward batch, from the service's metrics), and
each run's server CPU per request is split into that forward and the rest: the host work that a GPU would not take
over, by which its throughput per process divides (`docs/performance.md`, "Host work"). In the split layout
(``--setting layout=split``) the model process's own CPU is split the same way, at its merged passes' size: what it
does besides the forward bounds the requests per second of one model process whatever its device, and the API
processes' CPU is what is left (`docs/decisions/serving-processes.md`, "What the CPU predicts for a GPU"). Questions
are distinct (every request a cache miss), without a subject, so that the retriever ranks the articles: TF-IDF, or
with ``--retriever bm25`` Lucene's BM25 through the JVM. Server CPU is summed over every process of the service (its
workers too), and split by kind of thread over them all (``main``, each process's event loop; ``model``, its model
thread; ``retrieval``, ``knn``...: `bench.common.thread_cpu_s`). With ``--hits`` each level's questions are asked once before it is measured, so that every measured
request is a hit of the in-process cache (its encoding and its articles): no forward, the rest of a request's work
(`Finisher.hit`). Each service process has a cache of its own, so ``--hits`` takes ``--workers 1``.

``--baseline REV`` serves the same datastore from another commit (a git worktree under runs/) in the same run:
both services are up at once and each level's questions go to them in ``--blocks`` blocks that take turns (A B,
B A, ...), so that the host's drift falls on both, in two halves: the services started in one order, then started
again in the other. Each ratio comes with a 95 % interval over the blocks (`paired_interval`). Their answers
to the same questions are compared (top-1 and every prediction's probability, over all of them and over those that
searched the same articles: `bench.answers`, which also counts the other articles that a tie at the ranker's
boundary explains). ``--setting
[SECTION.]NAME=VALUE`` (repeatable) serves this tree a second time with those of the service's settings changed
(e.g. ``batching.on_event_loop=true``), the same way, at every ``--workers`` count. ``--threads N`` gives every
service process of every tree N model threads (one by default, the service's own default on two cores). ``--model
DIR`` serves another model (the proxy, for answers that mean something); the default is the hidden-size-64 one.

Before the load, each tree's service is started ``--starts`` times (the trees taking turns) for its start-up: the
seconds from its launch until it answers ``/readyz``, and its resident memory then (before any request), against
the baseline's with ``--baseline``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.answers import answers, compare, in_words
from bench.bert_base import BERT_BASE, make
from bench.common import (
    REPO,
    RUNS,
    baseline_or_exit,
    build_datastore,
    cpu_between,
    host_port,
    lama_queries,
    machine,
    ms_per_request,
    run_async,
    thread_cpu_s,
    tree_cpu_s,
    tree_rss_mb,
    write_result,
)
from bench.rawhttp import AsyncRawClient
from tests.support.processes import service_process

# bert-base-uncased's depth, heads' count and vocabulary at hidden size 64: the forward costs almost nothing
TINY = {**BERT_BASE, "hidden_size": 64, "num_attention_heads": 4, "intermediate_size": 256}
CORPUS = REPO / "data" / "sample_wiki.jsonl"


async def _load(url: str, payloads: list[dict], clients: int) -> tuple[float, int, int]:
    """Every payload once, ``clients`` keep-alive connections at a time: (seconds, ok, errors)."""
    it = iter(payloads)
    ok = err = 0
    conns = [AsyncRawClient(*host_port(url)) for _ in range(clients)]

    async def worker(conn: AsyncRawClient) -> None:
        nonlocal ok, err
        for payload in it:
            status, _ = await conn.post_json("/predict", payload)
            ok, err = (ok + 1, err) if status == 200 else (ok, err + 1)

    try:
        t = time.perf_counter()
        await asyncio.gather(*(worker(c) for c in conns))
        return time.perf_counter() - t, ok, err
    finally:
        for c in conns:
            await c.close()


# what `counters` keeps of `bench.serving.scrape_stages`: the processes' batches and, in the split layout, the model
# process's merged passes and CPU seconds
METRICS = {"batch:sum": "rows", "batch:count": "batches", "model_batch:sum": "model_rows",
           "model_batch:count": "model_passes", "model_cpu_s": "model_cpu_s"}  # fmt: skip


def counters(url: str) -> dict[str, float]:
    """The service's running sums from its /metrics (summed over its processes): the rows and forward batches of
    its processes (``rows``, ``batches``) and, in the split layout, its model process's merged passes
    (``model_rows``, ``model_passes``) and CPU seconds (``model_cpu_s``); 0 where the service has none."""
    from bench.serving import scrape_stages

    got = scrape_stages(url)
    return {ours: got.get(theirs, 0.0) for theirs, ours in METRICS.items()}


def warm_up_size(requests: int, clients: int, blocks: int) -> int:
    """The questions each service answers, unmeasured, before a level's blocks: a block's worth (at least one a
    client, and 20). After a warm-up of 20, the first block still held first-time costs, and the service that
    took the first turn paid more of them: a commit measured against itself came out dearer in the first slot,
    whichever tree held it (docs/performance.md, "Host work")."""
    return max(clients, 20, -(-requests // blocks))


TOTALS = ("secs", "ok", "err", "cpu_s", *METRICS.values())


@dataclass
class LevelSums:
    """One service's counters summed over a level's turns (`measure_sums`): ``totals`` (seconds, answered, errors,
    CPU seconds, `METRICS`), CPU seconds by kind of thread, and each turn's [CPU seconds, answered]. Two runs of
    a level add up."""

    totals: dict[str, float] = field(default_factory=lambda: dict.fromkeys(TOTALS, 0.0))
    threads: dict[str, float] = field(default_factory=dict)
    turns: list[list[float]] = field(default_factory=list)

    def add(self, other: LevelSums) -> None:
        for key, value in other.totals.items():
            self.totals[key] += value
        for kind, seconds in other.threads.items():
            self.threads[kind] = self.threads.get(kind, 0.0) + seconds
        self.turns += other.turns

    def figures(self) -> dict[str, Any]:
        by_thread = ms_per_request(self.threads, self.totals["ok"])
        return {**_level(self.totals, len(self.turns)), "server_cpu_ms_per_request_by_thread": by_thread,
                "by_block": self.turns}  # fmt: skip


def measure(
    services: dict[str, tuple[str, int]], payloads: list[dict], clients: int, blocks: int, *, hits: bool = False,
    warm: int | None = None,
) -> dict[str, dict]:
    """`measure_sums`' figures: req/s, errors, the service's CPU ms per answered request (all its processes), rows
    per batch; in the split layout also its model process's rows per merged pass and CPU ms per answered
    request."""
    got = measure_sums(services, payloads, clients, blocks, hits=hits, warm=warm)
    return {name: sums.figures() for name, sums in got.items()}


def measure_sums(
    services: dict[str, tuple[str, int]], payloads: list[dict], clients: int, blocks: int, *, hits: bool = False,
    warm: int | None = None,
) -> dict[str, LevelSums]:
    """One level for each running service (name: (url, pid)), after ``warm`` questions each (unmeasured), the same
    questions to each in ``blocks`` blocks that take turns (A B, B A, ...) so that the host's drift falls on every
    service alike. With ``hits``, every question is asked once before (not measured): each measured request is a
    cache hit."""
    warm = max(clients, 20) if warm is None else warm
    for url, _ in services.values():
        run_async(_load(url, payloads if hits else payloads[:warm], clients))  # warm-up: connections, first batches
    rest = payloads[warm:]
    size = -(-len(rest) // blocks)
    sums = {name: LevelSums() for name in services}
    for b in range(blocks):
        part = rest[b * size : (b + 1) * size]
        for name in list(services) if b % 2 == 0 else list(services)[::-1]:
            url, pid = services[name]
            before, cpu0, by0 = counters(url), tree_cpu_s(pid), thread_cpu_s(pid)
            secs, ok, err = run_async(_load(url, part, clients))
            by1, cpu1, after = thread_cpu_s(pid), tree_cpu_s(pid), counters(url)
            turn = LevelSums(threads=cpu_between(by0, by1), turns=[[round(cpu1 - cpu0, 4), ok]])
            turn.totals.update(secs=secs, ok=ok, err=err, cpu_s=cpu1 - cpu0)
            turn.totals.update({key: after[key] - before[key] for key in METRICS.values()})
            sums[name].add(turn)
    return sums


def paired_interval(ours: list[list[float]], theirs: list[list[float]], *, rounds: int = 2000) -> list[float] | None:
    """A 95 % interval of the ratio of two services' server CPU per request, from their turns' [CPU seconds,
    requests] in the same blocks (`measure`'s ``by_block``): the blocks drawn again with replacement, the same
    draws for both (a block's two turns shared its questions and the host's speed of the moment). None with fewer
    than 4 blocks. Two services of the same code give an interval around 1 as wide as the host's noise: a ratio
    whose interval holds 1 is not told apart from no change by this run."""
    if len(ours) != len(theirs) or len(ours) < 4:
        return None
    a, b = np.array(ours, dtype=float), np.array(theirs, dtype=float)
    draws = np.random.default_rng(0).integers(0, len(a), size=(rounds, len(a)))
    ratio = (a[draws, 0].sum(1) / a[draws, 1].sum(1)) / (b[draws, 0].sum(1) / b[draws, 1].sum(1))
    return [round(float(x), 3) for x in np.percentile(ratio, [2.5, 97.5])]


def _level(g: dict[str, float], blocks: int) -> dict[str, Any]:
    """A level's figures from its summed counters (`measure`)."""
    ok = max(1, int(g["ok"]))
    out: dict[str, Any] = {"requests_per_s": round(g["ok"] / g["secs"], 1),
                           "server_cpu_ms_per_request": round(g["cpu_s"] * 1000 / ok, 3),
                           "requests": int(g["ok"] + g["err"]), "errors": int(g["err"]), "blocks": blocks,
                           "rows_per_batch": round(g["rows"] / max(1.0, g["batches"]), 2)}  # fmt: skip
    if g["model_passes"] > 0:  # the split layout
        out["rows_per_model_pass"] = round(g["model_rows"] / g["model_passes"], 2)
        out["model_process_cpu_ms_per_request"] = round(g["model_cpu_s"] * 1000 / ok, 3)
    return out


def _encoder(model: Path, ds: Path) -> Any:
    """The datastore's encoder of ``model`` on this CPU, one thread: the service's, without the service."""
    import torch

    from bertknn.core.encoder import MaskedLMEncoder
    from bertknn.core.format import Datastore

    torch.set_num_threads(1)
    man = Datastore(ds).manifest
    return MaskedLMEncoder.load(str(model), layer=man.layer, device="cpu", max_seq_len=man.max_seq_len)


def forward_ms(enc: Any, texts: list[str]) -> dict[str, float]:
    """The bare forward's ms per question, one at a time, eager and with the service's backend on this CPU (one
    thread): how much of a request the forward itself is, with this model (``enc``: `_encoder`)."""
    from bench.common import bare_forward, percentiles

    out = {}
    for backend in ("eager", "auto"):
        name = enc.set_backend(backend)
        bare_forward(enc, texts[:10])  # warm-up
        out[f"{name}_p50"] = round(percentiles(bare_forward(enc, texts))["p50"] * 1000, 3)
    return out


def forward_per_row_ms(enc: Any, texts: list[str], sizes: set[int]) -> dict[int, float]:
    """The bare forward with the service's backend in batches of each size, one thread: ms per question (the
    median batch's time over its size). What a run's forward cost the server's CPU at its batch size, to tell
    the forward's share of a request from the rest."""
    from bench.common import bare_forward

    enc.set_backend("auto")
    out = {}
    for size in sorted(sizes):
        chunk = (texts * (-(-size * 20 // len(texts))))[: size * 20]  # 20 batches of real questions
        bare_forward(enc, chunk[: size * 2], batch=size)  # warm-up
        out[size] = round(float(np.median(bare_forward(enc, chunk, batch=size))) * 1000 / size, 3)
    return out


def forward_rows(run: dict) -> int:
    """The rows per forward pass a run's forward ran at: its model process's merged passes in the split layout,
    else its processes' batches."""
    return max(1, round(run.get("rows_per_model_pass", run["rows_per_batch"])))


def split_forward(runs: list[dict], per_row: dict[int, float] | None) -> None:
    """Each run's server CPU per request split into the forward's (`forward_per_row_ms` at the run's mean batch
    size, rounded) and the rest, the host work a GPU would not take over. In the split layout, the model
    process's CPU per request is split the same way: its rest (the asks, the merge, the heads, the replies) is
    work that one interpreter does for every request, so it bounds the requests per second of one model process
    whatever its device (``model_process_bound_per_s``, at this host's speed); the API processes' share is what
    is left. ``per_row`` None: cache hits, which run no forward."""
    for r in runs:
        fwd = 0.0 if per_row is None else per_row[forward_rows(r)]
        r["forward_ms_per_request"] = fwd
        r["host_ms_per_request"] = round(r["server_cpu_ms_per_request"] - fwd, 3)
        if "model_process_cpu_ms_per_request" in r:
            rest = r["model_process_cpu_ms_per_request"] - fwd
            r["model_process_host_ms_per_request"] = round(rest, 3)
            r["model_process_bound_per_s"] = round(1000 / rest, 1) if rest > 0 else None
            r["api_processes_cpu_ms_per_request"] = round(
                r["server_cpu_ms_per_request"] - r["model_process_cpu_ms_per_request"], 3)


def threads_line(r: dict) -> str:
    """A run's server CPU per request by kind of thread, as printed (``main``: each process's event loop)."""
    return ", ".join(f"{kind} {ms:.2f}" for kind, ms in r["server_cpu_ms_per_request_by_thread"].items())


def split_line(r: dict) -> str:
    """A run's `split_forward` figures, as printed."""
    head = f"{r['tree']:>20}  workers {r['workers']:>2}  clients {r['clients']:>3}:"
    forward = f"the bare forward at {forward_rows(r)} rows per batch" if r["forward_ms_per_request"] else "no forward"
    line = (f"{head} of the server CPU per request, {forward} {r['forward_ms_per_request']:.2f} ms, the rest "
            f"{r['host_ms_per_request']:.2f} ms")  # fmt: skip
    if "model_process_host_ms_per_request" in r:
        bound = r["model_process_bound_per_s"]
        line += (f"\n{head} the model process {r['model_process_cpu_ms_per_request']:.2f} ms of it ({forward_rows(r)} "
                 f"rows per merged pass), of that the rest {r['model_process_host_ms_per_request']:.2f} ms: one model "
                 f"process answers at most {bound if bound is not None else 'n/a'} req/s on this host, whatever its "
                 f"device; the API processes {r['api_processes_cpu_ms_per_request']:.2f} ms")  # fmt: skip
    return line


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", default="1", help="comma-separated service process counts (e.g. 1,2)")
    p.add_argument("--clients", default="1,64", help="comma-separated concurrent client counts")
    p.add_argument("--requests", type=int, default=1500, help="distinct questions per level")
    p.add_argument("--articles", type=int, default=40, help="articles of the sample corpus in the datastore")
    p.add_argument("--retriever", choices=("tfidf", "bm25"), default="tfidf",
                   help="what ranks the articles (bm25: Lucene through the JVM, as the service's default)")
    p.add_argument("--baseline", default=None, help="a commit to measure beside this tree in the same run")
    p.add_argument("--setting", action="append", default=[], help="[SECTION.]NAME=VALUE: this tree served again "
                   "with that service setting, beside it in the same run (e.g. batching.on_event_loop=true); "
                   "repeated: all of them at once")
    p.add_argument("--model", type=Path, default=None, help="a masked LM directory (default: bert-base's shape at "
                   "hidden size 64, written here)")
    p.add_argument("--compare", type=int, default=300, help="questions whose answers are compared with --baseline's")
    p.add_argument("--work", type=Path, default=RUNS / "bench-hostwork")
    p.add_argument("--threads", type=int, default=1, help="the model's threads in every service process of every "
                   "tree (model.threads; the bare forward's stay one)")
    p.add_argument("--starts", type=int, default=3, help="service starts per tree for the start-up figures")
    p.add_argument("--blocks", type=int, default=8, help="blocks of each level, the trees taking turns (at least 4 for "
                   "the 95 %% interval of a ratio)")
    p.add_argument("--hits", action="store_true", help="every measured request a hit of the in-process cache (each "
                   "level's questions asked once before; one service process)")
    p.add_argument("--name", default=None, help="the results file, bench/results/NAME.json (default: hostwork, or "
                   "hostwork-MODEL with --model; -hits with --hits)")  # fmt: skip
    return p


def setting_env(text: str) -> dict[str, str]:
    """``[SECTION.]NAME=VALUE`` as the service's environment variable; ValueError naming what is wrong."""
    from bertknn.service.settings import ServiceSettings

    key, sep, value = text.partition("=")
    section, dot, name = key.strip().rpartition(".")
    top = ServiceSettings.model_fields
    if not dot:
        fields = top
    else:
        fields = getattr(top[section].annotation, "model_fields", {}) if section in top else {}
    if not sep or name not in fields or hasattr(fields[name].annotation, "model_fields"):
        sections = sorted(k for k, f in top.items() if hasattr(f.annotation, "model_fields"))
        raise ValueError(f"--setting takes [SECTION.]NAME=VALUE with a setting of the service's (sections: "
                         f"{', '.join(sections)}; docs/configuration.md), got {text!r}")  # fmt: skip
    return {"BERTKNN_" + (f"{section.upper()}__" if dot else "") + name.upper(): value.strip()}


def _ints(text: str, flag: str, parser: argparse.ArgumentParser) -> list[int]:
    try:
        values = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        parser.error(f"{flag} takes comma-separated whole numbers, got {text!r}")
    if not values or min(values) < 1:
        parser.error(f"{flag} takes numbers of at least 1, got {text!r}")
    return values


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    workers, clients = _ints(args.workers, "--workers", p), _ints(args.clients, "--clients", p)
    if args.requests < 100 or args.starts < 1 or args.blocks < 2 or args.threads < 1:
        p.error("--requests must be at least 100, --blocks at least 2 (a level runs in two halves), --starts and "
                "--threads at least 1")
    if args.hits and max(workers) > 1:  # a re-ask may reach another process, whose cache never saw the question
        p.error("--hits measures hits of the in-process cache, which each service process has of its own: use "
                "--workers 1")
    model = args.model or make(args.work / "bert-base-h64", shape=TINY)
    ds_name = f"ds-{args.articles}" + ("" if args.model is None else f"-{Path(args.model).name}")
    ds_name += "-bm25" if args.retriever == "bm25" else ""
    ds = build_datastore([CORPUS], args.work / ds_name, model, limit=args.articles, bm25=args.retriever == "bm25")
    try:
        changed = {k: v for text in args.setting for k, v in setting_env(text).items()} if args.setting else None
    except ValueError as exc:
        p.error(str(exc))
    # each way to serve: the source tree, the settings it changes
    ways: dict[str, tuple[Path, dict[str, str]]] = {"this tree": (REPO, {})}
    if args.baseline:
        ways[f"baseline {args.baseline}"] = (baseline_or_exit(p, args.baseline), {})
    if changed is not None:
        ways[f"this tree, {', '.join(args.setting)}"] = (REPO, changed)
    env = {"BERTKNN_DEFAULTS__RETRIEVER": args.retriever, "BERTKNN_MODEL__THREADS": str(args.threads)}
    if args.hits:  # room for a level's encodings and articles (two entries a question), or its re-asks would miss
        env["BERTKNN_CACHE__LRU_SIZE"] = str(max(4096, 2 * (args.requests + max(clients)) + 64))
    # distinct within a service process (its cache lives as long as it does); every process starts from the first
    need = sum(level_questions(args.requests, c, args.blocks) for c in clients) + args.compare
    pool = [{"text": t} for t, _ in lama_queries(need, seed=5)]
    if len(pool) < need:
        p.error(f"--requests and --compare ask for {need} distinct questions; the LAMA templates give {len(pool)}")
    model_name = "bert-base-uncased's shape at hidden size 64" if args.model is None else Path(args.model).name
    result: dict = {"model": model_name, "machine": machine(), "articles": args.articles, "retriever": args.retriever,
                    "model_threads": args.threads, "cache_hits": args.hits, "runs": []}  # fmt: skip
    enc = _encoder(model, ds)  # the bare forward's, in this process, before the load and after it
    result["bare_forward_ms"] = forward_ms(enc, [p["text"] for p in pool[:200]])
    print(f"bare forward of one question, ms (p50): {result['bare_forward_ms']}", flush=True)
    asked = pool[-args.compare :] if args.compare else []  # the same questions for every tree, never in the load
    pool = pool[: len(pool) - len(asked)]
    said: dict[str, list] = {}
    result["starts"] = starts(ways, ds, env, args.starts)
    for n in workers:
        names = [name for name, (tree, _) in ways.items() if tree == REPO or n == 1]  # the baseline serves one process
        levels = serve_levels({name: ways[name] for name in names}, n, ds, env, clients, pool, args, asked, said)
        for c in clients:
            for name in names:
                row = levels[(c, name)].figures()
                result["runs"].append({"tree": name, "workers": n, "clients": c, **row})
                print(f"{name:>20}  workers {n:>2}  clients {c:>3}: {row['requests_per_s']:>7.1f} req/s, "
                      f"server CPU {row['server_cpu_ms_per_request']:.2f} ms/request, {row['rows_per_batch']} rows "
                      f"per batch, {row['errors']} errors", flush=True)  # fmt: skip
                print(f"{'':>20}  by thread, ms per request: {threads_line(row)}", flush=True)
    missed = [r for r in result["runs"] if args.hits and r["rows_per_batch"] > 0]
    if missed:
        print(f"--hits: {len(missed)} runs had cache misses (forward passes): not every request was a hit; no "
              "results written", file=sys.stderr)  # fmt: skip
        return 1
    sizes = {forward_rows(r) for r in result["runs"]}
    split_forward(result["runs"], None if args.hits else forward_per_row_ms(enc, [p["text"] for p in pool[:200]], sizes))
    for r in result["runs"]:
        print(split_line(r), flush=True)
    _ratios(result)
    for name in said:
        if name != "this tree":
            key = "answers_vs_baseline" if name.startswith("baseline") else "answers_with_setting"
            result[key] = compare(said["this tree"], said[name])
            print(f"answers of {name} against this tree's: {in_words(result[key])}")
    name = args.name or ("hostwork" if args.model is None else f"hostwork-{Path(args.model).name}")
    name += "-bm25" if args.retriever == "bm25" and not args.name else ""
    name += "-hits" if args.hits and not args.name else ""
    path = write_result(name, result)
    print(f"wrote {path}")
    return 0


def halves(requests: int, blocks: int) -> list[tuple[int, int]]:
    """A level's two halves (`serve_levels`): each one's measured questions and blocks."""
    return [(requests // 2, blocks // 2), (requests - requests // 2, blocks - blocks // 2)]


def level_questions(requests: int, clients: int, blocks: int) -> int:
    """The distinct questions one level takes: each half's warm-up and measured questions."""
    return sum(r + warm_up_size(r, clients, b) for r, b in halves(requests, blocks))


def serve_levels(
    ways: dict[str, tuple[Path, dict[str, str]]], n: int, ds: Path, env: dict[str, str], clients: list[int],
    pool: list[dict], args: argparse.Namespace, asked: list[dict], said: dict[str, list],
) -> dict[tuple[int, str], LevelSums]:
    """Every client level of each way's service at ``n`` processes, in two halves of its questions and blocks: the
    services started and taking their turns in ``ways``' order, then started again in the reverse order. The
    order costs something: a commit measured against itself spent more CPU per request in the service started
    first, whichever tree that was (docs/performance.md, "Host work"). Answers to ``asked`` go to ``said``."""
    got: dict[tuple[int, str], LevelSums] = {}
    for half, order in enumerate((list(ways), list(ways)[::-1])):
        with contextlib.ExitStack() as stack:
            up = {name: stack.enter_context(service_process(
                ds, env={**env, **ways[name][1], "PYTHONPATH": str(ways[name][0])}, cwd=ways[name][0],
                args=("--workers", str(n)) if n != 1 else ())) for name in order}  # fmt: skip
            for name, svc in up.items():
                if asked and name not in said:
                    said[name] = answers(svc.url, asked)
            requests, blocks = halves(args.requests, args.blocks)[half]
            at = 0
            for c in clients:
                warm = warm_up_size(requests, c, blocks)
                start = at + (0 if half == 0 else level_questions(args.requests, c, args.blocks) - warm - requests)
                sums = measure_sums({k: (svc.url, svc.proc.pid) for k, svc in up.items()},
                                    pool[start : start + warm + requests], c, blocks, hits=args.hits, warm=warm)  # fmt: skip
                at += level_questions(args.requests, c, args.blocks)
                for name, level in sums.items():
                    got.setdefault((c, name), LevelSums()).add(level)
    return got


def timed_starts(ways: dict[str, tuple[Path, dict[str, str]]], ds: Path, n: int) -> dict[str, dict[str, Any]]:
    """Each way's service (one process: the source tree it is served from, its environment) started ``n`` times,
    the ways taking turns: the seconds from its launch until it answers ``/readyz`` and its resident memory then,
    before any request (each start's, and their medians)."""
    got: dict[str, dict[str, list[float]]] = {name: {"start_s": [], "rss_mb": []} for name in ways}
    for _ in range(n):
        for name, (tree, env) in ways.items():
            t = time.perf_counter()
            with service_process(ds, env=env, cwd=tree) as svc:
                got[name]["start_s"].append(round(time.perf_counter() - t, 2))
                got[name]["rss_mb"].append(round(tree_rss_mb(svc.proc.pid), 1))
    out: dict[str, dict[str, Any]] = {}
    for name, runs in got.items():
        out[name] = {**runs, **{f"{k}_median": round(float(np.median(v)), 2) for k, v in runs.items()}}
        print(f"{name:>20}  ready after {out[name]['start_s_median']} s, {out[name]['rss_mb_median']} MiB resident "
              f"(medians of {n} starts, before any request)", flush=True)  # fmt: skip
    return out


def starts(ways: dict[str, tuple[Path, dict[str, str]]], ds: Path, env: dict[str, str], n: int) -> dict[str, dict[str, Any]]:
    """Each way's `timed_starts` (its tree, the settings it changes), and this tree's medians against the
    baseline's."""
    out = timed_starts({name: (tree, {**env, **changed, "PYTHONPATH": str(tree)})
                        for name, (tree, changed) in ways.items()}, ds, n)  # fmt: skip
    base = next((v for k, v in out.items() if k.startswith("baseline")), None)
    if base is not None:
        ours = out["this tree"]
        ours["vs_baseline"] = {k: round(ours[f"{k}_median"] / base[f"{k}_median"], 3) for k in ("start_s", "rss_mb")}
        print(f"start-up: {ours['vs_baseline']}x the baseline's (time, resident memory)", flush=True)
    return out


def _ratios(result: dict) -> None:
    """This tree against the baseline at each client count (one process each), when a baseline ran; this tree
    with ``--setting`` against this tree at each worker and client count, when it ran."""
    runs = result["runs"]
    for r in runs:
        ours = next((t for t in runs if t["tree"] == "this tree" and (t["workers"], t["clients"]) ==
                     (r["workers"], r["clients"])), None)  # fmt: skip
        if r["tree"].startswith("this tree, ") and ours is not None:
            cpu = r["server_cpu_ms_per_request"] / ours["server_cpu_ms_per_request"]
            tput = r["requests_per_s"] / ours["requests_per_s"]
            r["vs_this_tree"] = {"cpu_per_request": round(cpu, 3), "requests_per_s": round(tput, 3),
                                 "cpu_per_request_95": _interval(r, ours)}  # fmt: skip
            print(f"workers {r['workers']:>2}  clients {r['clients']:>3}: with {r['tree'][11:]}, server CPU per "
                  f"request {cpu:.2f}x{_said(r['vs_this_tree'])}, req/s {tput:.2f}x", flush=True)  # fmt: skip
    for r in runs:
        base = next((b for b in runs if b["tree"].startswith("baseline") and b["clients"] == r["clients"]), None)
        if base is None or r["tree"] != "this tree" or r["workers"] != 1:
            continue
        cpu = base["server_cpu_ms_per_request"] / r["server_cpu_ms_per_request"]
        tput = r["requests_per_s"] / base["requests_per_s"]
        r["vs_baseline"] = {"cpu_per_request": round(1 / cpu, 3), "requests_per_s": round(tput, 3),
                            "cpu_per_request_95": _interval(r, base)}  # fmt: skip
        print(f"clients {r['clients']:>3}: server CPU per request {1 / cpu:.2f}x the baseline's"
              f"{_said(r['vs_baseline'])}, req/s {tput:.2f}x", flush=True)


def _interval(ours: dict, theirs: dict) -> list[float] | None:
    return paired_interval(ours.get("by_block", []), theirs.get("by_block", []))


def _said(vs: dict) -> str:
    low_high = vs["cpu_per_request_95"]
    if low_high is None:
        return " (too few blocks for an interval)"
    told = "" if low_high[0] <= 1 <= low_high[1] else "; 1 is outside it"
    return f" (95 % interval over the blocks {low_high[0]:.2f}-{low_high[1]:.2f}{told})"


if __name__ == "__main__":
    sys.exit(main())
