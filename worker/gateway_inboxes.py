"""Results to gateway inboxes, and the gateways a worker has found gone, so that their
queued work is terminated, not computed for nobody.

A work item names its gateway's inbox (``Heron-Reply``). ``GatewayInboxes.deliver`` sends
the result there as a NATS request: the gateway confirms every result, and the worker acks
only after that. "No responders" right after a NATS restart can mean the gateway has not
re-subscribed yet (the worker reconnected first), so it is asked again for a few seconds,
and for ``RECONNECT_GRACE_S`` after the worker's own reconnect; after that the gateway
process is gone: nobody will ever read what is computed for it. Its
inbox prefix (one per gateway *process*: heron.runtime.nats_names.inbox_prefix) is
remembered for ``REMEMBER_S``, and the worker terminates the gateway's other items as it
fetches them (``gone``), without computing them. While a delivery is still asking, the
gateway is *suspect*: items for it wait for the verdict rather than start a forward pass
that may be for nobody.

A verdict can be wrong (a gateway cut off from NATS for longer than the asking lasted):
every ``PROBE_EVERY_S`` an item of a gone gateway is first used to ask its inbox again with
an empty message (one round trip; "no responders" comes back at once), so a gateway that is
back loses at most that long of work, not ``REMEMBER_S``.

``GoneInboxes`` is the bounded, clock-injected memory (no I/O); ``GatewayInboxes`` adds the
NATS requests and the suspects' verdicts.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from enum import Enum

from nats.aio.client import Client as NATS
from nats.errors import NoRespondersError

from heron.runtime.nats_names import inbox_of

log = logging.getLogger("heron.worker.consumer")

RESULT_ACK_TIMEOUT_S = 2.0
NO_RESPONDERS_BACKOFF_S = (0.25, 0.5, 1.0, 2.0)
# For this long after the worker itself reconnected to NATS, "no responders" is asked again
# (every RECONNECT_GRACE_PAUSE_S) rather than taken for a gone gateway: after a NATS restart
# every client comes back on its own schedule, and a gateway slower than this worker (a
# busy host) may not have subscribed again when the asking above runs out (3.75 s). Its
# work would be terminated, and its requests would wait out their deadlines (a bulk job's
# shard: 120 s) before they were sent again.
RECONNECT_GRACE_S = 15.0
RECONNECT_GRACE_PAUSE_S = 0.5
# The longest an item for a suspect gateway waits for the verdict: the asking delivery's
# pauses plus one unanswered request, and a margin.
SUSPECT_WAIT_S = sum(NO_RESPONDERS_BACKOFF_S) + RESULT_ACK_TIMEOUT_S + 1.0

# A gateway's queued items expire with their deadline (a request's timeout, 30 s by default
# at the gateway): remembered twice that, a gone gateway's items are all dropped unread.
REMEMBER_S = 60.0
# Bounded: an entry is one gateway process gone; far more than end within REMEMBER_S.
MAX_REMEMBERED = 1024
PROBE_EVERY_S = 2.0


class GoneInboxes:
    """Inbox prefixes found without responders, each for ``remember_s`` (oldest dropped
    past ``max_entries``)."""

    def __init__(self, remember_s: float = REMEMBER_S, max_entries: int = MAX_REMEMBERED,
                 probe_every_s: float = PROBE_EVERY_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.remember_s = remember_s
        self.max_entries = max_entries
        self.probe_every_s = probe_every_s
        self._clock = clock
        self._until: OrderedDict[str, float] = OrderedDict()  # prefix -> forget at
        self._probed: dict[str, float] = {}  # prefix -> when it was last asked again

    def __len__(self) -> int:
        self._expire()
        return len(self._until)

    def is_gone(self, prefix: str) -> bool:
        until = self._until.get(prefix)
        if until is None:
            return False
        if self._clock() >= until:
            del self._until[prefix]
            self._probed.pop(prefix, None)
            return False
        return True

    def mark_gone(self, prefix: str) -> None:
        """Found without responders (again): remembered for ``remember_s`` from now."""
        now = self._clock()
        self._until.pop(prefix, None)
        self._until[prefix] = now + self.remember_s
        self._probed.setdefault(prefix, now)
        self._expire()
        while len(self._until) > self.max_entries:
            self._probed.pop(self._until.popitem(last=False)[0], None)

    def probe_due(self, prefix: str) -> bool:
        """Whether to ask a gone gateway's inbox again now (then not for ``probe_every_s``)."""
        now = self._clock()
        if now - self._probed.get(prefix, now) < self.probe_every_s:
            return False
        self._probed[prefix] = now
        return True

    def forget(self, prefix: str) -> None:
        """It answered after all (a NATS partition healed): not gone."""
        self._until.pop(prefix, None)
        self._probed.pop(prefix, None)

    def _expire(self) -> None:
        now = self._clock()
        while self._until:
            prefix, until = next(iter(self._until.items()))
            if until > now:
                break
            del self._until[prefix]
            self._probed.pop(prefix, None)


class Delivery(Enum):
    CONFIRMED = "confirmed"  # the gateway replied: ack
    GATEWAY_GONE = "gateway gone"  # no responders, asked for a few seconds: terminate
    UNCONFIRMED = "unconfirmed"  # a timeout, NATS away: nak, compute and send it again


class GatewayInboxes:
    """Deliveries to gateway inboxes over ``nc``, with ``GoneInboxes`` and the gateways
    under suspicion: a delivery that met "no responders" and is asking again (``suspect``)
    until it is answered (``heard``) or gives up (``gone``)."""

    def __init__(self, nc: NATS, memory: GoneInboxes | None = None,
                 max_wait_s: float = SUSPECT_WAIT_S,
                 reconnect_grace_s: float = RECONNECT_GRACE_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.nc = nc
        self.memory = memory or GoneInboxes()
        self.max_wait_s = max_wait_s
        self.reconnect_grace_s = reconnect_grace_s
        self._clock = clock
        self._suspects: dict[str, asyncio.Future[bool]] = {}
        self._reconnects = self._reconnect_count()
        self._reconnected_at = float("-inf")

    def _reconnect_count(self) -> int:
        return int(self.nc.stats.get("reconnects", 0))

    def _after_reconnect(self) -> bool:
        """Whether this worker's connection came back less than ``reconnect_grace_s`` ago:
        seen as nats-py counts reconnects, at the first delivery that looks after one (a
        worker delivers results all the time, so that is close to the reconnect itself)."""
        count = self._reconnect_count()
        if count != self._reconnects:
            self._reconnects, self._reconnected_at = count, self._clock()
        return self._clock() - self._reconnected_at < self.reconnect_grace_s

    async def deliver(self, reply: str, data: bytes) -> Delivery:
        """Send a result and wait for the gateway's confirmation."""
        prefix = inbox_of(reply)
        settled = False
        self._after_reconnect()  # notes a reconnect as soon as a delivery sees it
        pauses = iter(NO_RESPONDERS_BACKOFF_S)
        try:
            while True:
                if self.memory.is_gone(prefix):  # another delivery found out meanwhile
                    settled = True
                    return Delivery.GATEWAY_GONE
                try:
                    await self.nc.request(reply, data, timeout=RESULT_ACK_TIMEOUT_S)
                except NoRespondersError:
                    pause = next(pauses, None)
                    if pause is None and self._after_reconnect():
                        pause = RECONNECT_GRACE_PAUSE_S
                    if pause is None:
                        log.info("no gateway listens on %s any more; terminating its work",
                                 prefix)
                        self._settle(prefix, gone=True)
                        settled = True
                        return Delivery.GATEWAY_GONE
                    self._suspect(prefix)
                    await asyncio.sleep(pause)
                except Exception as exc:  # timeout, or the connection went away meanwhile
                    log.warning("result on %s not confirmed (%s); will redo it", reply, exc)
                    return Delivery.UNCONFIRMED
                else:
                    self._settle(prefix, gone=False)
                    settled = True
                    return Delivery.CONFIRMED
        finally:
            if not settled:  # no verdict (NATS away, cancelled): whoever waits computes
                self._release(prefix)

    def is_suspect(self, reply: str) -> bool:
        """A delivery to this gateway is asking again: ``gone`` waits for its verdict."""
        return inbox_of(reply) in self._suspects

    async def gone(self, reply: str) -> bool:
        """Whether the gateway an item answers to is gone: at once, unless it is suspect
        (then once that is settled, at most ``max_wait_s``). Now and then a gone one's inbox
        is asked again with an empty message: a gateway that is back is heard."""
        prefix = inbox_of(reply)
        if not self.memory.is_gone(prefix):
            pending = self._suspects.get(prefix)
            if pending is None:
                return False
            try:
                if not await asyncio.wait_for(asyncio.shield(pending), self.max_wait_s):
                    return False
            except TimeoutError:
                return False
        if not self.memory.probe_due(prefix):
            return True
        heard = await self._ask(reply)
        if heard is None:  # no verdict (NATS away): the last one stands
            return True
        if not heard:
            self.memory.mark_gone(prefix)  # still gone: remembered for longer
            return True
        log.info("the gateway on %s answers again; computing its work", prefix)
        self._settle(prefix, gone=False)
        return False

    async def _ask(self, reply: str) -> bool | None:
        """An empty message to the inbox (a gateway answers every message there): True
        answered, False no responders, None no verdict (a timeout, NATS away)."""
        try:
            await self.nc.request(reply, b"", timeout=RESULT_ACK_TIMEOUT_S)
        except NoRespondersError:
            return False
        except Exception:
            return None
        return True

    async def listening(self, reply: str) -> bool:
        """Ask the item's inbox with an empty message (a gateway answers every message on
        its inbox): False when nobody listens there any more (remembered as gone). A
        redelivered item is asked about first: its first try's result may have gone to a
        gateway that died meanwhile (a request that timed out), and computing it again
        would be for nobody. Asked as a result is delivered (``deliver``), with the same
        patience: right after a NATS restart a live gateway may not have subscribed again
        yet. A timeout or NATS away is no verdict: the item is computed."""
        return await self.deliver(reply, b"") is not Delivery.GATEWAY_GONE

    def _suspect(self, prefix: str) -> None:
        if prefix not in self._suspects:
            self._suspects[prefix] = asyncio.get_running_loop().create_future()

    def _settle(self, prefix: str, *, gone: bool) -> None:
        if gone:
            self.memory.mark_gone(prefix)
        else:
            self.memory.forget(prefix)
        self._release(prefix, gone=gone)

    def _release(self, prefix: str, *, gone: bool = False) -> None:
        pending = self._suspects.pop(prefix, None)
        if pending is not None and not pending.done():
            pending.set_result(gone)
