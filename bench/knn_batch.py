"""A batch's restricted kNN three ways, on any device::

    python -m bench.knn_batch [--device cpu|cuda] [--threads 1]

What ``model.knn_device: model`` runs, with the rows copied (`batch_knn`: the batch's rows copied to the device
through the service's kept staging buffer, one batched pass, one top-k; ``model.knn_device_rows: copied``) and with
the rows kept on the device (`resident_knn`: the rows gathered there by their ids; ``resident``), against the
host's search (FAISS over each query's float16 rows, one query after another, one FAISS thread), in alternating
calls, on random float16 rows of bert-base's hidden size: p50 ms per batch of each, their ratios to the host's and
whether the neighbours agree. Each side starts from its rows where the service keeps them (host memory, or the
device), already found: reading them from the shards is left out of all three. Writes
``bench/results/knn-batch-DEVICE.json``; on CUDA, ``python -m bench.gpu``'s ``device_knn`` stage runs it.
"""

from __future__ import annotations

import time

from bench.common import device_sync, device_timing_args, machine, write_result


def time_device_knn(rows: tuple[int, ...] = (500, 3000), batches: tuple[int, ...] = (1, 32), hidden: int = 768,
                    k: int = 128, calls: int = 20, *, device: str = "cuda", seed: int = 0) -> dict[str, object]:  # fmt: skip
    """Per (rows per query, queries per batch): p50 ms of the batch on ``device`` and on the host, their ratio,
    whether every query's neighbours are the same and whether they come in the same order (two at equal
    distances may come either way)."""
    import numpy as np
    import torch

    from bertknn.core.runtime import faiss_threads
    from bertknn.service.retrieval.device_knn import Staging, batch_knn, resident_knn
    from bertknn.service.retrieval.knn import fp16_search
    from bertknn.service.retrieval.resident_rows import gather_rows

    rng = np.random.default_rng(seed)
    sync = device_sync(device)
    staging = Staging(torch.device(device))
    out: dict[str, object] = {"hidden": hidden, "k": k, "device": device}
    for n in rows:
        for b in batches:
            sets = [rng.normal(size=(n, hidden)).astype(np.float16) for _ in range(b)]
            queries = rng.normal(size=(b, hidden)).astype(np.float32)
            on_device = torch.from_numpy(queries).to(device)
            kept = _Kept(torch.from_numpy(np.concatenate(sets)).to(device), gather_rows)  # the rows as one table
            ids = [np.arange(i * n, (i + 1) * n) for i in range(b)]
            times: dict[str, list[float]] = {"device": [], "resident": [], "host": []}
            with faiss_threads(1):
                for _ in range(calls):
                    sync()
                    t = time.perf_counter()
                    got = batch_knn(on_device, sets, k, staging=staging)
                    times["device"].append(1000 * (time.perf_counter() - t))
                    t = time.perf_counter()
                    held = resident_knn(on_device, ids, k, kept)
                    times["resident"].append(1000 * (time.perf_counter() - t))
                    t = time.perf_counter()
                    want = [fp16_search(r, q, k) for r, q in zip(sets, queries, strict=True)]
                    times["host"].append(1000 * (time.perf_counter() - t))
            out[f"rows_{n}_batch_{b}"] = _summary(times, got, held, want)
    return out


class _Kept:
    """Rows kept on the device as `ResidentRows` keeps them (one table, gathered by `gather_rows`)."""

    def __init__(self, table, gather):
        self.table, self._gather = table, gather

    def gather(self, ids, width):
        return self._gather(self.table, ids, width)


def _summary(times: dict[str, list[float]], got: list, held: list, want: list) -> dict[str, object]:
    """p50 ms of each side, the device sides' ratios to the host's, and whether their neighbours are the host's
    (as sets, and in the same order: two at equal distances may come either way)."""
    import numpy as np

    p50 = {side: float(np.median(t)) for side, t in times.items()}
    same = all(set(g[1].tolist()) == set(w[1].tolist()) for side in (got, held) for g, w in zip(side, want, strict=True))
    order = all(np.array_equal(g[1], w[1]) for side in (got, held) for g, w in zip(side, want, strict=True))
    return {"device_ms_p50": round(p50["device"], 3), "resident_ms_p50": round(p50["resident"], 3),
            "host_ms_p50": round(p50["host"], 3), "device_over_host": round(p50["device"] / p50["host"], 3),
            "resident_over_host": round(p50["resident"] / p50["host"], 3), "same_neighbours": same,
            "same_order": order}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = device_timing_args("python -m bench.knn_batch", __doc__, argv)
    result = {"machine": machine(), "threads": args.threads, **time_device_knn(calls=args.calls, device=args.device)}
    path = write_result(f"knn-batch-{args.device}", result)
    for key, r in result.items():
        if key.startswith("rows_"):
            print(f"{key}: copied {r['device_ms_p50']} ms ({r['device_over_host']}x the host's), kept on the device "
                  f"{r['resident_ms_p50']} ms ({r['resident_over_host']}x), host {r['host_ms_p50']} ms; same neighbours: "
                  f"{r['same_neighbours']}, in the same order: {r['same_order']}")  # fmt: skip
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
