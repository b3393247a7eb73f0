"""A datastore's float16 rows kept on the model's device (``model.knn_device_rows``), so that a batch's kNN there
gathers its questions' rows by their global ids instead of copying them from the host each batch.

The rows are loaded by the model thread (every torch call of the service comes from it): all at once at start-up,
and after a reload a bounded step after each batch, so that no batch waits long. Rows stay valid across live
updates: `bert-knn add` appends shards and never changes a global row id, so a datastore whose shards extend the
loaded ones keeps them and only its new shards are loaded. Until a question's rows are all on the device, its
batch copies them from the host as without this (`device_knn.batch_knn`).
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import torch

from bertknn.core.format import VECTORS, Datastore

logger = logging.getLogger(__name__)

# Rows loaded after one batch while a datastore is only partly on the device: a short wait for that batch.
STEP_BYTES = 16 << 20
# Head room kept when the rows' tensor is allocated, so that a few live updates fit before it is reallocated.
GROWTH = 1.125


@dataclass(frozen=True)
class RowsKey:
    """Which rows a global row id means: the datastore's shards in order, each as (name, rows, its vectors'
    checksum). A live update changes the datastore's id but keeps its shards: the key's shards begin the new one's."""

    shards: tuple[tuple[str, int, str], ...]

    def agrees(self, other: RowsKey) -> bool:
        """Whether the global row ids both have mean the same rows: one's shards begin the other's."""
        n = min(len(self.shards), len(other.shards))
        return self.shards[:n] == other.shards[:n]


def rows_key(datastore: Datastore) -> RowsKey:
    shards = datastore.manifest.shards
    return RowsKey(tuple((s.name, s.rows, s.files[VECTORS].sha256 if VECTORS in s.files else "") for s in shards))


def residable(datastore: Datastore) -> bool:
    """Whether the datastore's rows can be kept on the device: float16 vectors (not codes, not float32)."""
    if datastore.codec is not None or not len(datastore.shards):
        return False
    return bool(datastore.shards[0].vectors.dtype == np.float16)


def fits_in_half_the_free_memory(device: torch.device, nbytes: int) -> bool:
    """The ``auto`` budget: a CUDA device keeps the rows when they take at most half of its free memory."""
    if device.type != "cuda":
        return False
    free, _ = torch.cuda.mem_get_info(device)
    return nbytes <= free // 2


class ResidentRows:
    """The float16 rows of the last datastore `advance` was given, on ``device``, at their global row ids.

    ``allowed(nbytes)`` says whether a datastore of that many bytes of rows may be kept (the budget); one that may
    not, or whose allocation failed, is not tried again until another datastore comes.
    """

    def __init__(self, device: torch.device | str, allowed: Callable[[int], bool]):
        self.device = torch.device(device)
        self.allowed = allowed
        self.key: RowsKey | None = None  # the rows' datastore
        self.loaded = 0  # rows 0 .. loaded-1 are on the device
        self._rows: torch.Tensor | None = None  # [capacity, hidden] float16
        self._refused: RowsKey | None = None
        self._keys: weakref.WeakKeyDictionary[Datastore, RowsKey] = weakref.WeakKeyDictionary()

    @property
    def nbytes(self) -> int:
        return 0 if self._rows is None else self._rows.numel() * self._rows.element_size()

    def _key(self, datastore: Datastore) -> RowsKey:
        key = self._keys.get(datastore)
        if key is None:
            key = self._keys[datastore] = rows_key(datastore)
        return key

    def covers(self, datastore: Datastore, rows: np.ndarray) -> bool:
        """Whether every one of these global rows of ``datastore`` is on the device."""
        if self.key is None or not len(rows) or not self.key.agrees(self._key(datastore)):
            return False
        return int(rows.max()) < self.loaded

    def advance(self, datastore: Datastore, max_bytes: int | None = None) -> int:
        """Load up to ``max_bytes`` more of ``datastore``'s rows (None: all of them); the rows loaded now. A
        datastore whose ids mean other rows than the loaded ones' replaces them."""
        key = self._key(datastore)
        if key == self._refused:
            return 0
        if self.key is None or not self.key.agrees(key):
            self._drop()
            if not residable(datastore):
                self._refused = key
                return 0
        elif len(key.shards) < len(self.key.shards):
            return 0  # an earlier version of the kept rows' datastore (still draining): its rows are all there
        total = datastore.total_rows
        if self.loaded >= total:
            self.key = key
            return 0
        try:
            self._reserve(datastore, total)
        except (RuntimeError, MemoryError) as exc:  # the budget said no, or the device's allocation failed
            logger.warning("the datastore's rows stay on the host for the kNN on the device: %s", exc)
            self._drop()
            self._refused = key
            return 0
        self.key = key
        return self._copy(datastore, total, max_bytes)

    def _reserve(self, datastore: Datastore, total: int) -> None:
        """The rows' tensor holds ``total`` rows: allocated, or grown (the loaded rows moved over)."""
        hidden = int(datastore.shards[0].vectors.shape[1])
        if self._rows is not None and self._rows.shape[0] >= total and self._rows.shape[1] == hidden:
            return
        capacity = int(total * GROWTH) + 1
        if not self.allowed(capacity * hidden * 2):
            raise RuntimeError(f"{capacity * hidden * 2:,} bytes of rows are over model.knn_device_rows' budget")
        grown = torch.empty((capacity, hidden), dtype=torch.float16, device=self.device)
        if self._rows is not None and self.loaded:
            grown[: self.loaded].copy_(self._rows[: self.loaded])
        self._rows = grown

    def _copy(self, datastore: Datastore, total: int, max_bytes: int | None) -> int:
        assert self._rows is not None
        row_bytes = self._rows.shape[1] * 2
        budget = total if max_bytes is None else max(1, max_bytes // row_bytes)
        start = self.loaded
        offsets = datastore.shard_offsets
        while self.loaded < total and self.loaded - start < budget:
            pos = int(np.searchsorted(offsets, self.loaded, side="right")) - 1
            a = self.loaded - int(offsets[pos])
            n = min(int(offsets[pos + 1]) - self.loaded, budget - (self.loaded - start))
            _write(self._rows[self.loaded : self.loaded + n], datastore.shards[pos].vectors[a : a + n])
            self.loaded += n
        return self.loaded - start

    def _drop(self) -> None:
        self.key, self.loaded, self._rows = None, 0, None

    def gather(self, ids: Sequence[np.ndarray], width: int) -> torch.Tensor:
        """The rows at each set of global ids, padded to ``width``: float32 ``[len(ids), width, hidden]`` on the
        device, a tensor of its own (`gather_rows`)."""
        assert self._rows is not None
        return gather_rows(self._rows, ids, width)

def _write(out: torch.Tensor, rows: np.ndarray) -> None:
    """Memory-mapped rows into ``out``: straight in on the CPU, else through a host copy of their own."""
    if out.device.type == "cpu":
        out.numpy()[...] = rows
    else:
        out.copy_(torch.from_numpy(np.array(rows)))


def gather_rows(table: torch.Tensor, ids: Sequence[np.ndarray], width: int) -> torch.Tensor:
    """``table``'s rows at each set of ids (host arrays), padded to ``width`` with row 0: float32
    ``[len(ids), width, hidden]`` on ``table``'s device, a tensor of its own; only the ids cross."""
    index = np.zeros((len(ids), width), np.int64)
    for i, r in enumerate(ids):
        index[i, : len(r)] = r
    at = torch.from_numpy(index.reshape(-1)).to(table.device, non_blocking=True)
    return table.index_select(0, at).view(len(ids), width, -1).float()
