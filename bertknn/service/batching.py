"""Micro-batching: concurrent requests are gathered into one forward pass, formed by the model's thread itself.

The model thread takes its next batch the moment its last one ends: whatever queued meanwhile (up to
``max_batch_size``) goes in at once, so the model never waits for a busy event loop between batches. Results go
back to the loop in one callback per batch. Without a model thread, the batches run on the event loop itself, one
task taking turns with the requests (`MicroBatcher` with no executor).

The queue is bounded: when it is full, `submit` raises `Overloaded` at once (the API answers 503 with
Retry-After) instead of letting latency and memory grow without limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future
from typing import Any, Generic, TypeVar

from bertknn.core.errors import Overloaded

logger = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")


def deliver(pairs: Sequence[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    """On the event loop: hand each waiter its result (skipping those that gave up, e.g. a client gone)."""
    for fut, result, error in pairs:
        if fut.done():
            continue
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)


Delivery = tuple[asyncio.Future[Any], Any, BaseException | None]
Item = tuple[T, asyncio.Future[R]]  # an item and its waiter
Call = tuple[Callable[[], Any], Future[Any]]  # a call and its result
Work = Call | list[Item[T, R]]  # what the worker does next: one call, or one batch


class Outbox:
    """Results handed from worker threads to the event loop, one loop wake-up for all that arrive before it runs.

    Each ``call_soon_threadsafe`` writes to the loop's wake-up pipe and makes the loop thread take the GIL from
    the worker: a batch finished answer by answer would pay that once per answer. Here an answer goes out as soon
    as it is made, but while a hand-over is still pending, later answers join it."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[Delivery] = []

    def put(self, pairs: Sequence[Delivery]) -> None:
        """Hand ``pairs`` to their waiters. `RuntimeError`: the loop is closed (nobody waits any more)."""
        with self._lock:
            first = not self._pending
            self._pending.extend(pairs)
        if first:
            self._loop.call_soon_threadsafe(self._drain)

    def _drain(self) -> None:
        with self._lock:
            pairs, self._pending = self._pending, []
        deliver(pairs)


class WorkQueue(Generic[T, R]):
    """What waits for a `MicroBatcher`'s thread, and which of it goes next: items, run in batches of up to
    ``max_batch_size``, and calls, run one at a time. When both wait, calls and batches take turns; a batch that is
    not full waits up to ``max_wait_s`` for company; when more items wait than a batch takes, ``key`` (an item's
    client) has the batch take them round robin over clients, each client's in order.

    ``cond`` guards everything: the methods that take work are called under it."""

    def __init__(
        self, *, max_batch_size: int, max_wait_s: float, max_queue: int, key: Callable[[T], str] | None
    ):
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_s
        self.max_queue = max_queue
        self._key = key
        self.items: deque[Item[T, R]] = deque()
        self.calls: deque[Call] = deque()
        self.cond = threading.Condition()
        self.stopping = False
        self._last_was_call = False  # calls and batches take turns when both wait

    def add(self, item: T, fut: asyncio.Future[R]) -> None:
        """Queue an item; `Overloaded` when ``max_queue`` wait already."""
        with self.cond:
            if self.stopping:
                raise RuntimeError("the batcher is stopping")
            if len(self.items) >= self.max_queue:
                raise Overloaded(
                    f"server busy: {self.max_queue} queries are already waiting; retry after the Retry-After delay"
                )
            self.items.append((item, fut))
            self.cond.notify()

    def add_call(self, fn: Callable[[], Any], fut: Future[Any]) -> None:
        with self.cond:
            self.calls.append((fn, fut))
            self.cond.notify()

    def stop(self) -> None:
        """No new items; what waits is still taken."""
        with self.cond:
            self.stopping = True
            self.cond.notify_all()

    @property
    def empty(self) -> bool:
        """Nothing to take and not stopping: the worker waits."""
        return not self.items and not self.calls and not self.stopping

    def call_is_next(self) -> bool:
        """Whether a waiting call goes before the waiting items (calls and batches take turns)."""
        return bool(self.calls) and not (self.items and self._last_was_call)

    def company_deadline(self) -> float | None:
        """Until when a batch waits for more items to join it (``max_wait_s``); None: it does not wait."""
        if self.max_wait_s > 0 and len(self.items) < self.max_batch_size and not self.stopping:
            return time.monotonic() + self.max_wait_s
        return None

    def company_left(self, deadline: float) -> float:
        """Seconds left to wait for company; 0: the batch goes now (full, stopping, or the wait is over)."""
        if len(self.items) >= self.max_batch_size or self.stopping:
            return 0.0
        return max(0.0, deadline - time.monotonic())

    def take(self) -> Work[T, R] | None:
        """The next call, or batch; None: stopping and nothing left."""
        if self.call_is_next():
            self._last_was_call = True
            return self.calls.popleft()
        return self.batch() if self.items else None

    def batch(self) -> list[Item[T, R]]:
        """The next batch of waiting items (at least one waits)."""
        self._last_was_call = False
        n = min(self.max_batch_size, len(self.items))
        if self._key is None or n == len(self.items):
            return [self.items.popleft() for _ in range(n)]
        return self._take_fairly(n)

    def _take_fairly(self, n: int) -> list[Item[T, R]]:
        """``n`` waiting items, round robin over their clients."""
        assert self._key is not None
        rank: dict[str, int] = {}
        order = []
        for i, (item, _) in enumerate(self.items):
            who = self._key(item)
            rank[who] = rank.get(who, -1) + 1
            order.append((rank[who], i))
        chosen = sorted(i for _, i in sorted(order)[:n])
        taken = [self.items[i] for i in chosen]
        keep = set(chosen)
        self.items = deque(x for i, x in enumerate(self.items) if i not in keep)
        return taken


class MicroBatcher(Generic[T, R]):
    """Batches `submit`ted items into calls of ``fn`` on the thread of ``executor`` (a single-thread pool), or
    with ``executor`` None on the event loop's thread, in a task of the loop that blocks it while ``fn`` runs.

    Between `start` and `stop` that thread runs the batcher's loop; other work for it (for example extra
    forward passes that must come from the model's thread) goes through `call`. When both wait, calls and batches
    take turns (`WorkQueue`): one request's long series of extra passes never holds back the others' next batch
    by more than one call.
    """

    def __init__(
        self,
        fn: Callable[[Sequence[T]], Sequence[R]],
        *,
        executor: Executor | None,
        max_batch_size: int = 32,
        max_wait_ms: float = 2.0,
        max_queue: int = 256,
        on_batch: Callable[[int, float], None] | None = None,
        after_delivery: Callable[[], None] | None = None,
        key: Callable[[T], str] | None = None,
    ):
        """``after_delivery``: called on the worker thread once a batch's results are on their way to the
        waiters (work that no request needs to wait for, e.g. cache writes). ``key``: an item's client; when more
        items wait than a batch takes, the batch takes them round robin over clients (each client's in order)."""
        if max_batch_size < 1 or max_queue < 1 or max_wait_ms < 0:
            raise ValueError("max_batch_size and max_queue must be >= 1, max_wait_ms >= 0")
        self._fn = fn
        self._executor = executor
        self._queue: WorkQueue[T, R] = WorkQueue(
            max_batch_size=max_batch_size, max_wait_s=max_wait_ms / 1000.0, max_queue=max_queue, key=key
        )
        self._on_batch = on_batch
        self._after_delivery = after_delivery
        self._running = False  # the worker is inside fn
        self._worker: Future[None] | asyncio.Future[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None  # on the event loop (``executor`` None): new work

    @property
    def depth(self) -> int:
        """Items waiting for a batch (read from any thread: a hint)."""
        return len(self._queue.items)

    @property
    def busy(self) -> bool:
        """Whether a batch is being computed now, so that a new item will wait (a hint)."""
        return self._running or bool(self._queue.items)

    def start(self) -> None:
        if self._worker is None:
            self._loop = asyncio.get_running_loop()
            self._queue.stopping = False
            if self._executor is None:
                self._wake = asyncio.Event()
                self._worker = asyncio.ensure_future(self._work_on_loop())
            else:
                self._worker = self._executor.submit(self._work)

    async def stop(self) -> None:
        """Finish what is queued, then stop; the executor's thread is free again afterwards."""
        if self._worker is None:
            return
        self._queue.stop()
        if self._wake is not None:
            self._wake.set()
        await asyncio.wrap_future(self._worker)
        self._worker = None

    async def submit(self, item: T) -> R:
        if self._worker is None or self._loop is None:
            raise RuntimeError("MicroBatcher.start() was not called")
        fut: asyncio.Future[R] = self._loop.create_future()
        self._queue.add(item, fut)
        if self._wake is not None:
            self._wake.set()
        return await fut

    def call(self, fn: Callable[[], R]) -> Future[R]:
        """Run ``fn`` on the batcher's thread (next, or after one batch when batches wait too); thread-safe."""
        if self._worker is None or self._worker.done() or self._on_loop_thread():
            return _run_now(fn) if self._executor is None else self._executor.submit(fn)
        fut: Future[R] = Future()
        self._queue.add_call(fn, fut)
        if self._wake is not None and self._loop is not None:
            self._loop.call_soon_threadsafe(self._wake.set)
        return fut

    def _on_loop_thread(self) -> bool:
        if self._executor is not None or self._loop is None:
            return False
        try:
            return asyncio.get_running_loop() is self._loop
        except RuntimeError:
            return False

    # ---- the worker: a thread of its own, or a task of the event loop ----------------------------------------

    def _work(self) -> None:
        while True:
            work = self._next()
            if work is None or not self._do(work):
                return
            del work  # idle, the worker holds nothing of its last batch: its requests, their datastore version

    def _next(self) -> Work[T, R] | None:
        """Wait for work: a `call`, else a batch (after waiting up to max_wait for company); None: stop."""
        q = self._queue
        with q.cond:
            while q.empty:
                # wakes now and then: a batcher nobody stopped ends with the event loop it serves (closed: nobody
                # can take a result any more), instead of keeping the process from exiting
                if not q.cond.wait(timeout=0.5) and self._orphaned():
                    return None
            if q.call_is_next() or not q.items:
                return q.take()  # (None: stopping, and nothing left)
            deadline = q.company_deadline()
            while deadline is not None and (left := q.company_left(deadline)) > 0:
                q.cond.wait(left)
            return q.batch()

    def _orphaned(self) -> bool:
        loop = self._loop
        return loop is None or loop.is_closed() or sys.is_finalizing()

    async def _work_on_loop(self) -> None:
        """The batcher's loop as a task of the event loop (no ``executor``): each batch runs there, blocking it."""
        while True:
            work = await self._next_on_loop()
            if work is None or not self._do(work):
                return
            del work  # (as `_work`)

    async def _next_on_loop(self) -> Work[T, R] | None:
        """`_next` for the loop's task: first the loop reads what came in during the last batch (each request
        takes a few turns of the loop to reach `submit`), then waits for work."""
        assert self._wake is not None
        q = self._queue
        seen = -1
        while seen != len(q.items) and len(q.items) < q.max_batch_size:
            seen = len(q.items)
            for _ in range(3):
                await asyncio.sleep(0)
        while q.empty:
            self._wake.clear()
            await self._wake.wait()
        if q.call_is_next() or not q.items:
            with q.cond:
                return q.take()  # (None: stopping, and nothing left)
        deadline = q.company_deadline()
        while deadline is not None and (left := q.company_left(deadline)) > 0:
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), left)
        with q.cond:
            return q.batch()

    def _do(self, work: Work[T, R]) -> bool:
        """One call or batch; False: the loop is closed (stop)."""
        if isinstance(work, tuple):
            _complete(work[1], work[0])
            return True
        live = [(x, f) for x, f in work if not f.done()]  # a waiter that gave up is not computed
        if not live:
            return True
        pairs = self._run_batch(live)
        if self._executor is None:
            deliver(pairs)
        else:
            try:
                assert self._loop is not None
                self._loop.call_soon_threadsafe(deliver, pairs)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                return False
        if self._after_delivery:
            try:
                self._after_delivery()
            except Exception:  # e.g. a cache write: never stops the model
                logger.exception("after_delivery hook failed")
        return True

    def _run_batch(self, live: list[Item[T, R]]) -> list[Delivery]:
        """``fn`` over the batch: each waiter's result, or the batch's error for every waiter."""
        t0 = time.perf_counter()
        self._running = True
        try:
            results = self._fn([x for x, _ in live])
            pairs: list[Delivery] = [(f, r, None) for (_, f), r in zip(live, results, strict=True)]
        except Exception as exc:  # the whole batch failed: every waiter gets the error
            logger.debug("batch of %d failed: %s", len(live), exc)
            pairs = [(f, None, exc) for _, f in live]
        finally:
            self._running = False
        if self._on_batch:
            try:
                self._on_batch(len(live), time.perf_counter() - t0)
            except Exception:  # a metrics hook never stops the model
                logger.exception("on_batch hook failed")
        return pairs


def _complete(fut: Future[R], fn: Callable[[], R]) -> None:
    """``fn``'s result, or the exception it raised, into ``fut`` (unless its caller cancelled it)."""
    if fut.set_running_or_notify_cancel():
        try:
            fut.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            fut.set_exception(exc)


def _run_now(fn: Callable[[], R]) -> Future[R]:
    """``fn`` run here and now, as a finished `Future`."""
    fut: Future[R] = Future()
    _complete(fut, fn)
    return fut
