"""Where a request's host work goes, stage by stage, beside a service's CPU per request. ::

    python -m bench.stages [--rounds 5] [--questions 600] [--blocks 4]

The service's own stages run in this process, one after another on one thread, on `bench.hostwork`'s datastore and
model (bert-base-uncased's shape at hidden size 64, 40 articles of the sample corpus, TF-IDF), the pipeline opened
as the service opens it (`open_pipeline`, its default settings, one torch thread, the start-up heap frozen):

- ``tokenise``: the question checked and tokenised (`AnswerPipeline.check_query`), and its encoding's cache key;
- ``retrieval``: its articles (TF-IDF, the in-process cache missed);
- ``forward``: the batched forward (the service's backend) at the service's batch size, per question;
- ``p_mlm_head``: each row's kept head of p_MLM (`QueryEncoder.complete`: the top entries, the float16 encoding);
- ``knn``: the restricted kNN over the articles' rows;
- ``answer``: the vote, the interpolation, the rankings, the supporting contexts and entities (the rest of
  `AnswerAssembler.answer_from_encoding`);
- ``response``: the response model and its JSON.

Each stage's thread CPU per question is the median over ``--rounds`` rounds, each of new questions (so that no
cache answers). Then the same kind of questions go to a service process (one worker, ``--clients`` raw keep-alive
clients, every request a cache miss): its CPU per request, summed over its threads, set beside the stages' sum. The
difference is what no stage above does: the HTTP layer (uvicorn, Starlette, FastAPI, the request's validation), the
event loop, the hand-offs between threads and what running two busy threads on one GIL costs. The batch size the
forward is timed at is the service's mean rows per batch in that run.

A second service process serves the same questions in blocks that take turns with the first (``--blocks``), every
thread of it pinned to one core (`pin_threads`, from outside: the service has no such setting): how much of that
difference is the threads running on two cores, where each hand-off of the GIL moves their data between the cores'
caches. Its model thread then also shares that core with the forward, which costs little here (hidden size 64) and
a whole forward's overlap with the host work where the forward is dear.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.bert_base import make
from bench.common import RUNS, build_datastore, lama_queries, machine, write_result
from bench.hostwork import CORPUS, TINY, measure
from tests.support.processes import service_process

STAGES = ("tokenise", "retrieval", "forward", "p_mlm_head", "knn", "answer", "response")
ENV = {"BERTKNN_DEFAULTS__RETRIEVER": "tfidf", "BERTKNN_MODEL__THREADS": "1"}


def pin_threads(pid: int, cores: set[int]) -> int:
    """Every thread of process ``pid`` on ``cores`` (threads it starts later inherit it): how many were pinned."""
    tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):  # (a thread that ended meanwhile)
            os.sched_setaffinity(tid, cores)
    return len(tids)


def per_item_ms(fn: Callable[[Any], Any], items: Sequence[Any]) -> tuple[float, list[Any]]:
    """``fn`` of each item in turn: this thread's CPU ms per item, and the results."""
    t = time.thread_time()
    out = [fn(x) for x in items]
    return (time.thread_time() - t) * 1000 / max(1, len(items)), out


def one_round(pipe: Any, settings: Any, texts: list[str], batch: int) -> dict[str, float]:
    """Each stage's thread CPU ms per question over ``texts`` (new to the pipeline's caches); ``settings``: the
    service's, which make each request's query."""
    from pydantic import TypeAdapter

    from bertknn.service.api.routes import to_query, to_response
    from bertknn.service.api.schemas import PredictRequest, PredictResponse
    from bertknn.service.results import Stage

    queries = [to_query(PredictRequest(text=t), settings) for t in texts]

    def tokenise(query: Any) -> tuple[Any, str]:
        inp = pipe.check_query(query)
        return inp, pipe.queries.key(inp)

    ms: dict[str, float] = {}
    ms["tokenise"], keyed = per_item_ms(tokenise, queries)
    ms["retrieval"], found = per_item_ms(pipe.articles.retrieve, queries)
    chunks = [keyed[i : i + batch] for i in range(0, len(keyed), batch)]
    forward_ms, pending = per_item_ms(
        lambda c: pipe.queries.forward([x for x, _ in c], keys=[k for _, k in c], missed=True, defer_heads=True)[0],
        chunks,
    )
    ms["forward"] = forward_ms * len(chunks) / len(keyed)
    ms["p_mlm_head"], encs = per_item_ms(pipe.queries.complete, [p for ps in pending for p in ps])
    work = list(zip(queries, encs, found, strict=True))
    ms["knn"], nbrs = per_item_ms(lambda w: pipe.neighbours_of.neighbours(w[0], w[1], w[2][0], None), work)
    ms["answer"], answers = per_item_ms(
        lambda wn: pipe.assembler.answer_from_encoding(wn[0][0], wn[0][1], "miss", Stage(), articles=wn[0][2],
                                                       neighbours=wn[1]),
        list(zip(work, nbrs, strict=True)),
    )  # fmt: skip
    identity, adapter = pipe.identity(), TypeAdapter(PredictResponse)
    ms["response"], _ = per_item_ms(lambda a: adapter.dump_json(to_response(a, identity)), answers)
    return ms


def stage_ms(ds: Path, texts: list[str], rounds: int, batch: int) -> dict[str, float]:
    """Each stage's median thread CPU ms per question over ``rounds`` equal rounds of new questions (after a
    warm-up batch), in a pipeline opened as the service opens its own."""
    import torch

    from bertknn.service import heap
    from bertknn.service.main import open_pipeline
    from bertknn.service.settings import ServiceSettings

    os.environ.update(ENV)
    settings = ServiceSettings(datastore=str(ds))
    pipe = open_pipeline(settings)
    torch.set_num_threads(1)
    heap.settle()  # as the service does when it is ready
    try:
        one_round(pipe, settings, texts[:batch], batch)  # warm-up, not counted (its questions are not asked again)
        per = (len(texts) - batch) // rounds
        got = [one_round(pipe, settings, texts[batch + r * per : batch + (r + 1) * per], batch) for r in range(rounds)]
    finally:
        heap.thaw()
    return {s: round(float(np.median([g[s] for g in got])), 4) for s in STAGES}


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=5, help="rounds of new questions for the stages' medians")
    p.add_argument("--questions", type=int, default=600, help="questions per round")
    p.add_argument("--clients", type=int, default=64, help="the service's concurrent clients")
    p.add_argument("--requests", type=int, default=3000, help="requests to the service")
    p.add_argument("--blocks", type=int, default=4, help="blocks of the load, the two services taking turns")
    p.add_argument("--articles", type=int, default=40, help="articles of the sample corpus in the datastore")
    p.add_argument("--work", type=Path, default=RUNS / "bench-hostwork")
    p.add_argument("--name", default="stages", help="the results file, bench/results/NAME.json")
    return p


def main(argv: list[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if min(args.rounds, args.clients, args.blocks) < 1 or args.questions < 50 or args.requests < 100:
        p.error("--rounds, --clients and --blocks take at least 1, --questions at least 50, --requests at least 100")
    model = make(args.work / "bert-base-h64", shape=TINY)
    ds = build_datastore([CORPUS], args.work / f"ds-{args.articles}", model, limit=args.articles, bm25=False)
    pool = [t for t, _ in lama_queries(args.requests + args.clients + args.questions * args.rounds + 64, seed=5)]
    served, asked = pool[: args.requests + args.clients], pool[args.requests + args.clients :]
    with service_process(ds, env=ENV) as svc, service_process(ds, env=ENV) as one:
        pinned = pin_threads(one.proc.pid, {max(os.sched_getaffinity(0))})
        print(f"second service: its {pinned} threads pinned to one core", flush=True)
        runs = measure({"service": (svc.url, svc.proc.pid), "one_core": (one.url, one.proc.pid)},
                       [{"text": t} for t in served], args.clients, args.blocks)  # fmt: skip
    run = runs["service"]
    one_core = {**runs["one_core"], "cpu_vs_service": round(runs["one_core"]["server_cpu_ms_per_request"]
                                                            / run["server_cpu_ms_per_request"], 3),
                "requests_per_s_vs_service": round(runs["one_core"]["requests_per_s"] / run["requests_per_s"], 3)}
    batch = max(1, round(run["rows_per_batch"]))
    print(f"service, {args.clients} clients: {run['server_cpu_ms_per_request']} ms of CPU per request, "
          f"{run['rows_per_batch']} rows per batch, {run['requests_per_s']} req/s; its threads on one core: "
          f"{one_core['cpu_vs_service']}x the CPU per request, {one_core['requests_per_s_vs_service']}x the req/s",
          flush=True)  # fmt: skip
    stages = stage_ms(ds, asked, args.rounds, batch)
    total = round(sum(stages.values()), 4)
    rest = round(run["server_cpu_ms_per_request"] - total, 4)
    share = {s: round(v / run["server_cpu_ms_per_request"], 3) for s, v in stages.items()}
    for s in STAGES:
        print(f"{s:>12}  {stages[s]:7.3f} ms per question  {share[s]:6.1%} of the service's CPU per request")
    print(f"{'stages':>12}  {total:7.3f} ms;  the service's other work (HTTP, event loop, hand-offs): {rest:.3f} ms "
          f"({rest / run['server_cpu_ms_per_request']:.1%})")  # fmt: skip
    result = {"model": "bert-base-uncased's shape at hidden size 64", "machine": machine(), "articles": args.articles,
              "retriever": "tfidf", "rounds": args.rounds, "questions_per_round": args.questions,
              "forward_batch": batch, "stages_ms_per_question": stages, "stages_total_ms": total,
              "service": {"clients": args.clients, **run}, "service_rest_ms": rest, "service_on_one_core": one_core,
              "share_of_service_cpu": {**share, "stages": round(total / run["server_cpu_ms_per_request"], 3),
                                       "rest": round(rest / run["server_cpu_ms_per_request"], 3)}}  # fmt: skip
    print(f"wrote {write_result(args.name, result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
