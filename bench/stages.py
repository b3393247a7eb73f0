"""Where one uncached query's time goes, stage by stage, at 1 client. One command::

    python -m bench.stages [--model DIR] [--queries 300]

The service runs in this process (uvicorn in a thread, the default settings: the same code as ``python -m service``),
with timers wrapped around its stages; a separate client process sends distinct LAMA-template queries one at a time
over one keep-alive connection (``bench/rawhttp.py``). The bare forward runs in the same process on the client's own
queries, the service idle, in blocks of 10 that alternate with the client's (the host's speed drifts), so that the
forward inside the service can be compared with the forward alone, and the client's latency with both.
Prints a table of p50s and writes bench/results/stages.json (another model than the proxy: stages-<model>.json).
"""

from __future__ import annotations

import argparse
import functools
import inspect
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.common import (
    PROXY_MODEL,
    REPO,
    RUNS,
    bare_forward,
    build_datastore,
    free_port,
    lama_queries,
    machine,
    result_name,
    write_result,
)

_CLIENT = """
import json, sys, time
from bench.common import lama_queries
from bench.rawhttp import RawClient
port, n = int(sys.argv[1]), int(sys.argv[2])
queries = iter(lama_queries(n, seed=5))
with RawClient("127.0.0.1", port) as c:
    for line in sys.stdin:  # each line: how many of the next queries to send; one line of timings back
        out = []
        for text, subject in [next(queries) for _ in range(int(line))]:
            t = time.perf_counter()
            status, body = c.post_json("/predict", {"text": text, "subject": subject, "return_contexts": True})
            out.append(time.perf_counter() - t)
            assert status == 200, body[:200]
        print(json.dumps(out), flush=True)
"""


class Timers:
    """Seconds per call of wrapped functions (sync or async), and of spans between named marks."""

    def __init__(self) -> None:
        self.samples: dict[str, list[float]] = defaultdict(list)
        self.marks: dict[str, float] = {}

    def wrap(self, owner: Any, name: str, label: str) -> None:
        fn = getattr(owner, name)
        if inspect.iscoroutinefunction(fn):

            @functools.wraps(fn)
            async def awrapped(*a: Any, **k: Any) -> Any:
                t = time.perf_counter()
                try:
                    return await fn(*a, **k)
                finally:
                    self.samples[label].append(time.perf_counter() - t)

            setattr(owner, name, awrapped)
        else:

            @functools.wraps(fn)
            def wrapped(*a: Any, **k: Any) -> Any:
                t = time.perf_counter()
                try:
                    return fn(*a, **k)
                finally:
                    self.samples[label].append(time.perf_counter() - t)

            setattr(owner, name, wrapped)

    def mark_before(self, owner: Any, name: str, mark: str, span_from: str | None = None, span: str = "") -> None:
        """Record time ``mark`` when ``owner.name`` is called; with ``span_from``, also the time since that mark."""
        fn: Callable[..., Any] = getattr(owner, name)

        @functools.wraps(fn)
        def wrapped(*a: Any, **k: Any) -> Any:
            now = time.perf_counter()
            if span_from is not None and span_from in self.marks:
                self.samples[span].append(now - self.marks[span_from])
            self.marks[mark] = now
            return fn(*a, **k)

        setattr(owner, name, wrapped)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.stages", description=__doc__)
    p.add_argument("--model", default=str(PROXY_MODEL))
    p.add_argument("--corpus", type=Path, default=REPO / "data" / "sample_wiki.jsonl")
    p.add_argument("--articles", type=int, default=150)
    p.add_argument("--queries", type=int, default=300)
    p.add_argument("--work", type=Path, default=RUNS / "bench-serving")
    args = p.parse_args(argv)
    if args.queries < 20 or args.articles < 1:
        p.error("--queries must be at least 20 and --articles at least 1")
    os.environ.setdefault("OPENAI_API_KEY", "unused")
    ds = build_datastore([args.corpus], args.work / "ds", args.model, limit=args.articles)

    import uvicorn

    import bertknn.core.encoder as encoder_mod
    import bertknn.service.api.routes as routes
    import bertknn.service.codec as codec
    import bertknn.service.main as service_main
    import bertknn.service.pipeline as pipeline_mod
    import bertknn.service.serving as serving
    from bertknn.service.pipeline import AnswerPipeline
    from bertknn.service.server import uvicorn_config
    from bertknn.service.settings import ServiceSettings

    timers = Timers()
    timers.wrap(routes, "response_fields", "response fields")
    timers.wrap(routes, "response_json", "response JSON")
    timers.mark_before(routes, "to_query", "handler", span_from="request in", span="HTTP in (routing, deps, body)")
    timers.wrap(AnswerPipeline, "check_query", "tokenising")
    timers.wrap(encoder_mod.MaskedLMEncoder, "_forward", "forward (model alone)")
    timers.wrap(codec.QueryEncoding, "from_top", "encoding from the top entries")
    timers.wrap(codec.QueryEncoding, "to_bytes", "encoding to bytes")
    timers.wrap(pipeline_mod, "top_set", "top p_MLM entries (the set)")
    timers.wrap(AnswerPipeline, "forward", "encoding (forward + top entries + cache)")
    timers.wrap(AnswerPipeline, "retrieve", "retrieval (overlapped)")
    timers.wrap(AnswerPipeline, "neighbours", "kNN")
    timers.wrap(AnswerPipeline, "answer", "interpolation + contexts")
    timers.wrap(serving.AsyncAnswerer, "answer", "answer (service side)")
    middleware = service_main.RequestContextMiddleware.__call__

    async def timed_middleware(self: Any, scope: Any, receive: Any, send: Any) -> None:
        t = time.perf_counter()
        timers.marks["request in"] = t
        await middleware(self, scope, receive, send)
        if scope["type"] == "http" and scope["path"] == "/predict":
            timers.samples["server total"].append(time.perf_counter() - t)

    service_main.RequestContextMiddleware.__call__ = timed_middleware  # type: ignore[method-assign]

    port = free_port()
    settings = ServiceSettings(datastore=ds, port=port, log_level="warning")
    app = service_main.create_app(settings)
    server = uvicorn.Server(uvicorn_config(app, settings, host="127.0.0.1"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 300
    while not (server.started and app.state.resources.ready) and time.monotonic() < deadline:
        time.sleep(0.1)
    if not app.state.resources.ready:
        raise SystemExit(f"the service did not become ready: {app.state.resources.error}")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    warm, block = 30, 10
    client_proc = subprocess.Popen([sys.executable, "-c", _CLIENT, str(port), str(args.queries + warm)],
                                   env=env, cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
    cin, cout = client_proc.stdin, client_proc.stdout
    assert cin is not None and cout is not None

    def send(n: int) -> list[float]:
        cin.write(f"{n}\n")
        cin.flush()
        line = cout.readline()
        if not line:
            raise SystemExit(f"the client process failed (exit {client_proc.wait()})")
        return [float(x) for x in json.loads(line)]

    # The host's speed drifts: blocks of 10 queries through the service alternate with blocks of 10 bare forward
    # passes in this process (the service idle meanwhile), so that both sides of the ratio share the same windows.
    encoder = app.state.resources.pipeline.encoder
    texts = [t for t, _ in lama_queries(args.queries + warm, seed=5)[warm:]]  # the client's queries, in order
    send(warm)
    client: list[float] = []
    bare: list[float] = []
    in_service: dict[str, list[float]] = defaultdict(list)
    for done in range(0, args.queries, block):
        n = min(block, args.queries - done)
        timers.samples.clear()
        client += send(n)
        for name, v in timers.samples.items():
            in_service[name] += v
        timers.samples.clear()
        bare += bare_forward(encoder, texts[done : done + n])
    cin.close()
    client_proc.wait(30)
    server.should_exit = True
    thread.join(30)

    def p50_ms(v: list[float]) -> float:
        return statistics.median(v) * 1000

    stages = {name: p50_ms(v) for name, v in in_service.items()}
    result = {"model": Path(args.model).name, "machine": machine(), "queries": args.queries,
              "backend": encoder.backend, "client_p50_ms": p50_ms(client), "bare_forward_p50_ms": p50_ms(bare),
              "client_over_bare": p50_ms(client) / p50_ms(bare),
              "forward_in_service_over_bare": stages["forward (model alone)"] / p50_ms(bare),
              "stages_p50_ms": stages}  # fmt: skip
    path = write_result(result_name("stages", args.model), result)
    print(f"model {result['model']}, backend {encoder.backend}, {args.queries} queries, machine {result['machine']}")
    print(f"client-side p50 {result['client_p50_ms']:.2f} ms; bare forward p50 (same process, service idle) "
          f"{result['bare_forward_p50_ms']:.2f} ms, in alternating blocks -> {result['client_over_bare']:.2f}x; the "
          f"forward inside the service / alone: {result['forward_in_service_over_bare']:.2f}x")
    for name, ms in stages.items():
        print(f"  {name:<44} p50 {ms:7.3f} ms")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
