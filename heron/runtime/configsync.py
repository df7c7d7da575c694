"""ConfigFollower: how gateways and workers keep up with the config service.

Start: subscribe to the deltas first (new ones only), then bootstrap from GET
/v1/configs/export, then apply the deltas that arrived meanwhile: none is missed. After
that, apply each delta newer than the current epoch (a delta seen twice, or late, changes
nothing), and every ``resync_s`` compare GET /v1/configs/epoch and bootstrap again on a gap
(a follower cut off from NATS catches up this way).
"""

from __future__ import annotations

import asyncio
import contextlib
import copy
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy

from heron.runtime.nats_names import CONFIG_STREAM, config_all_subject, config_subject
from heron.runtime.protocol import ConfigDelta, ProtocolError
from heron_sdk import wire
from heron_sdk.errors import HeronError

log = logging.getLogger("heron.configsync")

Snapshot = dict[str, Any]  # GET /v1/configs/export: {"epoch", "models", "bundles"}
OnChange = Callable[[Snapshot], Awaitable[None] | None]
EPOCH_TIMEOUT_S = 5.0  # GET /v1/configs/epoch, every resync
EXPORT_TIMEOUT_S = 10.0  # GET /v1/configs/export: every model's config


def apply_delta(snapshot: Snapshot, delta: ConfigDelta) -> bool:
    """Fold one delta into a snapshot in place; False (and no change) unless it is newer."""
    if delta.epoch <= int(snapshot.get("epoch", 0)):
        return False
    model_id = delta.model_id
    snapshot.setdefault("models", {})[model_id] = delta.model
    bundles = snapshot.setdefault("bundles", {})
    for name in delta.bundles:
        entry = bundles.setdefault(name, {"adapters": [], "models": [], "hash": ""})
        if model_id not in entry["models"]:
            entry["models"].append(model_id)
        entry["hash"] = delta.bundles_hash.get(name, entry.get("hash", ""))
    snapshot["epoch"] = delta.epoch
    return True


class ConfigFollower:
    def __init__(self, config_url: str, *, bundle: str | None = None,
                 on_change: OnChange, admin_token: str | None = None,
                 resync_s: float | None = None) -> None:
        self.config_url = config_url.rstrip("/")
        self.subject = config_subject(bundle) if bundle else config_all_subject()
        self.on_change = on_change
        token = admin_token if admin_token is not None else os.environ.get("HERON_ADMIN_TOKEN")
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}
        self.resync_s = resync_s or float(os.environ.get("HERON_CONFIG_RESYNC_S", "30"))
        self.snapshot: Snapshot = {"epoch": -1, "models": {}, "bundles": {}}
        self._pending: list[ConfigDelta] = []
        self._bootstrapped = False
        self._lock = asyncio.Lock()
        self._task: asyncio.Task | None = None
        # One client for the follower's life: building one loads the CA bundle into an SSL
        # context on the event loop, 30 ms here (175 ms the first time in a process), which
        # a client per resync stalled every gateway and worker for, every 30 s.
        self._http: httpx.AsyncClient | None = None

    @property
    def epoch(self) -> int:
        return int(self.snapshot.get("epoch", -1))

    @property
    def ready(self) -> bool:
        return self._bootstrapped

    async def start(self, nc: NATS) -> None:
        """Subscribe, bootstrap (retrying until the config service answers), keep up."""
        self._nc = nc
        self._subscribed = False
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def _subscribe(self) -> None:
        # The config service declares HERON_CONFIG; until it has, this fails and is retried.
        await self._nc.jetstream().subscribe(
            self.subject, stream=CONFIG_STREAM, cb=self._on_delta, ordered_consumer=True,
            deliver_policy=DeliverPolicy.NEW, idle_heartbeat=5.0)
        self._subscribed = True

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def _run(self) -> None:
        while True:
            try:
                if not self._subscribed:
                    await self._subscribe()
                if not self._bootstrapped or await self._remote_epoch() > self.epoch:
                    await self.bootstrap()
            except Exception as exc:  # config service away: keep what we have, try again
                log.warning("config sync with %s failed: %s", self.config_url, exc)
                await asyncio.sleep(1.0 if not self._bootstrapped else self.resync_s)
                continue
            await asyncio.sleep(self.resync_s)

    def _client(self) -> httpx.AsyncClient:
        if self._http is None:  # made on first use, on the event loop that uses it
            self._http = httpx.AsyncClient(timeout=EXPORT_TIMEOUT_S)
        return self._http

    async def _remote_epoch(self) -> int:
        r = await self._client().get(f"{self.config_url}/v1/configs/epoch",
                                     timeout=EPOCH_TIMEOUT_S)
        r.raise_for_status()
        return int(r.json()["epoch"])

    async def bootstrap(self) -> None:
        r = await self._client().get(f"{self.config_url}/v1/configs/export",
                                     headers=self.headers)
        r.raise_for_status()
        snapshot = r.json()
        async with self._lock:
            if int(snapshot["epoch"]) < self.epoch:
                return  # a delta already moved us past this export
            for delta in self._pending:  # arrived while the export was on its way
                apply_delta(snapshot, delta)
            self._pending.clear()
            self.snapshot = snapshot
            self._bootstrapped = True
        log.info("config bootstrapped at epoch %d", self.epoch)
        await self._notify()

    async def _on_delta(self, msg: Msg) -> None:
        try:
            delta = ConfigDelta.from_wire(wire.decode(msg.data, wire.MSGPACK))
        except (HeronError, ProtocolError) as exc:  # not msgpack, or not a delta
            log.warning("dropping an undecodable config delta: %s", exc)
            return
        async with self._lock:
            if not self._bootstrapped:
                self._pending.append(delta)
                return
            changed = apply_delta(self.snapshot, delta)
        if changed:
            await self._notify()

    async def _notify(self) -> None:
        try:
            result = self.on_change(copy.deepcopy(self.snapshot))
            if asyncio.iscoroutine(result):
                await result
        except Exception:  # the follower keeps following whatever a listener does
            log.exception("applying config epoch %d failed", self.epoch)
