"""The fair executor: clients take turns, each client's tasks in order, cancelled tasks skipped."""

from __future__ import annotations

import threading
import time
import weakref

import pytest

from bertknn.service.fair import FairExecutor, client_var


def test_clients_take_turns_and_each_client_s_tasks_keep_their_order() -> None:
    ran: list[str] = []
    gate = threading.Event()
    pool = FairExecutor(1, "t")
    blocker = pool.submit(gate.wait, 5, client="x")
    futs = [pool.submit(ran.append, f"a{i}", client="a") for i in range(4)]
    futs += [pool.submit(ran.append, f"b{i}", client="b") for i in range(2)]
    cancelled = pool.submit(ran.append, "a-late", client="a")
    assert cancelled.cancel()
    token = client_var.set("c")
    try:
        futs.append(pool.submit(ran.append, "c0"))  # the current request's client
    finally:
        client_var.reset(token)
    gate.set()
    for f in [blocker, *futs]:
        f.result(5)
    pool.shutdown()
    assert ran == ["a0", "b0", "c0", "a1", "b1", "a2", "a3"]


def test_a_task_s_error_reaches_its_waiter_and_the_worker_goes_on() -> None:
    pool = FairExecutor(1, "t")

    def fail() -> None:
        raise ValueError("bad task")

    failed = pool.submit(fail)
    after = pool.submit(lambda: 42)
    with pytest.raises(ValueError, match="bad task"):
        failed.result(5)
    assert after.result(5) == 42
    pool.shutdown()


def test_shutdown_finishes_what_is_queued_then_stops_its_threads(monkeypatch: pytest.MonkeyPatch) -> None:
    errors: list[threading.ExceptHookArgs] = []
    monkeypatch.setattr(threading, "excepthook", errors.append)
    gate = threading.Event()
    pool = FairExecutor(2, "fin")
    assert sorted(t.name for t in pool._threads) == ["fin_0", "fin_1"]
    assert all(t.daemon for t in pool._threads)  # never keeps the process from exiting
    blockers = [pool.submit(gate.wait, 5, client=c) for c in "xy"]
    queued = [pool.submit(lambda i=i: i * i, client="z") for i in range(5)]
    stopper = threading.Thread(target=pool.shutdown)
    stopper.start()
    stopper.join(0.2)
    assert stopper.is_alive()  # waits for the threads, which are busy
    with pytest.raises(RuntimeError, match="shut down"):
        pool.submit(print, "too late")
    gate.set()
    stopper.join(5)
    assert not stopper.is_alive() and not any(t.is_alive() for t in pool._threads)
    assert errors == []  # each thread ended by returning, none by an error
    assert [f.result(0) for f in blockers] == [True, True] and [f.result(0) for f in queued] == [0, 1, 4, 9, 16]


def test_shutdown_without_waiting_returns_while_a_task_runs() -> None:
    gate = threading.Event()
    pool = FairExecutor(1, "nowait")
    running = pool.submit(gate.wait, 5)
    pool.shutdown(wait=False)
    assert pool._threads[0].is_alive() and not running.done()
    gate.set()
    assert running.result(5) is True
    pool._threads[0].join(5)
    assert not pool._threads[0].is_alive()


class Request:
    """Stands for what a task's arguments keep alive: a request, the datastore version it holds."""


def test_an_idle_thread_keeps_nothing_of_its_last_task() -> None:
    """A thread waiting for work holds no reference to the task it ran last: a retired datastore version that
    a request used is freed once the request is done, not when the thread next gets work."""
    pool = FairExecutor(2, "t")
    request = Request()
    gone = weakref.ref(request)
    assert pool.submit(lambda r: r, request).result(5) is request
    del request
    deadline = time.monotonic() + 5
    while gone() is not None and time.monotonic() < deadline:  # (the thread lets go right after the result)
        time.sleep(0.01)
    try:
        assert gone() is None
    finally:
        pool.shutdown()
