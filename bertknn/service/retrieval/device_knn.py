"""The restricted kNN of a whole batch where its queries' embeddings are (a GPU): each query's article rows
gathered into one padded batch, distances by one batched matrix product, top-k; only ids and distances come back.

Not yet what the service runs: `ArticleSearch.search` (FAISS over the rows in place, one query at a time) is. This
is the candidate that `python -m bench.gpu`'s ``device_knn`` stage measures against it on a device, batch by batch
(docs/decisions/serving-processes.md, "Not built, and why"); it gives the same neighbours (tests/unit/test_device_knn.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch


def batch_knn(queries: torch.Tensor, rows: Sequence[np.ndarray], k: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """Exact squared L2 of each query (``queries[i]``, on any device) against its own float16 rows (``rows[i]``,
    host arrays ``[n_i, hidden]``): per query its ``min(k, n_i)`` nearest as (distances float32 ascending, row
    indices int64 into ``rows[i]``). The rows cross to the queries' device once, as one padded batch."""
    if len(rows) != len(queries):
        raise ValueError(f"{len(queries)} queries but {len(rows)} row sets")
    sizes = [len(r) for r in rows]
    width = max(sizes, default=0)
    if width == 0 or k < 1:
        return [(np.zeros(0, np.float32), np.zeros(0, np.int64)) for _ in rows]
    device = queries.device
    host = torch.zeros((len(rows), width, queries.shape[1]), dtype=torch.float16, pin_memory=device.type == "cuda")
    for i, r in enumerate(rows):
        host[i, : len(r)] = torch.from_numpy(np.ascontiguousarray(r, dtype=np.float16))
    x = host.to(device, non_blocking=True).float()  # [batch, width, hidden]
    q = queries.float()
    dist = (x * x).sum(-1) - 2.0 * torch.bmm(x, q[:, :, None])[..., 0] + (q * q).sum(-1, keepdim=True)
    padded = torch.arange(width, device=device)[None, :] >= torch.tensor(sizes, device=device)[:, None]
    dist = dist.masked_fill(padded, float("inf"))
    top = torch.topk(dist, min(k, width), dim=1, largest=False, sorted=True)
    values, index = top.values.cpu().numpy(), top.indices.cpu().numpy()
    return [(values[i, : min(k, n)].clip(min=0.0), index[i, : min(k, n)]) for i, n in enumerate(sizes)]
