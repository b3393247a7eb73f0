"""Does bfloat16 on the CPU change answers? Top-1 agreement with float32 on LAMA-template queries, and the speed
of the forward pass, both measured in one run. One command::

    python -m bench.bf16 [--datastore runs/bench-quality/datastore] [--queries 400]

The datastore stays as built (float32 embeddings stored as float16); only the serving model's dtype changes, as
``BERTKNN_MODEL__DTYPE=bfloat16`` would. Writes bench/results/bf16.json.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from bench.common import REPO, lama_queries, machine, write_result
from bertknn.service.pipeline import AnswerPipeline, Query


def run(datastore: Path, dtype: str, queries: list[tuple[str, str]], batch: int) -> tuple[list[str], list[str], float]:
    pipe = AnswerPipeline.open(datastore, device="cpu", dtype=dtype)
    try:
        qs = [Query(t, subject=s, top_k=1) for t, s in queries]
        pipe.predict_batch(qs[:batch])  # warm-up
        pipe.cache.close()
        t0 = time.perf_counter()
        answers = []
        for i in range(0, len(qs), batch):
            answers.extend(pipe.predict_batch(qs[i : i + batch]))
        seconds = time.perf_counter() - t0
        return [a.predictions[0].token for a in answers], [a.mlm[0].token for a in answers], seconds
    finally:
        pipe.close()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.bf16", description=__doc__)
    p.add_argument("--datastore", type=Path, default=REPO / "runs" / "bench-quality" / "datastore")
    p.add_argument("--queries", type=int, default=400)
    p.add_argument("--batch", type=int, default=16)
    args = p.parse_args(argv)
    queries = lama_queries(args.queries, seed=7)
    f32, f32_mlm, t32 = run(args.datastore, "float32", queries, args.batch)
    b16, b16_mlm, t16 = run(args.datastore, "bfloat16", queries, args.batch)
    same = sum(a == b for a, b in zip(f32, b16, strict=True)) / len(f32)
    same_mlm = sum(a == b for a, b in zip(f32_mlm, b16_mlm, strict=True)) / len(f32)
    result = {
        "queries": len(queries),
        "bert_knn_top1_agreement": same,
        "mlm_top1_agreement": same_mlm,
        "float32_s": t32,
        "bfloat16_s": t16,
        "bfloat16_speedup": t32 / t16,
        "cpu_bf16": torch.backends.mkldnn.is_available(),
        "machine": machine(),
        "datastore": str(args.datastore),
    }
    path = write_result("bf16", result)
    print(f"{len(queries)} queries: BERT-kNN top-1 identical in {100 * same:.1f}%, MLM top-1 in {100 * same_mlm:.1f}%; "
          f"bf16 took {t16:.1f}s vs float32 {t32:.1f}s ({t32 / t16:.2f}x)")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
