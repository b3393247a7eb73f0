"""What an entity answer and a two-hop ``/follow`` cost against a word answer, on a real linked Wikipedia dump::

    python -m bench.entity_cost --dump enwiki-...-pages-articles1.xml-p000000010p000030302-shortened.bz2

A real dump's articles carry many links around every neighbour, which is where an entity answer's cost lies
(the sequential fill of several-piece names). Any ``pages-articles`` dump works; a small real one ships inside
gensim's wheel: ``pip download gensim --no-deps`` and take
``gensim/test/test_data/enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2`` out of it (a zip).

The dump's first ``--articles`` articles are built with links (the proxy model by default); then, in process, the
same questions about those articles' subjects
are answered as words, as entities, and as two-hop follows, alternating, with no cache; p50 of each and the ratios are printed
and written to ``bench/results/entity-cost.json``.
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

TEMPLATES = ("[X] was born in [Y] .", "[X] is located in [Y] .", "[X] is a member of [Y] .", "[X] is part of [Y] .")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.entity_cost", description=__doc__.splitlines()[0])
    p.add_argument("--dump", type=Path, required=True, help="a pages-articles dump (plain, .bz2 or .gz)")
    p.add_argument("--model", default=str(PROXY_MODEL))
    p.add_argument("--articles", type=int, default=20, help="the dump's first N articles are built")
    p.add_argument("--subjects", type=int, default=10, help="articles asked about (one question per template)")
    p.add_argument("--top-k", type=int, default=10, help="answers per question and per follow (the API's default)")
    p.add_argument("--beams", type=int, nargs="+", default=[5, 3], help="the follows' beams (5: the API's default)")
    p.add_argument("--work", type=Path, default=RUNS / "bench-entity-cost")
    args = p.parse_args(argv)
    if not args.dump.is_file():
        p.error(f"--dump {args.dump}: no such file (see the module docstring for a small real one)")
    if min(args.articles, args.subjects, args.top_k, *args.beams) < 1:
        p.error("--articles, --subjects, --top-k and --beams must be at least 1")
    from bertknn.service.cache import InMemoryCache
    from bertknn.service.follow import InProcess, follow
    from bertknn.service.pipeline import AnswerPipeline
    from bertknn.service.results import Query

    ds = build_datastore([args.dump], args.work / f"ds-{args.articles}", args.model, limit=args.articles)
    pipe = AnswerPipeline.open(ds, device="cpu", cache=InMemoryCache(max_items=0))  # every answer uncached
    pipe.encoder.set_backend("auto")
    lower = pipe.encoder.words.lowercase
    subjects = [title for title, _ in pipe.datastore.iter_article_texts()][: args.subjects]

    def ask(template: str, subject: str) -> str:
        text = template.replace("[X]", subject).replace("[Y]", "[MASK]")
        return text.lower() if lower else text.replace("[mask]", "[MASK]")

    here = InProcess(pipe)

    async def follow_one(subject: str, beam: int) -> Any:
        base = Query(text="x [MASK]", top_k=args.top_k)
        return await follow(
            subject, list(TEMPLATES[:2]), top_k=args.top_k, beam=beam, lower=lower, base=base, ask=here.ask,
            fill_names=here.fill_names,
        )  # fmt: skip

    pipe.predict(Query(text=ask(TEMPLATES[0], subjects[0]), subject=subjects[0]))  # warm-up (JVM, first forward)
    follows = [f"follow (beam {b})" for b in args.beams]
    times: dict[str, list[float]] = {"word": [], "entity": [], **{f: [] for f in follows}}
    for subject in subjects:
        for template in TEMPLATES:
            q = Query(text=ask(template, subject), subject=subject, top_k=args.top_k)
            for kind in ("word", "entity"):
                t = time.perf_counter()
                pipe.predict(replace(q, answer=kind))
                times[kind].append(time.perf_counter() - t)
        for beam, name in zip(args.beams, follows, strict=True):
            t = time.perf_counter()
            asyncio.run(follow_one(subject, beam))
            times[name].append(time.perf_counter() - t)
    p50 = {k: percentiles(v)["p50"] * 1000 for k, v in times.items()}
    man = pipe.datastore.manifest
    result = {
        "model": Path(args.model).name, "machine": machine(), "dump": args.dump.name,
        "datastore": {"articles": man.counts.articles, "contexts": man.counts.contexts,
                      "entities": man.links.entities if man.links else 0},
        "p50_ms": {k: round(v, 2) for k, v in p50.items()},
        "over_word": {k: round(v / p50["word"], 2) for k, v in p50.items() if k != "word"},
        "queries": {k: len(v) for k, v in times.items()}, "top_k": args.top_k,
    }  # fmt: skip
    path = write_result(result_name("entity-cost", args.model), result)
    ratios = ", ".join(f"{k} {p50[k]:.1f} ms ({v}x)" for k, v in result["over_word"].items())
    print(f"{result['datastore']} top_k {args.top_k}: p50 word {p50['word']:.1f} ms, {ratios}")
    print(f"wrote {path}")
    pipe.close()
    return 0 if np.isfinite(p50["word"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
