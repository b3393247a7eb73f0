"""``bert-knn eval lama --answer entity`` and ``bert-knn eval follow``: entity answers and two-hop questions over
a datastore with links, in process (`bertknn.evaluation.entities` scores them)."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

from bertknn.core.errors import EvaluationError
from bertknn.evaluation.base import RunSettings
from bertknn.evaluation.common import AVERAGES_NOTE, linked_pipeline, run_settings_dict, write_report


def entity_lama(
    args: argparse.Namespace, settings: RunSettings, relations: Sequence[Any], stack: ExitStack
) -> int:
    from tqdm import tqdm

    from bertknn.evaluation.entities import entity_lama

    for flag, on in (("--url", args.url), ("--grid", args.grid), ("--adaptive", args.adaptive or args.adaptive_rule),
                     ("--multi-piece", args.multi_piece), ("--no-retrieval", args.no_retrieval)):  # fmt: skip
        if on:
            raise EvaluationError(f"--answer entity runs in process over the retrieved articles; drop {flag}")
    t0 = time.perf_counter()
    pipeline = linked_pipeline(args, stack)
    relations = [r for r in relations if r.template is not None]
    with tqdm(desc="entity queries", unit="q", disable=args.quiet) as bar:
        table = entity_lama(pipeline, relations, settings, limit=args.limit, batch_size=args.batch_size,
                            progress=bar.update)  # fmt: skip
    print(table.format("LAMA, entity answers (gold: the object's article): P@1/P@10 in %, macro over relations"))
    report = {
        "settings": {"mode": "in-process", "datastore": str(args.datastore), **pipeline.identity(),
                     **run_settings_dict(settings), "limit": args.limit, "answer": "entity",
                     "averages": AVERAGES_NOTE, "wall_s": round(time.perf_counter() - t0, 2)},
        **table.report(),
    }  # fmt: skip
    write_report(args.out, report)
    return 0


def follow(args: argparse.Namespace, stack: ExitStack) -> int:
    """``bert-knn eval follow``: two-hop questions composed from T-REx facts, answered by following relations."""
    from tqdm import tqdm

    from bertknn.evaluation.entities import COMPOSED, two_hop, two_hop_questions
    from bertknn.evaluation.lama import discover_relations

    t0 = time.perf_counter()
    if args.limit is not None and args.limit < 1:
        raise EvaluationError("--limit must be >= 1")
    relations = {r.id: r for r in discover_relations(args.data, trex="evidence") if r.template is not None}
    pairs: list[tuple[str, str]] = []
    for text in args.pairs or [f"{a}:{b}" for a, b in COMPOSED]:
        r1, sep, r2 = text.partition(":")
        if not sep or (r1, r2) not in COMPOSED:
            known = ", ".join(f"{a}:{b}" for a, b in COMPOSED)
            raise EvaluationError(f"--pairs {text!r}: give r1:r2 pairs with a composed template: {known}")
        pairs.append((r1, r2))
    questions = two_hop_questions(relations, pairs, args.limit)
    if not questions:
        raise EvaluationError(f"no two-hop question could be composed from {args.data} for {pairs}")
    pipeline = linked_pipeline(args, stack)
    settings = RunSettings(retriever=args.retriever, num_articles=args.num_articles, k=args.k,
                           temperature=args.temperature, lambda_=args.lambda_)  # fmt: skip
    with tqdm(total=len(questions), desc="two-hop questions", unit="q", disable=args.quiet) as bar:
        table = two_hop(pipeline, relations, questions, settings, beam=args.beam, progress=bar.update)
    print(table.format("Two hops (X r1 Y, Y r2 Z), entity answers: P@1/P@10 in %, macro over relation pairs"))
    report = {
        "settings": {"datastore": str(args.datastore), **pipeline.identity(), **run_settings_dict(settings),
                     "beam": args.beam, "limit": args.limit, "pairs": [f"{a}:{b}" for a, b in pairs],
                     "composed": {f"{a}:{b}": COMPOSED[(a, b)] for a, b in pairs},
                     "questions": len(questions), "wall_s": round(time.perf_counter() - t0, 2)},
        **table.report(),
    }  # fmt: skip
    write_report(args.out, report)
    return 0

