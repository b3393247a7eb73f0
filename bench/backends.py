"""Forward backends (eager PyTorch, TorchScript trace, ONNX Runtime): speed of the forward pass at batch 1, 8 and 32,
and whether answers change, all measured in one run. One command::

    python -m bench.backends [--model DIR] [--queries 400] [--threads N]

Speed: the same batches of LAMA-template queries run through each backend in turn (the order rotates per batch, so
machine noise falls on all three alike); per-query p50 of ``encode(..., with_mlm=True)``, the service's forward.
Answers: the whole pipeline (retrieval, kNN, interpolation) over the ``bench.serving`` datastore, per backend, with
BERT-kNN and MLM top-1 agreement against eager, and the largest differences in the embedding and in log p_MLM.
Selection: the service keeps the 2048 most probable p_MLM entries of each query, as a set (`top_set`); its time
per query against the same entries ranked (`top_entries`) and against argpartition + lexsort over the whole
vocabulary (the first code), on the same real rows.
Writes bench/results/backends.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from bench.common import PROXY_MODEL, REPO, RUNS, build_datastore, lama_queries, machine, write_result
from bertknn.core.encoder import MaskedLMEncoder
from bertknn.core.format import Datastore
from bertknn.core.topk import top_entries, top_set
from bertknn.service.cache import InMemoryCache
from bertknn.service.pipeline import AnswerPipeline, Query

BACKENDS = ("eager", "torchscript", "onnx")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.backends", description=__doc__)
    p.add_argument("--model", default=str(PROXY_MODEL))
    p.add_argument("--corpus", type=Path, default=REPO / "data" / "sample_wiki.jsonl")
    p.add_argument("--articles", type=int, default=150)
    p.add_argument("--queries", type=int, default=400)
    p.add_argument("--threads", type=int, default=0, help="torch (and ONNX Runtime) threads; 0 = the service's default")
    p.add_argument("--work", type=Path, default=RUNS / "bench-serving")
    args = p.parse_args(argv)

    from bertknn.service.main import default_threads

    threads = args.threads or default_threads()
    torch.set_num_threads(threads)
    ds = build_datastore([args.corpus], args.work / "ds", args.model, limit=args.articles)
    man = Datastore(ds).manifest
    encoders = {}
    for name in BACKENDS:
        enc = MaskedLMEncoder.load(args.model, layer=man.layer, device="cpu", dtype="float32",
                                   max_seq_len=man.max_seq_len)
        got = enc.set_backend(name)
        if got != name:
            raise SystemExit(f"the {name} backend could not be used here (got {got}); see the log above")
        encoders[name] = enc
    queries = lama_queries(args.queries, seed=23)
    inputs = [encoders["eager"].query_input(t) for t, _ in queries]

    # ---- speed: the same batches through every backend, order rotating -----------------------------------
    speed: dict[str, dict[str, float]] = {name: {} for name in BACKENDS}
    for batch in (1, 8, 32):
        chunks = [inputs[i : i + batch] for i in range(0, len(inputs) - batch + 1, batch)][: max(12, 240 // batch)]
        for enc in encoders.values():  # warm-up at this shape
            enc.encode(chunks[0], with_mlm=True)
        times: dict[str, list[float]] = {name: [] for name in BACKENDS}
        for j, chunk in enumerate(chunks):
            for name in BACKENDS[j % 3 :] + BACKENDS[: j % 3]:
                t = time.perf_counter()
                encoders[name].encode(chunk, with_mlm=True)
                times[name].append((time.perf_counter() - t) / batch)
        for name in BACKENDS:
            speed[name][f"batch_{batch}_ms_per_query"] = statistics.median(times[name]) * 1000

    # ---- agreement: raw outputs, then whole answers ------------------------------------------------------
    ref = encoders["eager"].encode(inputs[:64], with_mlm=True)
    assert ref.mlm_log_probs is not None
    answers: dict[str, tuple[list[str], list[str]]] = {}
    diffs: dict[str, dict[str, float]] = {}
    for name, enc in encoders.items():
        out = enc.encode(inputs[:64], with_mlm=True)
        assert out.mlm_log_probs is not None
        diffs[name] = {
            "max_abs_embedding_diff": float(np.abs(out.embeddings - ref.embeddings).max()),
            "max_abs_log_prob_diff": float((out.mlm_log_probs - ref.mlm_log_probs).abs().max()),
        }
        pipe = AnswerPipeline(enc, Datastore(ds), cache=InMemoryCache(0))
        try:
            qs = [Query(t, subject=s, top_k=1) for t, s in queries]
            replies = [a for i in range(0, len(qs), 16) for a in pipe.predict_batch(qs[i : i + 16])]
        finally:
            pipe.release()
        answers[name] = ([a.predictions[0].token for a in replies], [a.mlm[0].token for a in replies])

    # ---- selecting the stored p_MLM entries: on the rows the model produced -----------------------------
    rows = ref.mlm_log_probs.numpy()
    k = 2048

    def argpartition_lexsort(row: np.ndarray) -> np.ndarray:
        idx = np.argpartition(-row, k - 1)[:k]
        return idx[np.lexsort((idx, -row[idx]))]

    sel_fns = {
        "top_set": lambda r: top_set(r, k)[1],
        "top_entries": lambda r: top_entries(r, k)[1],
        "argpartition_lexsort": argpartition_lexsort,
    }
    sel_times: dict[str, list[float]] = {name: [] for name in sel_fns}
    for rep in range(6):
        names = list(sel_fns)
        for fn_name in names[rep % 3 :] + names[: rep % 3]:  # the order rotates
            fn = sel_fns[fn_name]
            t = time.perf_counter()
            for row in rows:
                fn(row)
            sel_times[fn_name].append((time.perf_counter() - t) / len(rows))
    same = all(np.array_equal(top_entries(r, k)[1], argpartition_lexsort(r)) for r in rows)
    same_set = all(np.array_equal(np.sort(top_entries(r, k)[1]), top_set(r, k)[1]) for r in rows)
    med = {name: statistics.median(v) * 1e6 for name, v in sel_times.items()}
    selection = {"top_set_us": med["top_set"], "top_entries_us": med["top_entries"],
                 "argpartition_lexsort_us": med["argpartition_lexsort"],
                 "speedup": med["argpartition_lexsort"] / med["top_entries"],
                 "top_set_speedup_vs_top_entries": med["top_entries"] / med["top_set"],
                 "same_ids": same, "top_set_same_entries": same_set}  # fmt: skip

    result: dict = {"model": Path(args.model).name, "machine": machine(), "threads": threads,
                    "queries": len(queries), "backends": {}, "mlm_top_2048_selection": selection}
    eager_knn, eager_mlm = answers["eager"]
    for name in BACKENDS:
        knn, mlm = answers[name]
        row = {**speed[name], **diffs[name],
               "bert_knn_top1_agreement": sum(a == b for a, b in zip(knn, eager_knn, strict=True)) / len(knn),
               "mlm_top1_agreement": sum(a == b for a, b in zip(mlm, eager_mlm, strict=True)) / len(mlm)}
        for batch in (1, 8, 32):
            key = f"batch_{batch}_ms_per_query"
            row[f"batch_{batch}_speedup_vs_eager"] = speed["eager"][key] / row[key]
        result["backends"][name] = row
    path = write_result("backends", result)

    print(f"model {result['model']}, {threads} threads, {len(queries)} queries, machine {result['machine']}")
    print(f"{'backend':<12} {'b1 ms':>7} {'b8 ms':>7} {'b32 ms':>7} {'vs eager b1/b8/b32':>20} "
          f"{'BERT-kNN top1 =':>16} {'MLM top1 =':>11} {'max|dlogp|':>11}")
    for name, r in result["backends"].items():
        ratios = "/".join(f"{r[f'batch_{b}_speedup_vs_eager']:.2f}" for b in (1, 8, 32))
        print(f"{name:<12} {r['batch_1_ms_per_query']:>7.2f} {r['batch_8_ms_per_query']:>7.2f} "
              f"{r['batch_32_ms_per_query']:>7.2f} {ratios:>20} {100 * r['bert_knn_top1_agreement']:>15.1f}% "
              f"{100 * r['mlm_top1_agreement']:>10.1f}% {r['max_abs_log_prob_diff']:>11.2g}")
    print(f"selecting the 2048 most probable entries per query: top_set {selection['top_set_us']:.0f} us (the "
          f"service), top_entries (ranked) {selection['top_entries_us']:.0f} us "
          f"({selection['top_set_speedup_vs_top_entries']:.2f}x; same entries: {selection['top_set_same_entries']}), "
          f"argpartition + lexsort {selection['argpartition_lexsort_us']:.0f} us ({selection['speedup']:.2f}x of "
          f"top_entries; same ids: {selection['same_ids']})")
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
