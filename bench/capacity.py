"""The arithmetic of a full-Wikipedia build, from the measured rates: GPU hours, wall time and disk. ::

    python -m bench.capacity [--contexts 1e9] [--pods 8,16,32,64] [--gpu bench/results/gpu.json]
                             [--preprocess bench/results/preprocess.json] [--workers-per-gpu 6]

Nothing is measured here: every input is read from a results file that a benchmark wrote (the GPU build's
contexts/s, its bare forward's, its bytes per context: ``python -m bench.gpu``; the CPU stages' rates per core on
real enwiki pages: ``python -m bench.preprocess``), quoted from the paper (``bench/results/published.json``),
stated about the dump (`ENWIKI`) or named as an assumption in the output (GPU classes no lease has measured).
GPU hours = contexts / rate / 3600; wall time = GPU hours / pods (one GPU each); a CPU stage's core-hours = its
work (bytes of XML, or contexts) / its rate per core / 3600. It prints the tables that docs/deployment.md and
docs/building.md quote and writes them, as printed, to ``bench/results/capacity.json``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bench.common import RESULTS, write_result

# contexts/s per GPU of classes no lease measured: 30-35 % of the fp16 peak over bert-base's 6.1 GFLOP per context
ASSUMED = (("L4/T4 class, assumed", 4000.0), ("A100, assumed", 12000.0))
# enwiki's pages-articles dump, as dumps.wikimedia.org lists it (stated, not measured): XML bytes out of bz2
ENWIKI = {"bz2_gb": 22, "xml_gb": 90, "articles_millions": 6.9, "redirects_millions": 11}
XML_BYTES = ENWIKI["xml_gb"] * 1e9


def shown(hours: float) -> str:
    """A duration as the docs write it: whole minutes under an hour, hours with one decimal under 100, else whole."""
    if hours < 1:
        return f"{max(1, round(hours * 60))} min"
    return f"{hours:.1f} h" if hours < 100 else f"{hours:.0f} h"


def terabytes(n_bytes: float) -> str:
    return f"{n_bytes / 1e12:.2f} TB ({n_bytes / 2**40:.2f} TiB)"


PER_CORE = ("decompress_bytes_per_s", "parse_bytes_per_s", "markup_bytes_per_s", "split_contexts_per_s",
            "targets_contexts_per_s", "write_bytes_per_s")  # what `python -m bench.preprocess` measures


def _json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise SystemExit(f"{path}: not a readable JSON results file ({exc})") from None
    if not isinstance(data, dict):
        raise SystemExit(f"{path}: not a results file (a JSON object was expected)")
    return data


def measured_build(gpu_file: Path) -> dict:
    """The GPU build's rates and sizes (`python -m bench.gpu`'s builder stage)."""
    data = _json(gpu_file)
    stage = data.get("builder_bfloat16") or {}
    runs = stage.get("runs") if isinstance(stage, dict) else None
    if not runs or not isinstance(runs[0], dict):
        raise SystemExit(f"{gpu_file}: no builder_bfloat16 run; run `python -m bench.gpu` on a GPU first")
    run = runs[0]
    try:
        return {"device": data.get("device", "?"), "build_ctx_per_s": float(run["embed_span_ctx_per_s"]),
                "bare_forward_ctx_per_s": float(run["bare_forward_ctx_per_s"]),
                "bytes_per_context": float(run["bytes_per_context_dir"])}  # fmt: skip
    except (KeyError, TypeError, ValueError) as exc:
        raise SystemExit(f"{gpu_file}: its builder_bfloat16 run lacks {exc}; run `python -m bench.gpu` again") from None


def preprocess_rates(path: Path) -> dict:
    """`python -m bench.preprocess`'s results, checked: every stage's rate per core, a positive number."""
    data = _json(path)
    per_core = data.get("per_core")
    bad = [k for k in PER_CORE if not isinstance(per_core, dict) or not isinstance(per_core.get(k), int | float)
           or per_core[k] <= 0]  # fmt: skip
    if bad:
        raise SystemExit(f"{path}: per_core lacks a positive {', '.join(bad)}; run `python -m bench.preprocess` again")
    return data


def rates(build: dict, paper: dict) -> list[tuple[str, float]]:
    return [
        ("the paper", float(paper["contexts_per_s_per_gpu"])),
        *ASSUMED,
        (f"{build['device']}, the measured build", build["build_ctx_per_s"]),
        (f"{build['device']}, the measured bare forward", build["bare_forward_ctx_per_s"]),
    ]


def hours_table(contexts: float, pods: list[int], by_rate: list[tuple[str, float]]) -> list[dict]:
    rows = []
    for label, rate in by_rate:
        gpu_hours = contexts / rate / 3600
        rows.append({"rate": label, "contexts_per_s": round(rate), "gpu_hours": shown(gpu_hours).removesuffix(" h"),
                     "wall": {str(n): shown(gpu_hours / n) for n in pods}})  # fmt: skip
    return rows


def stage_hours(contexts: float, pre: dict, bytes_per_context: float) -> dict[str, float]:
    """Core-hours of each CPU stage for the whole dump and ``contexts`` contexts, from the rates per core."""
    r = pre["per_core"]
    work = {"decompress": XML_BYTES / r["decompress_bytes_per_s"],
            "parse": XML_BYTES / r["parse_bytes_per_s"],
            "markup": XML_BYTES / r["markup_bytes_per_s"],
            "split": contexts / r["split_contexts_per_s"],
            "targets": contexts / r["targets_contexts_per_s"],
            "write": contexts * bytes_per_context / r["write_bytes_per_s"]}  # fmt: skip
    return {stage: seconds / 3600 for stage, seconds in work.items()}


def building(contexts: float, pods: list[int], pre: dict, build: dict, workers_per_gpu: int) -> dict:
    """docs/building.md's two tables: each stage's cost, and the wall time of a build on N GPUs."""
    core_h = stage_hours(contexts, pre, build["bytes_per_context"])
    gpu_h = contexts / build["build_ctx_per_s"] / 3600
    workers_h = sum(core_h[s] for s in ("markup", "split", "targets"))
    reading_h = core_h["decompress"] + core_h["parse"]
    return {
        "core_hours": {k: round(v, 1) for k, v in core_h.items()},
        "forward_gpu_hours": round(gpu_h, 1),
        "forward_gpu_hours_bare": round(contexts / build["bare_forward_ctx_per_s"] / 3600, 1),
        "workers_core_hours": round(workers_h, 1),
        "wall": {str(n): {"embedding": shown(gpu_h / n), "preprocessing": shown(workers_h / workers_per_gpu / n),
                          "reading_multistream": shown(reading_h / n), "reading_whole_dump": shown(reading_h)}
                 for n in pods},
    }  # fmt: skip


def building_markdown(result: dict) -> str:
    b = result["building"]
    lines = ["| stage | core-hours (CPU) or GPU-hours |", "|---|---:|"]
    lines += [f"| {stage} | {hours} core-h |" for stage, hours in b["core_hours"].items()]
    lines += [f"| forward | {b['forward_gpu_hours']} GPU-h ({b['forward_gpu_hours_bare']} at the bare forward) |", "",
              "| GPUs | embedding | preprocessing | reading, multistream | reading, whole dump |", "|---:|---:|---:|---:|---:|"]
    lines += [f"| {n} | {w['embedding']} | {w['preprocessing']} | {w['reading_multistream']} | {w['reading_whole_dump']} |"
              for n, w in b["wall"].items()]  # fmt: skip
    return "\n".join(lines)


def markdown(result: dict) -> str:
    pods = result["pods"]
    lines = [f"| contexts/s per GPU | GPU hours | {' | '.join(f'N = {n}' for n in pods)} |",
             "|---|---|" + "---|" * len(pods)]  # fmt: skip
    for row in result["hours"]:
        walls = " | ".join(row["wall"][str(n)] for n in pods)
        lines.append(f"| {row['contexts_per_s']:,} ({row['rate']}) | {row['gpu_hours']} | {walls} |")
    disk = result["disk"]
    lines += ["", f"shards: {disk['bytes_per_context']:,} B per context x {result['contexts']:.3g} = {disk['shards']}"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--contexts", type=float, default=1e9, help="contexts to build (default 1e9)")
    p.add_argument("--pods", default="8,16,32,64", help="comma-separated GPU counts")
    p.add_argument("--gpu", type=Path, default=RESULTS / "gpu.json", help="the GPU run to read the rates from")
    p.add_argument("--preprocess", type=Path, default=RESULTS / "preprocess.json",
                   help="the CPU stages' rates per core (python -m bench.preprocess)")
    p.add_argument("--workers-per-gpu", type=int, default=6, help="tokenising workers per GPU (the build Job's --workers)")
    args = p.parse_args(argv)
    try:
        pods = [int(x) for x in args.pods.split(",") if x.strip()]
    except ValueError:
        p.error(f"--pods takes comma-separated whole numbers, got {args.pods!r}")
    if not pods or min(pods) < 1 or args.contexts < 1 or args.workers_per_gpu < 1:
        p.error("--pods and --workers-per-gpu take numbers of at least 1, and --contexts must be at least 1")
    if not args.gpu.is_file():
        p.error(f"--gpu {args.gpu}: no such results file; run `python -m bench.gpu` on a GPU first")
    if not args.preprocess.is_file():
        p.error(f"--preprocess {args.preprocess}: no such results file; run `python -m bench.preprocess` first")
    pre = preprocess_rates(args.preprocess)
    build = measured_build(args.gpu)
    paper = json.loads((RESULTS / "published.json").read_text(encoding="utf-8"))["figures"]
    result = {
        "contexts": args.contexts, "pods": pods, "inputs": {**build, "gpu_file": args.gpu.name, "assumed": dict(ASSUMED),
                                                             "paper_ctx_per_s": paper["contexts_per_s_per_gpu"]},
        "hours": hours_table(args.contexts, pods, rates(build, paper)),
        "disk": {"bytes_per_context": round(build["bytes_per_context"], 1),
                 "shards": terabytes(args.contexts * build["bytes_per_context"])},
        "dump": {**ENWIKI, "stated": "enwiki pages-articles, dumps.wikimedia.org"},
        "preprocess": {"file": args.preprocess.name, "per_core": pre["per_core"], "workers_per_gpu": args.workers_per_gpu},
        "building": building(args.contexts, pods, pre, build, args.workers_per_gpu),
    }  # fmt: skip
    print(markdown(result))
    print(building_markdown(result))
    print(f"wrote {write_result('capacity', result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
