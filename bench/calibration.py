"""What the datastore's own contexts say about the mixture, one command: ``python -m bench.calibration``.

The builder fits ``temperature: auto`` by the leave-one-out likelihood of p_kNN alone (``bertknn/core/calibration.py``).
This benchmark asks the same sample the next question: at which kNN weight lambda, and which temperature factor
``a``, does the *mixture* ``lambda p_kNN + (1 - lambda) p_MLM`` give the sampled contexts' own words the highest
mean log-probability? p_MLM comes from the model's forward pass over each sampled context's sentence with its word
replaced by [MASK] (the service's query path). Nothing here is tuned on LAMA: it is the diagnostic a researcher runs
to see whether the paper's lambda = 0.3 suits a model and datastore, next to the builder's ``a``.

Reads the datastore (default: the quality benchmark's, ``runs/bench-quality/datastore``; ``python -m bench.quality``
builds it) and writes ``bench/results/calibration.json`` (``--out`` for another datastore of the same model, such as a
``recode`` copy).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bench.common import PROXY_MODEL, RUNS, machine, result_name, write_json, write_result

LAMBDAS = np.round(np.arange(0.0, 1.0001, 0.05), 2)
FACTOR_STEPS = np.logspace(-1, 1, 21, base=4.0)  # the builder's a times 1/4 ... 4


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.calibration", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    p.add_argument("--datastore", type=Path, default=RUNS / "bench-quality" / "datastore")
    p.add_argument("--model", default=str(PROXY_MODEL), help="masked LM the datastore was built with")
    p.add_argument("--sample", type=int, default=2000, help="contexts drawn (the builder's sample size)")
    p.add_argument("--seed", type=int, default=0, help="the builder's seed is 0")
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--threads", type=int, default=0, help="torch CPU threads (0 = the CPU quota)")
    p.add_argument("--out", type=Path, help="write the report here (default bench/results/calibration.json; another "
                   "model's beside it)")  # fmt: skip
    return p


def knn_gold(distances: list[np.ndarray], matches: list[np.ndarray], scales: np.ndarray, factor: float) -> np.ndarray:
    """p_kNN of each sampled context's own word at ``l = factor * scale`` (0 where no neighbour carries it), by the
    builder's own likelihood (`own_word_log_probability`)."""
    from bertknn.core.calibration import own_word_log_probability, padded

    out = np.zeros(len(distances))
    rows = [i for i, (d, m, s) in enumerate(zip(distances, matches, scales, strict=True)) if len(d) and s > 0 and m.any()]
    if rows:
        dist, match = padded([distances[i] for i in rows], [matches[i] for i in rows])
        out[rows] = np.exp(own_word_log_probability(dist, match, (factor * scales[rows])[:, None]))
    return out


def mixture_ll(p_knn: np.ndarray, p_mlm: np.ndarray, lam: float) -> float:
    """Mean log-probability of the gold under ``lam p_kNN + (1 - lam) p_MLM`` (-inf when some gold gets 0)."""
    with np.errstate(divide="ignore"):
        return float(np.mean(np.log(lam * p_knn + (1.0 - lam) * p_mlm)))


def _json_ll(value: float) -> float | None:
    """A log-likelihood for the JSON report: None where it is -inf (some sampled word gets probability 0)."""
    return round(value, 5) if np.isfinite(value) else None


class _Refused(Exception):
    """What this datastore cannot be calibrated for, in one line."""


def _sample(args: argparse.Namespace) -> tuple[Any, Any, list, np.ndarray]:
    """The manifest, the sampled contexts' neighbours, their stored sentences and their words (token ids)."""
    from bertknn.core.calibration import sample_neighbours
    from bertknn.core.format import read_manifest
    from bertknn.core.format.reader import Datastore

    if not (args.datastore / "manifest.json").is_file():
        raise _Refused(f"no datastore at {args.datastore}: run `python -m bench.quality` first, or pass --datastore")
    manifest = read_manifest(args.datastore)
    ds = Datastore(args.datastore, manifest)
    try:
        if ds.whole_words:
            raise _Refused("a whole-word datastore's labels are words, not token ids; this benchmark reads "
                           "single-wordpiece datastores")  # fmt: skip
        drawn = sample_neighbours(ds, sample=args.sample, seed=args.seed)
        contexts = ds.contexts(drawn.rows)
        gold = ds.labels_at(np.asarray(drawn.rows, dtype=np.int64)).astype(np.int64)
    finally:
        ds.close()
    return manifest, drawn, contexts, gold


def _mlm_at_gold(args: argparse.Namespace, contexts: list, gold: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """p_MLM of each sampled context's own word with the word masked, and whether the MLM ranks it first."""
    import torch

    from bertknn.core.encoder import MaskedLMEncoder

    encoder = MaskedLMEncoder.load(args.model, device="cpu")
    inputs = [encoder.query_input(c.sentence[: c.span[0]] + "[MASK]" + c.sentence[c.span[1] :]) for c in contexts]
    p_mlm = np.empty(len(inputs))
    mlm_top1 = np.empty(len(inputs), dtype=bool)
    with torch.inference_mode():
        for i in range(0, len(inputs), args.batch_size):
            lp = encoder.encode(inputs[i : i + args.batch_size], with_mlm=True).mlm_log_probs
            assert lp is not None
            rows = lp.numpy()
            g = gold[i : i + args.batch_size]
            p_mlm[i : i + len(rows)] = np.exp(rows[np.arange(len(rows)), g].astype(np.float64))
            mlm_top1[i : i + len(rows)] = rows.argmax(axis=1) == g
    return p_mlm, mlm_top1


def _fit(manifest: Any, drawn: Any, p_mlm: np.ndarray) -> dict[str, Any]:
    """The mixture's log-likelihood over the factor x lambda grid, its best, and each lambda's at the builder's
    factor (or, without one, the kNN-only refit)."""
    from bertknn.core.calibration import fit_temperature, neighbour_scale, temperature_for

    scales = np.array([neighbour_scale(d) for d in drawn.distances])
    builder = temperature_for(manifest.distance_scale)
    refit = fit_temperature(drawn.distances, drawn.matches, list(scales))
    a0 = builder.factor if builder.factor is not None else refit
    if a0 is None:
        raise _Refused("no sampled context has its word among its neighbours")
    grid: list[dict] = []
    for step in FACTOR_STEPS:
        pk = knn_gold(drawn.distances, drawn.matches, scales, float(a0 * step))
        for lam in LAMBDAS:
            grid.append({"factor": round(float(a0 * step), 5), "lambda": float(lam), "ll": mixture_ll(pk, p_mlm, lam)})
    by_ll = max(grid, key=lambda r: r["ll"])
    at_a0 = [mixture_ll(knn_gold(drawn.distances, drawn.matches, scales, float(a0)), p_mlm, lam) for lam in LAMBDAS]
    return {
        "builder_factor": builder.factor,
        "refit_knn_only_factor": refit,
        "at_builder_factor": {
            "best_lambda": float(LAMBDAS[int(np.argmax(at_a0))]),
            "ll_by_lambda": {f"{lam:.2f}": _json_ll(v) for lam, v in zip(LAMBDAS, at_a0, strict=True)},
        },
        "joint_best": {"factor": by_ll["factor"], "lambda": by_ll["lambda"], "ll": _json_ll(by_ll["ll"])},
        "paper_lambda_ll_at_builder_factor": _json_ll(at_a0[int(np.flatnonzero(LAMBDAS == 0.3)[0])]),
        "grid": [{**r, "ll": _json_ll(r["ll"])} for r in grid],
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.sample < 1 or args.batch_size < 1 or args.threads < 0:
        parser.error("--sample and --batch-size must be >= 1, --threads >= 0")
    import torch

    from bertknn.core.runtime import cpu_quota_threads

    torch.set_num_threads(args.threads or cpu_quota_threads())
    t0 = time.perf_counter()
    try:
        manifest, drawn, contexts, gold = _sample(args)
        p_mlm, mlm_top1 = _mlm_at_gold(args, contexts, gold)
        fitted = _fit(manifest, drawn, p_mlm)
    except _Refused as exc:
        print(f"bench.calibration: {exc}", file=sys.stderr)
        return 2
    payload = {
        "datastore": {"path": str(args.datastore), "id": manifest.datastore_id, "contexts": manifest.counts.contexts},
        "model": str(args.model),
        "sample": len(drawn.rows),
        "seed": args.seed,
        "gold_among_neighbours": round(float(np.mean([m.any() for m in drawn.matches])), 4),
        "mlm_p1_on_sample": round(float(mlm_top1.mean()), 4),
        "mlm_mean_p_gold": round(float(p_mlm.mean()), 5),
        **fitted,
        "wall_s": round(time.perf_counter() - t0, 1),
        "machine": machine(),
    }
    if args.out is not None:
        path = write_json(args.out, payload)
    else:
        path = write_result(result_name("calibration", args.model), payload)
    print(json.dumps({k: v for k, v in payload.items() if k not in ("grid", "machine")}, indent=1))
    print(f"written {path}")
    return 0

if __name__ == "__main__":
    raise SystemExit(main())
