"""Article retrieval latency (BM25, TF-IDF) per query, against the model's forward pass on the same queries.

``python -m bench.retrieval`` builds (once; cached under ``runs/bench-retrieval/``) the BM25 and TF-IDF
indexes over the Wikipedia articles in ``../shared/data/wiki/*.jsonl`` with the builder's own
``write_sparse_indexes``, runs cloze queries made from the LAMA T-REx templates and subjects, and prints
p50/p99 latency per query of each retriever and of the proxy model's forward pass (embedding + p_MLM, batch
of one), with their ratio. The table's figures are written to ``bench/results/retrieval.json``.
"""

from __future__ import annotations

import argparse
import logging
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

if __package__ in (None, ""):  # `python bench/retrieval.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import PROXY_MODEL, RUNS, SHARED, lama_queries, machine, percentiles, write_result

logger = logging.getLogger("bench.retrieval")
WIKI = SHARED / "data" / "wiki"
INDEX_ROOT = RUNS / "bench-retrieval"
T = TypeVar("T")


def corpus_articles(files: list[Path]) -> Iterator[tuple[str, str]]:
    """(normalised title, text) per article, first title wins: what the builder would index."""
    from bertknn.builder.corpus import read_jsonl

    seen: set[str] = set()
    for path in files:
        for art in read_jsonl(path):
            if art.title not in seen:
                seen.add(art.title)
                yield art.title, art.text


def corpus_id(files: list[Path]) -> str:
    from bertknn.core.format import sha256_file

    return "|".join(f"{p.name}:{sha256_file(p)}" for p in files)


def time_calls(fn: Callable[[T], object], items: Sequence[T], warmup: int) -> list[float]:
    """Milliseconds per call, after ``warmup`` untimed calls."""
    for item in items[:warmup]:
        fn(item)
    out = []
    for item in items:
        t = time.perf_counter()
        fn(item)
        out.append((time.perf_counter() - t) * 1000.0)
    return out


def java_version() -> str | None:
    try:
        proc = subprocess.run(["java", "-version"], capture_output=True, text=True, check=False)
    except OSError:
        return None
    return (proc.stderr or proc.stdout).splitlines()[0] if (proc.stderr or proc.stdout) else None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.retrieval", description=__doc__)
    p.add_argument("--queries", type=int, default=500, help="LAMA template queries (default 500)")
    p.add_argument(
        "--num-articles", type=int, default=3, help="articles retrieved per query (the paper's N=3)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for the forward pass (default 1, like the retrievers; 0 = the CPU quota)",
    )
    p.add_argument(
        "--rebuild", action="store_true", help="rebuild the indexes even if the cached ones are current"
    )
    p.add_argument("--model", type=Path, default=PROXY_MODEL)
    return p


@dataclass
class _Indexes:
    """The BM25 and TF-IDF indexes over the corpus, open, and what building (or reusing) and opening them took."""

    bm25: Any
    tfidf: Any
    titles: set[str]
    setup_s: dict[str, object]
    index_bytes: dict[str, int]


def _open_indexes(files: list[Path], rebuild: bool) -> _Indexes:
    from bertknn.builder.sparse_index import write_sparse_indexes
    from bertknn.core.format import BM25_DIR, TFIDF_DIR
    from bertknn.service.retrieval.sparse import Bm25Retriever, TfidfRetriever

    if rebuild:
        import shutil

        shutil.rmtree(INDEX_ROOT / "index", ignore_errors=True)
    params = INDEX_ROOT / TFIDF_DIR / "params.json"
    before = params.stat().st_mtime_ns if params.is_file() else None
    t0 = time.perf_counter()
    write_sparse_indexes(INDEX_ROOT, corpus_articles(files), content_id=corpus_id(files))
    index_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    bm25 = Bm25Retriever(INDEX_ROOT / BM25_DIR)
    bm25_open_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    tfidf = TfidfRetriever(INDEX_ROOT / TFIDF_DIR)
    tfidf_open_s = time.perf_counter() - t0
    setup: dict[str, object] = {
        "indexes_built_now": before != params.stat().st_mtime_ns,
        "index_build_or_reuse": round(index_s, 2),
        "bm25_open_incl_jvm": round(bm25_open_s, 2),
        "tfidf_open": round(tfidf_open_s, 2),
    }
    sizes = {name: sum(f.stat().st_size for f in (INDEX_ROOT / rel).iterdir())
             for name, rel in (("bm25", BM25_DIR), ("tfidf", TFIDF_DIR))}  # fmt: skip
    return _Indexes(bm25, tfidf, set(tfidf.titles()), setup, sizes)


def _rows(stats: dict[str, dict[str, float]]) -> list[dict[str, object]]:
    """Each stage's latency, and against the forward pass's p50."""
    fwd = stats["forward"]
    return [
        {
            "stage": name,
            "p50_ms": round(s["p50"], 3),
            "p99_ms": round(s["p99"], 3),
            "mean_ms": round(s["mean"], 3),
            "p50_vs_forward_p50": round(s["p50"] / fwd["p50"], 4),
            "p99_vs_forward_p50": round(s["p99"] / fwd["p50"], 4),
        }
        for name, s in ((n, stats[n]) for n in ("bm25", "tfidf", "forward"))
    ]


def _print_table(rows: list[dict[str, Any]]) -> None:
    header = f"{'stage':<8} {'p50 ms':>9} {'p99 ms':>9} {'mean ms':>9} {'p50/fwd p50':>12} {'p99/fwd p50':>12}"
    print(header)
    print("-" * len(header))
    for r in rows:
        print(
            f"{r['stage']:<8} {r['p50_ms']:>9.3f} {r['p99_ms']:>9.3f} {r['mean_ms']:>9.3f} "
            f"{r['p50_vs_forward_p50']:>12.4f} {r['p99_vs_forward_p50']:>12.4f}"
        )


def _measure(args: argparse.Namespace, ix: _Indexes, queries: list[tuple[str, str]]) -> dict[str, Any]:
    """Each retriever's and the model's forward's latency per query, and how often each retriever's top N holds
    the subject's own article (when it has one)."""
    import torch

    from bertknn.core.encoder import MaskedLMEncoder
    from bertknn.core.runtime import cpu_quota_threads
    from bertknn.core.titles import normalize_title

    texts = [q for q, _ in queries]
    n = args.num_articles
    warm = min(20, len(texts))
    latency = {
        "bm25": time_calls(lambda q: ix.bm25.top_articles(q, n), texts, warm),
        "tfidf": time_calls(lambda q: ix.tfidf.top_articles(q, n), texts, warm),
    }
    with_article = [(q, normalize_title(s)) for q, s in queries if normalize_title(s) in ix.titles]
    recall = {
        name: sum(t in {h for h, _ in r.top_articles(q, n)} for q, t in with_article) / max(1, len(with_article))
        for name, r in (("bm25", ix.bm25), ("tfidf", ix.tfidf))
    }
    torch.set_num_threads(args.threads or cpu_quota_threads())
    encoder = MaskedLMEncoder.load(str(args.model), device="cpu")
    inputs = [encoder.query_input(q) for q in texts]
    latency["forward"] = time_calls(lambda x: encoder.encode([x], with_mlm=True), inputs, min(10, len(inputs)))
    return {"queries": len(texts), "stats": {name: percentiles(v) for name, v in latency.items()},
            "with_article": len(with_article), "recall": recall, "threads": torch.get_num_threads()}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from importlib.metadata import version

    load_start = os.getloadavg()[0]
    files = sorted(WIKI.glob("*.jsonl"))
    if not files:
        print(f"error: no corpus in {WIKI}", file=sys.stderr)
        return 1
    ix = _open_indexes(files, args.rebuild)
    m = _measure(args, ix, lama_queries(args.queries))
    n, stats, recall = args.num_articles, m["stats"], m["recall"]
    rows = _rows(stats)
    print(
        f"\nRetrieval latency per query: {m['queries']} LAMA T-REx template queries, top {n} of {len(ix.titles)} "
        f"articles ({', '.join(f.name for f in files)}); forward = {Path(str(args.model)).name} on CPU, "
        f"{m['threads']} torch threads, batch 1, embedding + p_MLM"
    )
    _print_table(rows)
    print(
        f"subject article in the top {n} (queries whose subject has an article: {m['with_article']}): "
        + ", ".join(f"{k} {v:.3f}" for k, v in recall.items())
    )
    payload = {
        "benchmark": "retrieval",
        "command": " ".join(["python -m bench.retrieval", *(argv if argv is not None else sys.argv[1:])]),
        "conditions": {
            **machine(), "queries": m["queries"], "num_articles": n, "articles_indexed": len(ix.titles),
            "corpus": [f.name for f in files], "model": Path(str(args.model)).name, "pyserini": version("pyserini"),
            "java": java_version(), "retrieval_threads": 1, "loadavg_1m_start": round(load_start, 2),
            "loadavg_1m_end": round(os.getloadavg()[0], 2),
        },
        "table": rows,
        "latency_ms": {
            k: {q: round(v, 4) if isinstance(v, float) else v for q, v in s.items()} for k, s in stats.items()
        },
        "subject_article_in_top_n": {"queries": m["with_article"], **{k: round(v, 4) for k, v in recall.items()}},
        "setup_s": ix.setup_s,
        "index_bytes": ix.index_bytes,
    }  # fmt: skip
    path = write_result("retrieval", payload)
    print(f"written: {path}")
    ix.bm25.close()
    return 0

if __name__ == "__main__":
    sys.exit(main())
