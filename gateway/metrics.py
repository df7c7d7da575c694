"""Prometheus metrics of one gateway process (its own registry, so tests can run several)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from heron.runtime.loop_histogram import LoopHistogram
from heron.runtime.metric_children import MetricChildren

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10,
                    30)
# A request's phases in the order they happen: the gateway's own (coalesce, for a request
# that shared its work item with others; publish, queue_wait) then the worker's, as the
# slice that answered last reported them (the work result's "timings").
PHASES = ("coalesce", "publish", "queue_wait", "tokenize", "batch_wait", "inference",
          "postprocess")
# Requests per shared work item (gateway/coalescing.py)
_GROUP_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
# Workers older than the phase timings reported the batcher wait as "queue": read it
# during a rolling upgrade.
_LEGACY_PHASES = {"queue": "batch_wait"}


class GatewayMetrics(MetricChildren):
    def __init__(self) -> None:
        super().__init__()
        self.registry = CollectorRegistry()
        self._phase_children: dict[str, dict[str, Any]] = {}  # model -> phase -> child
        r = self.registry
        self.requests = Counter("heron_gateway_requests_total",
                                "Requests by route, model and status",
                                ["route", "model", "status"], registry=r)
        # Observed eight or nine times a request, on the event loop: lock-free counts
        # (heron.runtime.loop_histogram), the same series as prometheus_client's.
        self.latency = LoopHistogram("heron_gateway_request_duration_seconds",
                                     "Request latency", ["route", "model"],
                                     buckets=_LATENCY_BUCKETS, registry=r)
        self.phase = LoopHistogram("heron_gateway_phase_duration_seconds",
                                   "Time per phase of a successful request (coalesce, publish, "
                                   "queue_wait, tokenize, batch_wait, inference, postprocess)",
                                   ["phase", "model"], buckets=_LATENCY_BUCKETS, registry=r)
        self.coalesced = Histogram("heron_gateway_coalesced_requests",
                                   "Requests that shared one work item (small encode and "
                                   "extract requests of one model and options)", ["pool"],
                                   buckets=_GROUP_BUCKETS, registry=r)
        self.coalesced_resent = Counter("heron_gateway_coalesced_resent_total",
                                        "Requests sent again in a new work item because a "
                                        "request they shared one with failed on its input",
                                        ["pool"], registry=r)
        self.work_items = Counter("heron_gateway_work_items_published_total",
                                  "Work items published to JetStream", ["pool"], registry=r)
        self.outstanding = Gauge("heron_gateway_outstanding_items",
                                 "Items published to the pool and not answered yet", ["pool"],
                                 registry=r)
        self.refused = Counter("heron_gateway_admission_refused_total",
                               "Requests refused 429 because they could not finish within "
                               "their deadline at the pool's measured rate, or past its "
                               "backlog bound", ["pool"], registry=r)
        self.publish_retries = Counter("heron_gateway_publish_retries_total",
                                       "JetStream publishes tried again (leader election, "
                                       "NATS reconnecting) that then succeeded", ["pool"],
                                       registry=r)
        self.pending_demand = Gauge("heron_gateway_pending_demand",
                                    "Requests answered 202 (no healthy worker) in the trailing "
                                    "demand window", ["pool"], registry=r)
        self.healthy_workers = Gauge("heron_gateway_healthy_workers",
                                     "Workers whose last heartbeat is recent and ready",
                                     ["pool"], registry=r)
        self.ignored_results = Counter("heron_gateway_results_ignored_total",
                                       "Results dropped: duplicate (redelivered work), "
                                       "unknown (request already answered or expired), "
                                       "malformed", ["reason"], registry=r)
        self.nats_connected = Gauge("heron_gateway_nats_connected",
                                    "1 while connected to NATS", registry=r)
        self.config_epoch = Gauge("heron_gateway_config_epoch",
                                  "Config epoch this gateway has applied (with --config)",
                                  registry=r)

    def observe_phases(self, model: str, phases: Mapping[str, float]) -> None:
        """One request's phases (phase -> seconds) into ``phase``. Its children are kept
        per model, one lookup a request instead of one a phase (seven a request)."""
        children = self._phase_children.get(model)
        if children is None:
            children = self._phase_children[model] = {}
        for phase, seconds in phases.items():
            child = children.get(phase)
            if child is None:
                child = children[phase] = self.phase.labels(phase, model)
            child.observe(seconds)

    def forget_pool(self, pool: str) -> None:
        """Drop a pool's per-pool series (a lease ended): a gone pool shows no demand."""
        for gauge in (self.pending_demand, self.healthy_workers):
            with contextlib.suppress(KeyError):
                gauge.remove(pool)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def gateway_phases(timings: Mapping[str, float]) -> dict[str, float]:
    """The phases of ``timings`` (a Reassembly's: the gateway's and the last slice's)
    that a request reports, in ``PHASES`` order; missing ones are left out."""
    named = {_LEGACY_PHASES.get(k, k): v for k, v in timings.items()}
    return {phase: named[phase] for phase in PHASES if phase in named}
