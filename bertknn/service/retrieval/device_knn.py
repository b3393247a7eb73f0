"""The restricted kNN of a whole batch where its queries' embeddings can be searched in one pass (the model's
device): each query's article rows gathered into a padded batch, distances by one batched pass over the rows, top-k;
only distances and row indices come back.

The service runs it right after a batch's forward pass when ``model.knn_device`` is ``model``
(`bertknn.service.device_search`); otherwise `ArticleSearch.search` (FAISS over the rows on the host, one query at
a time) does. Both give the same neighbours (tests/unit/test_device_knn.py); which is faster on a GPU is what
``python -m bench.gpu``'s ``device_knn`` and ``serving_device_knn`` stages measure
(docs/decisions/serving-processes.md).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from bertknn.service.retrieval.knn import ArticleSearch, Neighbours

# The most float32 bytes one padded group of rows may take on the device: a batch whose queries search long
# articles is split into groups under it (one query over it goes alone).
GROUP_BYTES = 256 << 20


def batch_knn(
    queries: torch.Tensor, rows: Sequence[np.ndarray], k: int, *, group_bytes: int = GROUP_BYTES,
    staging: Staging | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Exact squared L2 of each query (``queries[i]``, on any device) against its own float16 rows (``rows[i]``,
    host arrays ``[n_i, hidden]``): per query its ``min(k, n_i)`` nearest as (distances float32 ascending, row
    indices int64 into ``rows[i]``). The rows cross to the queries' device once, as padded groups of at most
    ``group_bytes`` each (`_groups`), through ``staging`` (a new one per call when not given)."""
    if len(rows) != len(queries):
        raise ValueError(f"{len(queries)} queries but {len(rows)} row sets")
    out: list[tuple[np.ndarray, np.ndarray]] = [(np.zeros(0, np.float32), np.zeros(0, np.int64)) for _ in rows]
    if k < 1:
        return out
    staging = staging or Staging(queries.device)
    sizes = [len(r) for r in rows]
    for group in _groups(sizes, queries.shape[1], group_bytes):
        found = _padded_knn(queries[group], [rows[i] for i in group], k, staging)
        for i, hit in zip(group, found, strict=True):
            out[i] = hit
    return out


class Staging:
    """The host buffer the padded rows are written into on their way to the device, kept from batch to batch
    and grown when a batch needs more: pinned for a CUDA device (page-locked memory copies asynchronously, and
    allocating it costs more than the copy it serves). Each group's results are read back (a synchronisation)
    before the next group writes it again."""

    def __init__(self, device: torch.device):
        self.pin = device.type == "cuda"
        self._buffer: torch.Tensor | None = None

    def take(self, shape: tuple[int, int, int]) -> torch.Tensor:
        """A float16 tensor of ``shape`` over the buffer; its contents are left as they were."""
        n = shape[0] * shape[1] * shape[2]
        if self._buffer is None or self._buffer.numel() < n:
            grown = max(n, 2 * self._buffer.numel()) if self._buffer is not None else n
            self._buffer = torch.empty(grown, dtype=torch.float16, pin_memory=self.pin)
        return self._buffer[:n].view(shape)


def _groups(sizes: Sequence[int], hidden: int, group_bytes: int) -> list[list[int]]:
    """The non-empty row sets' indices in groups whose padded float32 batch (queries x widest x hidden) fits
    ``group_bytes``: widest first, so that each group pads to about its own width."""
    order = sorted((i for i, n in enumerate(sizes) if n), key=lambda i: -sizes[i])
    groups: list[list[int]] = []
    for i in order:
        if groups and (len(groups[-1]) + 1) * sizes[groups[-1][0]] * hidden * 4 <= group_bytes:
            groups[-1].append(i)
        else:
            groups.append([i])
    return groups


def _padded_knn(
    queries: torch.Tensor, rows: Sequence[np.ndarray], k: int, staging: Staging
) -> list[tuple[np.ndarray, np.ndarray]]:
    """`batch_knn` of one group: its rows padded into one tensor, one batched pass, one top-k. The padding
    is left unwritten: its distances are masked to infinity whatever it holds."""
    sizes = [len(r) for r in rows]
    width, device = max(sizes), queries.device
    host = staging.take((len(rows), width, queries.shape[1]))
    for i, r in enumerate(rows):
        host[i, : len(r)] = torch.from_numpy(np.ascontiguousarray(r, dtype=np.float16))
    x = host.to(device, non_blocking=True).float()  # [batch, width, hidden], a tensor of its own
    # the differences themselves, in place: |x|^2 - 2 x.q + |q|^2 loses the distance's digits to cancellation
    # where the vectors are long beside their distances (some families' hidden states), and FAISS does not
    dist = x.sub_(queries.float()[:, None, :]).square_().sum(-1)
    padded = torch.arange(width, device=device)[None, :] >= torch.tensor(sizes, device=device)[:, None]
    dist = dist.masked_fill(padded, float("inf"))
    top = torch.topk(dist, min(k, width), dim=1, largest=False, sorted=True)
    values, index = top.values.cpu().numpy(), top.indices.cpu().numpy()
    return [(values[i, : min(k, n)].clip(min=0.0), index[i, : min(k, n)]) for i, n in enumerate(sizes)]


class DeviceKnn:
    """`batch_knn` for the service: a batch's queries, each with its prepared `ArticleSearch` and its k, searched
    on ``device`` in one go; each query's `Neighbours` as `ArticleSearch.search` gives them."""

    def __init__(self, device: torch.device | str, *, group_bytes: int = GROUP_BYTES):
        self.device = torch.device(device)
        self.group_bytes = group_bytes
        self.staging = Staging(self.device)  # (one thread searches: the model's)

    @staticmethod
    def searchable(search: ArticleSearch) -> bool:
        """Whether ``search``'s rows can be searched here: float16 rows (a datastore with a codec, or of float32
        rows, is searched on the host)."""
        return search.float16_rows() is not None

    def search(self, items: Sequence[tuple[np.ndarray, ArticleSearch, int]]) -> list[Neighbours]:
        """Per (embedding, search, k) its k nearest among the search's rows. The embedding is taken as the
        host's search takes it (float16, as the encoding keeps it, widened to float32)."""
        if not items:
            return []
        rows = []
        for _, search, _ in items:
            r = search.float16_rows()
            if r is None:
                raise ValueError("DeviceKnn searches float16 rows only (see `searchable`)")
            rows.append(r)
        vectors = np.stack([np.asarray(e, dtype=np.float16).astype(np.float32) for e, _, _ in items])
        queries = torch.from_numpy(vectors).to(self.device)
        found = batch_knn(queries, rows, max(k for *_, k in items), group_bytes=self.group_bytes, staging=self.staging)
        return [s.at(d[:k], i[:k]) for (_, s, k), (d, i) in zip(items, found, strict=True)]
