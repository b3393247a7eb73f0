"""Which datastore version each request holds, so that a live reload releases the old one only when it is free."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Generic, TypeVar

P = TypeVar("P")


class Leases(Generic[P]):
    """Requests in flight per pipeline (event-loop side only).

    A reload installs a new pipeline; requests already holding the old one finish on it, and the old one is
    released only after `drained` says its last lease ended."""

    def __init__(self) -> None:
        self._held: dict[int, int] = {}  # id(pipeline) -> requests holding it
        self._drained: dict[int, asyncio.Event] = {}

    @contextmanager
    def hold(self, pipeline: P) -> Iterator[P]:
        """``pipeline``, held for the length of one request."""
        key = id(pipeline)
        self._held[key] = self._held.get(key, 0) + 1
        try:
            yield pipeline
        finally:
            left = self._held[key] - 1
            if left:
                self._held[key] = left
            else:
                del self._held[key]
                event = self._drained.pop(key, None)
                if event is not None:
                    event.set()

    def in_flight(self, pipeline: P) -> int:
        return self._held.get(id(pipeline), 0)

    async def drained(self, pipeline: P, timeout_s: float) -> bool:
        """Wait until no request holds ``pipeline``; False if some still do after ``timeout_s``."""
        if id(pipeline) not in self._held:
            return True
        event = self._drained.setdefault(id(pipeline), asyncio.Event())
        try:
            await asyncio.wait_for(event.wait(), timeout_s)
        except TimeoutError:
            return False
        return True
