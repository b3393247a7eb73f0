"""A CPU batch's forward in groups of similar width against the same batch padded whole, in one run. ::

    python -m bench.width_groups [--model runs/bert-base-shaped] [--batches 8,32] [--rounds 3] [--backend onnx]

The service's forward as it runs on a CPU (ONNX Runtime, the default there, or ``--backend eager``; one thread),
over batches of distinct LAMA questions, two ways in alternating rounds: grouped by width
(`bertknn.core.width_groups`, the default) and padded to each batch's longest question (a call price too high to
split). Reports the thread CPU ms
per question of each, their ratio, the padding of each way, and the largest difference between their outputs.
The default model is bert-base-uncased's shape (`python -m bench.bert_base`); ``--model`` takes another. Writes
``bench/results/width-groups-MODEL.json`` (``-eager`` added for the eager forward).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from bench.bert_base import make
from bench.common import RUNS, lama_queries, machine, write_result


def _padding(batches: list, per_call: float) -> dict[str, float]:
    """Padded positions over real ones, whole and grouped."""
    from bertknn.core.width_groups import width_groups

    real = whole = grouped = 0
    for b in batches:
        lengths = np.array([len(x.input_ids) for x in b])
        real += int(lengths.sum())
        whole += len(b) * int(lengths.max())
        grouped += sum(len(g) * int(lengths[g].max()) for g in width_groups(lengths, per_call))
    return {"whole": round(whole / real, 3), "grouped": round(grouped / real, 3)}


def one_size(enc, inputs: list, batch: int, rounds: int) -> dict:  # type: ignore[no-untyped-def]
    """Both ways over ``inputs`` in batches of ``batch``, ``rounds`` alternating rounds each."""
    from bertknn.core import width_groups as wg

    batches = [inputs[i : i + batch] for i in range(0, len(inputs) - batch + 1, batch)]
    grouped, whole = dict(wg.CALL_FLOPS), {k: float("inf") for k in wg.CALL_FLOPS}
    ms: dict[str, list[float]] = {"grouped": [], "whole": []}
    outs: dict[str, list] = {}
    for r in range(rounds + 1):  # the first round warms up
        for name in ("grouped", "whole") if r % 2 else ("whole", "grouped"):
            wg.CALL_FLOPS = grouped if name == "grouped" else whole
            t = time.thread_time()
            outs[name] = [enc.encode(b, with_mlm=True) for b in batches]
            if r:
                ms[name].append((time.thread_time() - t) * 1000 / (len(batches) * batch))
    wg.CALL_FLOPS = grouped
    g, w = float(np.median(ms["grouped"])), float(np.median(ms["whole"]))
    diff = max(max(float(np.abs(a.embeddings - b.embeddings).max()), float((a.mlm_log_probs - b.mlm_log_probs).abs().max()))
               for a, b in zip(outs["grouped"], outs["whole"], strict=True))  # fmt: skip
    return {"batch": batch, "batches": len(batches), "grouped_ms_per_question": round(g, 3),
            "whole_ms_per_question": round(w, 3), "grouped_over_whole": round(g / w, 3),
            "padded_over_real": _padding(batches, wg.call_positions(enc.config, enc.backend)),
            "max_output_difference": diff}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", type=Path, default=None, help="a masked LM directory (default: bert-base's shape)")
    p.add_argument("--batches", default="8,32", help="comma-separated batch sizes")
    p.add_argument("--questions", type=int, default=128, help="distinct questions, in batches of each size")
    p.add_argument("--rounds", type=int, default=3, help="timed rounds of each way (alternating)")
    p.add_argument("--backend", choices=("onnx", "eager"), default="onnx", help="the forward's backend")
    args = p.parse_args(argv)
    try:
        sizes = [int(x) for x in args.batches.split(",")]
    except ValueError:
        p.error("--batches takes comma-separated integers, e.g. 8,32")
    if min(sizes) < 1 or args.rounds < 1 or args.questions < max(sizes):
        p.error("--batches and --rounds take at least 1, --questions at least the largest batch")
    import torch

    from bertknn.core.encoder import MaskedLMEncoder

    torch.set_num_threads(1)
    model = args.model or make(RUNS / "bert-base-shaped")
    enc = MaskedLMEncoder.load(str(model), device="cpu", dtype="float32")
    if enc.set_backend(args.backend) != args.backend:
        p.error(f"the {args.backend} backend could not be used for this model (the log says why)")
    inputs = [enc.query_input(t) for t, _ in lama_queries(args.questions, seed=11)]
    result: dict = {"model": "bert-base-uncased's shape" if args.model is None else Path(model).name,
                    "machine": machine(), "backend": enc.backend, "threads": 1, "sizes": []}  # fmt: skip
    for batch in sizes:
        row = one_size(enc, inputs, batch, args.rounds)
        result["sizes"].append(row)
        print(f"batch {batch:>3}: grouped {row['grouped_ms_per_question']:.3f} ms per question, whole "
              f"{row['whole_ms_per_question']:.3f}: {row['grouped_over_whole']}x; padded/real {row['padded_over_real']}; "
              f"outputs differ by at most {row['max_output_difference']:.2g}", flush=True)  # fmt: skip
    name = "width-groups-bert-base-shaped" if args.model is None else f"width-groups-{Path(model).name}"
    name += "-eager" if args.backend == "eager" else ""
    print(f"wrote {write_result(name, result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
