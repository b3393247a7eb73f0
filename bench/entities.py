"""Entities benchmark, one command: ``python -m bench.entities`` (``--help`` for the options).

1. Facts: the first ``--limit`` facts of every T-REx relation with evidence files (all of them, whatever their
   object's length: entity answers have no single-wordpiece rule), and two-hop questions composed from the facts
   (X r1 Y, Y r2 Z, for the relation pairs that `bertknn.evaluation.entities.COMPOSED` names), ``--follow-limit``
   per pair.
2. Corpus (``bench/quality/corpus.py`` with ``links=True``): the benchmark corpus with links: the subject articles
   of those facts and of the questions' bridges Y, made of T-REx evidence sentences in which the object's surface
   form links to the object's title (as Wikipedia's own link there would), plus ``--distractors`` vital articles.
3. Datastore: built with the real builder (``--model``, default the proxy MiniLM MLM), links kept; reused when
   the corpus and the model are unchanged.
4. Evaluations (the commands a user runs, in process, service defaults):
   ``python -m evaluation lama --answer entity``, ``python -m evaluation lama --by-popularity --adaptive
   --adaptive-popularity`` (word answers: P@1 per quartile of the subjects' inbound links, and the adaptive rule
   fitted on dev with and without the subject's popularity as a feature) and ``python -m evaluation follow``.

5. What links cost a word query after its forward pass (each answer's entity): the same queries with warm caches,
   links on and off, alternating.

Writes ``bench/results/entities-{lama,popularity,follow,overhead}.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.common import write_json
from bertknn.service.results import DEFAULT_BEAM

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
PROXY_MODEL = SHARED / "models" / "proxy-minilm-l6-mlm"

logger = logging.getLogger("bench.entities")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.entities", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--model", default=str(PROXY_MODEL), help="masked LM directory or name")
    p.add_argument("--data", type=Path, default=SHARED / "data", help="directory holding lama/ and wiki/")
    p.add_argument("--work", type=Path, default=REPO / "runs" / "bench-entities", help="corpus and datastore go here")
    p.add_argument("--results", type=Path, default=REPO / "bench" / "results", help="reports go here")
    p.add_argument("--limit", type=int, default=30, help="facts per relation (first N, file order)")
    p.add_argument("--follow-limit", type=int, default=30, help="two-hop questions per relation pair")
    p.add_argument("--distractors", type=int, default=300, help="vital articles added as distractors")
    p.add_argument("--fact-sentences", type=int, default=20, help="evidence sentences kept per evaluated fact")
    p.add_argument("--other-sentences", type=int, default=5, help="other evidence sentences per subject article")
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = CPU quota)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="cpu")
    p.add_argument("--rebuild", action="store_true", help="build the datastore again even if it is current")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def _asked(args: argparse.Namespace, relations: dict) -> tuple[set[str], set[str], list]:
    """The subjects and fact ids the corpus needs: the first ``--limit`` facts of each relation, and the
    two-hop questions with the facts that make each (X r1 Y, and Y's r2 facts)."""
    from bertknn.evaluation.entities import COMPOSED, two_hop_questions
    from bertknn.evaluation.lama import read_facts

    subjects: set[str] = set()
    uids: set[str] = set()
    for rel in relations.values():
        for fact in read_facts(rel)[: args.limit]:
            if fact.subject:
                subjects.add(fact.subject)
                uids.add(fact.uid)
    questions = two_hop_questions(relations, list(COMPOSED), args.follow_limit)
    bridges = {q.bridge for q in questions}
    for q in questions:
        subjects.add(q.subject)
    for rel in relations.values():
        for fact in read_facts(rel):
            if fact.subject in subjects and any(q.subject == fact.subject and q.r1 == rel.id for q in questions):
                uids.add(fact.uid)
            if fact.subject in bridges and any(q.bridge == fact.subject and q.r2 == rel.id for q in questions):
                subjects.add(fact.subject)
                uids.add(fact.uid)
    return subjects, uids, questions


def _datastore(args: argparse.Namespace, corpus: Path) -> tuple[Path, Any, bool, float]:
    """The linked datastore of ``corpus`` (reused when it is current): its path, manifest, whether it was reused,
    and the build's seconds."""
    from bertknn.builder.build import build
    from bertknn.builder.settings import BuildSettings
    from bertknn.core.format import read_manifest, sha256_file, validate_datastore
    from bertknn.core.runtime import cpu_quota_threads

    ds = args.work / "datastore"
    current = (
        not args.rebuild
        and (ds / "manifest.json").is_file()
        and [s.sha256 for s in read_manifest(ds).sources] == [sha256_file(corpus)]
        and read_manifest(ds).links is not None
        and not validate_datastore(ds, hashes=False)
    )
    t = time.perf_counter()
    if not current:
        if ds.exists():
            shutil.rmtree(ds)
        build(BuildSettings(corpus=[corpus], model=args.model, out=ds, device=args.device, workers=1,
                            batch_size=128, threads=args.threads or cpu_quota_threads()))  # type: ignore[call-arg]  # fmt: skip
    man = read_manifest(ds)
    logger.info("datastore %s: %s, links %s%s", ds, man.counts.model_dump(), man.links, " (reused)" if current else "")
    return ds, man, current, time.perf_counter() - t


def _evaluate(args: argparse.Namespace, ds: Path, lama_dir: Path, bench_meta: dict) -> int:
    """The entity LAMA, popularity and follow runs of `bertknn.evaluation`, each report with ``bench_meta``."""
    from bertknn.evaluation.__main__ import main as evaluate

    common = ["--datastore", str(ds), "--device", args.device, "--data", str(lama_dir)] + (["--quiet"] if args.quiet else [])
    if args.threads:
        common += ["--threads", str(args.threads)]
    args.results.mkdir(parents=True, exist_ok=True)
    runs = {
        "lama": ["lama", "--answer", "entity", "--trex", "evidence", "--datasets", "T-REx", "--limit", str(args.limit)],
        "popularity": ["lama", "--by-popularity", "--adaptive", "--adaptive-popularity", "--trex", "evidence",
                       "--datasets", "T-REx", "--limit", str(args.limit)],
        "follow": ["follow", "--limit", str(args.follow_limit)],
    }  # fmt: skip
    for name, argv_run in runs.items():
        out = args.results / f"entities-{name}.json"
        code = evaluate([*argv_run, *common, "--out", str(out)])
        if code != 0:
            return code
        report = json.loads(out.read_text(encoding="utf-8"))
        report.setdefault("settings", {}).update({"bench": bench_meta})
        write_json(out, report)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)

    from bench.quality.corpus import write_corpus
    from bertknn.evaluation.lama import discover_relations

    t0 = time.perf_counter()
    lama_dir, wiki_dir = args.data / "lama", args.data / "wiki"
    relations = {r.id: r for r in discover_relations(lama_dir, trex="evidence") if r.template is not None}
    subjects, uids, questions = _asked(args, relations)
    args.work.mkdir(parents=True, exist_ok=True)
    corpus = args.work / "corpus.jsonl"
    stats = write_corpus(
        corpus, wiki_dir=wiki_dir, lama_dir=lama_dir, trex_subjects=subjects, trex_uids=uids, google_re_uids=set(),
        distractors=args.distractors, max_fact_sentences=args.fact_sentences,
        max_other_sentences=args.other_sentences, links=True,
    )  # fmt: skip
    links = sum(len(json.loads(line).get("links", [])) for line in corpus.open(encoding="utf-8"))
    logger.info("corpus %s: %d articles, %d links, %d two-hop questions", corpus, stats.articles, links, len(questions))
    ds, man, current, build_s = _datastore(args, corpus)
    bench_meta = {"corpus_articles": stats.articles, "corpus_links": links, "contexts": man.counts.contexts,
                  "links": man.links.model_dump() if man.links else None, "build_s": round(build_s, 1),
                  "datastore_reused": current, "model": args.model}  # fmt: skip
    code = _evaluate(args, ds, lama_dir, bench_meta)
    if code != 0:
        return code
    overhead = measure_overhead(ds, lama_dir, args.limit, args.device)
    overhead["follow"] = measure_follow(ds, relations, questions, args.device)
    overhead["model"] = args.model
    write_json(args.results / "entities-overhead.json", overhead)
    logger.info("entity costs: %s", overhead)
    logger.info("bench.entities finished in %.0f s", time.perf_counter() - t0)
    return 0

def measure_follow(ds: Path, relations: dict, questions: Sequence, device: str, limit: int = 40) -> dict[str, object]:
    """Uncached latency of a two-hop relation following (the API's default beam: 1 + up to beam queries, two
    forward passes and their fills) against one entity query (its first hop alone), question by question,
    alternating, one torch thread, no cache."""
    import asyncio

    import numpy as np
    import torch

    from bertknn.evaluation.lama import fill_template
    from bertknn.service.cache import InMemoryCache
    from bertknn.service.follow import InProcess, follow
    from bertknn.service.pipeline import AnswerPipeline
    from bertknn.service.results import Query

    torch.set_num_threads(1)
    pipe = AnswerPipeline.open(ds, device=device, cache=InMemoryCache(0))  # nothing cached: every forward runs
    lower = bool(getattr(pipe.encoder.tokenizer, "do_lower_case", False))
    base = Query(text="", answer="entity")
    here = InProcess(pipe)
    batches = here.batches

    one: list[float] = []
    two: list[float] = []
    try:
        for q in list(questions)[:limit]:
            t1, t2 = relations[q.r1].template, relations[q.r2].template
            text = fill_template(t1, q.subject, lowercase=lower)
            t = time.perf_counter()
            pipe.predict(Query(text=text, subject=q.subject, answer="entity"))
            one.append(time.perf_counter() - t)
            t = time.perf_counter()
            asyncio.run(follow(
                q.subject, [t1, t2], top_k=10, beam=DEFAULT_BEAM, lower=lower, base=base, ask=here.ask,
                fill_names=here.fill_names,
            ))
            two.append(time.perf_counter() - t)
    finally:
        pipe.close()
    p50_one, p50_two = float(np.median(one)) * 1000, float(np.median(two)) * 1000
    return {
        "questions": len(one), "predict_entity_p50_ms": round(p50_one, 2), "follow_two_hops_p50_ms": round(p50_two, 2),
        "ratio": round(p50_two / p50_one, 2), "queries_per_follow_mean": round(sum(batches) / max(1, len(one)), 2),
    }  # fmt: skip


def measure_overhead(ds: Path, lama_dir: Path, limit: int, device: str, reps: int = 3) -> dict[str, object]:
    """What links cost a word query after its forward pass (each word answer's entity, the rows filter): the same
    queries with warm encoding and retrieval caches, on the datastore with its links and with them switched off,
    in alternating blocks, one torch thread."""
    import torch

    from bertknn.evaluation.lama import discover_relations, fill_template, read_facts
    from bertknn.service.cache import InMemoryCache
    from bertknn.service.pipeline import AnswerPipeline
    from bertknn.service.results import Query

    torch.set_num_threads(1)
    pipe = AnswerPipeline.open(ds, device=device, cache=InMemoryCache(1 << 16))
    lower = bool(getattr(pipe.encoder.tokenizer, "do_lower_case", False))
    queries = [
        Query(text=fill_template(r.template, f.subject, lowercase=lower), subject=f.subject)
        for r in discover_relations(lama_dir, trex="evidence") if r.template is not None
        for f in read_facts(r)[:limit] if f.subject
    ]  # fmt: skip
    for q in queries:  # warm the caches: what is timed is what comes after the forward pass
        pipe.predict(q)
    links = pipe.datastore.manifest.links
    ms: dict[str, list[float]] = {"with_links": [], "links_off": []}
    try:
        for _ in range(reps):
            for name, value in (("with_links", links), ("links_off", None)):
                pipe.datastore.manifest.links = value
                t = time.perf_counter()
                for q in queries:
                    pipe.predict(q)
                ms[name].append(round((time.perf_counter() - t) / len(queries) * 1000, 4))
    finally:
        pipe.datastore.manifest.links = links
        pipe.close()
    best = {k: min(v) for k, v in ms.items()}
    return {
        "queries": len(queries), "ms_per_query_after_forward": ms, "best": best,
        "added_ms": round(best["with_links"] - best["links_off"], 4),
        "ratio": round(best["with_links"] / best["links_off"], 3),
    }  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
