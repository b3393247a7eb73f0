"""Where one uncached question's time goes in the service, step by step, from the HTTP layer to the response. ::

    python -m bench.steps [--model runs/bert-base-shaped] [--device auto] [--requests 200]

One client asks distinct questions one after another (every request a cache miss, the model idle when it
arrives) over one keep-alive connection (`bench/rawhttp.py`); the service runs in one process with a probe at each
step (`bench.steps_probe`). Per request, the steps add up to the time the service held it:

- ``request_in``: the middleware's start to tokenisation (the body read and validated, dependencies, deadline,
  cost, admission);
- ``tokenise``; ``to_model_thread``: cache key and lookup, the batcher, the model thread's wake-up;
- ``forward``: the service's forward pass, p_MLM's head included;
- ``before_answer``: what runs between the forward and the answer (the kNN and vote on the device, where they run
  there);
- ``answer``: the restricted kNN, the vote, the interpolation, the supporting contexts, entity references;
- ``to_event_loop``: the answer handed to the request's task; ``response_out``: metrics, the response model, its
  JSON and the socket writes.

It reports each step's p50 and p90, the service's time (``held``), the client's (``client``: the HTTP parsing and the
kernel's loopback besides), and ``own``, the service's time apart from its forward pass, per request: what issue
#52's p50 ratio divides by the forward. Beside them, this host's cold tax (`cold_tax`): the same tokenisation back
to back and after an idle wait as long as the forward, in this process: code that runs after a wait runs on cold
caches, as the event loop's steps do (it idles through the forward). Writes bench/results/steps[-MODEL][-DEVICE].json (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import bisect
import json
import tempfile
import time
from pathlib import Path

import numpy as np
from transformers import AutoTokenizer

from bench.common import (
    REPO,
    RUNS,
    build_datastore,
    host_port,
    lama_queries,
    machine,
    result_name,
    service_process,
    write_json,
    write_result,
)
from bench.rawhttp import RawClient
from bertknn.core.context_tokenizer import ContextTokenizer
from bertknn.core.format import read_manifest
from bertknn.core.model_ref import locate_model

# (step, the probe event it starts at, the one it ends at); each ends where the next starts
STEPS = (
    ("request_in", "http<", "tokenise<"),
    ("tokenise", "tokenise<", "tokenise>"),
    ("to_model_thread", "tokenise>", "forward<"),
    ("forward", "forward<", "forward>"),
    ("before_answer", "forward>", "answer<"),
    ("answer", "answer<", "answer>"),
    ("to_event_loop", "answer>", "answered>"),
    ("response_out", "answered>", "http>"),
)
ORDER = ("http<", "answered<", "tokenise<", "tokenise>", "forward<", "forward>", "answer<", "answer>", "answered>", "http>")
CACHED = tuple(name for name in ORDER if not name.startswith("forward"))


def requests_of(events: list[tuple[str, float, int | None]], since: float) -> tuple[list[dict[str, float]], int, int]:
    """The probe times (name -> seconds) of each question that reached the service at or after ``since`` (a
    `time.perf_counter` of this process: on Linux both read the same monotonic clock) and ran every step in
    `ORDER`; then how many others were answered from the cache (every step but the forward: two texts a model
    tokenises alike), and how many ran some other way (a request that is not a question).

    A request's records are those of its own task (the event loop's probes) and those of the model thread that
    fall between its ``answered`` probe's start and end: one question after another, only one is on its way
    there at a time, while the end of one request's task may run after the next one's start."""
    tasks: dict[int, list[tuple[str, float]]] = {}
    elsewhere = []
    for name, t, task in events:
        if task is None:
            elsewhere.append((name, t))
        else:
            tasks.setdefault(task, []).append((name, t))
    orders = []
    for run in tasks.values():
        if run[0][0] != "http<" or run[0][1] < since:
            continue
        span = [t for name, t in run if name.startswith("answered")]
        inside = [(n, t) for n, t in elsewhere if len(span) == 2 and span[0] <= t <= span[1]]
        merged = sorted(run + inside, key=lambda e: e[1])
        orders.append((tuple(n for n, _ in merged), merged))
    kept = [dict(run) for order, run in orders if order == ORDER]
    cached = sum(order == CACHED for order, _ in orders)
    return kept, cached, len(orders) - len(kept) - cached


def step_times(request: dict[str, float]) -> dict[str, float]:
    """One request's steps in ms, with ``held`` (their sum) and ``own`` (``held`` less the forward)."""
    out = {name: 1000 * (request[end] - request[start]) for name, start, end in STEPS}
    out["held"] = 1000 * (request["http>"] - request["http<"])
    out["own"] = out["held"] - out["forward"]
    return out


def summarise(rows: list[dict[str, float]], client: list[float]) -> dict[str, dict[str, float]]:
    """p50 and p90 of each step, of ``held``, ``own`` and the client's time."""
    cols = {name: [r[name] for r in rows] for name in (*(s for s, _, _ in STEPS), "held", "own")}
    cols["client"] = client
    return {name: {"p50": round(float(np.percentile(v, 50)), 3), "p90": round(float(np.percentile(v, 90)), 3)}
            for name, v in cols.items()}  # fmt: skip


def ask(url: str, texts: list[str]) -> list[tuple[float, float]]:
    """Each question once, one after another over one connection: when each was sent and its answer read
    (`time.perf_counter`)."""
    out = []
    with RawClient(*host_port(url)) as raw:
        for text in texts:
            t = time.perf_counter()
            status, body = raw.post_json("/predict", {"text": text})
            out.append((t, time.perf_counter()))
            if status != 200:
                raise RuntimeError(f"/predict answered {status}: {body[:200]!r}")
    return out


def client_ms(asked: list[tuple[float, float]], requests: list[dict[str, float]]) -> list[float]:
    """The client's ms for each of ``requests`` (the one whose sending and reading hold its ``http<``)."""
    starts = [t0 for t0, _ in asked]
    out = []
    for r in requests:
        t0, t1 = asked[bisect.bisect_right(starts, r["http<"]) - 1]
        if not t0 <= r["http<"] <= t1:
            raise RuntimeError("a measured request reached the service outside every question's round trip")
        out.append(1000 * (t1 - t0))
    return out


def cold_tax(tokenizer: ContextTokenizer, texts: list[str], gap_s: float) -> dict[str, float]:
    """What this host charges code that runs after an idle wait: one question's tokenisation (the service's own
    code, in this process) back to back, and each after sleeping ``gap_s`` (the forward's p50, which the event
    loop idles through before its steps after the forward): the p50s in microseconds."""
    for text in texts[:20]:
        tokenizer.query_input(text)

    def times(gap: float) -> list[float]:
        out = []
        for text in texts:
            if gap:
                time.sleep(gap)
            t = time.perf_counter()
            tokenizer.query_input(text)
            out.append(1e6 * (time.perf_counter() - t))
        return out

    back, after = float(np.median(times(0.0))), float(np.median(times(gap_s)))
    return {"gap_ms": round(1000 * gap_s, 3), "tokenise_back_to_back_us": round(back, 1),
            "tokenise_after_gap_us": round(after, 1), "after_gap_over_back_to_back": round(after / back, 3)}  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.steps", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=RUNS / "bert-base-shaped",
                   help="a masked LM directory (default: bert-base-uncased's shape, `python -m bench.bert_base`)")  # fmt: skip
    p.add_argument("--datastore", type=Path, help="serve this datastore (its own model) instead of building one")
    p.add_argument("--corpus", type=Path, default=REPO / "data" / "sample_wiki.jsonl")
    p.add_argument("--articles", type=int, default=40, help="articles of --corpus in the datastore built")
    p.add_argument("--requests", type=int, default=200, help="measured questions, after --warm-up more")
    p.add_argument("--warm-up", type=int, default=40)
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="the service's model.device")
    p.add_argument("--retriever", choices=["bm25", "tfidf"], default="tfidf", help="the service's default ranker")
    p.add_argument("--work", type=Path, default=RUNS / "bench-steps")
    p.add_argument("--out", type=Path, help="the JSON to write (default: bench/results/steps[-MODEL][-DEVICE].json)")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.requests < 10 or args.warm_up < 0 or args.articles < 1:
        p.error("--requests must be at least 10, --warm-up at least 0, --articles at least 1")
    if args.datastore is None and not (args.model / "config.json").is_file():
        p.error(f"--model {args.model}: no model there (`python -m bench.bert_base` writes the default one)")
    if args.datastore is not None and not (args.datastore / "manifest.json").is_file():
        p.error(f"--datastore {args.datastore}: no datastore there (no manifest.json)")
    texts = [t for t, _ in lama_queries(args.requests + args.warm_up, seed=23)]
    if len(texts) < args.requests + args.warm_up:
        p.error(f"--requests and --warm-up ask for {args.requests + args.warm_up} distinct questions; LAMA has {len(texts)}")
    ds = args.datastore or build_datastore([args.corpus], args.work / f"ds-{args.articles}-{args.model.name}", args.model,
                                           limit=args.articles, bm25=args.retriever == "bm25")  # fmt: skip
    env = {"BERTKNN_WORKERS": "1", "BERTKNN_MODEL__DEVICE": args.device, "BERTKNN_DEFAULTS__RETRIEVER": args.retriever}
    with tempfile.TemporaryDirectory(prefix="bench-steps-") as tmp:
        events_path = Path(tmp) / "events.json"
        with service_process(ds, env={**env, "BENCH_STEPS_OUT": str(events_path)}, module="bench.steps_probe") as svc:
            ask(svc.url, texts[: args.warm_up])
            since = time.perf_counter()
            asked = ask(svc.url, texts[args.warm_up :])
        events = [(str(n), float(t), task) for n, t, task in json.loads(events_path.read_text())]
    requests, cached, other = requests_of(events, since)
    if other or not requests:
        raise RuntimeError(f"of {args.requests} questions, {len(requests)} ran every step in order and {cached} came "
                           f"from the cache; {other} ran otherwise (do bench.steps_probe's PROBES still follow the "
                           "service's path?)")
    rows = [step_times(r) for r in requests]
    man = read_manifest(ds)
    result = {"model": Path(man.model.name).name, "machine": machine(), "device": args.device, "datastore": {
              "articles": man.counts.articles, "contexts": man.counts.contexts}, "retriever": args.retriever,
              "requests": len(rows), "cache_hits": cached, "ms": summarise(rows, client_ms(asked, requests))}  # fmt: skip
    result["own_over_forward_p50"] = round(result["ms"]["own"]["p50"] / result["ms"]["forward"]["p50"], 4)
    tok = AutoTokenizer.from_pretrained(locate_model(man.model.name, man.model.path, None), use_fast=True)
    gap = result["ms"]["forward"]["p50"] / 1000
    result["cold_tax"] = cold_tax(ContextTokenizer(tok, man.max_seq_len, man.model.vocab_size), texts[: args.requests], gap)
    report(result)
    if args.out:
        path = write_json(args.out, result)
    else:
        suffix = "" if args.device == "auto" else f"-{args.device}"
        path = write_result(result_name("steps", args.model if args.datastore is None else man.model.name) + suffix, result)
    print(f"wrote {path}")
    return 0


def report(result: dict) -> None:
    ms = result["ms"]
    print(f"model {result['model']}, {result['requests']} uncached questions one after another ({result['cache_hits']} "
          f"others came from the cache), machine {result['machine']}")
    for name in (*(s for s, _, _ in STEPS), "held", "own", "client"):
        print(f"  {name:<16} p50 {ms[name]['p50']:>9.3f} ms   p90 {ms[name]['p90']:>9.3f} ms")
    print(f"  own / forward (p50s): {result['own_over_forward_p50']:.3f}")
    tax = result["cold_tax"]
    print(f"  this host's cold tax: one tokenisation {tax['tokenise_back_to_back_us']} us back to back, "
          f"{tax['tokenise_after_gap_us']} us after {tax['gap_ms']} ms idle ({tax['after_gap_over_back_to_back']}x)")


if __name__ == "__main__":
    raise SystemExit(main())
