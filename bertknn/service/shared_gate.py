"""The cost gate of several server processes: rows in flight counted in a table every worker maps.

Each worker writes only its own row (its slot: `bertknn.service.processes.WorkerSlot`) and reads every row's sum,
all under one file lock, so a client's cap and the server's queue cap hold across processes. Clients are counted
by a hash bucket: two clients that share a bucket share a cap (with `BUCKETS` buckets, rarely; never a looser one).
A worker that dies leaves its row behind; its replacement takes the slot and clears the row.
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np

from bertknn.service.cost import CostCaps, CostGate
from bertknn.service.processes import MAX_SLOTS, WorkerSlot

BUCKETS = 8192


def bucket_of(client: str) -> int:
    return int.from_bytes(hashlib.blake2b(client.encode("utf-8"), digest_size=4).digest(), "little") % BUCKETS


class SharedCostGate(CostGate):
    """`CostGate` over ``root/gate.bin``: column 0 of each slot's row is its rows in flight, then one per bucket."""

    def __init__(self, caps: CostCaps, root: Path, slot: WorkerSlot):
        super().__init__(caps)
        path = root / "gate.bin"
        size = MAX_SLOTS * (BUCKETS + 1) * 8
        self._file = open(path, "a+b")  # noqa: SIM115 (mapped for the process's life)
        with self._locked():
            if path.stat().st_size < size:
                self._file.truncate(size)
        self._map = mmap.mmap(self._file.fileno(), size)
        self.table = np.ndarray((MAX_SLOTS, BUCKETS + 1), np.int64, self._map)
        self._slot = slot  # held: the slot is this gate's for as long as it lives
        self.slot = slot.index
        with self._locked():
            self.table[self.slot] = 0  # a dead worker's rows in flight, if it held this slot

    @contextmanager
    def _locked(self) -> Iterator[None]:
        fcntl.flock(self._file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(self._file, fcntl.LOCK_UN)

    @contextmanager
    def admit(self, client: str, cost: int, what: str) -> Iterator[None]:
        self.check(cost, what)
        b = 1 + bucket_of(client)
        with self._locked():
            held = int(self.table[:, b].sum())
            in_flight = int(self.table[:, 0].sum())
            if held:
                self._client_cap(held, cost)
            if in_flight:
                self._queue_cap(in_flight, cost)
            self.table[self.slot, 0] += cost
            self.table[self.slot, b] += cost
        self.in_flight += cost  # this process's share, as `CostGate` counts it
        try:
            yield
        finally:
            self.in_flight -= cost
            with self._locked():
                self.table[self.slot, 0] -= cost
                self.table[self.slot, b] -= cost

    def held_total(self) -> int:
        """Rows in flight over every process."""
        with self._locked():
            return int(self.table[:, 0].sum())
