"""The service's forward with its last layer at the [MASK] rows only, against the full forward, in one run::

    python -m bench.bert_base && python -m bench.mask_rows [--model runs/bert-base-shaped] [--queries 200]

The same LAMA questions go through the service's forward (embedding at the stored layer and log p_MLM at the
mask, `MaskedLMEncoder.encode(..., with_mlm=True)`) at batch 1, as an uncached ``/predict`` runs it, loaded twice:
with the last layer run at the mask rows (`bertknn.core.truncate.MaskRowCore`, the default where the layers are
BERT's) and with the full forward (``truncate=False``, the code before it). The two alternate query by query, for
each backend, on the thread count the service uses. Prints p50 of each and their ratio, the largest difference of
their outputs, and writes ``bench/results/mask-rows[-MODEL].json``. docs/decisions/mask-row-layer.md reads it.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np

from bench.common import RUNS, lama_queries, machine, percentiles, result_name, write_result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.mask_rows", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=RUNS / "bert-base-shaped")
    p.add_argument("--queries", type=int, default=200)
    p.add_argument("--backends", default="onnx,eager", help="comma-separated: onnx (the CPU default), eager")
    args = p.parse_args(argv)
    if not (args.model / "config.json").is_file():
        p.error(f"--model {args.model}: no model there (python -m bench.bert_base writes the default one)")
    if args.queries < 10:
        p.error("--queries must be at least 10")
    import torch

    from bertknn.core.encoder import MaskedLMEncoder
    from bertknn.core.runtime import cpu_quota_threads

    torch.set_num_threads(cpu_quota_threads())
    texts = [t for t, _ in lama_queries(args.queries, seed=11)]
    result: dict[str, object] = {"model": args.model.name, "machine": machine(), "threads": torch.get_num_threads(),
                                 "queries": len(texts), "backends": {}}  # fmt: skip
    for backend in [b for b in args.backends.split(",") if b]:
        encoders = {
            cut: MaskedLMEncoder.load(str(args.model), device="cpu", truncate=cut) for cut in (True, False)
        }  # fmt: skip
        if not encoders[True].last_layer_at_mask:
            p.error(f"{args.model}: its layers are not BERT's; the forward runs in full either way")
        for enc in encoders.values():
            enc.set_backend(backend)
        inputs = [encoders[True].query_input(t) for t in texts]
        times: dict[bool, list[float]] = {True: [], False: []}
        diff = 0.0
        for i, inp in enumerate([*inputs[:5], *inputs]):  # the first five warm up
            outs = {}
            for cut in ((True, False) if i % 2 else (False, True)):
                t = time.perf_counter()
                outs[cut] = encoders[cut].encode([inp], with_mlm=True)
                if i >= 5:
                    times[cut].append(time.perf_counter() - t)
            a, b = outs[True], outs[False]
            assert a.mlm_log_probs is not None and b.mlm_log_probs is not None
            diff = max(diff, float(np.abs(a.embeddings - b.embeddings).max()),
                       float((a.mlm_log_probs - b.mlm_log_probs).abs().max()))  # fmt: skip
        p50 = {cut: percentiles(v)["p50"] * 1000 for cut, v in times.items()}
        row = {"mask_rows_p50_ms": round(p50[True], 2), "full_p50_ms": round(p50[False], 2),
               "full_over_mask_rows": round(p50[False] / p50[True], 3), "max_abs_difference": diff}  # fmt: skip
        result["backends"][backend] = row  # type: ignore[index]
        print(f"{backend}: forward p50 at batch 1, last layer at the mask rows {p50[True]:.2f} ms, full "
              f"{p50[False]:.2f} ms: {row['full_over_mask_rows']}x faster; largest output difference {diff:.2g}")  # fmt: skip
    print(f"wrote {write_result(result_name('mask-rows', args.model), result)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
