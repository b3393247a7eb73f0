"""Real-data quality benchmark, one command: ``python -m bench.quality`` (``--help`` for the options).

1. Queries: the LAMA probe (T-REx relations that have evidence files, Google-RE, SQuAD) built as
   ``python -m evaluation lama`` builds them, the first ``--limit`` facts per relation (default 50).
2. Corpus (``bench/quality/corpus.py``): the subject articles of those facts (T-REx evidence sentences grouped
   per subject; the Google-RE Wikipedia snippets of those facts) plus ``--distractors`` vital Wikipedia articles
   (default 2000, a fixed sample by title hash) for the article ranker to choose among. ``--full`` takes every
   article of ``wiki/`` and every T-REx subject instead (hours on 2 CPU cores).
3. Datastore: built with the real builder (``--model``, default the proxy MiniLM MLM), BM25 + TF-IDF + IVF-PQ
   indexes; reused when the corpus and model are unchanged (``--rebuild`` forces a new build).
4. Evaluation: one in-process pipeline, MLM vs kNN vs interpolation, with retrieval (BM25, N=3, subject article
   first) and without (kNN over the whole datastore, IVF-PQ); full vocabulary, and LAMA's common vocabulary.
   Settings are the service defaults (k=128, l=6, lambda=0.3).

Writes ``bench/results/quality.json`` (every report in the ``--out`` format of ``python -m evaluation lama``,
with the subset, corpus, datastore and wall times) and ``bench/results/quality.md`` (the table).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SHARED = REPO.parent / "shared"
PROXY_MODEL = SHARED / "models" / "proxy-minilm-l6-mlm"

logger = logging.getLogger("bench.quality")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m bench.quality",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--model", default=str(PROXY_MODEL), help="masked LM directory or name")
    p.add_argument("--data", type=Path, default=SHARED / "data", help="directory holding lama/ and wiki/")
    p.add_argument(
        "--work", type=Path, default=REPO / "runs" / "bench-quality", help="corpus and datastore go here"
    )
    p.add_argument("--results", type=Path, default=REPO / "bench" / "results", help="reports go here")
    p.add_argument("--limit", type=int, default=50, help="facts per relation (first N kept, file order)")
    p.add_argument("--distractors", type=int, default=2000, help="vital articles added as distractors")
    p.add_argument("--full", action="store_true", help="every article and every fact (hours on 2 CPU cores)")
    p.add_argument(
        "--vocab", type=Path, help="LAMA common vocabulary (default lama/common_vocab_lowercased.txt)"
    )
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = CPU quota)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="cpu")
    p.add_argument("--batch-size", type=int, default=32, help="evaluation batch size")
    p.add_argument("--rebuild", action="store_true", help="build the datastore again even if it is current")
    p.add_argument("--quiet", action="store_true", help="no progress bars")
    return p


def _datastore_is_current(ds: Path, corpus_sha: str, model_sha: str) -> bool:
    from datastore_builder.format import read_manifest, validate_datastore

    if not (ds / "manifest.json").is_file():
        return False
    man = read_manifest(ds)
    same = [s.sha256 for s in man.sources] == [corpus_sha] and man.model.weights_sha256 == model_sha
    return same and {"bm25", "ivfpq"} <= set(man.indexes) and not validate_datastore(ds, hashes=False)


def _markdown(runs: dict[str, dict], meta: dict) -> str:
    cols = ("mlm", "knn", "bert_knn")
    names = {"mlm": "MLM", "knn": "kNN", "bert_knn": "BERT-kNN"}
    lines = [
        "# Quality benchmark (LAMA)",
        "",
        f"Model: `{meta['model']}`; datastore: {meta['datastore']['articles']} articles, "
        f"{meta['datastore']['contexts']} contexts (layer {meta['datastore']['layer']}); "
        f"subset: {meta['subset']['description']}.",
        f"Settings: N=3 articles (subject article first, then BM25), k=128, l=6, lambda=0.3; no retrieval = kNN over "
        f"the whole datastore (IVF-PQ, nprobe 64, re-ranked exactly). Wall time: {meta['timings_s']['total']:.0f} s "
        f"({', '.join(f'{k} {v:.0f} s' for k, v in meta['timings_s'].items() if k != 'total')}) on "
        f"{meta['machine']['cores']} CPU cores.",
        "Macro P@k (%): per relation first, then the mean over relations; 'overall' is the mean over all relations of "
        "all datasets.",
        "",
    ]
    for vocab_name in ("full", "common"):
        subset = {k: v for k, v in runs.items() if k.endswith(vocab_name)}
        if not subset:
            continue
        title = (
            "full vocabulary"
            if vocab_name == "full"
            else "LAMA common vocabulary (ranking and facts restricted)"
        )
        lines += [f"## {title}", ""]
        lines.append(
            "| dataset | relations | facts | retrieval | "
            + " | ".join(f"{names[c]} P@1" for c in cols)
            + " | "
            + " | ".join(f"{names[c]} P@10" for c in cols)
            + " |"
        )
        lines.append("|---|---:|---:|---|" + "---:|" * (2 * len(cols)))
        first = next(iter(subset.values()))
        rows = [(d, v["relations"], v["facts"]) for d, v in first["datasets"].items()]
        rows.append(
            ("overall", len(first["relations"]), sum(r["facts"] for r in first["relations"].values()))
        )
        for ds, nrel, nfacts in rows:
            for run_name, rep in subset.items():
                block = rep["macro"] if ds == "overall" else rep["datasets"][ds]
                retr = "BM25 + subject" if run_name.startswith("bm25") else "none (whole datastore)"
                cells = [f"{block[c]['p@1']:.1f}" for c in cols] + [f"{block[c]['p@10']:.1f}" for c in cols]
                lines.append(f"| {ds} | {nrel} | {nfacts} | {retr} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines) + "\n"


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    import torch
    from transformers import AutoTokenizer

    from bench.quality.corpus import write_corpus
    from datastore_builder.build import build, cpu_quota_threads
    from datastore_builder.encoder import MaskedLMEncoder
    from datastore_builder.format import Datastore, read_manifest, sha256_file
    from datastore_builder.settings import BuildSettings
    from evaluation.lama import (
        GOOGLE_RE,
        TREX,
        ObjectVocabulary,
        discover_relations,
        load_probe,
        load_vocab_file,
    )
    from evaluation.metrics import format_table, report_dict, summarize
    from evaluation.runner import PipelineRunner, RunSettings
    from service.cache import InMemoryCache
    from service.pipeline import AnswerPipeline

    t_start = time.perf_counter()
    timings: dict[str, float] = {}
    threads = args.threads or cpu_quota_threads()
    torch.set_num_threads(threads)
    lama_dir, wiki_dir = args.data / "lama", args.data / "wiki"
    limit = None if args.full else args.limit
    distractors = None if args.full else args.distractors

    # 1. queries (the model's tokenizer decides which objects are single wordpieces)
    tokenizer = AutoTokenizer.from_pretrained(args.model, use_fast=True)
    relations = discover_relations(lama_dir, trex="evidence")
    probe = load_probe(relations, ObjectVocabulary(tokenizer), limit=limit)
    trex_subjects = {q.subject for q in probe.queries if q.dataset == TREX and q.subject}
    gre_uids = {q.uid for q in probe.queries if q.dataset == GOOGLE_RE}

    # 2. corpus
    t = time.perf_counter()
    args.work.mkdir(parents=True, exist_ok=True)
    corpus_path = args.work / "corpus.jsonl"
    corpus_stats = write_corpus(
        corpus_path,
        wiki_dir=wiki_dir,
        lama_dir=lama_dir,
        trex_subjects=None if args.full else trex_subjects,
        google_re_uids=None if args.full else gre_uids,
        distractors=distractors,
    )
    timings["corpus"] = time.perf_counter() - t

    # 3. datastore
    t = time.perf_counter()
    encoder = MaskedLMEncoder.load(args.model, layer=-2, device=args.device)
    ds = args.work / "datastore"
    corpus_sha = sha256_file(corpus_path)
    reused = not args.rebuild and _datastore_is_current(ds, corpus_sha, encoder.weights_sha256)
    if not reused:
        if ds.exists():
            shutil.rmtree(ds)
        build(
            BuildSettings(
                corpus=[corpus_path], model=args.model, out=ds, device=args.device, ivfpq=True, threads=threads,
                workers=1, batch_size=128,
            ),
            encoder=encoder,
        )  # fmt: skip
    timings["build"] = time.perf_counter() - t
    man = read_manifest(ds)
    logger.info("datastore %s: %s%s", ds, man.counts.model_dump(), " (reused)" if reused else "")

    # 4. evaluation: one pipeline, so the forward pass and retrieval of each query run once across the runs
    pipeline = AnswerPipeline(encoder, Datastore(ds), cache=InMemoryCache(1 << 18))
    vocab_path = args.vocab or lama_dir / "common_vocab_lowercased.txt"
    common = ObjectVocabulary(tokenizer, load_vocab_file(vocab_path))
    common_probe = load_probe(relations, common, limit=limit)
    runs: dict[str, dict] = {}
    try:
        for vocab_name, vocab, queries in (
            ("full", None, probe.queries),
            ("common", common, common_probe.queries),
        ):
            runner = PipelineRunner(
                pipeline, allowed_ids=None if vocab is None else vocab.allowed_ids(), progress=not args.quiet
            )
            for retriever in ("bm25", "none"):
                t = time.perf_counter()
                settings = RunSettings(retriever=retriever, batch_size=args.batch_size)  # type: ignore[arg-type]
                results = runner.run(queries, settings)
                elapsed = time.perf_counter() - t
                timings[f"eval {retriever} {vocab_name}"] = elapsed
                summary = summarize(results)
                name = f"{retriever}_{vocab_name}"
                runs[name] = report_dict(
                    summary,
                    {
                        "model": args.model,
                        "datastore": str(ds),
                        "retriever": retriever,
                        "num_articles": None if retriever == "none" else settings.num_articles,
                        "k": settings.k,
                        "temperature": settings.temperature,
                        "lambda": settings.lambda_,
                        "vocab": None if vocab is None else str(vocab_path),
                        "limit": limit,
                        "queries": len(queries),
                        "wall_s": round(elapsed, 1),
                        "averages": "macro: per relation first, then mean over relations; 'macro' = mean over all "
                        "relations of all datasets",
                    },
                )
                label = "no retrieval" if retriever == "none" else "BM25 + subject article"
                print(format_table(summary, title=f"\n{label}, {vocab_name} vocabulary: P@1/P@5/P@10 in %"))
    finally:
        pipeline.close()
    timings["total"] = time.perf_counter() - t_start

    n_rel = len({q.relation for q in probe.queries})
    meta = {
        "model": args.model,
        "subset": {
            "full": bool(args.full),
            "limit_per_relation": limit,
            "distractor_vital_articles": distractors,
            "relations": n_rel,
            "queries_full_vocab": len(probe.queries),
            "queries_common_vocab": len(common_probe.queries),
            "description": (
                "every fact, every article"
                if args.full
                else f"first {limit} facts per relation of T-REx (22 relations with evidence files), Google-RE (2) and "
                f"SQuAD ({len(probe.queries)} queries, {n_rel} relations); corpus = their subject articles + "
                f"{distractors} vital Wikipedia articles"
            ),
        },
        "corpus": corpus_stats.as_dict(),
        "datastore": {
            **man.counts.model_dump(),
            "layer": man.layer,
            "id": man.datastore_id,
            "reused": reused,
        },
        "timings_s": {k: round(v, 1) for k, v in timings.items()},
        "machine": {"cores": os.cpu_count(), "torch_threads": threads, "python": platform.python_version()},
    }
    args.results.mkdir(parents=True, exist_ok=True)
    (args.results / "quality.json").write_text(
        json.dumps({**meta, "runs": runs}, indent=1, ensure_ascii=False) + "\n"
    )
    md = _markdown(runs, meta)
    (args.results / "quality.md").write_text(md)
    print("\n" + md)
    print(
        f"wall time {timings['total']:.0f} s; reports in {args.results / 'quality.json'} and {args.results / 'quality.md'}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
