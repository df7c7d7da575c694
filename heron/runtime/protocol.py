"""The typed messages Heron's processes send each other over NATS, one class per message.

Every class is a frozen dataclass with ``to_wire()`` (the dict or headers that go on the
wire; the caller encodes it with ``heron_sdk.wire``, msgpack) and ``from_wire(...)`` (a
classmethod that reads one back, raising ``ProtocolError`` and nothing else on a message
that does not have the shape documented here). The bytes on the wire are the ones the
project sent before these classes existed: same keys in the same order, same value types,
same header names and formatting.

Readers stay tolerant where older processes send less: fields marked optional below have
a default when absent. Subjects, stream and header names live in heron.runtime.nats_names.

===============  ======================================  ==============================
message          where                                   producer -> consumers
===============  ======================================  ==============================
WorkItemHeaders  headers of heron.work.<pool>.<model>    gateway -> workers
WorkResult       NATS Core request to its item's reply   worker -> gateway
WorkerHeartbeat  heron.status.<pool>.<worker>, 1/s       worker -> gateways, heron up
DemandNotice     heron.demand.<pool>                     gateway -> autoscalers
ConfigDelta      heron.config.models.<bundle>, ._all     config service -> followers
PoolLease        KV heron_pools, key = the pool's name   gateway -> gateways, heron up
===============  ======================================  ==============================

PoolLease lives in the SDK (heron_sdk.pools: the client reads the pools API with it, and the
SDK never imports the server); it is re-exported here so that this module lists them all.
Its stored form is JSON (``to_kv``/``from_kv``); its ``to_wire`` is the pools API's view, a
superset that ``from_wire`` reads back.

Cost, per work item (its headers and its result, on each side): constructing the frozen
dataclass is most of it, 0.7-1 us more per message than the dicts these classes replaced
(timeit, shared 2-core machine), against ~5 us to decode a one-text result there and
~110 us per work item through a Python NATS work queue (8,000-9,000/s, docs/deploy.md).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from heron.runtime.nats_names import Header
from heron_sdk.errors import ProtocolError
from heron_sdk.pools import PoolLease

__all__ = ["ConfigDelta", "DemandNotice", "PoolLease", "ProtocolError", "WorkItemHeaders",
           "WorkResult", "WorkerHeartbeat"]


# What int(), float(), str() and dict() raise on a value of the wrong kind (int(inf): overflow).
_UNREADABLE = (TypeError, ValueError, OverflowError)


def _object(data: Any, what: str) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise ProtocolError(f"{what} must be a map, not {type(data).__name__}")
    return data


# ---- work items and their results (per work item: kept cheap) -------------------------------
@dataclass(frozen=True, slots=True)
class WorkItemHeaders:
    """The headers of one work item (a JetStream message on work_subject(pool, model)).

    The body is the inference request's wire form (EncodeRequest/ScoreRequest/
    ExtractRequest.to_wire(), msgpack) holding only this item's slice of the request's
    items (score: top_k left out; the gateway ranks the whole request). The gateway adds a
    W3C ``traceparent`` to the headers after ``to_wire()`` (heron.runtime.telemetry); the
    worker reads it from the raw headers, so it is not a field here.

    Read tolerantly: every header is optional (text fields default to "", the item range to
    0), ``priority`` None means the request's own, ``deadline`` None means none."""

    request_id: str  # the request's id: the item's log lines and spans carry it
    task: str  # encode | score | extract | tokenize | decode (heron.runtime.token_calls)
    model: str
    reply: str  # the gateway inbox for the WorkResult ("" : nobody to answer)
    start: int  # index of the item's first text in its request
    count: int  # texts in this item
    deadline: float | None  # unix seconds after which the work is dropped; sent to 1 us
    priority: int | None  # 0 = highest

    def to_wire(self) -> dict[str, str]:
        headers = {Header.REQUEST_ID: self.request_id, Header.TASK: self.task,
                   Header.MODEL: self.model, Header.REPLY: self.reply,
                   Header.START: str(self.start), Header.COUNT: str(self.count)}
        if self.priority is not None:
            headers[Header.PRIORITY] = str(self.priority)
        if self.deadline is not None:
            headers[Header.DEADLINE] = f"{self.deadline:.6f}"
        return headers

    @classmethod
    def from_wire(cls, headers: Mapping[str, str] | None) -> WorkItemHeaders:
        get = (headers or {}).get
        deadline, priority = get(Header.DEADLINE), get(Header.PRIORITY)
        try:
            start, count = int(get(Header.START, "0")), int(get(Header.COUNT, "0"))
            item = cls(get(Header.REQUEST_ID, ""), get(Header.TASK, ""), get(Header.MODEL, ""),
                       get(Header.REPLY, ""), start, count,
                       None if deadline is None else float(deadline),
                       None if priority is None else int(priority))
        except _UNREADABLE as exc:
            raise ProtocolError(f"malformed work item headers: {exc}") from None
        if start < 0 or count < 0:
            raise ProtocolError(f"work item range {start}+{count} is negative")
        return item


@dataclass(frozen=True, slots=True)
class WorkResult:
    """A worker's answer to one work item, published (request/reply, so the gateway
    confirms it) to the item's ``reply`` inbox.

    Exactly one of ``body`` (the worker's response body for the item's slice) and
    ``error`` (``{"code", "message", "field"?, "retry_after_s"?}``: the whole slice failed).
    ``timings`` in seconds: ``tokenize``, ``batch_wait``, ``inference``, ``postprocess`` and
    ``total``, the worker's whole time on the item (docs/observability.md); None when the
    worker sent none (an empty dict is sent as none)."""

    request_id: str
    start: int
    count: int
    body: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    timings: dict[str, float] | None = None

    def __post_init__(self) -> None:
        if self.body is not None and self.error is not None:
            raise ValueError("a WorkResult holds a body or an error, not both")

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"request_id": self.request_id, "start": self.start,
                               "count": self.count}
        if self.error is not None:
            out["error"] = self.error
        else:
            out["body"] = self.body
        if self.timings:
            out["timings"] = self.timings
        return out

    @classmethod
    def from_wire(cls, data: Any) -> WorkResult:
        """Checks the envelope only (types of the range, the body's and error's kind): the
        body's content is checked where the slices are merged. The dicts are the decoded
        ones, not copies. A body that is not a map reads as None (the gateway then fails the
        request at once, as before); timings that are not a map read as None."""
        if type(data) is not dict:
            raise ProtocolError(f"a work result must be a map, not {type(data).__name__}")
        request_id, start, count = data.get("request_id"), data.get("start"), data.get("count")
        if type(request_id) is not str or type(start) is not int or type(count) is not int:
            raise ProtocolError("a work result needs request_id (text), start and count "
                                f"(whole numbers); got {request_id!r}, {start!r}, {count!r}")
        error = data.get("error")
        if error is not None:
            if type(error) is not dict:
                raise ProtocolError(f"a work result's error must be a map, not {error!r}")
            body = None
        else:
            body = data.get("body")
            if type(body) is not dict:
                body = None
        timings = data.get("timings")
        return cls(request_id, start, count, body, error,
                   timings if type(timings) is dict and timings else None)


# ---- control plane (once a second or less) -----------------------------------------------
def _counters(value: Any) -> dict[str, int]:
    return {str(k): int(v) for k, v in dict(value or {}).items()}


@dataclass(frozen=True, slots=True)
class WorkerHeartbeat:
    """A worker's status, once a second on status_subject(pool, worker_id); a last one
    with ``ready`` false when it stops.

    ``items_done`` and ``model_items`` (model id -> items) count the items the worker has
    computed since it started: counters, so a reader gets a rate from two beats and a lost
    beat costs nothing. ``model_memory`` is each loaded model's weights and buffers in
    bytes. Only ``worker_id`` and ``pool`` are required on reading: the rest default
    (older workers do not send the counters and model memory)."""

    worker_id: str
    pool: str
    bundle: str = ""
    bundle_hash: str = ""  # bundle_config_hash of the model configs the worker serves
    models: dict[str, str] = field(default_factory=dict)  # model id -> state
    queue_depth: int = 0  # items waiting in the worker's batchers
    in_flight: int = 0  # work items held
    memory_rss: int = 0  # bytes
    ready: bool = False
    address: str = ""  # the worker's own HTTP API, host:port
    items_done: int = 0
    model_items: dict[str, int] = field(default_factory=dict)
    model_memory: dict[str, int] = field(default_factory=dict)
    # model id -> the family it loaded as: what a config's adapter "auto" turned out to be
    # (on the wire only when there is one, so beats of plain configs keep their bytes).
    model_adapters: dict[str, str] = field(default_factory=dict)
    # The lanes of its pool's stream it pulls (heron.runtime.nats_names.Lane names). Older
    # workers send none: they pull the first and bulk lanes, so gateways send requests of
    # priority 1 and up on the first lane until every worker of the pool pulls "low".
    lanes: tuple[str, ...] = ()
    ts: float = field(default_factory=time.time)  # unix seconds, the worker's clock

    def to_wire(self) -> dict[str, Any]:
        return {"worker_id": self.worker_id, "pool": self.pool, "bundle": self.bundle,
                "bundle_hash": self.bundle_hash, "models": self.models,
                "queue_depth": self.queue_depth, "in_flight": self.in_flight,
                "memory_rss": self.memory_rss, "ready": self.ready, "address": self.address,
                "items_done": self.items_done, "model_items": self.model_items,
                "model_memory": self.model_memory, "ts": self.ts,
                **({"model_adapters": self.model_adapters} if self.model_adapters else {}),
                **({"lanes": list(self.lanes)} if self.lanes else {})}

    @classmethod
    def from_wire(cls, data: Any) -> WorkerHeartbeat:
        beat = _object(data, "a heartbeat")
        try:
            return cls(
                worker_id=str(beat["worker_id"]), pool=str(beat["pool"]),
                bundle=str(beat.get("bundle", "")), bundle_hash=str(beat.get("bundle_hash", "")),
                models={str(m): str(s) for m, s in dict(beat.get("models") or {}).items()},
                queue_depth=int(beat.get("queue_depth") or 0),
                in_flight=int(beat.get("in_flight") or 0),
                memory_rss=int(beat.get("memory_rss") or 0), ready=bool(beat.get("ready")),
                address=str(beat.get("address") or ""),
                items_done=int(beat.get("items_done") or 0),
                model_items=_counters(beat.get("model_items")),
                model_memory=_counters(beat.get("model_memory")),
                model_adapters={str(m): str(a) for m, a in
                                dict(beat.get("model_adapters") or {}).items()},
                lanes=tuple(str(lane) for lane in beat.get("lanes") or ()),
                ts=float(beat.get("ts") or 0.0))
        except KeyError as exc:
            raise ProtocolError(f"a heartbeat has no {exc.args[0]!r}") from None
        except _UNREADABLE as exc:
            raise ProtocolError(f"a heartbeat has a malformed field: {exc}") from None


@dataclass(frozen=True, slots=True)
class DemandNotice:
    """Published on demand_subject(pool) with a 202 (at most one per pool per interval, see
    heron.gateway.demand): an autoscaler starts a worker for the pool."""

    pool: str
    bundle: str = ""  # optional on reading
    ts: float = field(default_factory=time.time)  # unix seconds, the gateway's clock

    def to_wire(self) -> dict[str, Any]:
        return {"pool": self.pool, "bundle": self.bundle, "ts": self.ts}

    @classmethod
    def from_wire(cls, data: Any) -> DemandNotice:
        notice = _object(data, "a demand notice")
        try:
            return cls(str(notice["pool"]), str(notice.get("bundle", "")),
                       float(notice.get("ts") or 0.0))
        except KeyError as exc:
            raise ProtocolError(f"a demand notice has no {exc.args[0]!r}") from None
        except _UNREADABLE as exc:
            raise ProtocolError(f"a demand notice has a malformed field: {exc}") from None


@dataclass(frozen=True, slots=True)
class ConfigDelta:
    """One config change, published on config_subject(b) for each bundle b that routes the
    model and on config_all_subject() (heron.config_service). ``model`` is
    ModelConfig.to_dict(); ``bundles_hash`` is each of those bundles' config hash after the
    change. Applying a delta whose epoch is not newer than one's own changes nothing
    (heron.runtime.configsync.apply_delta). ``bundles`` and ``bundles_hash`` are optional
    on reading."""

    epoch: int
    model: dict[str, Any]
    bundles: tuple[str, ...] = ()
    bundles_hash: dict[str, str] = field(default_factory=dict)

    @property
    def model_id(self) -> str:
        return str(self.model["id"])

    def to_wire(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "model": self.model, "bundles": list(self.bundles),
                "bundles_hash": self.bundles_hash}

    @classmethod
    def from_wire(cls, data: Any) -> ConfigDelta:
        delta = _object(data, "a config delta")
        try:
            epoch, model = delta["epoch"], delta["model"]
            bundles = delta.get("bundles") or ()
            if isinstance(epoch, bool) or not isinstance(model, dict) or "id" not in model \
                    or isinstance(bundles, str | bytes):
                raise TypeError("epoch must be a number, model a map with an id, bundles a list")
            return cls(int(epoch), model, tuple(str(b) for b in bundles),
                       {str(b): str(h) for b, h in dict(delta.get("bundles_hash") or {}).items()})
        except KeyError as exc:
            raise ProtocolError(f"a config delta has no {exc.args[0]!r}") from None
        except _UNREADABLE as exc:
            raise ProtocolError(f"a config delta has a malformed field: {exc}") from None
