"""Micro-batching: concurrent requests are gathered for a few milliseconds into one forward pass.

The queue is bounded: when it is full, `submit` raises `QueueFull` at once (the API answers 503 with
Retry-After) instead of letting latency and memory grow without limit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor
from typing import Generic, TypeVar

logger = logging.getLogger(__name__)
T = TypeVar("T")
R = TypeVar("R")


class QueueFull(Exception):
    """The batching queue is full; retry later."""


class MicroBatcher(Generic[T, R]):
    def __init__(
        self,
        fn: Callable[[Sequence[T]], Sequence[R]],
        *,
        executor: Executor,
        max_batch_size: int = 32,
        max_wait_ms: float = 2.0,
        max_queue: int = 256,
        on_batch: Callable[[int, float], None] | None = None,
    ):
        self._fn = fn
        self._executor = executor
        self.max_batch_size = max_batch_size
        self.max_wait_s = max_wait_ms / 1000.0
        self._queue: asyncio.Queue[tuple[T, asyncio.Future[R]]] = asyncio.Queue(maxsize=max_queue)
        self._task: asyncio.Task[None] | None = None
        self._on_batch = on_batch
        self._busy = False

    @property
    def depth(self) -> int:
        return self._queue.qsize()

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name="micro-batcher")

    async def stop(self) -> None:
        """Finish what is queued, then stop."""
        if self._task is None:
            return
        while not self._queue.empty() or self._busy:
            await asyncio.sleep(0.005)
        self._task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
        self._task = None

    async def submit(self, item: T) -> R:
        if self._task is None:
            raise RuntimeError("MicroBatcher.start() was not called")
        fut: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        try:
            self._queue.put_nowait((item, fut))
        except asyncio.QueueFull:
            raise QueueFull(f"{self._queue.maxsize} queries are already waiting") from None
        return await fut

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            self._busy = False
            first = await self._queue.get()
            self._busy = True
            batch = [first]
            # Continuous batching: whatever queued up while the model was busy joins this batch at once; an
            # idle model starts immediately unless max_wait_ms asks it to wait for company.
            deadline = loop.time() + self.max_wait_s
            while len(batch) < self.max_batch_size:
                timeout = deadline - loop.time()
                if timeout <= 0:
                    # take whatever is already queued without waiting
                    try:
                        batch.append(self._queue.get_nowait())
                        continue
                    except asyncio.QueueEmpty:
                        break
                try:
                    batch.append(await asyncio.wait_for(self._queue.get(), timeout))
                except TimeoutError:
                    break
            live = [(x, f) for x, f in batch if not f.done()]
            if not live:
                continue
            t0 = time.perf_counter()
            try:
                results = await loop.run_in_executor(self._executor, self._fn, [x for x, _ in live])
            except Exception as exc:  # the whole batch failed: every waiter gets the error
                for _, f in live:
                    if not f.done():
                        f.set_exception(exc)
                continue
            if self._on_batch:
                self._on_batch(len(live), time.perf_counter() - t0)
            for (_, f), r in zip(live, results, strict=True):
                if not f.done():
                    f.set_result(r)
