"""What an entity answer and a two-hop ``/follow`` cost against a word answer, on a real linked Wikipedia dump::

    python -m bench.entity_cost --dump enwiki-...-pages-articles1.xml-p000000010p000030302-shortened.bz2

A real dump's articles carry many links around every neighbour; an entity answer's cost is bounded by its
answers (one fill pass for the names the neighbours weigh most), not by those links. Any ``pages-articles`` dump
works; a small real one ships inside gensim's wheel: ``pip download gensim --no-deps`` and take
``gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2`` out of it (a zip).

The dump's first ``--articles`` articles are built with links (the proxy model by default); then, in process, the
same questions about those articles' subjects are answered as words, as entities, and as two-hop follows,
alternating, with no cache, ``--rounds`` times; the p50 of each over all rounds, its ratio to the word answer's, and
each round's ratios (their spread on a shared host) are printed and written to ``bench/results/entity-cost.json``.
"""

from __future__ import annotations

import argparse
import asyncio
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import PROXY_MODEL, RUNS, build_datastore, machine, percentiles, result_name, write_result
from bertknn.evaluation.lama import fill_template
from bertknn.service.results import DEFAULT_BEAM

TEMPLATES = ("[X] was born in [Y] .", "[X] is located in [Y] .", "[X] is a member of [Y] .", "[X] is part of [Y] .")


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m bench.entity_cost", description=__doc__.splitlines()[0])
    p.add_argument("--dump", type=Path, required=True, help="a pages-articles dump (plain, .bz2 or .gz)")
    p.add_argument("--model", default=str(PROXY_MODEL))
    p.add_argument("--articles", type=int, default=20, help="the dump's first N articles are built")
    p.add_argument("--subjects", type=int, default=10, help="articles asked about (one question per template)")
    p.add_argument("--top-k", type=int, default=10, help="answers per question and per follow (the API's default)")
    p.add_argument("--beams", type=int, nargs="+", default=[DEFAULT_BEAM, 5], help="the follows' beams (the first: "
                   "the API's default; its stages are timed)")  # fmt: skip
    p.add_argument("--rounds", type=int, default=3, help="times every question is asked (a p50 of each round too)")
    p.add_argument("--stages", action="store_true", help="then, with timers around the pipeline's stages, where "
                   "a word answer's and a follow's (the first of --beams) time goes (ms each, means)")  # fmt: skip
    p.add_argument("--work", type=Path, default=RUNS / "bench-entity-cost")
    args = p.parse_args(argv)
    if not args.dump.is_file():
        p.error(f"--dump {args.dump}: no such file (see the module docstring for a small real one)")
    if min(args.articles, args.subjects, args.top_k, args.rounds, *args.beams) < 1:
        p.error("--articles, --subjects, --top-k, --rounds and --beams must be at least 1")
    return args


class _Round:
    """One round of the questions, uncached: per subject each template as a word and an entity answer
    (alternating), then a follow of each beam; the seconds of each kind."""

    def __init__(self, pipe: Any, args: argparse.Namespace):
        from bertknn.service.follow import InProcess

        self.pipe, self.args = pipe, args
        self.lower = pipe.encoder.words.lowercase
        self.here = InProcess(pipe)
        self.follows = [f"follow (beam {b})" for b in args.beams]
        self.loop = asyncio.Runner()  # one event loop for every follow, as in the server (not one per follow)

    def question(self, template: str, subject: str) -> str:
        return fill_template(template, subject, lowercase=self.lower)

    def follow_one(self, subject: str, beam: int) -> Any:
        from bertknn.service.follow import follow
        from bertknn.service.results import Query

        base = Query(text="x [MASK]", top_k=self.args.top_k)
        return self.loop.run(follow(
            subject, list(TEMPLATES[:2]), top_k=self.args.top_k, beam=beam, lower=self.lower, base=base,
            ask=self.here.ask, fill_names=self.here.fill_names,
        ))  # fmt: skip

    def run(self, subjects: list[str]) -> dict[str, list[float]]:
        from bertknn.service.results import Query

        times: dict[str, list[float]] = {"word": [], "entity": [], **{f: [] for f in self.follows}}
        for subject in subjects:
            for template in TEMPLATES:
                q = Query(text=self.question(template, subject), subject=subject, top_k=self.args.top_k)
                for kind in ("word", "entity"):
                    t = time.perf_counter()
                    self.pipe.predict(replace(q, answer=kind))
                    times[kind].append(time.perf_counter() - t)
            for beam, name in zip(self.args.beams, self.follows, strict=True):
                t = time.perf_counter()
                self.follow_one(subject, beam)
                times[name].append(time.perf_counter() - t)
        return times


STAGES = ("encode", "fill_names", "retrieve", "neighbours", "answer")  # the pipeline's stages timed by --stages


def stage_times(pipe: Any, one: _Round, subjects: list[str], beam: int = DEFAULT_BEAM) -> dict[str, dict[str, float]]:
    """Mean ms of each stage per word answer and per follow (``beam``), timed by wrapping the pipeline's own
    methods on this instance: the questions' forward passes (``encode``), the fill passes (``fill_names``),
    retrieval, kNN (``neighbours``) and the answers' assembly (``answer``); ``other`` is the rest."""
    from bertknn.service.results import Query

    spent: dict[str, float] = {}

    def timed(name: str, method: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            t = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t

        return call

    owners = {"encode": pipe.queries, "fill_names": pipe, "retrieve": pipe.articles, "neighbours": pipe.neighbours_of,
              "answer": pipe.assembler}  # fmt: skip
    for name in STAGES:
        setattr(owners[name], name, timed(name, getattr(owners[name], name)))
    try:
        out = {}
        questions = [Query(text=one.question(t, s), subject=s, top_k=one.args.top_k)
                     for s in subjects for t in TEMPLATES]  # fmt: skip
        kinds = (("word", lambda: [pipe.predict(q) for q in questions], len(questions)),
                 (f"follow (beam {beam})", lambda: [one.follow_one(s, beam) for s in subjects], len(subjects)))
        for kind, run, n in kinds:
            spent.clear()
            t = time.perf_counter()
            run()
            total = time.perf_counter() - t
            out[kind] = {k: round(spent.get(k, 0.0) / n * 1000, 2) for k in STAGES}
            out[kind]["other"] = round((total - sum(spent.values())) / n * 1000, 2)
            out[kind]["total"] = round(total / n * 1000, 2)
        return out
    finally:
        for name in STAGES:
            delattr(owners[name], name)  # the classes' methods again


def report(pipe: Any, args: argparse.Namespace, rounds: list[dict[str, list[float]]]) -> dict[str, Any]:
    """p50 of each kind over every round, its ratio to the word answer's, and each round's ratios."""
    times = {k: [t for r in rounds for t in r[k]] for k in rounds[0]}
    p50 = {k: percentiles(v)["p50"] * 1000 for k, v in times.items()}
    per_round = [{k: percentiles(v)["p50"] / percentiles(r["word"])["p50"] for k, v in r.items() if k != "word"}
                 for r in rounds]  # fmt: skip
    man = pipe.datastore.manifest
    return {
        "model": Path(args.model).name, "machine": machine(), "dump": args.dump.name,
        "datastore": {"articles": man.counts.articles, "contexts": man.counts.contexts,
                      "entities": man.links.entities if man.links else 0},
        "p50_ms": {k: round(v, 2) for k, v in p50.items()},
        "over_word": {k: round(v / p50["word"], 2) for k, v in p50.items() if k != "word"},
        "queries": {k: len(v) for k, v in times.items()}, "top_k": args.top_k, "rounds": args.rounds,
        "over_word_per_round": {k: [round(r[k], 2) for r in per_round] for k in per_round[0]},
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from bertknn.service.cache import InMemoryCache
    from bertknn.service.pipeline import AnswerPipeline
    from bertknn.service.results import Query

    ds = build_datastore([args.dump], args.work / f"ds-{args.articles}", args.model, limit=args.articles)
    pipe = AnswerPipeline.open(ds, device="cpu", cache=InMemoryCache(max_items=0))  # every answer uncached
    pipe.local_encoder.set_backend("auto")
    subjects = [title for title, _ in pipe.datastore.iter_article_texts()][: args.subjects]
    one = _Round(pipe, args)
    pipe.predict(Query(text=one.question(TEMPLATES[0], subjects[0]), subject=subjects[0]))  # warm-up (JVM, forward)
    result = report(pipe, args, [one.run(subjects) for _ in range(args.rounds)])
    if args.stages:
        result["stages_ms"] = stage_times(pipe, one, subjects, args.beams[0])
    one.loop.close()
    path = write_result(result_name("entity-cost", args.model), result)
    p50 = result["p50_ms"]
    ratios = ", ".join(f"{k} {p50[k]:.1f} ms ({v}x)" for k, v in result["over_word"].items())
    print(f"{result['datastore']} top_k {args.top_k}: p50 word {p50['word']:.1f} ms, {ratios}")
    spread = ", ".join(f"{k} {min(v)}-{max(v)}x" for k, v in result["over_word_per_round"].items())
    print(f"each round's p50 over the word answer's ({args.rounds} rounds): {spread}")
    for kind, stages in result.get("stages_ms", {}).items():
        print(f"{kind}, ms each (means): " + ", ".join(f"{k} {v}" for k, v in stages.items()))
    print(f"wrote {path}")
    pipe.close()
    return 0 if np.isfinite(p50["word"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
