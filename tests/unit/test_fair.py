"""The fair executor: clients take turns, each client's tasks in order, cancelled tasks skipped."""

from __future__ import annotations

import threading

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
