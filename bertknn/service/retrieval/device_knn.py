"""The restricted kNN of a whole batch where its queries' embeddings can be searched in one pass (the model's
device): each query's article rows gathered into a padded batch (copied from the host, or gathered on the device
where its rows are kept there: `ResidentRows`), distances by one batched pass over the rows, top-k; only distances
and row indices come back.

The service runs it right after a batch's forward pass when ``model.knn_device`` is ``model``
(`bertknn.service.device_search`); otherwise `ArticleSearch.search` (FAISS over the rows on the host, one query at
a time) does. Both give the same neighbours (tests/unit/test_device_knn.py); which is faster on a GPU is what
``python -m bench.gpu``'s ``device_knn`` and ``serving_device_knn`` stages measure
(docs/decisions/serving-processes.md).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import numpy as np
import torch

from bertknn.core.format import Datastore
from bertknn.service.retrieval.knn import ArticleSearch, Neighbours
from bertknn.service.retrieval.resident_rows import ResidentRows

# The most float32 bytes one padded group of rows may take on the device: a batch whose queries search long
# articles is split into groups under it (one query over it goes alone).
GROUP_BYTES = 256 << 20


class RowSource(Protocol):
    """A set of float16 rows on the host: its length, and a copy of it into an array of that shape."""

    def __len__(self) -> int: ...

    def read_float16_into(self, out: np.ndarray) -> None: ...


class _HostRows:
    """A float16 array as a `RowSource`."""

    def __init__(self, rows: np.ndarray):
        self.rows = rows

    def __len__(self) -> int:
        return len(self.rows)

    def read_float16_into(self, out: np.ndarray) -> None:
        out[...] = self.rows


def batch_knn(
    queries: torch.Tensor, rows: Sequence[np.ndarray | RowSource], k: int, *, group_bytes: int = GROUP_BYTES,
    staging: Staging | None = None,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Exact squared L2 of each query (``queries[i]``, on any device) against its own float16 rows (``rows[i]``,
    host arrays ``[n_i, hidden]`` or row sources): per query its ``min(k, n_i)`` nearest as (distances float32
    ascending, row indices int64 into ``rows[i]``). The rows cross to the queries' device once, as padded groups
    of at most ``group_bytes`` each (`_groups`), through ``staging`` (a new one per call when not given)."""
    sources = [_HostRows(r) if isinstance(r, np.ndarray) else r for r in rows]
    staging = staging or Staging(queries.device)

    def load(group: list[int], width: int) -> torch.Tensor:
        return staging.rows([sources[i] for i in group], width, queries.shape[1], queries.device)

    return _grouped_knn(queries, [len(r) for r in sources], k, group_bytes, load)


class KeptRows(Protocol):
    """Rows kept on the device (`ResidentRows`): a batch's gathered there by their ids."""

    def gather(self, ids: Sequence[np.ndarray], width: int) -> torch.Tensor: ...


def resident_knn(
    queries: torch.Tensor, ids: Sequence[np.ndarray], k: int, resident: KeptRows, *,
    group_bytes: int = GROUP_BYTES,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """`batch_knn` over rows kept on the device (`ResidentRows`): ``ids[i]`` the global row ids of query i's
    rows, gathered there; only the ids cross."""

    def load(group: list[int], width: int) -> torch.Tensor:
        return resident.gather([ids[i] for i in group], width)

    return _grouped_knn(queries, [len(r) for r in ids], k, group_bytes, load)


def _grouped_knn(
    queries: torch.Tensor, sizes: list[int], k: int, group_bytes: int,
    load: Callable[[list[int], int], torch.Tensor],
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per query its nearest, the queries searched in groups (`_groups`): ``load(group, width)`` gives a group's
    rows, padded, float32 ``[len(group), width, hidden]`` on the queries' device, a tensor of its own."""
    if len(sizes) != len(queries):
        raise ValueError(f"{len(queries)} queries but {len(sizes)} row sets")
    out: list[tuple[np.ndarray, np.ndarray]] = [(np.zeros(0, np.float32), np.zeros(0, np.int64)) for _ in sizes]
    if k < 1:
        return out
    for group in _groups(sizes, queries.shape[1], group_bytes):
        group_sizes = [sizes[i] for i in group]
        found = _nearest(queries[group], load(group, max(group_sizes)), group_sizes, k)
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

    def rows(self, sources: Sequence[RowSource], width: int, hidden: int, device: torch.device) -> torch.Tensor:
        """The sources' rows padded to ``width``, on ``device`` as float32 (a tensor of its own). The padding is
        left unwritten: `_nearest` masks its distances whatever it holds."""
        host = self.take((len(sources), width, hidden))
        for i, r in enumerate(sources):
            r.read_float16_into(host[i, : len(r)].numpy())
        return host.to(device, non_blocking=True).float()


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


def _nearest(
    queries: torch.Tensor, x: torch.Tensor, sizes: Sequence[int], k: int
) -> list[tuple[np.ndarray, np.ndarray]]:
    """One group: ``x`` its rows (`_grouped_knn`'s ``load``), one batched pass, one top-k; the padding's
    distances masked to infinity."""
    width, device = x.shape[1], queries.device
    # the differences themselves, in place: |x|^2 - 2 x.q + |q|^2 loses the distance's digits to cancellation
    # where the vectors are long beside their distances (some families' hidden states), and FAISS does not
    dist = x.sub_(queries.float()[:, None, :]).square_().sum(-1)
    padded = torch.arange(width, device=device)[None, :] >= torch.tensor(list(sizes), device=device)[:, None]
    dist = dist.masked_fill(padded, float("inf"))
    top = torch.topk(dist, min(k, width), dim=1, largest=False, sorted=True)
    values, index = top.values.cpu().numpy(), top.indices.cpu().numpy()
    return [(values[i, : min(k, n)].clip(min=0.0), index[i, : min(k, n)]) for i, n in enumerate(sizes)]


class DeviceKnn:
    """`batch_knn` for the service: a batch's queries, each with its prepared `ArticleSearch` and its k, searched
    on ``device`` in one go; each query's `Neighbours` as `ArticleSearch.search` gives them. With ``resident``,
    the queries whose rows it holds are searched there (`resident_knn`), the others' rows copied."""

    def __init__(
        self, device: torch.device | str, *, group_bytes: int = GROUP_BYTES, resident: ResidentRows | None = None
    ):
        self.device = torch.device(device)
        self.group_bytes = group_bytes
        self.staging = Staging(self.device)  # (one thread searches: the model's)
        self.resident = resident

    @property
    def reads_rows(self) -> bool:
        """Whether the host reads the questions' rows for this search (to copy them); False: it keeps them, and
        only their ids are needed."""
        return self.resident is None

    @staticmethod
    def searchable(search: ArticleSearch) -> bool:
        """Whether ``search``'s rows can be searched here: float16 rows (a datastore with a codec, or of float32
        rows, is searched on the host)."""
        return search.float16

    def keep_rows(self, datastore: Datastore, max_bytes: int | None = None) -> int:
        """With resident rows, load up to ``max_bytes`` more of ``datastore``'s (None: all): the rows loaded."""
        return 0 if self.resident is None else self.resident.advance(datastore, max_bytes)

    def search(
        self, items: Sequence[tuple[np.ndarray, ArticleSearch, int]], datastores: Sequence[Datastore] | None = None
    ) -> list[Neighbours]:
        """Per (embedding, search, k) its k nearest among the search's rows; ``datastores``: each item's, for the
        resident rows. The embedding is taken as the host's search takes it (float16, as the encoding keeps it,
        widened to float32)."""
        if not items:
            return []
        for _, search, _ in items:
            if not search.float16:
                raise ValueError("DeviceKnn searches float16 rows only (see `searchable`)")
        vectors = np.stack([np.asarray(e, dtype=np.float16).astype(np.float32) for e, _, _ in items])
        queries = torch.from_numpy(vectors).to(self.device)
        k = max(k for *_, k in items)
        held = self._held(items, datastores)
        copied = [i for i in range(len(items)) if i not in set(held)]
        found: dict[int, tuple[np.ndarray, np.ndarray]] = {}
        if held:
            assert self.resident is not None
            ids = [items[i][1].rows for i in held]
            got = resident_knn(queries[held], ids, k, self.resident, group_bytes=self.group_bytes)
            found.update(zip(held, got, strict=True))
        if copied:
            sources = [items[i][1] for i in copied]
            got = batch_knn(queries[copied], sources, k, group_bytes=self.group_bytes, staging=self.staging)
            found.update(zip(copied, got, strict=True))
        return [s.at(found[j][0][:k], found[j][1][:k]) for j, (_, s, k) in enumerate(items)]

    def _held(
        self, items: Sequence[tuple[np.ndarray, ArticleSearch, int]], datastores: Sequence[Datastore] | None
    ) -> list[int]:
        """The items whose rows are all on the device."""
        if self.resident is None or datastores is None:
            return []
        return [i for i, ((_, s, _), d) in enumerate(zip(items, datastores, strict=True))
                if self.resident.covers(d, s.rows)]  # fmt: skip
