"""The service's start-up on the CPU with and without what it keeps on disk: its exported ONNX graph and the
vocabulary's word table. ::

    python -m bench.startup [--model runs/bert-base-shaped] [--starts 3]

One service process (bert-base-uncased's shape by default, ONNX Runtime, TF-IDF) is started again and again, three
ways taking turns: nothing kept (``onnx_cache off``, ``vocab_cache off``: the graph exported and the table made at
every start), the graph kept (``vocab_cache off``), and both kept (the defaults), each cache in a directory this
run empties first (the first start makes both there, each later one loads them). Each start's seconds from
launch until ``/readyz`` answers, and its resident memory then; the same questions are asked of each way's last
process and their answers compared (they must be equal). A killed worker's replacement, the next of N workers
and a container's restart all pay this start again.
"""

from __future__ import annotations

import argparse
import shutil
from pathlib import Path
from typing import Any

from bench.answers import answers
from bench.bert_base import make
from bench.common import REPO, RUNS, build_datastore, lama_queries, machine, write_result
from bench.hostwork import timed_starts
from tests.support.processes import service_process

CORPUS = REPO / "data" / "sample_wiki.jsonl"
WAYS = ("nothing kept", "graph kept", "graph and table kept")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=RUNS / "bert-base-shaped", help="a masked LM directory "
                   "(default: bert-base-uncased's shape, written there if missing)")  # fmt: skip
    p.add_argument("--starts", type=int, default=3, help="starts of each way after the first (at least 1)")
    p.add_argument("--articles", type=int, default=20, help="articles of the sample corpus in the datastore")
    p.add_argument("--questions", type=int, default=20, help="questions whose answers are compared")
    p.add_argument("--work", type=Path, default=RUNS / "bench-startup")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.starts < 1 or args.questions < 1:
        build_parser().error("--starts and --questions must be at least 1")
    model = args.model if (args.model / "config.json").is_file() else make(args.model)
    ds = build_datastore([CORPUS], args.work / f"ds-{args.articles}-{model.name}", model, limit=args.articles, bm25=False)
    onnx, vocab = args.work / "onnx", args.work / "vocab"
    for cache in (onnx, vocab):
        shutil.rmtree(cache, ignore_errors=True)
    base = {"BERTKNN_DEFAULTS__RETRIEVER": "tfidf", "BERTKNN_MODEL__BACKEND": "onnx"}
    envs = {WAYS[0]: {**base, "BERTKNN_MODEL__ONNX_CACHE": "off", "BERTKNN_MODEL__VOCAB_CACHE": "off"},
            WAYS[1]: {**base, "BERTKNN_MODEL__ONNX_CACHE": str(onnx), "BERTKNN_MODEL__VOCAB_CACHE": "off"},
            WAYS[2]: {**base, "BERTKNN_MODEL__ONNX_CACHE": str(onnx), "BERTKNN_MODEL__VOCAB_CACHE": str(vocab)}}  # fmt: skip
    first = timed_starts({"first start": (REPO, envs[WAYS[2]])}, ds, 1)["first start"]  # it makes both
    got = timed_starts({w: (REPO, envs[w]) for w in WAYS}, ds, args.starts)
    questions = [{"text": t} for t, _ in lama_queries(args.questions, seed=11)]
    said = []
    for way in WAYS:
        with service_process(ds, env=envs[way]) as svc:
            said.append(answers(svc.url, questions))
    result: dict[str, Any] = {
        "model": model.name, "machine": machine(), "articles": args.articles, "backend": "onnx",
        "first_start_kept": {"start_s": first["start_s"][0], "rss_mb": first["rss_mb"][0]},
        "starts": got,
        "answers_equal": all(s == said[0] for s in said), "questions": len(questions),
    }  # fmt: skip
    medians = [result["starts"][w] for w in WAYS]
    for name, (a, b) in {"graph_vs_nothing": (1, 0), "both_vs_graph": (2, 1), "both_vs_nothing": (2, 0)}.items():
        result[name] = {k: round(medians[a][f"{k}_median"] / medians[b][f"{k}_median"], 3) for k in ("start_s", "rss_mb")}
        print(f"{name}: start-up {result[name]['start_s']}x, resident memory {result[name]['rss_mb']}x "
              f"(medians of {args.starts})", flush=True)  # fmt: skip
    print(f"answers equal on {len(questions)} questions: {result['answers_equal']}", flush=True)
    path = write_result(f"startup-{model.name}", result)
    print(f"wrote {path}")
    return 0 if result["answers_equal"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
