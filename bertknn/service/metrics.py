"""Prometheus metrics, one registry per app (tests can build several apps in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from bertknn.service.cache import Cache

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


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
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
        self.queue_depth = Gauge("bertknn_queue_depth", "queries waiting for the model", registry=self.registry)
        self.knn_skipped = Counter(
            "bertknn_knn_skipped", "adaptive queries answered by the MLM alone (no retrieval, no kNN)",
            registry=self.registry,
        )
        self.ready = Gauge("bertknn_ready", "1 when the service is ready", registry=self.registry)

    def watch_cache(self, cache: Cache) -> None:
        self.registry.register(_CacheCollector(cache))
