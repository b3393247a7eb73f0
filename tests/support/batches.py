"""Queries answered as one forward batch: queued while the model thread is held, then released together."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Awaitable, Callable, Sequence

from bertknn.service.results import Answer, Query
from bertknn.service.serving import AsyncAnswerer


async def answer_as_one_batch(
    answerer: AsyncAnswerer, queries: Sequence[Query], *, before_release: Callable[[], Awaitable[None]] | None = None
) -> list[Answer]:
    """Each query's answer from a started ``answerer``, all of them in one batch: the model thread is held until
    every query waits for it (each must be new to the answerer's cache), then ``before_release`` runs, then the
    thread is let go."""
    gate, busy = threading.Event(), threading.Event()

    def hold() -> None:
        busy.set()
        gate.wait(10)

    blocker = answerer.batcher.call(hold)
    while not busy.is_set():
        await asyncio.sleep(0.001)
    pending = [asyncio.ensure_future(answerer.answer(q)) for q in queries]
    deadline = asyncio.get_running_loop().time() + 10
    while answerer.batcher.depth < len(queries):
        assert asyncio.get_running_loop().time() < deadline, "a query did not queue for the model (a cache hit?)"
        await asyncio.sleep(0.001)
    if before_release is not None:
        await before_release()
    gate.set()
    await asyncio.wrap_future(blocker)
    return list(await asyncio.gather(*pending))
