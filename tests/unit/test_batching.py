"""The micro-batcher gathers concurrent submissions into one call and bounds its queue."""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from service.batching import MicroBatcher, QueueFull


def test_concurrent_items_share_one_call():
    calls: list[list[int]] = []

    def fn(items):
        calls.append(list(items))
        return [x * 10 for x in items]

    async def main():
        b = MicroBatcher(fn, executor=ThreadPoolExecutor(1), max_batch_size=8, max_wait_ms=50, max_queue=100)
        b.start()
        results = await asyncio.gather(*(b.submit(i) for i in range(5)))
        await b.stop()
        return results

    assert asyncio.run(main()) == [0, 10, 20, 30, 40]
    assert calls == [[0, 1, 2, 3, 4]]


def test_full_queue_refuses_at_once_and_errors_reach_every_waiter():
    gate = threading.Event()

    def slow(items):
        gate.wait(5)
        if any(x < 0 for x in items):
            raise ValueError("bad item")
        return list(items)

    async def main():
        b = MicroBatcher(slow, executor=ThreadPoolExecutor(1), max_batch_size=1, max_wait_ms=0, max_queue=2)
        b.start()
        first = asyncio.ensure_future(b.submit(1))
        await asyncio.sleep(0.05)  # 1 is running; the queue (2) can take two more
        queued = [asyncio.ensure_future(b.submit(2)), asyncio.ensure_future(b.submit(-1))]
        await asyncio.sleep(0.01)
        with pytest.raises(QueueFull):
            await b.submit(4)
        gate.set()
        assert await first == 1
        assert await queued[0] == 2
        with pytest.raises(ValueError, match="bad item"):
            await queued[1]
        await b.stop()

    asyncio.run(main())
