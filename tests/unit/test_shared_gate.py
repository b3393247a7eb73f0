"""`SharedCostGate`: the cost caps of several server processes, counted in one mapped table. Two gates of one run
directory (each with its own slot, as two workers have) stand for two processes here; the integration test
`test_workers.py::test_a_client_cost_cap_holds_across_processes` does the same across real OS processes."""

from __future__ import annotations

import fcntl
import itertools
import threading
from pathlib import Path

import pytest

from bertknn.core.errors import ClientOverloaded, Overloaded, TooCostly
from bertknn.service.cost import CostCaps
from bertknn.service.processes import WorkerSlot
from bertknn.service.shared_gate import BUCKETS, SharedCostGate, bucket_of

CAPS = CostCaps(max_request_cost=10, max_client_cost=10, max_queued_cost=16)


def _gates(root: Path, n: int = 2) -> list[SharedCostGate]:
    return [SharedCostGate(CAPS, root, WorkerSlot.claim(root)) for _ in range(n)]


def _client_in_bucket(bucket: int) -> str:
    return next(
        c for c in (f"ip:10.0.{i // 256}.{i % 256}-{i}" for i in itertools.count()) if bucket_of(c) == bucket
    )


def test_rows_are_given_back_when_a_request_ends_in_every_process(tmp_path: Path):
    a, b = _gates(tmp_path)
    assert (a.slot, b.slot) == (0, 1)
    for _ in range(3):  # rows that were not given back would refuse the second round
        with a.admit("ip:1", 10, "q"):
            assert a.held_total() == b.held_total() == 10 and (a.in_flight, b.in_flight) == (10, 0)
            with (
                pytest.raises(ClientOverloaded, match="already has 10 forward rows"),
                b.admit("ip:1", 1, "q"),
            ):
                pass
        assert a.held_total() == 0 and a.in_flight == 0
        assert not a.table.any()  # the client's bucket too, not only the rows in flight
        with b.admit("ip:1", 10, "q"):  # the client's whole cap again, in the other process
            pass


def test_the_server_cap_counts_every_process_and_a_refusal_holds_nothing(tmp_path: Path):
    a, b = _gates(tmp_path)
    with a.admit("ip:1", 9, "q"):
        with pytest.raises(Overloaded, match="9 forward rows are already in flight"), b.admit("ip:2", 8, "q"):
            pass
        with pytest.raises(TooCostly, match="max_request_cost of 10"), b.admit("ip:3", 11, "a batch"):
            pass
        assert b.held_total() == 9 and not b.table[b.slot].any()
        with b.admit("ip:2", 7, "q"):  # 16 of 16
            assert a.held_total() == 16


@pytest.mark.parametrize("bucket", [0, BUCKETS - 1])
def test_clients_of_the_first_and_last_bucket_are_counted_apart(tmp_path: Path, bucket: int):
    a, b = _gates(tmp_path)
    client = _client_in_bucket(bucket)
    other = _client_in_bucket(1 if bucket == 0 else BUCKETS - 2)
    with a.admit(client, 6, "q"):
        with pytest.raises(ClientOverloaded), b.admit(client, 6, "q"):
            pass
        with b.admit(other, 6, "q"):  # another client: its own cap (12 of 16 in flight)
            pass
    assert not a.table.any()


def test_two_clients_of_one_bucket_share_a_cap_never_a_looser_one(tmp_path: Path):
    a, b = _gates(tmp_path)
    first = _client_in_bucket(bucket_of("ip:10.1.1.1"))
    second = next(c for c in (f"ip:10.2.{i}" for i in itertools.count()) if bucket_of(c) == bucket_of(first))
    with a.admit(first, 6, "q"), pytest.raises(ClientOverloaded), b.admit(second, 6, "q"):
        pass


def test_a_dead_workers_rows_are_cleared_by_the_process_that_takes_its_slot(tmp_path: Path):
    a, b = _gates(tmp_path)
    held = a.admit("ip:1", 8, "q")
    held.__enter__()  # a worker killed in the middle of a request: its rows stay in the table
    assert b.held_total() == 8
    a._slot.release()
    (c,) = _gates(tmp_path, 1)
    assert c.slot == a.slot and b.held_total() == 0
    with b.admit("ip:1", 10, "q"):
        pass


def test_admission_waits_while_another_process_holds_the_table(tmp_path: Path):
    """Reading the sums and adding a request's rows is one step under the table's file lock: otherwise two processes
    could both read room for the last rows and both take them. An open file of its own stands for the other process
    (flock locks belong to an open file, so they exclude each other within one process too)."""
    (gate,) = _gates(tmp_path, 1)
    entered = threading.Event()

    def admit() -> None:
        with gate.admit("ip:1", 4, "q"):
            entered.set()

    with open(tmp_path / "gate.bin", "rb") as other:
        fcntl.flock(other, fcntl.LOCK_EX)
        waiter = threading.Thread(target=admit)
        waiter.start()
        assert not entered.wait(0.3)  # held back by the other process's lock
        fcntl.flock(other, fcntl.LOCK_UN)
    assert entered.wait(10)
    waiter.join(10)
    assert gate.held_total() == 0
