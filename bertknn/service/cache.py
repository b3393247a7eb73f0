"""Caches for the expensive parts: the Cache protocol, RedisCache and InMemoryCache (the embedded default).

Keys are ``{prefix}:{kind}:{sha256 of the parts}``: nothing from a request reaches a Redis command except
inside a fixed-length hex digest. Values are checked on read (see `bertknn.service.codec`); a bad value is a miss.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

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
    """A bounded LRU in this process: the default when no Redis URL is set."""

    in_process = True

    def __init__(self, max_items: int = 4096):
        self.max_items = max_items
        self._data: OrderedDict[str, bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.stats = CacheStats()

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        out: list[bytes | None] = []
        with self._lock:
            for key in keys:
                value = self._data.get(key)
                if value is not None:
                    self._data.move_to_end(key)
                out.append(value)
        return out

    def set_many(self, items: dict[str, bytes]) -> None:
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


class RedisCache:
    """Redis with short timeouts, no retries and a circuit breaker: a sick Redis costs at most one timeout.

    After an error the cache is bypassed for ``backoff_s`` (doubling up to ``max_backoff_s``); the next call
    after that probes Redis again. Requests never fail because of the cache.
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
        self._redis_errors = (redis.RedisError, OSError)
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
            values = self._client.mget(list(keys))
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
        try:
            pipe = self._client.pipeline(transaction=False)
            for key, value in items.items():
                pipe.set(key, value, ex=self.ttl_s)
            pipe.execute()
        except self._redis_errors as exc:
            self._failed(exc)
            return
        self._succeeded()

    def ping(self) -> bool:
        try:
            ok = bool(self._client.ping())
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
