"""A worker's deliveries across a NATS restart (real nats-server, restarted on its port):
the worker may be back before a gateway has subscribed again, so for a while after its own
reconnect it keeps asking a silent inbox instead of taking the gateway for gone; a gateway
that does not come back is still found gone once that while is over."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import nats

from heron.worker.gateway_inboxes import NO_RESPONDERS_BACKOFF_S, Delivery, GatewayInboxes
from tests.support.nats_server import NatsServer

GRACE_S = 9.0  # the worker's grace after its reconnect (RECONNECT_GRACE_S is 15)
GATEWAY_BACK_S = 6.0  # the gateway's wait between reconnect tries: back about this late


async def _until(condition: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.05)


async def test_a_gateway_slower_to_reconnect_is_waited_for_not_found_gone(
        tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "nats").start()
    worker_nc = await nats.connect(server.url, reconnect_time_wait=0.2,
                                   max_reconnect_attempts=-1)
    gateway_nc = await nats.connect(server.url, reconnect_time_wait=GATEWAY_BACK_S,
                                    max_reconnect_attempts=-1)
    confirmed: list[bytes] = []

    async def confirm(msg: Any) -> None:  # the gateway confirms every result
        confirmed.append(msg.data)
        await msg.respond(b"")

    await gateway_nc.subscribe("_INBOX.heron.gw.p1.>", cb=confirm)
    inboxes = GatewayInboxes(worker_nc, reconnect_grace_s=GRACE_S)
    try:
        assert await inboxes.deliver("_INBOX.heron.gw.p1.k1", b"before") is Delivery.CONFIRMED
        # Without a reconnect, a silent inbox is gone once the short asking runs out.
        started = time.monotonic()
        assert await inboxes.deliver("_INBOX.heron.none.p1.k", b"x") is Delivery.GATEWAY_GONE
        assert time.monotonic() - started < sum(NO_RESPONDERS_BACKOFF_S) + 2.0

        server.stop()
        server.start()  # same port and store; the worker is back within a fraction of a second
        await _until(lambda: worker_nc.stats["reconnects"] == 1 and worker_nc.is_connected, 10)
        assert gateway_nc.stats["reconnects"] == 0  # the gateway is not back yet

        started = time.monotonic()
        assert await inboxes.deliver("_INBOX.heron.gw.p1.k2", b"after") is Delivery.CONFIRMED
        waited = time.monotonic() - started
        assert gateway_nc.stats["reconnects"] == 1
        # Past the short asking (3.75 s), within the grace: the gateway was waited for.
        assert sum(NO_RESPONDERS_BACKOFF_S) < waited < GRACE_S, waited
        assert confirmed == [b"before", b"after"]

        # A gateway that never comes back is found gone, once the grace is over.
        started = time.monotonic()
        assert await inboxes.deliver("_INBOX.heron.gone.p2.k", b"x") is Delivery.GATEWAY_GONE
        assert time.monotonic() - started < GRACE_S + 3.0
    finally:
        await worker_nc.close()
        await gateway_nc.close()
        server.stop()
