"""Prometheus metrics of one worker process (its own registry, so tests can run several).

``heron serve --workers N`` runs N processes behind one port; a scrape reaches one of them.
There, prometheus_client's multiprocess mode (``PROMETHEUS_MULTIPROC_DIR``, set by the
parent before it starts them) keeps every process's values in files, and ``render`` sums
them: a scrape of any process reports the whole server.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterator, Mapping

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector

from heron.runtime.metric_children import MetricChildren
from heron.worker.result_cache import CacheStats, ResultCache
from heron.worker.runner import BatchStats
from heron.worker.shared_results import SharedStats
from heron.worker.weight_stats import weight_cache_stats

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                    30)


class WorkerMetrics(MetricChildren):
    def __init__(self) -> None:
        super().__init__()
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("heron_worker_requests_total", "Requests by route, model and "
                                "status", ["route", "model", "status"], registry=r)
        self.latency = Histogram("heron_worker_request_duration_seconds", "Request latency",
                                 ["route", "model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.phase = Histogram("heron_worker_phase_duration_seconds", "Time per phase of a "
                               "successful request (tokenize, batch_wait, inference, "
                               "postprocess)", ["phase", "model"],
                               buckets=_LATENCY_BUCKETS, registry=r)
        self.items = Counter("heron_worker_items_total", "Items computed", ["model"],
                             registry=r)
        self.batch_items = Histogram("heron_worker_batch_items", "Items per batch", ["model"],
                                     buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256), registry=r)
        self.batch_tokens = Histogram("heron_worker_batch_padded_tokens",
                                      "Padded tokens per batch", ["model"],
                                      buckets=(64, 256, 1024, 2048, 4096, 8192, 16384, 32768),
                                      registry=r)
        self.padding_ratio = Histogram("heron_worker_batch_padding_ratio",
                                       "Padded / real tokens per batch", ["model"],
                                       buckets=(1.0, 1.05, 1.1, 1.25, 1.5, 2, 3, 5),
                                       registry=r)
        self.batch_seconds = Histogram("heron_worker_batch_inference_seconds",
                                       "Forward pass time per batch (collate, forward, "
                                       "postprocess)", ["model"], buckets=_LATENCY_BUCKETS,
                                       registry=r)
        # Across processes (--workers): queued items and memory add up; every process
        # loads the same models, so "loaded" is the largest count of any of them.
        self.queue_depth = Gauge("heron_worker_queue_items", "Items waiting per model",
                                 ["model"], registry=r, multiprocess_mode="livesum")
        self.models_loaded = Gauge("heron_worker_models_loaded", "Models loaded and ready",
                                   registry=r, multiprocess_mode="livemax")
        self.resident_bytes = Gauge("heron_worker_model_memory_bytes",
                                    "Weights and buffers of the loaded models", registry=r,
                                    multiprocess_mode="livesum")
        self.evictions = Counter("heron_worker_model_evictions_total",
                                 "Models unloaded, by reason (memory, budget, idle)",
                                 ["model", "reason"], registry=r)
        self.loads = Counter("heron_worker_model_loads_total",
                             "Model loads by result: loaded, retry (transient: memory, a "
                             "throttled store), failed (permanent)", ["model", "result"],
                             registry=r)
        self.load_seconds = Histogram("heron_worker_model_load_duration_seconds",
                                      "Time to load and warm a model", ["model"],
                                      buckets=(0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120,
                                               300), registry=r)
        self.redeliveries = Counter("heron_worker_redeliveries_total",
                                    "JetStream work messages received again (a worker died "
                                    "or ran past the ack wait)", ["pool"], registry=r)
        self.dead_letters = Counter("heron_worker_dead_letters_total",
                                    "Work messages moved to the dead-letter stream", ["pool"],
                                    registry=r)
        self.terminated_items = Counter(
            "heron_worker_terminated_items_total",
            "Queued items terminated because their gateway is gone (no responders on its "
            "inbox): computed=false were dropped unread, computed=true were computed for "
            "nobody (they were running when it went)", ["pool", "computed"], registry=r)
        self.config_epoch = Gauge("heron_worker_config_epoch",
                                  "Config epoch this worker has applied (cluster workers)",
                                  registry=r, multiprocess_mode="livemax")
        self.resident_memory = Gauge("heron_worker_resident_memory_bytes",
                                     "Resident memory of the worker process(es)", registry=r,
                                     multiprocess_mode="livesum")
        # The result cache (worker/result_cache.py): its counters are copied in by
        # ``observe_results`` (when gauges are set), so that processes' values add up.
        self.result_cache_items = Counter(
            "heron_worker_result_cache_items", "Cacheable items by result: hit (served from "
            "the cache), shared (served from the shared tier: another worker computed it), "
            "join (shared an identical item's computation in flight), miss (computed)",
            ["result"], registry=r)
        self.result_cache_evictions = Counter(
            "heron_worker_result_cache_evictions", "Result cache entries dropped: lru (for "
            "room, or emptied under memory pressure), invalidated (their model reloaded or "
            "its config changed)", ["reason"], registry=r)
        self.result_cache_bytes = Gauge("heron_worker_result_cache_bytes",
                                        "Bytes the result cache holds", registry=r,
                                        multiprocess_mode="livesum")
        self.result_cache_entries = Gauge("heron_worker_result_cache_entries",
                                          "Items the result cache holds", registry=r,
                                          multiprocess_mode="livesum")
        self.result_cache_shared = Counter(
            "heron_worker_result_cache_shared", "The result cache's shared tier (NATS KV), per "
            "item: lookups (hit, miss, error: no answer in time or NATS away, computed) and "
            "stores (stored, dropped: overload or not shareable, store_error)", ["result"],
            registry=r)
        self._results_seen = CacheStats()
        self._shared_seen = SharedStats()

        r.register(WeightCacheCollector())

    def observe_batch(self, model: str, stats: BatchStats) -> None:
        of = self.of
        of(self.items, model).inc(stats.items)
        of(self.batch_items, model).observe(stats.items)
        of(self.batch_tokens, model).observe(stats.padded_tokens)
        of(self.padding_ratio, model).observe(stats.padded_tokens / max(1, stats.real_tokens))
        of(self.batch_seconds, model).observe(stats.inference_s)

    def observe_phases(self, model: str, phases: Mapping[str, float]) -> None:
        for phase, seconds in phases.items():
            self.of(self.phase, phase, model).observe(seconds)

    def observe_eviction(self, model: str, reason: str) -> None:
        self.evictions.labels(model, reason).inc()

    def observe_load(self, model: str, result: str, seconds: float) -> None:
        self.loads.labels(model, result).inc()
        if result == "loaded":
            self.load_seconds.labels(model).observe(seconds)

    def observe_results(self, cache: ResultCache) -> None:
        """Bring the result cache's counters and size into the metrics."""
        now, seen = cache.stats, self._results_seen
        for label, name in (("hit", "hits"), ("shared", "shared"), ("join", "joins"),
                            ("miss", "misses")):
            delta = getattr(now, name) - getattr(seen, name)
            if delta:
                self.result_cache_items.labels(label).inc(delta)
        for label, name in (("lru", "evictions"), ("invalidated", "invalidated")):
            delta = getattr(now, name) - getattr(seen, name)
            if delta:
                self.result_cache_evictions.labels(label).inc(delta)
        self._results_seen = dataclasses.replace(now)
        if cache.shared is not None:
            tier, seen_tier = cache.shared.stats, self._shared_seen
            for label, name in (("hit", "hits"), ("miss", "misses"), ("error", "errors"),
                                ("stored", "stored"), ("dropped", "dropped"),
                                ("store_error", "store_errors")):
                delta = getattr(tier, name) - getattr(seen_tier, name)
                if delta:
                    self.result_cache_shared.labels(label).inc(delta)
            self._shared_seen = dataclasses.replace(tier)
        self.result_cache_bytes.set(cache.bytes)
        self.result_cache_entries.set(len(cache))

    def render(self) -> bytes:
        if not multiprocess_dir():
            return generate_latest(self.registry)
        merged = CollectorRegistry()
        multiprocess.MultiProcessCollector(merged)
        merged.register(WeightCacheCollector())  # this process's weight tiers
        return generate_latest(merged)


def multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or None


def mark_process_dead() -> None:
    """A process of a multiprocess worker is exiting: drop its live gauges."""
    if multiprocess_dir():
        multiprocess.mark_process_dead(os.getpid())


class WeightCacheCollector(Collector):
    """The weight tiers' counters (worker/weight_stats.py), read at scrape time."""

    def collect(self) -> Iterator[CounterMetricFamily]:
        stats = weight_cache_stats()
        for name, doc, values in (
                ("heron_worker_weight_cache_hits", "Weight resolutions served, by tier",
                 stats.hits),
                ("heron_worker_weight_cache_misses", "Tiers looked in without the model",
                 stats.misses),
                ("heron_worker_weight_cache_errors", "Tiers that failed to answer", stats.errors),
                ("heron_worker_weight_cache_downloaded_bytes", "Bytes fetched, by tier",
                 stats.downloaded_bytes)):
            family = CounterMetricFamily(name, doc, labels=["tier"])
            for tier, value in sorted(values.items()):
                family.add_metric([tier], value)
            yield family
        for name, doc, value in (
                ("heron_worker_weight_cache_evictions", "Local cache directories removed (LRU)",
                 stats.evictions),
                ("heron_worker_weight_cache_evicted_bytes", "Bytes removed from the local cache",
                 stats.evicted_bytes),
                ("heron_worker_weight_s3_uploads", "Read-through uploads to the S3 cache",
                 stats.s3_uploads),
                ("heron_worker_weight_s3_upload_failures", "Read-through uploads that failed",
                 stats.s3_upload_failures)):
            yield CounterMetricFamily(name, doc, value=value)
