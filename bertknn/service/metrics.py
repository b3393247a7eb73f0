"""Prometheus metrics, one registry per app (tests can build several apps in one process); with several server
processes, prometheus_client's multiprocess mode sums them (`bertknn.service.processes`)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector

from bertknn.service.cache import Cache

if TYPE_CHECKING:
    from bertknn.service.results import Answer

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10)


class _CacheCollector(Collector):
    def __init__(self, cache: Cache):
        self.cache = cache

    def collect(self):  # type: ignore[no-untyped-def]
        stats = getattr(self.cache, "stats", None)
        counters = CounterMetricFamily("bertknn_cache_events", "cache lookups and failures", labels=["event"])
        if stats is not None:
            for event in ("hits", "misses", "errors", "corrupt", "bypassed"):
                counters.add_metric([event], getattr(stats, event))
        yield counters
        state = GaugeMetricFamily("bertknn_cache_degraded", "1 while the cache is bypassed after errors")
        state.add_metric([], 1.0 if self.cache.status().state == "degraded" else 0.0)
        yield state
        ratio = GaugeMetricFamily("bertknn_cache_hit_ratio", "hits / (hits + misses) since start")
        if stats is not None:
            total = stats.hits + stats.misses
            ratio.add_metric([], stats.hits / total if total else 0.0)
        yield ratio


_CACHE_EVENTS = ("hits", "misses", "errors", "corrupt", "bypassed")


class Metrics:
    """The service's metrics. ``shared_dir``: the workers' multiprocess folder (its environment variable was set
    before prometheus_client was imported); `exposition` then reads every worker's values, summed."""

    def __init__(self, shared_dir: Path | None = None) -> None:
        self.shared_dir = shared_dir
        self.registry = CollectorRegistry()
        self._cache: Cache | None = None
        self._synced = dict.fromkeys(_CACHE_EVENTS, 0)
        self._request_series: dict[tuple[str, int], tuple[Any, Any, Any]] = {}  # (`observe_request`)
        self._stage_series: dict[str, Any] = {}
        # several processes: the gauges are summed over the live ones (the default would list them per process)
        self.requests = Counter(
            "bertknn_requests", "HTTP requests", ["path", "status"], registry=self.registry
        )
        self.errors = Counter("bertknn_errors", "error responses by code", ["code"], registry=self.registry)
        self.latency = Histogram(
            "bertknn_request_seconds", "request latency", ["path"], buckets=_LATENCY_BUCKETS, registry=self.registry
        )
        self.stage = Histogram(
            "bertknn_stage_seconds", "pipeline stage latency", ["stage"], buckets=_LATENCY_BUCKETS, registry=self.registry
        )
        self.batch_size = Histogram(
            "bertknn_batch_size", "queries per forward pass", buckets=(1, 2, 4, 8, 16, 32, 64, 128), registry=self.registry
        )
        self.queue_depth = Gauge(
            "bertknn_queue_depth", "queries waiting for the model", registry=self.registry, multiprocess_mode="livesum"
        )
        self.knn_skipped = Counter(
            "bertknn_knn_skipped", "adaptive queries answered by the MLM alone (no retrieval, no kNN)",
            registry=self.registry,
        )
        self.unvoted = Counter(
            "bertknn_unvoted", "answers the model gave alone though their kNN search ran, by why no stored context "
            "voted: no article matched the question (no_article), or those searched hold none (no_context)",
            ["reason"], registry=self.registry,
        )  # fmt: skip
        self.knn_on_device = Counter(
            "bertknn_knn_on_device", "questions whose restricted kNN ran on the model's device (model.knn_device: "
            "model): searched, or failed there and searched on the host", ["outcome"], registry=self.registry,
        )  # fmt: skip
        self.vote_on_device = Counter(
            "bertknn_vote_on_device", "questions whose vote, interpolation and top-k ran on the model's device "
            "(model.vote_device: model): voted, or failed there and voted on the host", ["outcome"],
            registry=self.registry,
        )  # fmt: skip
        self.knn_device_rows = Gauge(
            "bertknn_knn_device_rows", "datastore rows kept on the model's device for the kNN there "
            "(model.knn_device_rows; with several processes, summed: each keeps its own)",
            registry=self.registry, multiprocess_mode="livesum",
        )  # fmt: skip
        self.ready = Gauge(
            "bertknn_ready", "1 when the service is ready (with several processes: how many are)",
            registry=self.registry, multiprocess_mode="livesum",
        )  # fmt: skip
        if shared_dir:
            self.cache_events = Counter(
                "bertknn_cache_events", "cache lookups and failures", ["event"], registry=self.registry
            )
            self.cache_degraded = Gauge(
                "bertknn_cache_degraded", "1 while the cache is bypassed after errors (in any process)",
                registry=self.registry, multiprocess_mode="livemax",
            )  # fmt: skip
            _forget_dead(shared_dir)

    def observe_request(self, path: str, status: int, seconds: float) -> None:
        """One HTTP request: counted by route and status, its latency by route, an error response by status. The
        labelled series are looked up once per (route, status) and kept (prometheus_client's ``labels`` checks
        and locks on every call); routes are templates and ``unmatched``, so the pairs are few."""
        series = self._request_series.get((path, status))
        if series is None:
            series = (self.requests.labels(path, str(status)), self.latency.labels(path),
                      self.errors.labels(str(status)) if status >= 400 else None)  # fmt: skip
            self._request_series[(path, status)] = series
        series[0].inc()
        series[1].observe(seconds)
        if series[2] is not None:
            series[2].inc()

    def observe_answer(self, answer: Answer) -> None:
        """One answer: whether its kNN was skipped or ran without a context to vote (and why), its stages."""
        if answer.knn_skipped:
            self.knn_skipped.inc()
        if answer.unvoted is not None:
            self.unvoted.labels(answer.unvoted).inc()
        self.observe_stages(answer.timings_ms)

    def observe_stages(self, timings_ms: dict[str, float]) -> None:
        """A request's stage timings (ms; ``total`` is the request's, counted by `observe_request`)."""
        for name, ms in timings_ms.items():
            if name != "total":
                child = self._stage_series.get(name)
                if child is None:
                    child = self._stage_series[name] = self.stage.labels(name)
                child.observe(ms / 1000.0)

    def watch_cache(self, cache: Cache) -> None:
        if self.shared_dir:
            self._cache = cache  # its counts are copied into `cache_events` (`sync`)
        else:
            self.registry.register(_CacheCollector(cache))

    def sync(self) -> None:
        """Several processes: this one's cache counts into the shared counters (what grew since the last sync)."""
        if not self.shared_dir or self._cache is None:
            return
        self.cache_degraded.set(1.0 if self._cache.status().state == "degraded" else 0.0)
        stats = getattr(self._cache, "stats", None)
        if stats is None:
            return
        for event in _CACHE_EVENTS:
            now = getattr(stats, event)
            if now > self._synced[event]:
                self.cache_events.labels(event).inc(now - self._synced[event])
                self._synced[event] = now

    def exposition(self) -> bytes:
        """The text /metrics answers: this process's metrics, or with several processes all of theirs, summed."""
        if not self.shared_dir:
            return generate_latest(self.registry)
        self.sync()
        registry = CollectorRegistry()
        MultiProcessCollector(registry, path=str(self.shared_dir))
        return generate_latest(registry)


def _forget_dead(shared_dir: Path) -> None:
    """The live gauges of processes that are gone (a worker killed and replaced) no longer count."""
    for path in shared_dir.glob("gauge_live*_*.db"):
        pid = int(path.stem.rsplit("_", 1)[1])
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            mark_process_dead(pid, str(shared_dir))
        except PermissionError:
            pass
