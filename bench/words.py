"""Whole-word answers on real data, one command: ``python -m bench.words`` (a few minutes on 2 CPU cores).

The shared LAMA files hold single-wordpiece objects only (LAMA released its probe filtered to its common
vocabulary; ``TREx_facts_all41`` is filtered the same way), so ``evaluation lama --multi-piece`` finds no fact to
keep there. This benchmark asks the other way round, where the answers are real multi-piece words: T-REx P1376
("[X] is the capital of [Y] .", 1-1) turned around, "[MASK] is the capital of [Y] .", gold = the capital X
(Mogadishu, Valletta, Tegucigalpa, ...), subject = the country or region Y, whose own article is searched.

1. Probe: ``work/lama/`` in LAMA's format, the P1376 facts of ``TREx_facts_all41`` with subject and object
   swapped and the template ``[Y] is the capital of [X] .``.
2. Corpus: the Wikipedia lead sections (``wiki/vital_articles.jsonl``) of every Y and every X that has one.
3. Datastore: the real builder with ``--targets whole-word`` and the proxy MiniLM MLM (reused when present).
4. ``python -m evaluation lama --multi-piece``: the ordinary table (one-wordpiece capitals) and the multi-piece
   section (capitals of 2-8 wordpieces), MLM / kNN / BERT-kNN at k=128, l=6, lambda=0.3.

Writes ``bench/results/words.json`` (the evaluation report plus corpus, datastore and wall times).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
PROXY_MODEL = SHARED / "models" / "proxy-minilm-l6-mlm"
RELATION = "P1376"
TEMPLATE = "[Y] is the capital of [X] ."

logger = logging.getLogger("bench.words")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.words", description=__doc__)
    p.add_argument("--model", default=str(PROXY_MODEL), help="masked LM directory or name")
    p.add_argument("--data", type=Path, default=SHARED / "data", help="directory holding lama/ and wiki/")
    p.add_argument(
        "--work", type=Path, default=REPO / "runs" / "bench-words", help="probe, corpus, datastore"
    )
    p.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "words.json")
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads (0 = the CPU quota); 1 by default: on a busy 2-core machine two OpenMP threads per "
        "process spin against each other (measured 10x slower forward passes)",
    )
    return p


def write_probe(data: Path, work: Path) -> list[dict]:
    """The inverted P1376 facts as a LAMA directory under ``work/lama``; returns them."""
    facts = []
    with open(data / "lama" / "TREx_facts_all41" / f"{RELATION}.jsonl", encoding="utf-8") as f:
        for line in f:
            fact = json.loads(line)
            facts.append(
                {"uuid": fact["uuid"], "sub_label": fact["obj_label"], "obj_label": fact["sub_label"]}
            )
    lama = work / "lama"
    (lama / "TREx").mkdir(parents=True, exist_ok=True)
    relation = {
        "relation": RELATION,
        "template": TEMPLATE,
        "label": "capital of (inverted: the capital asked)",
    }
    (lama / "relations.jsonl").write_text(json.dumps(relation) + "\n", encoding="utf-8")
    (lama / "TREx" / f"{RELATION}.jsonl").write_text(
        "".join(json.dumps(f) + "\n" for f in facts), encoding="utf-8"
    )
    return facts


def write_corpus(data: Path, work: Path, facts: list[dict]) -> dict[str, int]:
    """Lead sections of the facts' countries/regions and capitals (those in ``wiki/vital_articles.jsonl``)."""
    wanted = {f["sub_label"] for f in facts} | {f["obj_label"] for f in facts}
    kept = []
    with open(data / "wiki" / "vital_articles.jsonl", encoding="utf-8") as f:
        for line in f:
            article = json.loads(line)
            if article["title"] in wanted:
                kept.append(article)
    (work / "corpus.jsonl").write_text(
        "".join(json.dumps(a, ensure_ascii=False) + "\n" for a in kept), encoding="utf-8"
    )
    subjects = {f["sub_label"] for f in facts}
    return {
        "articles": len(kept),
        "subject_articles": sum(a["title"] in subjects for a in kept),
        "chars": sum(len(a["text"]) for a in kept),
    }


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("OPENAI_API_KEY", "unused")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    from bertknn.builder.build import build
    from bertknn.builder.settings import BuildSettings
    from bertknn.core.format import MANIFEST, read_manifest
    from bertknn.core.runtime import cpu_quota_threads
    from bertknn.evaluation.__main__ import main as evaluate

    work: Path = args.work
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    facts = write_probe(args.data, work)
    corpus = write_corpus(args.data, work, facts)
    ds = work / "ds-whole-word"
    reused = (ds / MANIFEST).is_file()
    t = time.perf_counter()
    if not reused:
        threads = args.threads or cpu_quota_threads()
        build(
            BuildSettings(
                corpus=[work / "corpus.jsonl"], model=args.model, out=ds, device="cpu", targets="whole-word",
                threads=threads, workers=1, batch_size=128,
            )
        )  # fmt: skip
    build_s = time.perf_counter() - t
    report_path = work / "report.json"
    t = time.perf_counter()
    rc = evaluate(
        ["lama", "--data", str(work / "lama"), "--datastore", str(ds), "--multi-piece", "--device", "cpu",
         "--threads", str(args.threads), "--out", str(report_path), "--quiet"]
    )  # fmt: skip
    if rc != 0:
        return rc
    eval_s = time.perf_counter() - t
    report = json.loads(report_path.read_text(encoding="utf-8"))
    man = read_manifest(ds)
    result = {
        "probe": f"T-REx {RELATION} inverted: {TEMPLATE.replace('[Y]', '[MASK]').replace('[X]', '<country>')}",
        "facts_read": len(facts),
        "corpus": corpus,
        "datastore": {"targets": man.targets, "reused": reused, **man.counts.model_dump()},
        "model": args.model,
        "seconds": {
            "build": round(build_s, 1),
            "evaluation": round(eval_s, 1),
            "total": round(time.perf_counter() - t0, 1),
        },
        "single_piece": {c: report["macro"][c] for c in ("mlm", "knn", "bert_knn")},
        "single_piece_facts": report["relations"][RELATION]["facts"],
        "multi_piece": report["multi_piece"],
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1, ensure_ascii=False) + "\n", encoding="utf-8")
    logger.info("written to %s", args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
