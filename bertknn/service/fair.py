"""Fair queues: work of several clients takes turns, so that one client's flood of work waits behind itself.

`FairExecutor` is a thread pool whose queue is one FIFO per client, served round robin: a batch of 64 costly
queries from one client puts 64 tasks in that client's queue, and every other client's next task still runs after
at most one of them per worker. The client of the current request is `client_var` (set by the API's admission,
inherited by the request's tasks); work submitted outside a request is client ``"-"``.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from contextvars import ContextVar
from typing import Any, TypeVar

from bertknn.core.libc import name_os_thread

T = TypeVar("T")
client_var: ContextVar[str] = ContextVar("client", default="-")


class FairExecutor:
    """``workers`` threads taking tasks round robin over clients (each client's own tasks in order)."""

    def __init__(self, workers: int, name: str):
        self._queues: OrderedDict[str, deque[tuple[Callable[[], Any], Future[Any]]]] = OrderedDict()
        self._cond = threading.Condition()
        self._stopping = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True) for i in range(workers)]
        for t in self._threads:
            t.start()

    def submit(self, fn: Callable[..., T], *args: Any, client: str | None = None) -> Future[T]:
        """Queue ``fn(*args)`` for ``client`` (default: the current request's, `client_var`)."""
        fut: Future[T] = Future()
        who = client if client is not None else client_var.get()
        with self._cond:
            if self._stopping:
                raise RuntimeError("the executor is shut down")
            self._queues.setdefault(who, deque()).append((lambda: fn(*args), fut))
            self._cond.notify()
        return fut

    def _next(self) -> tuple[Callable[[], Any], Future[Any]] | None:
        with self._cond:
            while not self._queues and not self._stopping:
                self._cond.wait()
            if not self._queues:
                return None
            who, queue = self._queues.popitem(last=False)  # the client whose turn it is
            task = queue.popleft()
            if queue:
                self._queues[who] = queue  # back of the line
            return task

    def _work(self) -> None:
        name_os_thread()
        while (task := self._next()) is not None:
            _run(*task)
            del task  # an idle thread holds nothing of its last task: its request, the datastore version it used

    def shutdown(self, wait: bool = True) -> None:
        """Finish what is queued, then stop the threads."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if wait:
            for t in self._threads:
                t.join()


def _run(fn: Callable[[], Any], fut: Future[Any]) -> None:
    if not fut.set_running_or_notify_cancel():
        return  # cancelled while queued
    try:
        fut.set_result(fn())
    except BaseException as exc:  # noqa: BLE001 - handed to the waiter
        fut.set_exception(exc)
