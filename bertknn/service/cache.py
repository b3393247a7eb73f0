"""Caches for the expensive parts: the Cache protocol, RedisCache and InMemoryCache (the embedded default).

Keys are ``{prefix}:{kind}:{sha256 of the parts}``: nothing from a request reaches a Redis command except
inside a fixed-length hex digest. Values are checked on read (see `bertknn.service.codec`); a bad value is a miss.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import Literal, Protocol, TypeVar

from bertknn.core.libc import name_os_thread

T = TypeVar("T")

logger = logging.getLogger(__name__)

CacheState = Literal["ok", "degraded", "disabled"]


def cache_key(prefix: str, kind: str, *parts: object) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(repr(part).encode("utf-8"))
        h.update(b"\x1f")
    return f"{prefix}:{kind}:{h.hexdigest()}"


@dataclass(frozen=True)
class CacheStatus:
    backend: Literal["redis", "memory", "none"]
    state: CacheState
    detail: str = ""


class Cache(Protocol):
    # True: a look-up never waits on I/O, so the service may look up on its event loop and writes cost nothing
    # worth deferring; False: a network round trip (looked up with the batch, written after the answers)
    in_process: bool

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]: ...

    def set_many(self, items: dict[str, bytes]) -> None: ...

    def status(self) -> CacheStatus: ...

    def close(self) -> None: ...


class CacheStats:
    """Counters the metrics endpoint reads; thread-safe enough for monotonically increasing ints."""

    def __init__(self) -> None:
        self.hits = 0
        self.misses = 0
        self.errors = 0
        self.corrupt = 0
        self.bypassed = 0


class InMemoryCache:
    """A bounded LRU in this process: the default when no Redis URL is set.

    Besides bytes (`get_many`, as every cache), it keeps objects as they are (`get_objects`): a value that never
    leaves the process need not be encoded, checksummed and decoded again on every hit.
    """

    in_process = True

    def __init__(self, max_items: int = 4096):
        self.max_items = max_items
        self._data: OrderedDict[str, object] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = CacheStats()

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [v if isinstance(v, bytes) else None for v in self.get_objects(keys)]

    def set_many(self, items: dict[str, bytes]) -> None:
        self.set_objects(items)

    def get_objects(self, keys: Sequence[str]) -> list[object | None]:
        out: list[object | None] = []
        with self._lock:
            for key in keys:
                value = self._data.get(key)
                if value is not None:
                    self._data.move_to_end(key)
                out.append(value)
        return out

    def set_objects(self, items: Mapping[str, object]) -> None:
        if self.max_items <= 0:
            return
        with self._lock:
            for key, value in items.items():
                self._data[key] = value
                self._data.move_to_end(key)
            while len(self._data) > self.max_items:
                self._data.popitem(last=False)

    def status(self) -> CacheStatus:
        return CacheStatus("memory", "ok" if self.max_items > 0 else "disabled")

    def close(self) -> None:
        with self._lock:
            self._data.clear()


class _DeadlineRunner:
    """Runs calls on a few daemon threads and waits for each at most a deadline.

    The socket timeouts of the Redis client do not bound everything a call can wait on: resolving the host
    name (``getaddrinfo``) has no timeout, and a stopped container's name can take the resolver's retries
    (seconds) to fail. A call past its deadline is abandoned: it finishes on its own thread. When every thread
    still holds such a call, new calls are refused at once rather than queued, and daemon threads never hold
    up the process's exit.
    """

    def __init__(self, name: str, workers: int = 8):
        self._jobs: queue.SimpleQueue[tuple[Callable[[], object], Future[object]]] = queue.SimpleQueue()
        self._slots = threading.BoundedSemaphore(workers)  # at most one job per idle worker: none ever queues
        for i in range(workers):
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True).start()

    def _work(self) -> None:
        name_os_thread()
        while True:
            fn, fut = self._jobs.get()
            try:
                if fut.set_running_or_notify_cancel():
                    fut.set_result(fn())
            except BaseException as exc:  # handed to the waiting caller
                fut.set_exception(exc)
            finally:
                self._slots.release()

    def run(self, fn: Callable[[], T], deadline_s: float) -> T:
        """``fn()``'s result or exception; TimeoutError when it is not done in time or no thread is free."""
        if not self._slots.acquire(blocking=False):
            raise TimeoutError("every Redis I/O thread still waits on an earlier call")
        fut: Future[object] = Future()
        self._jobs.put((fn, fut))
        try:
            return fut.result(timeout=deadline_s)  # type: ignore[return-value]
        except FutureTimeout:
            raise TimeoutError(f"no answer from Redis within {deadline_s * 1000:.0f} ms") from None


class RedisCache:
    """Redis with short timeouts, no retries and a circuit breaker: a sick Redis costs at most one timeout.

    Every call runs on one I/O thread under a deadline (see `_DeadlineRunner`), so nothing the client waits on
    (a name that no longer resolves included) holds a request longer than that. After an error the cache is
    bypassed for ``backoff_s`` (doubling up to ``max_backoff_s``); the next call after that probes Redis again.
    Requests never fail because of the cache.
    """

    in_process = False

    def __init__(
        self,
        url: str,
        *,
        ttl_s: int = 86400,
        timeout_ms: int = 50,
        backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
    ):
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        timeout = timeout_ms / 1000.0
        self._client = redis.Redis.from_url(
            url,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
            health_check_interval=0,
        )
        self._redis_errors = (redis.RedisError, OSError)  # OSError covers TimeoutError from the runner
        # a round trip is at most a connect and a reply, each bounded by the timeout; the rest is slack for a
        # pipeline of writes and the thread hand-over
        self._deadline_s = 4 * timeout + 0.05
        self._runner = _DeadlineRunner("redis-io")
        self.ttl_s = ttl_s
        self._backoff_initial = backoff_s
        self._backoff = backoff_s
        self._max_backoff = max_backoff_s
        self._open_until = 0.0
        self._last_error = ""
        self._lock = threading.Lock()
        self.stats = CacheStats()

    def _available(self) -> bool:
        return time.monotonic() >= self._open_until

    def _failed(self, exc: Exception) -> None:
        with self._lock:
            self.stats.errors += 1
            self._last_error = f"{type(exc).__name__}: {exc}"[:200]
            self._open_until = time.monotonic() + self._backoff
            self._backoff = min(self._backoff * 2, self._max_backoff)
        logger.warning("redis cache error, bypassing for a while: %s", self._last_error)

    def _succeeded(self) -> None:
        if self._backoff != self._backoff_initial or self._open_until:
            with self._lock:
                self._backoff = self._backoff_initial
                self._open_until = 0.0
                self._last_error = ""

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        if not keys:
            return []
        if not self._available():
            self.stats.bypassed += 1
            return [None] * len(keys)
        try:
            values = self._runner.run(lambda: self._client.mget(list(keys)), self._deadline_s)
        except self._redis_errors as exc:
            self._failed(exc)
            return [None] * len(keys)
        self._succeeded()
        return [v if isinstance(v, bytes) else None for v in values]

    def set_many(self, items: dict[str, bytes]) -> None:
        if not items:
            return
        if not self._available():
            self.stats.bypassed += 1
            return

        def write() -> None:
            pipe = self._client.pipeline(transaction=False)
            for key, value in items.items():
                pipe.set(key, value, ex=self.ttl_s)
            pipe.execute()

        try:
            self._runner.run(write, self._deadline_s)
        except self._redis_errors as exc:
            self._failed(exc)
            return
        self._succeeded()

    def ping(self) -> bool:
        try:
            ok = bool(self._runner.run(self._client.ping, self._deadline_s))
        except self._redis_errors as exc:
            self._failed(exc)
            return False
        self._succeeded()
        return ok

    def status(self) -> CacheStatus:
        if self._open_until and not self._available():
            return CacheStatus("redis", "degraded", self._last_error)
        if self._open_until:
            return CacheStatus("redis", "degraded", f"recovering after: {self._last_error}")
        return CacheStatus("redis", "ok")

    def close(self) -> None:
        with contextlib.suppress(*self._redis_errors):
            self._client.close()


def count_hits(cache: Cache, hits: int, misses: int) -> None:
    stats = getattr(cache, "stats", None)
    if stats is not None:
        stats.hits += hits
        stats.misses += misses


def count_corrupt(cache: Cache) -> None:
    stats = getattr(cache, "stats", None)
    if stats is not None:
        stats.corrupt += 1
