"""Every knob of one gateway process, in one frozen dataclass with documented defaults."""

from __future__ import annotations

from dataclasses import dataclass, field

from heron.runtime.nats_names import (
    MAX_ITEMS_PER_WORK_ITEM,
    MAX_TOKENS_PER_WORK_ITEM,
    WorkStreamSpec,
    stream_replicas,
)


@dataclass(frozen=True, slots=True)
class GatewaySettings:
    # A request without timeout_s still gets a deadline: nothing waits forever.
    default_timeout_s: float = 30.0
    # Items outstanding (published, not answered) per pool before 429 QUEUE_FULL.
    max_outstanding_items_per_pool: int = 4096
    queue_full_retry_after_s: float = 1.0
    # Worker health: a worker counts while ready and its last beat is this recent.
    heartbeat_timeout_s: float = 3.0
    # Right after start the gateway has heard no beats yet: wait this long for one before
    # answering 202, so a restart of the gateway never looks like a cold pool.
    startup_grace_s: float = 1.5
    # 202 provisioning: how soon to retry, and how long a new worker takes to be ready.
    provisioning_retry_after_s: float = 2.0
    provisioning_estimate_s: float = 30.0
    # heron_gateway_pending_demand{pool}: 202 answers in this trailing window.
    demand_window_s: float = 60.0
    # At most one demand message per pool per interval (autoscalers need a signal, not a flood).
    demand_publish_interval_s: float = 1.0
    # JetStream publish acks and NATS connection attempts: fail fast instead of hanging.
    publish_timeout_s: float = 2.0
    connect_timeout_s: float = 2.0
    nats_retry_after_s: float = 2.0
    # Work item size bounds (heron.runtime.nats_names defaults); NATS max_payload bounds
    # bytes as well.
    max_items_per_work_item: int = MAX_ITEMS_PER_WORK_ITEM
    max_tokens_per_work_item: int = MAX_TOKENS_PER_WORK_ITEM
    # How the gateway declares work streams when it starts first (workers use the same spec).
    stream_replicas: int = field(default_factory=stream_replicas)  # HERON_STREAM_REPLICAS
    stream_file_storage: bool = True

    def stream_spec(self, pool: str) -> WorkStreamSpec:
        return WorkStreamSpec(pool=pool, replicas=self.stream_replicas,
                              file_storage=self.stream_file_storage)
