"""Prometheus metrics of one worker process (its own registry, so tests can run several)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from worker.runner import BatchStats

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                    30)


class WorkerMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("heron_worker_requests_total", "Requests by route, model and "
                                "status", ["route", "model", "status"], registry=r)
        self.latency = Histogram("heron_worker_request_duration_seconds", "Request latency",
                                 ["route", "model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.phase = Histogram("heron_worker_phase_duration_seconds", "Time per phase "
                               "(tokenize, queue, inference)", ["phase", "model"],
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
        self.queue_depth = Gauge("heron_worker_queue_items", "Items waiting per model",
                                 ["model"], registry=r)
        self.models_loaded = Gauge("heron_worker_models_loaded", "Models loaded and ready",
                                   registry=r)

    def observe_batch(self, model: str, stats: BatchStats) -> None:
        self.items.labels(model).inc(stats.items)
        self.batch_items.labels(model).observe(stats.items)
        self.batch_tokens.labels(model).observe(stats.padded_tokens)
        self.padding_ratio.labels(model).observe(stats.padded_tokens / max(1, stats.real_tokens))

    def render(self) -> bytes:
        return generate_latest(self.registry)
