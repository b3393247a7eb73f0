"""The builder's peak memory against ``--contexts-per-shard``, on real full Wikipedia pages. One command::

    python -m bench.build_memory            # gensim's real enwiki excerpt (dev dependency), three settings

Each setting builds the same corpus in a fresh process (``python -m datastore_builder build``, one tokenising
worker, the default) and reports the peak resident memory of the builder and of its worker (``ru_maxrss``),
the number of shards and the largest shard's contexts. The model is a small random BERT with the real
bert-base-uncased vocabulary (hidden 384 as the proxy, 2 layers): the memory held per context (inputs, vectors,
sentences) is the same as for any 384-d model, and its forward is quick, so the runs take minutes; for 768-d models
the vectors take twice the bytes. Results go to ``bench/results/build_memory.json`` and a table.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.bert_base import make
from bench.common import REPO, RESULTS, machine, write_json

SMALL_SHAPE = {"hidden_size": 384, "num_hidden_layers": 2, "num_attention_heads": 6, "intermediate_size": 1536,
               "vocab_size": 30522, "max_position_embeddings": 512}  # fmt: skip
_RUN_ONE = """
import json, resource, sys
from bertknn.builder.__main__ import main
code = main(sys.argv[1:])
me = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
print("PEAK " + json.dumps({"code": code, "builder_kib": me, "worker_kib": kids}))
"""


def enwiki_excerpt() -> Path:
    """gensim's test data: 206 real enwiki pages (full articles, with their markup), a dev dependency."""
    spec = importlib.util.find_spec("gensim")
    if spec is None or spec.origin is None:
        raise SystemExit("gensim is not installed: `pip install -e .[dev]` (or give --corpus)")
    path = Path(spec.origin).parent / "test" / "test_data" / "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"
    if not path.is_file():
        raise SystemExit(f"{path}: not in this gensim wheel; give --corpus")
    return path


def one(
    corpus: Path, model: Path, out: Path, contexts_per_shard: int, articles_per_shard: int, limit: int | None
) -> dict[str, object]:
    argv = [
        "build", "--corpus", str(corpus), "--model", str(model), "--out", str(out), "--device", "cpu",
        "--articles-per-shard", str(articles_per_shard), "--contexts-per-shard", str(contexts_per_shard),
        "--no-sparse-indexes", "--workers", "1", "--threads", "1",
        *(["--limit-articles", str(limit)] if limit else []),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", _RUN_ONE, *argv], cwd=REPO, env=env, capture_output=True, text=True)
    seconds = time.perf_counter() - t
    peak_line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("PEAK ")), None)
    if proc.returncode != 0 or peak_line is None:
        raise SystemExit(f"build failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    peak = json.loads(peak_line[5:])
    manifest = json.loads((out / "manifest.json").read_text())
    rows = [s["rows"] for s in manifest["shards"]]
    return {
        "contexts_per_shard": contexts_per_shard or None,
        "articles_per_shard": articles_per_shard,
        "articles": manifest["counts"]["articles"],
        "contexts": manifest["counts"]["contexts"],
        "shards": len(rows),
        "largest_shard_contexts": max(rows, default=0),
        "builder_peak_mib": round(peak["builder_kib"] / 1024, 1),
        "worker_peak_mib": round(peak["worker_kib"] / 1024, 1),
        "seconds": round(seconds, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--corpus", type=Path, default=None, help="default: gensim's real enwiki excerpt")
    p.add_argument("--settings", default="0,100000,20000", help="--contexts-per-shard values (0: one shard per block)")
    p.add_argument("--articles-per-shard", type=int, default=500)
    p.add_argument("--articles", type=int, default=None, help="the first N articles only (default: all)")
    p.add_argument("--out", type=Path, default=RESULTS / "build_memory.json")
    args = p.parse_args(argv)
    corpus = args.corpus or enwiki_excerpt()
    rows = []
    with tempfile.TemporaryDirectory(prefix="bench-build-memory-") as tmp:
        model = make(Path(tmp) / "model", shape=SMALL_SHAPE)
        for value in (int(v) for v in args.settings.split(",")):
            row = one(corpus, model, Path(tmp) / f"ds-{value}", value, args.articles_per_shard, args.articles)
            rows.append(row)
            print(json.dumps(row), flush=True)
    print(f"\n{'contexts/shard':>15} {'shards':>7} {'largest':>8} {'builder MiB':>12} {'worker MiB':>11} {'s':>7}")
    for r in rows:
        print(f"{str(r['contexts_per_shard']):>15} {r['shards']:>7} {r['largest_shard_contexts']:>8} "
              f"{r['builder_peak_mib']:>12} {r['worker_peak_mib']:>11} {r['seconds']:>7}")  # fmt: skip
    write_json(args.out, {"corpus": str(corpus.name), "model": "random BERT, hidden 384, 2 layers, bert-base-uncased "
                          "vocabulary", "machine": machine(), "runs": rows})  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
