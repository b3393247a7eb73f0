"""The GPU figures in one command, on a machine with a CUDA device::

    python -m bench.gpu [--model runs/bert-base-shaped] [--articles 10033] [--workers 8]

Runs, one after the other (nothing beside them), each stage in a process of its own so that one failing stage
leaves the others' figures:

- ``vectors``: the cut forward's rows on the GPU in bfloat16 and float16 against the full forward in float32 on
  the CPU, on the same contexts (relative error per row), and whether p_MLM's top entry agrees;
- ``new_shapes``: the builder's forward (bfloat16) on batch shapes it has not seen against the same shapes again,
  with cuDNN's attention kernel allowed, without it, and as the encoder leaves it (without, on CUDA): what a new
  (rows, width) shape costs (docs/decisions/cuda-attention-kernels.md);
- ``cuda_graphs``: the service's forward (bfloat16, with p_MLM) eager against its CUDA graphs, at 1 to 64
  questions per batch: p50 ms of each and the largest difference of their outputs, and how long capturing them at
  start-up took (docs/decisions/cuda-graphs.md);
- ``device_knn``: a batch's restricted kNN on the device (`batch_knn`: the rows copied there; `resident_knn`: kept there)
  against the service's FAISS search of each query's rows on the host, at 1 and 32 queries of 500 and 3,000 rows;
- ``device_vote``: a batch's vote, interpolation and top-k on the device (`DeviceVote`) against the host's, one
  question after another, at 1 and 32 questions (`bench.vote_batch`);
- ``builder_bfloat16`` / ``builder_float16``: the builder's contexts/s on bert-base-uncased's shape with the cut
  forward, the token budget per batch swept (in bfloat16; float16 at one budget), its padding fraction and the
  stage that bounds the build: the GPU's forward, or the CPU workers preparing contexts (`bench.builder
  --device cuda`);
- ``builder_cudnn``: the bfloat16 build at the first budget with cuDNN's attention kernel allowed again (`bench.builder
  --sdpa cudnn,flash,efficient,math`): the build as it was before the encoder left that kernel out;
- ``serving``: uncached ``/predict`` p50 and throughput at 1 and 64 clients, the service on the GPU with its
  default processes (`bench.serving --device cuda`; each level warmed at its own concurrency first);
- ``serving_device_knn``: ``serving`` with each batch's restricted kNN on the GPU (``--knn-device model``): whether
  that path should be the service's default on a GPU (docs/decisions/serving-processes.md);
- ``serving_device_vote``: ``serving_device_knn`` with each batch's vote, interpolation and top-k on the GPU too
  (``--vote-device model``): whether that should be the default with the kNN there;
- ``serving_one_process``: the same as ``serving`` with one service process (``--workers 1``): what the processes
  add;
- ``serving_event_loop``: ``serving`` with each process's batches on its event loop (``--on-event-loop``): whether
  that should be the default for several processes on a GPU (docs/decisions/serving-processes.md);
- ``serving_split`` / ``serving_split_4``: ``serving`` in the split layout (``--layout split``): its default API
  processes, or 4, beside one model process that merges their batches into one forward pass
  (docs/decisions/serving-processes.md);
- ``serving_block_wait``: ``serving`` with each process's model thread sleeping on a blocking CUDA event while
  its forward runs (``--cuda-wait block``) instead of busy-waiting on its core: whether the default processes' CPU
  per request is partly that wait (docs/decisions/serving-processes.md);
- ``steps``: where one uncached question's time goes in one service process on the GPU, step by step from the
  HTTP layer to the response (`bench.steps --device cuda`): what the one-client p50 consists of beside the forward;
- ``ivfpq_training``: the IVF-PQ index's training time for a ``--ivfpq-rows`` datastore (its plan's sample,
  synthetic vectors; on the GPU when the installed faiss has GPU support, docs/retrieval.md); 0 skips it.

The stages run in the order ``--only`` names them. Writes ``bench/results/gpu.json`` and ``bench/results/gpu.md``
(the table that docs/performance.md's GPU section takes) after every stage, so that a run stopped early keeps both.

Without a CUDA device it says so in one line and exits with status 3 (`NO_DEVICE`), so that a script can tell
"no GPU here" from a failure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import REPO, RESULTS, RUNS, SHARED, device_sync, machine, write_json

NO_DEVICE = 3
STAGES = ("vectors", "new_shapes", "cuda_graphs", "device_knn", "device_vote", "builder_bfloat16", "builder_float16", "builder_cudnn", "serving",
          "serving_device_knn", "serving_device_vote", "serving_one_process", "serving_event_loop", "serving_split", "serving_split_4", "serving_block_wait", "steps",
          "ivfpq_training")
VITAL = SHARED / "data" / "wiki" / "vital_articles.jsonl"


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


def masked_contexts(corpus: Path, n: int) -> list[str]:
    """``n`` sentences of the corpus with one word (the fourth) masked: contexts as the builder embeds them."""
    out: list[str] = []
    with open(corpus, encoding="utf-8") as f:
        for line in f:
            for sentence in json.loads(line)["text"].split(". "):
                words = sentence.split()
                if len(words) >= 6:
                    out.append(" ".join([*words[:3], "[MASK]", *words[4:]]) + " .")
                if len(out) == n:
                    return out
    return out


def compare_vectors(model: Path, corpus: Path, n: int = 256) -> dict[str, object]:
    """The cut forward on the GPU (bfloat16, float16) against the full forward in float32 on the CPU: the
    relative error of each context's row and the share of contexts whose p_MLM top entry is the same."""
    import numpy as np

    from bertknn.core.encoder import MaskedLMEncoder

    texts = masked_contexts(corpus, n)
    ref = MaskedLMEncoder.load(str(model), device="cpu", dtype="float32", truncate=False)
    inputs = [ref.query_input(t) for t in texts]
    want = ref.encode(inputs, with_mlm=True)
    assert want.mlm_log_probs is not None
    want_top = want.mlm_log_probs.argmax(-1).numpy()
    out: dict[str, object] = {"contexts": len(texts), "reference": "full forward, float32, CPU"}
    for dtype in ("bfloat16", "float16"):
        enc = MaskedLMEncoder.load(str(model), device="cuda", dtype=dtype)
        outs = [enc.encode(inputs[i : i + 64], with_mlm=True) for i in range(0, len(inputs), 64)]
        got = np.concatenate([o.embeddings for o in outs])
        top = np.concatenate([o.mlm_log_probs.argmax(-1).cpu().numpy() for o in outs if o.mlm_log_probs is not None])
        rel = np.linalg.norm(got - want.embeddings, axis=1) / np.linalg.norm(want.embeddings, axis=1)
        out[dtype] = {"forward": enc.eager.cut if enc.eager.truncated else "full", "rel_error_median": float(np.median(rel)),
                      "rel_error_max": float(rel.max()), "top1_agrees": float((top == want_top).mean())}  # fmt: skip
        del enc
    return out


def time_new_shapes(model: Path, shapes: int = 48, budget: int = 16_384, seed: int = 0) -> dict[str, object]:
    """The builder's forward (bfloat16, embeddings only) over ``shapes`` random (rows, width) batch shapes of about
    ``budget`` padded tokens, each run twice in a row, per attention-kernel choice: the milliseconds of a shape's
    first call (new to the process) and of its second, medians. Each choice gets shapes of its own."""
    import numpy as np
    import torch

    from bench.builder import attention_kernels
    from bertknn.core.encoder import MaskedLMEncoder

    enc = MaskedLMEncoder.load(str(model), device="cuda", dtype="bfloat16")
    core = enc.eager.cores[False]
    rng = np.random.default_rng(seed)
    out: dict[str, object] = {"forward": enc.eager.cut, "budget_tokens": budget, "shapes": shapes}
    used: set[tuple[int, int]] = set()
    for kernels in ("cudnn,flash,efficient,math", "flash,efficient,math", ""):
        first: list[float] = []
        second: list[float] = []
        with attention_kernels(kernels), torch.inference_mode():
            for _ in range(shapes):
                width = int(rng.integers(12, 128))
                rows = budget // width - int(rng.integers(0, 8))
                if (rows, width) in used:
                    continue
                used.add((rows, width))
                lengths = rng.integers(width // 2, width + 1, rows)
                lengths[0] = width
                attn = torch.from_numpy((np.arange(width)[None, :] < lengths[:, None]).astype(np.int64)).cuda()
                ids = torch.randint(1000, 20000, (rows, width), device="cuda") * attn
                pos = torch.from_numpy(rng.integers(1, lengths - 1)).cuda()
                args = (ids, attn, torch.arange(rows, device="cuda"), pos)
                for times in (first, second):
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    core(*args)
                    torch.cuda.synchronize()
                    times.append(1000 * (time.perf_counter() - t))
        out[kernels or "the encoder's default"] = {"first_ms_median": round(float(np.median(first)), 2),
                                            "second_ms_median": round(float(np.median(second)), 2),
                                            "first_ms_max": round(float(np.max(first)), 2)}  # fmt: skip
    return out


def time_graphs(model: Path, rows: tuple[int, ...] = (1, 8, 32, 64), calls: int = 50, *, device: str = "cuda",
                dtype: str = "bfloat16", capture: Any = None) -> dict[str, object]:  # fmt: skip
    """The service's forward (with p_MLM) on batches of real questions, eager against its CUDA graphs
    (`EagerForward.use_graphs`), in alternating calls from host inputs as the service makes them: p50 ms of each per
    batch size, and the largest difference of their outputs relative to the eager one's scale. ``device``,
    ``dtype``, ``capture``: a rehearsal on the CPU (tests/unit/test_bench_models.py)."""
    import numpy as np
    import torch

    from bench.common import lama_queries
    from bertknn.core.encoder import MaskedLMEncoder
    from bertknn.core.graphs import cuda_capture

    enc = MaskedLMEncoder.load(str(model), device=device, dtype=dtype)
    eager = enc.eager.cores[True]
    t = time.perf_counter()
    captured = enc.eager.use_graphs(enc.query_input, enc.tokenizer.mask_token, max_rows=max(rows),
                                    max_width=enc.max_seq_len, capture=capture or cuda_capture)  # fmt: skip
    start_up_s = time.perf_counter() - t
    questions = [enc.query_input(t) for t, _ in lama_queries(max(rows) * 4)]
    sync = device_sync(device)
    out: dict[str, object] = {"captured": captured, "forward": type(eager).__name__, "start_up_s": round(start_up_s, 3)}
    for n in rows:
        batch = questions[:n]
        runs = {"eager": lambda b=batch: eager(*enc.eager.tensors(b)),
                "graphs": lambda b=batch: enc.eager.run(b, with_mlm=True)}  # fmt: skip
        times: dict[str, list[float]] = {"eager": [], "graphs": []}
        with torch.inference_mode():
            for _ in range(calls):
                for name, run in runs.items():
                    sync()
                    t = time.perf_counter()
                    run()
                    sync()
                    times[name].append(1000 * (time.perf_counter() - t))
            diff = max(float((g.float() - e.float()).abs().max() / max(1.0, float(e.float().abs().max())))
                       for g, e in zip(runs["graphs"](), runs["eager"](), strict=True))  # fmt: skip
        eager_ms, graphs_ms = float(np.median(times["eager"])), float(np.median(times["graphs"]))
        out[f"rows_{n}"] = {"eager_ms_p50": round(eager_ms, 3), "graphs_ms_p50": round(graphs_ms, 3),
                            "graphs_over_eager": round(graphs_ms / eager_ms, 3), "max_relative_difference": diff}  # fmt: skip
    graphs = enc.eager.graphs
    out["buckets_captured"] = {f"{r}x{w}": not b.failed for (r, w), b in (graphs.buckets.items() if graphs else [])}
    return out


def _stage_commands(args: argparse.Namespace) -> dict[str, list[str]]:
    py, model = sys.executable, str(args.model)
    builder = [py, "-m", "bench.builder", "--model", model, "--device", "cuda", "--articles", str(args.articles),
               "--workers", str(args.workers), "--batch-size", "2048", "--runs", str(args.runs),
               "--articles-per-shard", "400"]  # fmt: skip
    bm25_runs = importlib.util.find_spec("pyserini") is not None and shutil.which("java") is not None
    retriever = args.retriever if args.retriever != "auto" else "bm25" if bm25_runs else "tfidf"
    serving = [py, "-m", "bench.serving", "--model", model, "--device", "cuda", "--articles", "40",
               "--work", str(RUNS / "bench-serving-gpu"), "--scale", "", "--concurrency", "1,64",
               "--per-client", "48", "--retriever", retriever]  # fmt: skip
    return {
        "vectors": [py, "-m", "bench.gpu", "--stage", "vectors", "--model", model],
        "new_shapes": [py, "-m", "bench.gpu", "--stage", "shapes", "--model", model],
        "cuda_graphs": [py, "-m", "bench.gpu", "--stage", "graphs", "--model", model],
        "device_knn": [py, "-m", "bench.gpu", "--stage", "knn"],
        "device_vote": [py, "-m", "bench.gpu", "--stage", "vote"],
        "builder_bfloat16": [*builder, "--dtype", "bfloat16", "--batch-tokens", args.batch_tokens,
                             "--out", str(_report("builder_bfloat16"))],
        "builder_float16": [*builder, "--dtype", "float16", "--batch-tokens", args.batch_tokens.split(",")[-1],
                            "--out", str(_report("builder_float16"))],
        # the same bf16 build with cuDNN's attention allowed again (the encoder leaves it out on CUDA)
        "builder_cudnn": [*builder, "--dtype", "bfloat16", "--batch-tokens", args.batch_tokens.split(",")[0],
                          "--sdpa", "cudnn,flash,efficient,math", "--out", str(_report("builder_cudnn"))],
        "serving": serving,
        "serving_device_knn": [*serving, "--knn-device", "model"],
        "serving_device_vote": [*serving, "--knn-device", "model", "--vote-device", "model"],
        "serving_one_process": [*serving, "--workers", "1"],
        "serving_event_loop": [*serving, "--on-event-loop"],
        "serving_split": [*serving, "--layout", "split"],
        "serving_split_4": [*serving, "--layout", "split", "--workers", "4"],
        "serving_block_wait": [*serving, "--cuda-wait", "block"],
        "steps": [py, "-m", "bench.steps", "--model", model, "--device", "cuda", "--retriever", retriever,
                  "--work", str(RUNS / "bench-steps-gpu"), "--out", str(_report("steps"))],
        "ivfpq_training": [py, "-m", "bench.gpu", "--stage", "ivfpq", "--ivfpq-rows", str(args.ivfpq_rows)],
    }  # fmt: skip


def _report(stage: str) -> Path:
    """Where a stage's own process writes its JSON (the serving stage: bench.serving's file)."""
    return RESULTS / f"gpu-{stage.replace('_', '-')}.json"


def _stage_result(name: str, model: Path, since: float) -> object:
    """What a finished stage wrote (at or after ``since``, a `time.time()`): its JSON, read back; ValueError
    when it wrote none, so that an older run's file is never taken for this one's."""
    if name.startswith("serving"):  # bench.serving's serving-cuda[:0][-Nw][-knn-model[-vote-model]][-loop][-split][-block]-MODEL.json
        one, vote, loop = name == "serving_one_process", name == "serving_device_vote", name == "serving_event_loop"
        knn = vote or name == "serving_device_knn"
        split, four, block = name.startswith("serving_split"), name == "serving_split_4", name == "serving_block_wait"
        found = [p for p in RESULTS.glob(f"serving-cuda*-{model.name}.json")
                 if p.name.endswith(f"-1w-{model.name}.json") == one and ("-knn-model-" in p.name) == knn
                 and ("-vote-model-" in p.name) == vote and ("-loop-" in p.name) == loop
                 and ("-split-" in p.name) == split and ("-4w-" in p.name) == four
                 and ("-block-" in p.name) == block]  # fmt: skip
    else:
        found = [_report(name)]
    fresh = [p for p in found if p.is_file() and p.stat().st_mtime >= since]
    if not fresh:
        raise ValueError(f"the stage wrote no result file in {RESULTS}")
    return json.loads(max(fresh, key=lambda p: p.stat().st_mtime).read_text())


def run_stages(args: argparse.Namespace, out: dict[str, Any]) -> None:
    """Each stage in its own process, with a time limit; a failing stage is recorded and the next one runs. The
    stages run in the order ``--only`` names them (a lease's time may end before the last), else in `STAGES`'."""
    path = RESULTS / "gpu.json"
    commands = _stage_commands(args)
    for name in list(dict.fromkeys(filter(None, args.only.split(",")))) or STAGES:
        cmd = commands[name]
        if name == "ivfpq_training" and args.ivfpq_rows == 0:
            continue
        print(f"bench.gpu: {name}: {' '.join(cmd[1:])}", flush=True)
        t, since = time.perf_counter(), time.time() - 1  # (file times may be rounded down to the second)
        try:
            subprocess.run(cmd, check=True, cwd=REPO, timeout=args.stage_timeout_s)
            out[name] = _stage_result(name, args.model, since)
        except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError, ValueError) as exc:
            out[name] = {"error": str(exc).splitlines()[0]}
        out.setdefault("stage_seconds", {})[name] = round(time.perf_counter() - t, 1)
        write_json(path, out)
        (RESULTS / "gpu.md").write_text(gpu_table(out))  # so that a run stopped by the lease's end has its table


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=RUNS / "bert-base-shaped")
    p.add_argument("--articles", type=int, default=10_033, help="the builder's corpus: the first N vital articles "
                   "(default: all; a small corpus measures the workers' start more than the build)")  # fmt: skip
    p.add_argument("--workers", type=int, default=max(1, min(8, (os.cpu_count() or 2) - 2)),
                   help="the builder's tokenising worker processes")  # fmt: skip
    p.add_argument("--batch-tokens", default="16384,65536", help="the token budgets swept (bfloat16); "
                   "float16 runs at the last")  # fmt: skip
    p.add_argument("--runs", type=int, default=2, help="builds per setting")
    p.add_argument("--retriever", choices=["auto", "bm25", "tfidf"], default="auto", help="the service's ranker "
                   "for unknown subjects (auto: bm25 where pyserini is installed, else tfidf)")  # fmt: skip
    p.add_argument("--ivfpq-rows", type=int, default=10_000_000, help="the datastore size whose IVF-PQ training is "
                   "timed (its plan's sample of synthetic vectors, bert-base's hidden size); 0 skips it")  # fmt: skip
    p.add_argument("--stage-timeout-s", type=float, default=600, help="a stage running longer is stopped and "
                   "recorded as failed")  # fmt: skip
    p.add_argument("--only", default="", help="comma-separated stages to run, in this order (default: all)")
    p.add_argument("--stage", choices=["vectors", "shapes", "graphs", "knn", "vote", "ivfpq"], help=argparse.SUPPRESS)  # one stage, in its own process
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    unknown = set(filter(None, args.only.split(","))) - set(STAGES)
    if unknown:
        parser.error(f"--only: no stage {', '.join(sorted(unknown))}; the stages are {', '.join(STAGES)}")
    import torch

    if not torch.cuda.is_available():
        print("bench.gpu: no CUDA device on this machine (torch.cuda.is_available() is False); run it where one is",
              file=sys.stderr)  # fmt: skip
        return NO_DEVICE
    RESULTS.mkdir(parents=True, exist_ok=True)
    if args.stage == "vectors":
        _report("vectors").write_text(json.dumps(compare_vectors(args.model, VITAL), indent=1) + "\n")
        return 0
    if args.stage == "shapes":
        _report("new_shapes").write_text(json.dumps(time_new_shapes(args.model), indent=1) + "\n")
        return 0
    if args.stage == "graphs":
        _report("cuda_graphs").write_text(json.dumps(time_graphs(args.model), indent=1) + "\n")
        return 0
    if args.stage == "knn":
        from bench.knn_batch import time_device_knn

        _report("device_knn").write_text(json.dumps(time_device_knn(), indent=1) + "\n")
        return 0
    if args.stage == "vote":
        from bench.vote_batch import time_device_vote

        _report("device_vote").write_text(json.dumps(time_device_vote(), indent=1) + "\n")
        return 0
    if args.stage == "ivfpq":
        _report("ivfpq_training").write_text(json.dumps(time_ivfpq_training(args.ivfpq_rows, 768)) + "\n")
        return 0
    if not (args.model / "config.json").is_file():
        subprocess.run([sys.executable, "-m", "bench.bert_base", "--out", str(args.model)], check=True, cwd=REPO)
    out: dict[str, Any] = {"device": torch.cuda.get_device_name(0), "machine": machine(), "model": args.model.name,
                              "torch_cuda": torch.version.cuda, "driver": _driver_version()}  # fmt: skip
    run_stages(args, out)
    table = gpu_table(out)
    print(table + f"wrote {RESULTS / 'gpu.json'} and {RESULTS / 'gpu.md'}")
    return 0


def _driver_version() -> str | None:
    try:
        run = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30, check=True)  # fmt: skip
    except (OSError, subprocess.SubprocessError):
        return None
    return run.stdout.strip() or None


def _count(value: float | None) -> str:
    """A rate as the table prints it; "n/a" where the run did not record it."""
    return "n/a" if value is None else f"{value:,.0f}"


def _measured(out: dict[str, Any], stage: str) -> list[tuple[str, dict]]:
    """A timing stage's measurements (its ``rows_...`` entries), the prefix cut: nothing where it failed."""
    got = out.get(stage, {})
    items = got.items() if isinstance(got, dict) else ()
    return [(k[5:], r) for k, r in items if k.startswith("rows_") and isinstance(r, dict)]


def gpu_table(out: dict[str, Any]) -> str:
    """The markdown table of the figures that docs/performance.md's GPU section holds."""
    rows = [f"{out['device']}, driver {out['driver']}, torch {out['machine']['torch']} (CUDA {out['torch_cuda']}), "
            f"{out['machine']['cores']} cores; {out['model']}\n", "| figure | value |", "|---|---:|"]
    for dtype in ("bfloat16", "float16", "cudnn"):
        vec = out.get("vectors", {}).get(dtype)
        if vec:
            rows.append(f"| rows vs float32 full forward, {dtype}: median / max relative error, top-1 agrees | "
                        f"{vec['rel_error_median']:.2e} / {vec['rel_error_max']:.2e}, {vec['top1_agrees']:.1%} |")  # fmt: skip
        build = out.get(f"builder_{dtype}", {})
        for run in build.get("runs", []) if isinstance(build, dict) else []:
            rows.append(f"| builder {dtype.replace('cudnn', 'bfloat16 with cuDNN attention allowed')}, budget "
                        f"{run['batch_tokens']} tokens: build / first batch to last / bare forward / forward inside the "
                        f"build contexts/s, padding, bound | {run['build_ctx_per_s']:,.0f} / "
                        f"{_count(run.get('embed_span_ctx_per_s'))} / {run['bare_forward_ctx_per_s']:,.0f} / "
                        f"{run['forward_in_build_ctx_per_s']:,.0f}, {run['padding_fraction']:.1%}, {run['bound']} |")  # fmt: skip
    shapes = out.get("new_shapes", {})
    for kernels, r in shapes.items() if isinstance(shapes, dict) else ():
        if isinstance(r, dict):
            rows.append(f"| builder forward on a new batch shape / the same shape again, {kernels} (median ms, "
                        f"{shapes['shapes']} shapes of {shapes['budget_tokens']:,} tokens) | {r['first_ms_median']} / "
                        f"{r['second_ms_median']} ms |")  # fmt: skip
    graphs = out.get("cuda_graphs")
    if isinstance(graphs, dict) and "start_up_s" in graphs:
        most = max((int(k) for k, _ in _measured(out, "cuda_graphs")), default=0)
        rows.append(f"| the service's CUDA graphs captured at start-up (every row bucket up to {most} questions, "
                    f"16 and 32 tokens) | {graphs['start_up_s']} s |")  # fmt: skip
    for key, r in _measured(out, "cuda_graphs"):
        rows.append(f"| service forward of {key} questions, eager / CUDA graphs (p50 ms; largest output "
                    f"difference) | {r['eager_ms_p50']} / {r['graphs_ms_p50']} ms = {r['graphs_over_eager']}x; "
                    f"{r['max_relative_difference']:.1e} |")  # fmt: skip
    for key, r in _measured(out, "device_knn"):
        n, b = key.split("_batch_")
        kept = f", kept there {r['resident_ms_p50']} ms = {r['resident_over_host']}x" if "resident_ms_p50" in r else ""
        rows.append(f"| restricted kNN of {b} queries x {n} rows: copied to the device / FAISS on the host, one by "
                    f"one (p50 ms; same neighbours) | {r['device_ms_p50']} / {r['host_ms_p50']} ms = "
                    f"{r['device_over_host']}x{kept}; {r['same_neighbours']} |")  # fmt: skip
    vote = out.get("device_vote")
    for key, r in vote.items() if isinstance(vote, dict) else ():
        if key.startswith("batch_") and isinstance(r, dict):
            rows.append(f"| vote, interpolation and top-k of {key[6:]} questions: on the device / on the host, one "
                        f"by one (p50 ms; same answers) | {r['device_ms_p50']} / {r['host_ms_p50']} ms = "
                        f"{r['device_over_host']}x; {r['same_answers']} |")  # fmt: skip
    how = {"serving": None, "serving_one_process": "one process", "serving_device_knn": "kNN on the device",
           "serving_device_vote": "kNN and vote on the device", "serving_event_loop": "batches on the event loop",
           "serving_split": "API processes beside one model process", "serving_split_4": "4 API processes beside one "
           "model process", "serving_block_wait": "each process sleeping while its forward runs"}
    for stage, label in how.items():
        rows += _serving_rows(out.get(stage, {}), label)
    steps = out.get("steps")
    if isinstance(steps, dict) and "ms" in steps:
        ms = steps["ms"]
        parts = ", ".join(f"{k} {v['p50']}" for k, v in ms.items() if k not in ("held", "own", "client"))
        rows.append(f"| one uncached question's steps in one service process, p50 ms (bench.steps) | {parts}; "
                    f"held {ms['held']['p50']}, own {ms['own']['p50']}, client {ms['client']['p50']} |")  # fmt: skip
    ivf = out.get("ivfpq_training")
    if isinstance(ivf, dict) and "train_s" in ivf:
        rows.append(f"| IVF-PQ training, {ivf['rows']:,} rows' plan (nlist {ivf['nlist']}, {ivf['train_rows']:,} "
                    f"sample) on the {ivf['on'].upper()} | {ivf['train_s']} s |")  # fmt: skip
    errors = [f"- {k}: {v['error']}" for k, v in out.items() if isinstance(v, dict) and "error" in v]
    return "\n".join(rows + ([""] + errors if errors else [])) + "\n"


def _serving_rows(serving: object, processes: str | None) -> list[str]:
    """A serving stage's rows: latency per load client, then each throughput level; ``processes`` names how the
    service ran where it is not its default (older reports do not say)."""
    if not isinstance(serving, dict):
        return []
    how = f"{processes}, " if processes else f"{serving['workers']} processes, " if "workers" in serving else ""
    rows = []
    for client, r in serving.get("clients", {}).items():
        if "uncached_ms" in r:
            rows.append(f"| /predict uncached p50 / p99, {how}{client} client, {serving['dtype']} (bare forward "
                        f"p50) | {r['uncached_ms']['p50']:.1f} / {r['uncached_ms']['p99']:.1f} ms "
                        f"({r['bare_forward_ms']['p50']:.1f} ms) |")  # fmt: skip
        for level, t in r.get("throughput", {}).items():
            rows.append(f"| /predict throughput, {how}{level} {client} clients (bare batched forward) | "
                        f"{t['requests_per_s']:,.0f}/s ({t['bare_batched_per_s']:,.0f}/s), {t['errors']} errors |")  # fmt: skip
            if t.get("stage_ms_mean"):
                stages = ", ".join(f"{k} {v}" for k, v in t["stage_ms_mean"].items())
                rows.append(f"| - mean ms per request by stage, rows per batch ({how}{level} {client} clients) | "
                            f"{stages} |")  # fmt: skip
            if "bare_at_service_batch_per_s" in t:  # reports from before this figure lack it
                rows.append(f"| - the bare forward in the service's batch size ({how}{level} {client} clients, "
                            f"{t['service_batch_rows']} rows) | {t['bare_at_service_batch_per_s']:,.0f}/s |")  # fmt: skip
            by_thread = ", ".join(f"{k} {v:.2f}" for k, v in t.get("server_cpu_ms_per_request_by_thread", {}).items())
            rows.append(f"| - server CPU per request ({how}{level} {client} clients) | "
                        f"{t['server_cpu_ms_per_request']:.1f} ms{f' (by thread: {by_thread})' if by_thread else ''} |")  # fmt: skip
            if "model_process_busy_cores" in t:  # the split layout: is its one model process the limit?
                rows.append(f"| - the model process: CPU per request, cores busy ({how}{level} {client} clients) | "
                            f"{t['model_process_cpu_ms_per_request']:.2f} ms, {t['model_process_busy_cores']:.2f} |")  # fmt: skip
            if "latency_ms" in t:
                rows.append(f"| - latency p50 / p99 under that load ({how}{level} {client} clients) | "
                            f"{t['latency_ms']['p50']:.1f} / {t['latency_ms']['p99']:.1f} ms |")  # fmt: skip
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
