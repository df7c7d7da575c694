"""Every limit and timeout of one gateway process: a frozen dataclass whose fields are the
flags of ``heron gateway`` and HERON_GATEWAY_* variables (heron.runtime.settings; the
reference table in docs/operations.md is checked against it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from heron.runtime.settings import InferenceServerSettings, setting
from heron_sdk.types import MAX_BODY_BYTES

# Work item size bounds; heron.runtime.nats_names holds the same numbers
# (tests/unit/test_settings.py checks). NATS max_payload bounds bytes as well.
MAX_ITEMS_PER_WORK_ITEM = 64
MAX_TOKENS_PER_WORK_ITEM = 8192  # estimated at the gateway as characters / 4

# A shared work item's items at most, by default: what a CPU worker fetches for one pass
# (its lookahead, worker/settings.py). The requests a pass answers come back together and
# were packed together again, so with up to 64 one worker's pass grew to 40-50 items
# (220-250 ms, the p99 at 64 clients) while the other ran small ones. Measured (MiniLM
# through heron up, 2 workers x 1 thread, interleaved A/B against 64): +5% requests/s at 32
# clients, +3% at 64 with p99 299-369 against 333-414 ms; 8 gave +3%/+2%; null model +2-4%.
COALESCE_MAX_ITEMS = 16


@dataclass(frozen=True, slots=True)
class GatewaySettings(InferenceServerSettings):
    """The gateway's knobs. The work stream's (``stream_*``, inherited) are shared with the
    workers, which declare the same streams; the HTTP API's (``default_model``,
    ``cors_origins``, inherited) are every inference server's."""

    env_prefix: ClassVar[str] = "HERON_GATEWAY_"

    default_timeout_s: float = setting(
        30.0, "Deadline of a request that sets no timeout_s: nothing waits forever", above=0)
    max_concurrent_requests: int = setting(
        1024, "Inference requests in flight on this gateway before 429 QUEUE_FULL", minimum=1)
    max_outstanding_items_per_pool: int = setting(
        4096, "Items published to a pool and not answered yet, on this gateway, before 429 "
              "QUEUE_FULL (a bigger request still goes when nothing waits)", minimum=1)
    admission_min_samples: int = setting(
        8, "Results per pool before the gateway trusts its throughput estimate for "
           "admission", minimum=1)
    admission_cold_rate_per_worker: float = setting(
        20.0, "Until a pool's rate is measured (admission_min_samples results), the items a "
              "second each healthy worker is assumed to compute, for admission by deadline "
              "(low: a burst into a cold pool is not admitted blind)", above=0)
    queue_full_retry_after_s: float = setting(
        1.0, "Retry-After of a 429 QUEUE_FULL for a full backlog or stream")
    max_body_bytes: int = setting(
        MAX_BODY_BYTES, "Largest request body, before 413 PAYLOAD_TOO_LARGE", minimum=1,
        size=True)
    max_items_per_work_item: int = setting(
        MAX_ITEMS_PER_WORK_ITEM, "Most items in one work item: a request is split into work "
                                 "items the pool's workers share", minimum=1)
    coalesce_max_items: int = setting(
        COALESCE_MAX_ITEMS, "Most items in a work item shared by concurrent small "
                                 "requests (encode, extract) of one model and options; a "
                                 "request of up to half this many may share (0 or 1: no "
                                 "coalescing)", minimum=0)
    coalesce_max_wait_s: float = setting(
        0.002, "Longest a small request waits for others to share its work item, while its "
               "pool is busy (none when the pool is idle); the wait adapts below it",
        minimum=0)
    max_tokens_per_work_item: int = setting(
        MAX_TOKENS_PER_WORK_ITEM, "Most tokens in one work item, estimated as characters / "
                                  "4 (a longer single text goes alone)", minimum=1)
    heartbeat_timeout_s: float = setting(
        3.0, "A worker counts as capacity while its last heartbeat (one a second) said ready "
             "and is this recent", above=0)
    # Right after start the gateway has heard no beats yet: it waits this long for one
    # before answering 202, so a restart of the gateway never looks like a cold pool.
    startup_grace_s: float = setting(
        1.5, "After connecting, how long to wait for a pool's first heartbeat before "
             "answering 202 (a restarted gateway never makes a warm pool look cold)")
    # After NATS comes back, a pool that was warm before waits this long for a beat: its
    # workers reconnect on their own schedule, and a loaded host took over 3 s in CI.
    reconnect_grace_s: float = setting(
        10.0, "After NATS comes back, how long a pool that had a healthy worker when the "
              "connection was lost waits for a heartbeat (within the request's deadline) "
              "before answering 202", minimum=0)
    provisioning_retry_after_s: float = setting(
        2.0, "Retry-After of a 202 (no healthy worker in the pool)")
    provisioning_estimate_s: float = setting(
        30.0, "How long a new worker takes to be ready: a 202's estimated_wait_s counts down "
              "from it")
    demand_window_s: float = setting(
        60.0, "The trailing window of 202 answers that heron_gateway_pending_demand{pool} "
              "counts (KEDA scales a pool to zero once it reads 0)", above=0)
    demand_publish_interval_s: float = setting(
        1.0, "At most one demand message per pool per this many seconds")
    publish_timeout_s: float = setting(
        2.0, "Wait for one JetStream publish acknowledgement", above=0)
    publish_retry_max_s: float = setting(
        10.0, "How long a JetStream publish is retried, with backoff, within the request's "
              "deadline, through a leader election (0: not retried)")
    nats_reconnect_wait_s: float = setting(
        2.0, "NATS away (the connection's node lost): how long a request waits for the client "
             "to reconnect, to this or another node, before 503 NATS_UNAVAILABLE "
             "(reconnecting to another node of a cluster took under a second on loopback)")
    connect_timeout_s: float = setting(
        2.0, "Timeout of one NATS connection attempt", above=0)
    nats_retry_after_s: float = setting(
        2.0, "Retry-After of a 503 NATS_UNAVAILABLE")
    shutdown_timeout_s: float = setting(
        30.0, "After SIGTERM, how long requests in flight may take to finish before the "
              "gateway closes their connections")
    # ---- bulk jobs (gateway/jobs.py, gateway/job_runner.py) ----
    job_roots: str | None = setting(
        None, "Local folders bulk jobs may read and write (file:// URIs), comma-separated; "
              "paths are resolved, symlinks followed, before they must be under one. none: "
              "no local paths (heron up allows its data dir)", env="HERON_JOB_ROOTS")
    job_buckets: str | None = setting(
        None, "S3 buckets bulk jobs may read and write (s3:// URIs), comma-separated; none: "
              "no buckets", env="HERON_JOB_BUCKETS")
    job_shard_rows: int = setting(
        256, "Rows of a bulk job's shard: a shard is one request's work and one part file "
             "(a new job keeps the value it was created with)", minimum=1, maximum=2048)
    job_priority: int = setting(
        10, "Priority of bulk jobs' work items (0 is the highest, interactive requests' "
            "default): workers take interactive work first")
    job_shards_in_flight: int = setting(
        2, "Shards of bulk jobs this gateway has in its pools at once, all jobs together: "
           "jobs fill idle capacity without filling the backlog", minimum=1)
    max_running_jobs: int = setting(
        4, "Bulk jobs this gateway runs at once; more wait (queued) for this or another "
           "gateway", minimum=1)
    job_lease_s: float = setting(
        10.0, "A bulk job's lease: its gateway renews it every third of this; a job whose "
              "gateway stopped renewing is taken over by another after it", minimum=1.0)
    job_shard_timeout_s: float = setting(
        120.0, "Deadline of one shard's request (a shard past it is sent again)", minimum=1.0)
    job_shard_attempts: int = setting(
        3, "Times a shard whose rows failed server-side (a worker lost) is computed before "
           "those rows are recorded as failed", minimum=1)
