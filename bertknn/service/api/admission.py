"""Each request under its deadline and admitted by its estimated cost (`bertknn.service.cost`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from fastapi import Request

from bertknn.core.errors import DeadlineExceeded
from bertknn.service.fair import client_var
from bertknn.service.resources import Resources

T = TypeVar("T")


def deadline_s(resources: Resources, asked_ms: int | None) -> float:
    """The request's deadline in seconds: the server's ``limits.deadline_ms``, or the request's when shorter."""
    server_ms = resources.settings.limits.deadline_ms
    return min(server_ms, asked_ms or server_ms) / 1000.0


def client_of(request: Request, resources: Resources) -> str:
    """Who a request is from, for the per-client cap: the configured header, else the peer's address."""
    header = resources.settings.limits.client_header
    if header and (value := request.headers.get(header)):
        return f"h:{value[:128]}"
    return f"ip:{request.client.host if request.client else '-'}"


async def admitted(
    request: Request, resources: Resources, *, cost: int, what: str, seconds: float, work: Callable[[], Awaitable[T]]
) -> T:
    """Run ``work`` holding ``cost`` rows of the gate, under a deadline of ``seconds``.

    Past the deadline the request's task is cancelled: its queries still queued for the model are dropped (the
    batcher skips a waiter that gave up) and work already on other threads stops before its next forward pass
    (the queries carry the same deadline)."""
    client = client_of(request, resources)
    client_var.set(client)  # the fair queues' turns (this request's task and the tasks it starts)
    with resources.gate.admit(client, cost, what):
        try:
            async with asyncio.timeout(seconds) as scope:
                return await work()
        except TimeoutError:
            if not scope.expired():
                raise
            raise DeadlineExceeded(
                f"the request ran past its deadline of {seconds * 1000:.0f} ms and was stopped; retry after the "
                "Retry-After delay, or ask for less (smaller k, fewer queries, fewer hops or a smaller beam)"
            ) from None


def monotonic_deadline(seconds: float) -> float:
    """The `time.monotonic` time a query's forward passes must start before."""
    return time.monotonic() + seconds
