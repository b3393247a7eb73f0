"""Which exact-search call is fastest for the restricted kNN: one query against the rows of a few articles.

``python -m bench.knn_calls`` times, in one run and on the same float16 rows (as memory-mapped shards store them),
every candidate that returns the exact k nearest by squared L2, including the float16 -> float32 conversion each
one needs. Row counts span a short article (64 rows) to N=3 long ones (30,000 rows); dims 384 (the proxy MiniLM)
and 768 (bert-base). Prints p50 per call and its ratio to the fastest, and writes ``bench/results/knn_calls.json``.
The service uses the candidate ``bertknn.service.retrieval.knn.SEARCH`` names; this benchmark is how it was chosen.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import faiss
import numpy as np

from bench.common import RESULTS, machine

Search = Callable[[np.ndarray, np.ndarray, int], tuple[np.ndarray, np.ndarray]]


def _faiss_knn(xb16: np.ndarray, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    xb = np.ascontiguousarray(xb16, dtype=np.float32)
    d, i = faiss.knn(q.reshape(1, -1), xb, k)
    return d[0], i[0]


def _faiss_sq_fp16(xb16: np.ndarray, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    from bertknn.service.retrieval.knn import fp16_search

    d, i = fp16_search(np.ascontiguousarray(xb16), q, k)
    return d, i


def _faiss_flat(xb16: np.ndarray, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    index = faiss.IndexFlatL2(xb16.shape[1])
    index.add(np.ascontiguousarray(xb16, dtype=np.float32))
    d, i = index.search(q.reshape(1, -1), k)
    return d[0], i[0]


def _numpy_gemv(xb16: np.ndarray, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    xb = np.asarray(xb16, dtype=np.float32)
    d = (xb * xb).sum(axis=1) - 2.0 * (xb @ q) + float(q @ q)
    idx = np.argpartition(d, k - 1)[:k] if k < len(d) else np.arange(len(d))
    idx = idx[np.argsort(d[idx], kind="stable")]
    return d[idx], idx


def _numpy_diff(xb16: np.ndarray, q: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray]:
    diff = np.asarray(xb16, dtype=np.float32) - q[None, :]
    d = np.einsum("ij,ij->i", diff, diff)
    idx = np.argpartition(d, k - 1)[:k] if k < len(d) else np.arange(len(d))
    idx = idx[np.argsort(d[idx], kind="stable")]
    return d[idx], idx


CANDIDATES: dict[str, Search] = {
    "faiss SQ fp16 (raw rows)": _faiss_sq_fp16,
    "faiss.knn": _faiss_knn,
    "faiss.IndexFlatL2": _faiss_flat,
    "numpy gemv (|x|^2 - 2xq + |q|^2)": _numpy_gemv,
    "numpy diff (einsum)": _numpy_diff,
}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.knn_calls", description=__doc__)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--k", type=int, default=128)
    args = p.parse_args(argv)
    faiss.omp_set_num_threads(1)
    rng = np.random.default_rng(0)
    rows_list, dims = (64, 300, 3000, 30000), (384, 768)
    results = []
    print(f"{'dim':>4} {'rows':>6}  " + "  ".join(f"{n[:22]:>22}" for n in CANDIDATES))
    for dim in dims:
        for rows in rows_list:
            xb16 = (rng.standard_normal((rows, dim)) * 0.5).astype(np.float16)
            q = rng.standard_normal(dim).astype(np.float32) * 0.5
            k = min(args.k, rows)
            ref_d, ref_i = _numpy_diff(xb16, q, k)
            times: dict[str, list[float]] = {n: [] for n in CANDIDATES}
            repeats = max(10, args.repeats * 300 // max(rows, 300))
            for _ in range(repeats):  # interleaved, so machine noise hits every candidate alike
                for name, fn in CANDIDATES.items():
                    t = time.perf_counter()
                    d, i = fn(xb16, q, k)
                    times[name].append(time.perf_counter() - t)
            for name, fn in CANDIDATES.items():  # every candidate must return the same neighbours
                d, i = fn(xb16, q, k)
                if not np.allclose(np.sort(d), np.sort(ref_d), rtol=1e-3, atol=1e-2):
                    raise SystemExit(f"{name} disagrees with the reference at dim={dim} rows={rows}")
            p50 = {n: float(np.median(t)) * 1e6 for n, t in times.items()}
            best = min(p50.values())
            results.append({"dim": dim, "rows": rows, "k": k, "repeats": repeats, "p50_us": p50,
                            "ratio_to_fastest": {n: v / best for n, v in p50.items()}})
            print(f"{dim:>4} {rows:>6}  " + "  ".join(f"{v:>14.1f}us {v / best:>5.2f}x" for v in p50.values()))
    out = {"machine": machine(), "faiss_threads": 1, "results": results}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "knn_calls.json").write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {RESULTS / 'knn_calls.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
