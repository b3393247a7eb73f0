"""The builder's CPU stages on real enwiki pages: what one core does per byte of wikitext and per context. ::

    python -m bench.preprocess [--articles 20] [--corpus DUMP.xml.bz2]

One build of the first ``--articles`` articles of gensim's real enwiki excerpt (full pages with their markup, a
dev dependency; ``--corpus`` takes another dump) with one tokenising worker and one torch thread, the model
bert-base-uncased's shape and vocabulary at hidden size 64 (its forward costs little and is not what is measured).
The build's closing ``build finished:`` line times every stage in the process that runs it (`docs/building.md`,
"Where a build's time goes"); this writes each stage's rate per core: decompress and parse in bytes of XML per
second, markup in bytes of XML and articles per second, split and targets in contexts per second, write in bytes
per second, and each stage's share of the CPU before the forward. ``python -m bench.capacity`` scales them to a full dump.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.bert_base import make
from bench.build_memory import enwiki_excerpt
from bench.common import REPO, RUNS, machine, write_result
from bench.hostwork import TINY

CPU_STAGES = ("markup", "split", "targets")  # the tokenising workers' stages, before the forward


def run_build(corpus: Path, model: Path, articles: int) -> dict:
    """The closing summary of one build (its ``build finished:`` line)."""
    with tempfile.TemporaryDirectory(prefix="bench-preprocess-") as tmp:
        cmd = [sys.executable, "-m", "datastore_builder", "build", "--corpus", str(corpus), "--model", str(model),
               "--out", str(Path(tmp) / "ds"), "--device", "cpu", "--limit-articles", str(articles),
               "--workers", "1", "--threads", "1", "--no-sparse-indexes"]  # fmt: skip
        env = {**os.environ, "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    lines = [ln.split("build finished: ", 1)[1] for ln in proc.stderr.splitlines() if "build finished: " in ln]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"the build failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    return json.loads(lines[-1])


def per_core(summary: dict) -> dict:
    """Each stage's rate per core, and the shares of the tokenising workers' CPU."""
    st = summary["stages"]
    xml_bytes, contexts = st["decompress"]["bytes"], summary["contexts"]
    rates = {
        "decompress_bytes_per_s": xml_bytes / st["decompress"]["seconds"],
        "parse_bytes_per_s": xml_bytes / st["parse"]["seconds"],
        "markup_bytes_per_s": xml_bytes / st["markup"]["seconds"],
        "markup_articles_per_s": st["markup"]["articles"] / st["markup"]["seconds"],
        "split_contexts_per_s": contexts / st["split"]["seconds"],
        "targets_contexts_per_s": contexts / st["targets"]["seconds"],
        "write_bytes_per_s": contexts * summary["bytes_per_context"] / st["write"]["seconds"],
    }
    cpu = sum(st[s]["seconds"] for s in CPU_STAGES)
    return {
        "xml_bytes": xml_bytes, "articles": summary["articles"], "sentences": summary["sentences"],
        "contexts": contexts, "contexts_per_xml_byte": contexts / xml_bytes,
        "per_core": {k: round(v, 1) for k, v in rates.items()},
        "xml_mb_per_s": {s: round(rates[f"{s}_bytes_per_s"] / 1e6, 2) for s in ("decompress", "parse", "markup")},
        "workers_contexts_per_s": round(contexts / cpu, 1),
        "workers_share": {s: round(st[s]["seconds"] / cpu, 3) for s in CPU_STAGES},
        "bytes_per_context": summary["bytes_per_context"],
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--articles", type=int, default=20, help="the first N articles of the dump")
    p.add_argument("--corpus", type=Path, default=None, help="a pages-articles dump (default: gensim's excerpt)")
    p.add_argument("--work", type=Path, default=RUNS / "bench-hostwork")
    args = p.parse_args(argv)
    if args.articles < 1:
        p.error("--articles must be at least 1")
    corpus = args.corpus or enwiki_excerpt()
    if not corpus.is_file():
        p.error(f"--corpus {corpus}: no such file")
    model = make(args.work / "bert-base-h64", shape=TINY)
    result = {"corpus": corpus.name, "model": "bert-base-uncased's shape at hidden size 64", "machine": machine(),
              **per_core(run_build(corpus, model, args.articles))}  # fmt: skip
    print(json.dumps({k: result[k] for k in ("articles", "contexts", "per_core", "workers_contexts_per_s",
                                             "workers_share")}, indent=1))  # fmt: skip
    print(f"wrote {write_result('preprocess', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
