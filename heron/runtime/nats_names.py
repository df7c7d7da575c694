"""The one source of truth for Heron's NATS names, headers and stream definitions.

The messages that travel on these subjects are typed classes in heron.runtime.protocol.

Gateway, worker and config service read every subject, stream, consumer, header and
bucket name from here, and declare streams and consumers through ``ensure_work_stream`` so
that whichever side starts first creates them, identically.
"""

from __future__ import annotations

import enum
import functools
import os
import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DiscardPolicy,
    KeyValueConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)
from nats.js.errors import BucketNotFoundError, NotFoundError
from nats.js.kv import KeyValue

# ---- subjects and names ------------------------------------------------------------------
WORK_STREAM_PREFIX = "HERON_WORK_"
DLQ_STREAM = "HERON_DLQ"
CONFIG_STREAM = "HERON_CONFIG"
POOLS_BUCKET = "heron_pools"  # KV: key <pool> = a PoolLease (sdk/pools.py), per-key TTL
# How long the server keeps the marker it writes when a lease's TTL runs out (and how long
# a DELETE's purge marker lives): watchers see the marker at once; it only has to outlive
# a watcher's reconnect, and then it goes too, so ended leases leave nothing behind.
POOLS_MARKER_TTL_S = 60.0
# KV: key <model>.<scope>.<item> = one model output (worker/shared_results.py): the result
# cache's shared tier, declared by the workers that turn it on (ensure_results_bucket).
RESULTS_BUCKET = "heron_results"
STATUS_WILDCARD = "heron.status.>"
DEMAND_WILDCARD = "heron.demand.>"
INBOX_ROOT = "_INBOX.heron"

_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")


def token(name: str) -> str:
    """A subject-safe token for a pool, model or worker name (lossy: the real name always
    travels in the message body; tokens only route)."""
    safe = _UNSAFE.sub("_", name).strip("_")
    if not safe:
        raise ValueError(f"{name!r} has no subject-safe characters")
    return safe


def work_stream(pool: str) -> str:
    return f"{WORK_STREAM_PREFIX}{token(pool)}"


class Lane(enum.Enum):
    """The lanes of a pool's stream, in the order a worker serves them. Each has its subjects
    and its durable consumer; the stream is first in, first out per consumer, so one lane's
    work queued ahead of another's held it back for as long as it took: in one lane, a bulk
    job's items gave interactive p99 x11 to x18 at 8 clients (bench/job_bench.py), and a
    flood of priority-1 requests left priority 0's p99 at 0.64 of theirs
    (bench/priority_bench.py). A worker fetches a lane only while it holds no work of the
    lanes before it that waits for a forward pass (worker/fetching.py)."""

    FIRST = ""  # priority 0, the default: heron.work.<pool>.<model>
    LOW = "low"  # interactive requests of priority 1 and up: heron.work.<pool>.low.<model>
    BULK = "bulk"  # bulk jobs' shards: heron.work.<pool>.bulk.<model>

    @property
    def label(self) -> str:
        """Its name in heartbeats (WorkerHeartbeat.lanes): first, low, bulk."""
        return self.name.lower()


def lane_of(priority: int, bulk: bool = False) -> Lane:
    """The lane a work item of ``priority`` goes on (``bulk``: a bulk job's shard)."""
    if bulk:
        return Lane.BULK
    return Lane.FIRST if priority <= 0 else Lane.LOW


# The filters are disjoint, as a work-queue stream requires of its consumers: the first
# lane's subjects have 4 tokens, the others' 5 (a model named "low" or "bulk" is
# heron.work.<pool>.low, in the first lane).
@functools.lru_cache(maxsize=1024)  # per request on a gateway; pools and models are few
def work_subject(pool: str, model: str, lane: Lane = Lane.FIRST) -> str:
    return f"{_lane_prefix(pool, lane)}{token(model)}"


def _lane_prefix(pool: str, lane: Lane) -> str:
    """``heron.work.<pool>.`` and the lane's token (the first lane has none)."""
    infix = f"{lane.value}." if lane.value else ""
    return f"heron.work.{token(pool)}.{infix}"


def work_subjects(pool: str) -> str:
    """Every subject of the pool's stream, every lane."""
    return f"heron.work.{token(pool)}.>"


def lane_subjects(pool: str, lane: Lane) -> str:
    return f"{_lane_prefix(pool, lane)}*"


def lane_consumer(pool: str, lane: Lane) -> str:
    """The durable pull consumer of one lane, shared by every worker of the pool."""
    return f"{_CONSUMER_PREFIX[lane]}_{token(pool)}"


_CONSUMER_PREFIX = {Lane.FIRST: "workers", Lane.LOW: "low", Lane.BULK: "bulk"}


def work_consumer(pool: str) -> str:
    """The first lane's consumer (priority 0)."""
    return lane_consumer(pool, Lane.FIRST)


def bulk_consumer(pool: str) -> str:
    return lane_consumer(pool, Lane.BULK)


def dlq_subject(pool: str) -> str:
    return f"heron.dlq.{token(pool)}"


def status_subject(pool: str, worker_id: str) -> str:
    return f"heron.status.{token(pool)}.{token(worker_id)}"


def demand_subject(pool: str) -> str:
    return f"heron.demand.{token(pool)}"


def config_subject(bundle: str) -> str:
    return f"heron.config.models.{token(bundle)}"


CONFIG_ALL = "_all"  # every delta is also published here (gateways listen to it)
CONFIG_SUBJECTS = "heron.config.models.>"
CONFIG_LEADER_BUCKET = "heron_config_leader"  # KV: key "leader" = the writer's lease
CONFIG_LEADER_KEY = "leader"


def config_all_subject() -> str:
    return config_subject(CONFIG_ALL)


# Unique to this process. A gateway restarted with the same id (a fixed --gateway-id, a
# pod's name) gets a new inbox: workers that found its predecessor's inbox without
# responders, and drop the work still queued for it (heron.worker.gone_gateways), never
# drop the new process's work.
_PROCESS_INBOX_TOKEN = secrets.token_hex(4)


def inbox_prefix(gateway_id: str) -> str:
    """``_INBOX.heron.<gateway_id>.<process>``: the inbox of one gateway process."""
    return f"{INBOX_ROOT}.{token(gateway_id)}.{_PROCESS_INBOX_TOKEN}"


def reply_subject(gateway_id: str, request_id: str) -> str:
    return f"{inbox_prefix(gateway_id)}.{token(request_id)}"


def inbox_of(reply: str) -> str:
    """The inbox prefix (one gateway process) a reply subject belongs to."""
    return reply.rpartition(".")[0] or reply


# ---- headers of a work item ------------------------------------------------------------------
class Header:
    """Header names of a work item (heron.runtime.protocol.WorkItemHeaders)."""

    REQUEST_ID = "Heron-Request-Id"
    TASK = "Heron-Task"  # encode | score | extract | tokenize | decode
    MODEL = "Heron-Model"
    REPLY = "Heron-Reply"  # the gateway inbox for the result
    START = "Heron-Item-Start"  # index of the work item's first item in its request
    COUNT = "Heron-Item-Count"
    DEADLINE = "Heron-Deadline"  # unix seconds (float) after which the work is dropped
    PRIORITY = "Heron-Priority"
    TRACEPARENT = "traceparent"


# ---- stream and consumer definitions ----------------------------------------------------------
def stream_replicas() -> int:
    """Replicas of every stream and KV bucket Heron declares: HERON_STREAM_REPLICAS, 1 by
    default (one nats-server); 3 on a 3-node JetStream cluster (deploy/k8s sets it). Every
    process that declares a stream must see the same value (ensure_work_stream compares)."""
    return int(os.environ.get("HERON_STREAM_REPLICAS", "1"))


@dataclass(frozen=True, slots=True)
class WorkStreamSpec:
    """Everything a pool's work stream and its consumer are declared with."""

    pool: str
    replicas: int = field(default_factory=stream_replicas)
    file_storage: bool = True  # nothing queued is lost when NATS restarts
    max_age_s: float = 3600.0
    max_bytes: int = 1 << 30
    ack_wait_s: float = 5.0  # short: a dead worker's items come back within seconds
    max_deliver: int = 5
    max_ack_pending: int = 4096

    def stream_config(self) -> StreamConfig:
        return StreamConfig(
            name=work_stream(self.pool), subjects=[work_subjects(self.pool)],
            retention=RetentionPolicy.WORK_QUEUE, discard=DiscardPolicy.NEW,
            storage=StorageType.FILE if self.file_storage else StorageType.MEMORY,
            num_replicas=self.replicas, max_age=self.max_age_s, max_bytes=self.max_bytes)

    def consumer_config(self, lane: Lane = Lane.FIRST) -> ConsumerConfig:
        """The consumer of one lane."""
        return ConsumerConfig(
            durable_name=lane_consumer(self.pool, lane), ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self.ack_wait_s, max_deliver=self.max_deliver,
            max_ack_pending=self.max_ack_pending, filter_subject=lane_subjects(self.pool, lane))


class StreamMismatch(RuntimeError):
    """An existing stream was declared differently; Heron reports it instead of guessing."""


_COMPARED = ("subjects", "retention", "storage", "num_replicas", "max_age", "discard")


async def ensure_work_stream(js: JetStreamContext, spec: WorkStreamSpec) -> None:
    """Create the pool's stream and consumer if missing; fail loudly on a mismatch."""
    wanted = spec.stream_config()
    try:
        info = await js.stream_info(wanted.name)
    except NotFoundError:
        await js.add_stream(wanted)
    else:
        diffs = {f: (getattr(info.config, f), getattr(wanted, f)) for f in _COMPARED
                 if _norm(getattr(info.config, f)) != _norm(getattr(wanted, f))}
        if diffs:
            detail = ", ".join(f"{k}: has {have!r}, wanted {want!r}"
                               for k, (have, want) in diffs.items())
            raise StreamMismatch(f"stream {wanted.name} exists with other settings ({detail});"
                                 " delete it or align the configuration")
    # The first lane's first: a consumer declared before the other lanes existed filtered
    # every subject, which would overlap theirs (its filter is updated).
    for lane in Lane:
        await js.add_consumer(wanted.name, spec.consumer_config(lane))


async def ensure_dlq_stream(js: JetStreamContext, file_storage: bool = True) -> None:
    config = StreamConfig(name=DLQ_STREAM, subjects=["heron.dlq.>"],
                          retention=RetentionPolicy.LIMITS,
                          storage=StorageType.FILE if file_storage else StorageType.MEMORY,
                          max_age=7 * 24 * 3600.0, num_replicas=stream_replicas())
    try:
        await js.stream_info(DLQ_STREAM)
    except NotFoundError:
        await js.add_stream(config)


async def ensure_pools_bucket(js: JetStreamContext, replicas: int | None = None) -> KeyValue:
    """The ``heron_pools`` KV bucket, created if missing (idempotent): one value per key,
    file storage, and per-key TTLs whose expiry the server announces to watchers with a
    delete marker (``limit_marker_ttl``), so every gateway and autoscaler sees a lease end."""
    try:
        return await js.key_value(POOLS_BUCKET)
    except BucketNotFoundError:
        # Two processes may both get here: the server accepts an identical stream twice.
        return await js.create_key_value(KeyValueConfig(
            bucket=POOLS_BUCKET, history=1, storage=StorageType.FILE,
            replicas=stream_replicas() if replicas is None else replicas,
            limit_marker_ttl=POOLS_MARKER_TTL_S,
            description="Heron leased pools: key = pool name, value = lease, TTL = lease"))


async def ensure_results_bucket(js: JetStreamContext, max_bytes: int, ttl_s: float,
                                max_value_bytes: int) -> KeyValue:
    """The ``heron_results`` KV bucket, created if missing (idempotent; an existing one is
    used as it is: the first worker's bound and TTL stand; ``nats stream edit
    KV_heron_results`` changes them). A cache, so unlike a KV bucket nats-py would create
    (discard new: a full bucket refuses writes) it discards the oldest entries when full;
    entries also expire after ``ttl_s``. File storage: it costs NATS disk, not memory."""
    try:
        return await js.key_value(RESULTS_BUCKET)
    except BucketNotFoundError:
        pass
    # The stream a KV bucket is (what create_key_value declares), but with discard old.
    await js.add_stream(StreamConfig(
        name=f"KV_{RESULTS_BUCKET}", subjects=[f"$KV.{RESULTS_BUCKET}.>"],
        description="Heron result cache, shared tier: key = model.scope.item, value = output",
        retention=RetentionPolicy.LIMITS, discard=DiscardPolicy.OLD, max_bytes=max_bytes,
        max_age=ttl_s, max_msgs_per_subject=1, max_msg_size=max_value_bytes,
        storage=StorageType.FILE, num_replicas=stream_replicas(), allow_direct=True,
        allow_rollup_hdrs=True, deny_delete=True, duplicate_window=min(120.0, ttl_s)))
    return await js.key_value(RESULTS_BUCKET)


def _norm(value: Any) -> Any:
    if isinstance(value, list):
        return sorted(value)
    if isinstance(value, float):
        return round(value, 3)
    return getattr(value, "value", value)


# ---- work items ---------------------------------------------------------------------------
# The messages themselves (work item headers, results, heartbeats, demand notices, config
# deltas) are typed classes in heron.runtime.protocol; this module only names where they go.
MAX_ITEMS_PER_WORK_ITEM = 64
MAX_TOKENS_PER_WORK_ITEM = 8192  # estimated at the gateway as characters / 4


async def ensure_config_stream(js: JetStreamContext, file_storage: bool = True,
                               replicas: int | None = None) -> None:
    config = StreamConfig(name=CONFIG_STREAM, subjects=[CONFIG_SUBJECTS],
                          retention=RetentionPolicy.LIMITS,
                          num_replicas=stream_replicas() if replicas is None else replicas,
                          storage=StorageType.FILE if file_storage else StorageType.MEMORY,
                          max_age=30 * 24 * 3600.0)
    try:
        await js.stream_info(CONFIG_STREAM)
    except NotFoundError:
        await js.add_stream(config)

# `heron up` publishes a JSON event here when one of its children dies or is restarted
# ({child, event, status, restarts, at, cause, restart_in_s}); gateways keep the last ones
# for the cluster page (heron.gateway.status_page).
SUPERVISOR_EVENTS = "heron.events.supervisor"
