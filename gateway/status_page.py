"""The live cluster page: ``GET /`` (plain HTML, JS and CSS from gateway/static, no build
step, nothing from outside the gateway) and the WebSocket ``/ws/cluster-status`` that feeds
it a JSON snapshot of the cluster about once a second.

Everything shown comes from what this gateway already tracks: its pools (static and
leased), the workers' heartbeats (gateway/health.py, including their item counters, from
which it computes recent throughput), pending demand, its own backlog, and the last deaths
and restarts ``heron up`` reported on NATS (``SupervisorEventLog``). The feed is
one-way: what a client sends is read and ignored, so a client can neither stall nor break
it. Like /readyz and /metrics the page needs no API key: it shows no request contents.

It also shows bulk jobs' progress, from the records every gateway mirrors from the jobs
bucket (gateway/job_store.py ``JobMirror``): the unfinished jobs and the last finished
ones, whichever gateway runs them.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect, WebSocketState

from heron.gateway.health import THROUGHPUT_WINDOW_S, WorkerBeat, WorkerHealth
from heron.gateway.job_store import JobRecord
from heron.gateway.pools import GatewayPools
from heron.gateway.registry import RouteTable
from heron.runtime.nats_names import SUPERVISOR_EVENTS
from heron_sdk import wire
from heron_sdk.jobs import STATES as JOB_STATES

log = logging.getLogger("heron.gateway.status_page")

STATIC_DIR = Path(__file__).parent / "static"
# The page's files, by the name the page asks for: a fixed table, so no request path ever
# reaches the filesystem.
ASSETS = {"cluster.js": "text/javascript; charset=utf-8",
          "cluster.css": "text/css; charset=utf-8"}
PAGE = "cluster.html"
PUSH_INTERVAL_S = 1.0
# A snapshot built this recently is sent as it is: many open pages cost one build a second.
SNAPSHOT_MAX_AGE_S = 0.5
# A worker that stopped beating stays on the page, marked gone, this long (then it is
# dropped): someone looking at the page sees that it died, not only that it vanished.
GONE_SHOWN_S = 60.0
# A client that has not taken a snapshot for this long is disconnected (it stopped reading;
# its socket buffers are full).
SEND_TIMEOUT_S = 10.0
MAX_CLIENTS = 64  # each open page holds a socket and a task; more get close code 1013
SNAPSHOT_VERSION = 1
SUPERVISOR_EVENTS_KEPT = 20  # the last deaths and restarts of `heron up`'s children shown
CAUSE_MAX_CHARS = 1000  # an event's cause (log lines) as shown; the full log is on disk
# Jobs shown: the snapshot stays small however many jobs the bucket holds (finished ones
# are kept a week). job_counts still counts them all.
JOBS_UNFINISHED_SHOWN = 50
JOBS_FINISHED_SHOWN = 10
JOB_TEXT_MAX_CHARS = 300  # a model name or output URI as shown (the record is anyone's)
# The page runs only its own script and style and talks only to this gateway.
SECURITY_HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; "
                               "img-src 'self' data:; connect-src 'self'; "
                               "base-uri 'none'; frame-ancestors 'none'",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


class ClusterStatusPage:
    """Builds cluster snapshots from what the gateway tracks and serves the page and its
    feed: ``outstanding`` and ``pending_demand`` give a pool's backlog and recent 202s,
    ``nats_connected`` and ``ready`` the gateway's NATS link and /readyz verdict, ``jobs``
    every bulk job's record this gateway knows of (its job mirror)."""

    def __init__(self, gateway_id: str, health: WorkerHealth, registry: RouteTable,
                 pools: GatewayPools, *, outstanding: Callable[[str], int],
                 pending_demand: Callable[[str], int], nats_connected: Callable[[], bool],
                 ready: Callable[[], bool],
                 supervisor_events: SupervisorEventLog | None = None,
                 jobs: Callable[[], Iterable[JobRecord]] | None = None) -> None:
        self.gateway_id = gateway_id
        self.health = health
        self.registry = registry
        self.pools = pools
        self._outstanding = outstanding
        self._pending_demand = pending_demand
        self._nats_connected = nats_connected
        self._ready = ready
        self.supervisor_events = supervisor_events or SupervisorEventLog()
        self._jobs = jobs or (lambda: ())
        self.clients = 0
        self._files = {name: (STATIC_DIR / name).read_bytes() for name in (PAGE, *ASSETS)}
        self._cached: tuple[float, str] | None = None  # (monotonic time, encoded snapshot)

    def routes(self) -> list[BaseRoute]:
        return [Route("/", self.page, methods=["GET"]),
                Route("/static/{name}", self.asset, methods=["GET"]),
                WebSocketRoute("/ws/cluster-status", self.feed)]

    # ---- the snapshot --------------------------------------------------------------------
    def snapshot(self) -> dict[str, Any]:
        """The cluster as this gateway sees it now (the WebSocket message; the format is in
        docs/gateway.md, "Cluster page")."""
        health = self.health
        now = health.clock()
        beats = [b for b in health.workers() if now - b.received <= GONE_SHOWN_S]
        rates = {b.worker_id: health.throughput(b) for b in beats}
        workers = [self._worker(b, now, rates[b.worker_id].items_per_s,
                                rates[b.worker_id].model_items_per_s)
                   for b in sorted(beats, key=lambda b: (b.pool, b.worker_id))]
        leased = self.pools.leased()
        pools = []
        for name, bundle in sorted(self.pools.all_pools().items()):
            expected = health.expected(name)
            members = [w for w in workers if w["pool"] == name]
            pools.append({
                "name": name, "bundle": bundle,
                "kind": "lease" if name in leased else "static",
                "bundle_hash": expected[1] if expected else "",
                "workers": sum(w["state"] != "gone" for w in members),
                "healthy_workers": sum(w["state"] == "ready" for w in members),
                "outstanding_items": self._outstanding(name),
                "pending_demand": self._pending_demand(name),
                "throughput_items_per_s": round(sum(w["throughput_items_per_s"]
                                                    for w in members), 2)})
        models = []
        for route in self.registry.models():
            model_id = route.model_id
            models.append({
                "id": model_id, "aliases": list(route.config.aliases),
                "adapter": route.config.adapter, "bundle": route.bundle, "pool": route.pool,
                "state": health.model_state(route.pool, model_id),
                "ready_workers": sum(w["state"] == "ready"
                                     and w["models"].get(model_id) == "ready"
                                     for w in workers),
                "throughput_items_per_s": round(sum(
                    r.model_items_per_s.get(model_id, 0.0) for r in rates.values()), 2)})
        return {"type": "cluster_status", "version": SNAPSHOT_VERSION, "ts": time.time(),
                "gateway_id": self.gateway_id, "nats_connected": self._nats_connected(),
                "ready": self._ready(),
                "heartbeat_timeout_s": health.timeout_s,
                "throughput_window_s": THROUGHPUT_WINDOW_S,
                "pools": pools, "workers": workers, "models": models,
                "supervisor_events": self.supervisor_events.recent(),
                **jobs_section(self._jobs())}

    def _worker(self, beat: WorkerBeat, now: float, items_per_s: float,
                model_items_per_s: dict[str, float]) -> dict[str, Any]:
        expected = self.health.expected(beat.pool)
        healthy = self.health.is_healthy(beat)
        fresh = now - beat.received < self.health.timeout_s
        return {
            "worker_id": beat.worker_id, "pool": beat.pool, "bundle": beat.bundle,
            "bundle_hash": beat.bundle_hash,
            # None: this gateway does not route the pool, so it expects nothing of it.
            "bundle_hash_matches": None if expected is None
            else beat.bundle_hash == expected[1],
            "state": "ready" if healthy else "not_ready" if fresh else "gone",
            "ready": beat.ready, "last_beat_s": round(now - beat.received, 2),
            "address": beat.address, "models": dict(beat.models),
            "queue_depth": beat.queue_depth, "in_flight": beat.in_flight,
            "memory_rss": beat.memory_rss, "model_memory": dict(beat.model_memory),
            "throughput_items_per_s": round(items_per_s, 2),
            "model_throughput_items_per_s": {m: round(r, 2)
                                             for m, r in model_items_per_s.items()},
        }

    def encoded_snapshot(self) -> str:
        now = self.health.clock()  # the clock the snapshot's ages are measured on
        if self._cached is None or now - self._cached[0] > SNAPSHOT_MAX_AGE_S:
            self._cached = (now, wire.encode(self.snapshot(), wire.JSON).decode())
        return self._cached[1]

    # ---- HTTP ----------------------------------------------------------------------------
    async def page(self, request: Request) -> Response:
        return Response(self._files[PAGE], media_type="text/html; charset=utf-8",
                        headers=SECURITY_HEADERS)

    async def asset(self, request: Request) -> Response:
        name = request.path_params["name"]
        if name not in ASSETS:
            return Response(b"not found\n", status_code=404, media_type="text/plain")
        return Response(self._files[name], media_type=ASSETS[name], headers=SECURITY_HEADERS)

    # ---- the WebSocket feed --------------------------------------------------------------
    async def feed(self, websocket: WebSocket) -> None:
        """Send a snapshot at once and then every PUSH_INTERVAL_S until the client goes."""
        if self.clients >= MAX_CLIENTS:
            await websocket.close(code=1013, reason="too many cluster page clients")
            return
        self.clients += 1
        try:
            await websocket.accept()
            gone = asyncio.create_task(_wait_for_disconnect(websocket))
            try:
                while not gone.done():
                    await asyncio.wait_for(websocket.send_text(self.encoded_snapshot()),
                                           SEND_TIMEOUT_S)
                    await asyncio.wait({gone}, timeout=PUSH_INTERVAL_S)
            finally:
                gone.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await gone
        except (WebSocketDisconnect, OSError, TimeoutError):
            pass  # the client went away (or stopped reading): nothing to clean up but it
        except RuntimeError as exc:  # Starlette: a send after the close began
            log.debug("cluster page client closed mid-send: %s", exc)
        finally:
            self.clients -= 1
            if (websocket.application_state == WebSocketState.CONNECTED
                    and websocket.client_state == WebSocketState.CONNECTED):
                with contextlib.suppress(Exception):  # it may be going at this very moment
                    await websocket.close()


def jobs_section(records: Iterable[JobRecord]) -> dict[str, Any]:
    """The snapshot's ``jobs`` (bounded) and ``job_counts`` (every job, by state). Jobs:
    the unfinished ones in the order they run (running, then queued, oldest first: the job
    loops take queued jobs oldest first), then the last JOBS_FINISHED_SHOWN finished ones,
    newest first."""
    counts = dict.fromkeys(JOB_STATES, 0)
    unfinished: list[JobRecord] = []
    finished: list[JobRecord] = []
    for record in records:
        if record.state in counts:
            counts[record.state] += 1
        (finished if record.finished else unfinished).append(record)
    unfinished.sort(key=lambda r: (r.state != "running", r.created_at, r.id))
    newest = heapq.nlargest(JOBS_FINISHED_SHOWN, finished,
                            key=lambda r: (r.finished_at or r.updated_at, r.id))
    shown = unfinished[:JOBS_UNFINISHED_SHOWN] + newest
    return {"jobs": [_job(r) for r in shown], "job_counts": counts}


def _job(record: JobRecord) -> dict[str, Any]:
    spec = record.spec if isinstance(record.spec, dict) else {}
    output = spec.get("output")
    uri = output.get("uri") if isinstance(output, dict) else None
    error = record.error if isinstance(record.error, dict) else {}
    return {
        "id": record.id[:JOB_TEXT_MAX_CHARS], "model": _text(spec.get("model")),
        "state": record.state, "rows_total": record.rows_total,
        "rows_done": record.rows_done, "rows_failed": record.rows_failed,
        "percent": job_percent(record), "rows_per_s": record.rows_per_s,
        "eta_s": record.eta_s, "owner": _text(record.owner), "output_uri": _text(uri),
        # The code only: a message may quote the input, and the page needs no API key.
        "error_code": _text(error.get("code")) if record.state == "failed" else None,
        "created_at": record.created_at, "finished_at": record.finished_at}


def job_percent(record: JobRecord) -> float | None:
    """Rows done (failed ones included) of the rows total, floored to 0.1 so 100 means
    every row; None until the input has been read (its size is unknown)."""
    total = record.rows_total
    if total is None:
        return None
    if total <= 0:
        return 100.0
    return min(100.0, math.floor(1000 * record.rows_done / total) / 10)


def _text(value: object) -> str | None:
    return value[:JOB_TEXT_MAX_CHARS] if isinstance(value, str) else None


class SupervisorEventLog:
    """The last SUPERVISOR_EVENTS_KEPT events ``heron up`` published on SUPERVISOR_EVENTS
    (a child died, was restarted), newest first. ``heron up`` publishes each event once and
    again after a gateway it restarted is ready (so the new gateway shows what happened to
    the old one): an event heard twice is kept once. A message that is not such an event
    is dropped with a debug line: the page shows nothing it cannot vouch for."""

    def __init__(self, keep: int = SUPERVISOR_EVENTS_KEPT) -> None:
        self._events: deque[dict[str, Any]] = deque(maxlen=keep)

    def add(self, data: bytes) -> bool:
        """Keep one published event; False when it is malformed or already kept."""
        event = _parse_event(data)
        if event is None:
            log.debug("dropping a malformed supervisor event: %.200r", data)
            return False
        key = (event["child"], event["event"], event["at"], event["restarts"])
        if any((e["child"], e["event"], e["at"], e["restarts"]) == key for e in self._events):
            return False
        self._events.append(event)
        return True

    def recent(self) -> list[dict[str, Any]]:
        return sorted(self._events, key=lambda e: e["at"], reverse=True)


def _parse_event(data: bytes) -> dict[str, Any] | None:
    try:
        raw = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        return None
    if not isinstance(raw, dict):
        return None
    child, event, status = raw.get("child"), raw.get("event"), raw.get("status")
    restarts, at, cause = raw.get("restarts", 0), raw.get("at"), raw.get("cause", "")
    restart_in_s = raw.get("restart_in_s")
    if not (isinstance(child, str) and child and isinstance(event, str) and event
            and (status is None or _is_int(status)) and _is_int(restarts)
            and _is_number(at) and isinstance(cause, str)
            and (restart_in_s is None or _is_number(restart_in_s))):
        return None
    return {"child": child[:200], "event": event[:40], "status": status,
            "restarts": restarts, "at": float(at), "cause": cause[-CAUSE_MAX_CHARS:],
            "restart_in_s": None if restart_in_s is None else float(restart_in_s)}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return (isinstance(value, int | float) and not isinstance(value, bool)
            and math.isfinite(value))


async def subscribe_supervisor_events(nc: NatsClient, page: ClusterStatusPage) -> None:
    """Feed ``page`` the events ``heron up`` publishes (call once per NATS client, in the
    gateway's NATS set-up: the client restores the subscription after a reconnect)."""

    async def on_event(msg: Msg) -> None:
        page.supervisor_events.add(msg.data)

    await nc.subscribe(SUPERVISOR_EVENTS, cb=on_event)


async def _wait_for_disconnect(websocket: WebSocket) -> None:
    """Read (and drop) whatever the client sends until it disconnects: the feed takes no
    input, and reading is how a closed connection is noticed."""
    while True:
        message = await websocket.receive()
        if message["type"] == "websocket.disconnect":
            return
