"""Prometheus metrics of one config service process (its own registry, so tests can run
several in one process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest


class ConfigMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.epoch = Gauge("heron_config_epoch", "The store's config epoch as this instance "
                           "has read it", registry=r)
        self.is_leader = Gauge("heron_config_is_leader",
                               "1 while this instance holds the writer lease and accepts "
                               "writes", registry=r)
        self.leader_changes = Counter("heron_config_leader_changes_total",
                                      "Writer lease acquisitions and losses", registry=r)
        self.models = Gauge("heron_config_models", "Models known (bundles dir and posted)",
                            registry=r)
        self.posts = Counter("heron_config_posts_total",
                             "POST /v1/configs/models answers by status", ["status"],
                             registry=r)
        self.deltas = Counter("heron_config_deltas_published_total",
                              "Delta messages published to JetStream (one per subject)",
                              registry=r)
        self.unpublished = Gauge("heron_config_unpublished_changes",
                                 "Committed changes whose deltas are not out yet", registry=r)
        self.publish_errors = Counter("heron_config_publish_errors_total",
                                      "Delta publishes that failed (retried)", registry=r)
        self.store_errors = Counter("heron_config_store_errors_total",
                                    "Store reads or writes that failed", ["op"], registry=r)
        self.nats_connected = Gauge("heron_config_nats_connected", "1 while connected to NATS",
                                    registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
