"""StatusPublisher: the worker's heartbeat, once a second on heron.status.<pool>.<worker>.

The gateway counts a worker as capacity only while its beats are fresh and say ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Callable
from typing import Any

import psutil
from nats.aio.client import Client as NATS

from heron.runtime.nats_names import status_subject
from heron.runtime.protocol import WorkerHeartbeat
from heron_sdk import wire

HEARTBEAT_INTERVAL_S = 1.0


class StatusPublisher:
    def __init__(self, nc: NATS, *, pool: str, worker_id: str,
                 snapshot: Callable[[], dict[str, Any]]) -> None:
        self.nc = nc
        self.subject = status_subject(pool, worker_id)
        self.pool = pool
        self.worker_id = worker_id
        self._snapshot = snapshot
        self._process = psutil.Process(os.getpid())
        self._task: asyncio.Task | None = None

    def beat(self, *, ready_override: bool | None = None) -> WorkerHeartbeat:
        """This worker's heartbeat now; ``snapshot()`` gives every field but the worker's
        id, pool, process memory and time (WorkerHeartbeat's keyword names)."""
        snapshot = self._snapshot()
        if ready_override is not None:
            snapshot["ready"] = ready_override
        return WorkerHeartbeat(worker_id=self.worker_id, pool=self.pool,
                               memory_rss=self._process.memory_info().rss, **snapshot)

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def beat_now(self, *, ready_override: bool | None = None) -> None:
        """Publish a beat at once, between the ticks: the worker's readiness just changed,
        and gateways would otherwise learn it up to a second later (answering 202 for a
        pool whose worker is ready meanwhile)."""
        with contextlib.suppress(Exception):  # NATS down: the next beat will tell
            await self.nc.publish(self.subject, wire.encode(
                self.beat(ready_override=ready_override).to_wire(), wire.MSGPACK))

    async def _run(self) -> None:
        while True:
            await self.beat_now()
            await asyncio.sleep(HEARTBEAT_INTERVAL_S)

    async def stop(self) -> None:
        """Stop beating and say so at once, so gateways stop routing here."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.beat_now(ready_override=False)
        with contextlib.suppress(Exception):
            await self.nc.flush(timeout=1)
