"""The GPU figures in one command, on a machine with a CUDA device::

    python -m bench.gpu [--model runs/bert-base-shaped] [--articles 200]

Runs, one after the other (nothing beside them): the builder's contexts/s on bert-base-uncased's shape in bfloat16
and float16 with the cut forward, its token budget per batch swept, its padding fraction and the stage that
bounds the build (the GPU's forward, or the CPU workers preparing contexts) (`bench.builder --device cuda`), uncached ``/predict``
p50 and throughput at 1 and 64 clients with the service on the GPU (`bench.serving --device cuda`), and the IVF-PQ
index's training time for a 10M-row datastore (its plan's sample, synthetic vectors; on the GPU when the
installed faiss has GPU support, docs/retrieval.md). Writes ``bench/results/gpu.json``.

Without a CUDA device it says so in one line and exits with status 3 (`NO_DEVICE`), so that a script can tell
"no GPU here" from a failure.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

from bench.common import REPO, RESULTS, RUNS, machine

NO_DEVICE = 3


def _run(cmd: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(cmd, check=True, cwd=REPO)
    return round(time.perf_counter() - t, 1)


def time_ivfpq_training(rows: int, dim: int, *, seed: int = 0) -> dict[str, object]:
    """Train the IVF-PQ index that `plan_ivfpq` plans for ``rows`` vectors of ``dim`` (on the GPUs faiss has,
    as `bert-knn ivfpq` would), on its training sample of synthetic clustered vectors: the plan and the seconds."""
    import numpy as np

    from bertknn.builder.ivfpq import new_index, on_gpus, plan_ivfpq

    plan = plan_ivfpq(rows, dim)
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((1000, dim)).astype(np.float32) * 3
    sample = centres[rng.integers(0, len(centres), plan.train_rows)]
    sample += rng.standard_normal(sample.shape, dtype=np.float32)
    cpu = new_index(plan)
    gpu = on_gpus(cpu, plan)
    t = time.perf_counter()
    (gpu if gpu is not None else cpu).train(sample)
    return {"rows": rows, "dim": dim, "nlist": plan.nlist, "m": plan.m, "nbits": plan.nbits,
            "train_rows": plan.train_rows, "on": "gpu" if gpu is not None else "cpu",
            "train_s": round(time.perf_counter() - t, 1)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=RUNS / "bert-base-shaped")
    p.add_argument("--articles", type=int, default=200)
    p.add_argument("--ivfpq-rows", type=int, default=10_000_000, help="the datastore size whose IVF-PQ training is "
                   "timed (its plan's sample of synthetic vectors, bert-base's hidden size)")  # fmt: skip
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print("bench.gpu: no CUDA device on this machine (torch.cuda.is_available() is False); run it where one is",
              file=sys.stderr)  # fmt: skip
        return NO_DEVICE
    if not (args.model / "config.json").is_file():
        _run([sys.executable, "-m", "bench.bert_base", "--out", str(args.model)])
    py = sys.executable
    out: dict[str, object] = {"device": torch.cuda.get_device_name(0), "machine": machine(), "model": args.model.name}
    for dtype in ("bfloat16", "float16"):
        report = RESULTS / f"gpu-builder-{dtype}.json"
        _run([py, "-m", "bench.builder", "--model", str(args.model), "--device", "cuda", "--dtype", dtype,
              "--articles", str(args.articles), "--batch-size", "2048", "--batch-tokens", "16384,65536,262144",
              "--runs", "2", "--out", str(report)])  # fmt: skip
        out[f"builder_{dtype}"] = json.loads(report.read_text())["runs"]
    serving = RESULTS / f"serving-cuda-{args.model.name}.json"
    _run([py, "-m", "bench.serving", "--model", str(args.model), "--device", "cuda", "--articles", "40",
          "--work", str(RUNS / "bench-serving-gpu"), "--scale", "", "--concurrency", "1,64"])  # fmt: skip
    if serving.is_file():
        out["serving"] = json.loads(serving.read_text())
    out["ivfpq_training"] = time_ivfpq_training(args.ivfpq_rows, 768)
    (RESULTS / "gpu.json").write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {RESULTS / 'gpu.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
