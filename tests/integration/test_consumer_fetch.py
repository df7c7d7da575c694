"""How a worker takes work from its pool's stream (real nats-server and WorkConsumer; the
service is a stand-in whose forward pass the test controls):

- a busy worker holds at most ``lookahead_items`` beyond its running forward pass, so
  the rest stays in the stream for an idle worker of the same pool (and while it holds
  that many, ``can_fetch`` tells its batchers that no more work can come);
- while a forward pass runs it holds at most ``lookahead_busy_items`` (0 on CPU), unless
  the pass is a lower lane's work: then priority 0 is fetched for the next pass;
- the low lane (priority 1 and up) waits in the stream while priority-0 items wait here;
- an item that computes for longer than the ack wait is kept alive, not redelivered, and
  so is one whose delivery waited in the client before its item started.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import nats
import pytest

from heron.runtime.nats_names import (
    Lane,
    WorkStreamSpec,
    ensure_work_stream,
    lane_consumer,
    lane_of,
    work_stream,
    work_subject,
)
from heron.runtime.protocol import WorkItemHeaders
from heron.worker.consumer import ItemKeepAlive, WorkConsumer
from heron.worker.metrics import WorkerMetrics
from heron.worker.service import Outcome, Timings
from heron.worker.settings import WorkerSettings
from heron_sdk import wire
from tests.support.nats_server import NatsServer


class HeldService:
    """Encode calls wait until ``release``; none counts as in a forward pass, so every
    call is backlog (what a worker looks like while its forward pass never ends)."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.released = asyncio.Event()

    def items_in_forward(self) -> int:
        return 0

    def passes_busy(self) -> bool:
        return bool(self.items_in_forward())

    async def encode(self, model: str, request: Any) -> Outcome:
        self.calls.append(request.items[0].text)
        await self.released.wait()
        return Outcome({"model": model, "items": [{"dense": [1.0]}]}, Timings(), model)


class PassService(HeldService):
    """Its calls are the items of one forward pass that runs until ``release``."""

    def items_in_forward(self) -> int:
        return 0 if self.released.is_set() else len(self.calls)


class SlowService(HeldService):
    """Every call takes ``seconds``."""

    def __init__(self, seconds: float) -> None:
        super().__init__()
        self.seconds = seconds

    async def encode(self, model: str, request: Any) -> Outcome:
        self.calls.append(request.items[0].text)
        await asyncio.sleep(self.seconds)
        return Outcome({"model": model, "items": [{"dense": [1.0]}]}, Timings(), model)


async def _publish(js: Any, pool: str, inbox: str, texts: list[str], first: int = 0,
                   priority: int = 0, lane: Lane | None = None) -> None:
    for i, text in enumerate(texts, first):
        await js.publish(work_subject(pool, "m", lane or lane_of(priority)),
                         wire.encode({"items": [text]}, wire.MSGPACK),
                         headers=WorkItemHeaders(f"r{i}", "encode", "m", inbox, 0, 1, None,
                                                 priority).to_wire())


async def _until(condition: Any, timeout_s: float = 2.0) -> None:
    for _ in range(int(timeout_s / 0.02)):
        if condition():
            return
        await asyncio.sleep(0.02)


async def _answers(sub: Any, n: int, timeout_s: float = 15.0) -> list[str]:
    ids = []
    for _ in range(n):
        msg = await sub.next_msg(timeout=timeout_s)
        await msg.respond(b"")  # the gateway's confirmation: the worker acks after it
        result = wire.decode(msg.data, wire.MSGPACK)
        assert "error" not in result or result["error"] is None, result
        ids.append(result["request_id"])
    return ids


async def _stop(nc: Any, service: HeldService, *consumers: WorkConsumer) -> None:
    service.released.set()  # a pass that never ends would hold the drain up
    for consumer in consumers:
        await consumer.drain()
    await nc.close()


async def test_a_busy_worker_leaves_work_for_an_idle_one(nats_server: NatsServer) -> None:
    pool = f"f{uuid.uuid4().hex[:8]}"
    spec = WorkStreamSpec(pool=pool)
    nc = await nats.connect(nats_server.url)
    busy_service, idle_service = HeldService(), SlowService(0.0)
    busy = WorkConsumer(nc, busy_service, spec, lookahead_items=4)  # type: ignore[arg-type]
    idle = WorkConsumer(nc, idle_service, spec, lookahead_items=4)  # type: ignore[arg-type]
    inbox = f"_INBOX.heron.fetchtest.{uuid.uuid4().hex[:6]}"
    sub = await nc.subscribe(inbox)
    try:
        await busy.start()
        assert busy.can_fetch()  # nothing held: its batchers may wait for work to come
        await _publish(nc.jetstream(), pool, inbox, [f"text {i}" for i in range(20)])
        for _ in range(50):  # the busy worker takes what its lookahead allows, then stops
            await asyncio.sleep(0.05)
            if len(busy_service.calls) >= 4:
                break
        await asyncio.sleep(0.3)
        assert len(busy_service.calls) == 4, busy_service.calls
        assert busy.backlog == 4
        assert not busy.can_fetch()  # full: its batchers close a batch without waiting

        # An idle worker of the same pool gets everything the busy one left in the stream.
        await idle.start()
        answered = await _answers(sub, 16)
        assert len(idle_service.calls) == 16 and len(set(answered)) == 16
        assert len(busy_service.calls) == 4  # it took nothing more meanwhile

        busy_service.released.set()  # its forward pass ends: its four are answered too
        answered += await _answers(sub, 4)
        for _ in range(50):
            if busy.can_fetch():
                break
            await asyncio.sleep(0.02)
        assert busy.can_fetch()
        assert sorted(answered) == sorted(f"r{i}" for i in range(20))  # each exactly once
    finally:
        await _stop(nc, busy_service, busy, idle)


async def test_a_worker_in_a_forward_pass_takes_nothing_more(nats_server: NatsServer) -> None:
    pool = f"p{uuid.uuid4().hex[:8]}"
    spec = WorkStreamSpec(pool=pool)
    nc = await nats.connect(nats_server.url)
    service, idle_service = PassService(), SlowService(0.0)
    worker = WorkConsumer(nc, service, spec, lookahead_items=4,  # type: ignore[arg-type]
                          lookahead_busy_items=0)
    idle = WorkConsumer(nc, idle_service, spec, lookahead_items=4)  # type: ignore[arg-type]
    inbox = f"_INBOX.heron.passtest.{uuid.uuid4().hex[:6]}"
    sub = await nc.subscribe(inbox)
    try:
        await worker.start()
        assert worker.lookahead() == 4  # the model is free: a batch may gather 4
        await _publish(nc.jetstream(), pool, inbox, ["first"])
        for _ in range(100):
            if service.calls:
                break
            await asyncio.sleep(0.02)
        assert service.calls == ["first"]  # now in its forward pass
        assert (worker.lookahead(), worker.backlog, worker.can_fetch()) == (0, 0, False)
        await _publish(nc.jetstream(), pool, inbox, [f"text {i}" for i in range(8)], first=1)
        await asyncio.sleep(0.3)
        assert service.calls == ["first"]  # it took nothing while the pass ran

        await idle.start()  # a free worker of the pool gets everything that arrived
        answered = await _answers(sub, 8)
        assert len(idle_service.calls) == 8

        service.released.set()  # the pass ends: answered, and fetching again
        answered += await _answers(sub, 1)
        assert worker.lookahead() == 4 and worker.can_fetch()
        assert sorted(answered) == sorted(f"r{i}" for i in range(9))  # each exactly once
    finally:
        await _stop(nc, service, worker, idle)


@pytest.mark.parametrize(("lane", "priority"), [(Lane.BULK, 10), (Lane.LOW, 2)])
async def test_a_worker_on_lower_lane_work_still_fetches_priority_0(
        nats_server: NatsServer, lane: Lane, priority: int) -> None:
    """A pass of a bulk job's or of the low lane's work is lower-priority work: priority-0
    items that arrive during it are fetched, to be the next pass."""
    pool = f"q{uuid.uuid4().hex[:8]}"
    spec = WorkStreamSpec(pool=pool)
    nc = await nats.connect(nats_server.url)
    service = PassService()
    worker = WorkConsumer(nc, service, spec, lookahead_items=4,  # type: ignore[arg-type]
                          lookahead_busy_items=0)
    inbox = f"_INBOX.heron.lowertest.{uuid.uuid4().hex[:6]}"
    sub = await nc.subscribe(inbox)
    try:
        await worker.start()
        js = nc.jetstream()
        await _publish(js, pool, inbox, ["lower"], first=9, priority=priority, lane=lane)
        await _until(lambda: service.calls)
        assert service.calls == ["lower"] and worker.lookahead(Lane.FIRST) == 4
        await _publish(js, pool, inbox, [f"text {i}" for i in range(3)])
        await _until(lambda: len(service.calls) == 4)
        assert sorted(service.calls) == ["lower", "text 0", "text 1", "text 2"]
        service.released.set()
        assert sorted(await _answers(sub, 4)) == ["r0", "r1", "r2", "r9"]
    finally:
        await _stop(nc, service, worker)


async def test_priority_0_is_fetched_before_the_low_lane(nats_server: NatsServer) -> None:
    """Requests of priority 1 and up wait in the stream's low lane while a priority-0 item
    waits here for a forward pass; priority 0 is still fetched while the worker holds low
    lane work (its pass is lower-priority work, so the next pass is priority 0's)."""
    pool = f"o{uuid.uuid4().hex[:8]}"
    spec = WorkStreamSpec(pool=pool)
    nc = await nats.connect(nats_server.url)
    service, idle_service = HeldService(), SlowService(0.0)
    worker = WorkConsumer(nc, service, spec, lookahead_items=4)  # type: ignore[arg-type]
    idle = WorkConsumer(nc, idle_service, spec, lookahead_items=4)  # type: ignore[arg-type]
    inbox = f"_INBOX.heron.lanetest.{uuid.uuid4().hex[:6]}"
    sub = await nc.subscribe(inbox)
    try:
        await worker.start()
        js = nc.jetstream()
        await _publish(js, pool, inbox, ["urgent 0"])
        await _until(lambda: service.calls)
        assert service.calls == ["urgent 0"] and worker.room(Lane.LOW) == 0
        await _publish(js, pool, inbox, [f"later {i}" for i in range(3)], first=1, priority=1)
        await _publish(js, pool, inbox, ["urgent 1", "urgent 2"], first=4)
        await _until(lambda: "urgent 2" in service.calls)
        await asyncio.sleep(0.3)
        # The priority-0 items that came after the low lane's were fetched; of those, only
        # what the low lane's pull already waiting on the server took (one work item).
        urgent = [c for c in service.calls if c.startswith("urgent")]
        later = [c for c in service.calls if c.startswith("later")]
        assert urgent == ["urgent 0", "urgent 1", "urgent 2"] and len(later) <= 1, later

        await idle.start()  # a free worker of the pool gets the low lane's items
        answered = await _answers(sub, 3 - len(later))
        assert sorted(idle_service.calls + later) == ["later 0", "later 1", "later 2"]
        service.released.set()
        answered += await _answers(sub, 3 + len(later))
        assert sorted(answered) == sorted(f"r{i}" for i in range(6))  # each exactly once
    finally:
        await _stop(nc, service, worker, idle)


@pytest.mark.slow
async def test_an_item_longer_than_the_ack_wait_is_not_redelivered(
        nats_server: NatsServer) -> None:
    pool = f"k{uuid.uuid4().hex[:8]}"
    spec = WorkStreamSpec(pool=pool, ack_wait_s=1.0)
    nc = await nats.connect(nats_server.url)
    service = SlowService(2.6)  # more than two ack waits
    metrics = WorkerMetrics()
    consumer = WorkConsumer(nc, service, spec, metrics=metrics)  # type: ignore[arg-type]
    inbox = f"_INBOX.heron.keepalive.{uuid.uuid4().hex[:6]}"
    sub = await nc.subscribe(inbox)
    try:
        await consumer.start()
        await _publish(nc.jetstream(), pool, inbox, ["slow"])
        assert await _answers(sub, 1) == ["r0"]
        await asyncio.sleep(1.5)  # a redelivery, had there been one, would show by now
        assert service.calls == ["slow"]
        assert f'heron_worker_redeliveries_total{{pool="{pool}"}}' not in \
            metrics.render().decode()
    finally:
        await consumer.drain()
        await nc.close()


@pytest.mark.slow
async def test_a_delivery_that_waited_before_its_item_started_is_not_redelivered(
        nats_server: NatsServer) -> None:
    """A delivery can sit in the client's queue before its item's task starts (a follow-up
    pull answered after it expired, while a forward pass ran): here three quarters of the
    ack wait. The item is kept alive from its delivery, not from its start: another
    worker's pull gets nothing past the ack wait."""
    pool = f"l{uuid.uuid4().hex[:8]}"
    spec = WorkStreamSpec(pool=pool, ack_wait_s=2.0)
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    keep_alive = None
    try:
        await ensure_work_stream(js, spec)
        await _publish(js, pool, "_INBOX.heron.late", ["late"])
        durable, stream = lane_consumer(pool, Lane.FIRST), work_stream(pool)
        mine = await js.pull_subscribe_bind(durable=durable, stream=stream)
        other = await js.pull_subscribe_bind(durable=durable, stream=stream)
        (msg,) = await mine.fetch(1, timeout=5)
        await asyncio.sleep(1.5)
        keep_alive = ItemKeepAlive(msg, spec.ack_wait_s / 2)  # the item starts
        await asyncio.sleep(1.0)  # 2.5 s from the delivery: past its ack wait
        with pytest.raises(nats.errors.TimeoutError):
            again = await other.fetch(1, timeout=0.5)
            pytest.fail(f"redelivered: {again[0].metadata}")
        await msg.ack()
    finally:
        if keep_alive is not None:
            keep_alive.cancel()
        await nc.close()


async def test_a_lone_item_costs_one_pull_and_queued_items_come_in_batches(
        nats_server: NatsServer) -> None:
    """A worker asks for more after a delivery only when JetStream said more was queued
    for its lane: a lone item is followed by the next blocking pull alone (not by a no-wait
    pull, a pull that lingers 5 ms and their two status replies), and items already
    queued come in follow-up pulls of several, not one pull each."""
    pool = f"n{uuid.uuid4().hex[:8]}"
    spec = WorkStreamSpec(pool=pool)
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    service = SlowService(0.0)
    worker = WorkConsumer(nc, service, spec, lookahead_items=16)  # type: ignore[arg-type]
    inbox = f"_INBOX.heron.pulltest.{uuid.uuid4().hex[:6]}"
    sub = await nc.subscribe(inbox)
    pulls: list[dict[str, Any]] = []  # the FIRST lane's pull requests, as the server gets them

    async def seen(msg: Any) -> None:
        pulls.append(json.loads(msg.data))

    spy = await nc.subscribe(
        f"$JS.API.CONSUMER.MSG.NEXT.{work_stream(pool)}.{lane_consumer(pool, Lane.FIRST)}",
        cb=seen)
    try:
        await ensure_work_stream(js, spec)
        await _publish(js, pool, inbox, [f"queued {i}" for i in range(10)])
        await worker.start()
        assert sorted(await _answers(sub, 10)) == sorted(f"r{i}" for i in range(10))
        await asyncio.sleep(0.3)  # any follow-up pull has expired by now
        assert any(pull["batch"] > 1 for pull in pulls), pulls
        assert len(pulls) <= 5, pulls  # a pull of one a message would be 11

        for lone in range(3):
            before = len(pulls)
            await _publish(js, pool, inbox, [f"lone {lone}"], first=10 + lone)
            assert await _answers(sub, 1) == [f"r{10 + lone}"]
            await asyncio.sleep(0.3)
            # The blocking pull that took it was sent before; after it, only the next one.
            assert pulls[before:] == [{"batch": 1, "expires": pulls[-1]["expires"]}], \
                pulls[before:]
    finally:
        await spy.unsubscribe()
        await _stop(nc, service, worker)


def test_fetch_lookahead_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HERON_FETCH_LOOKAHEAD", raising=False)
    assert WorkerSettings.from_env().lookahead(on_gpu=False) == 16
    assert WorkerSettings.from_env().lookahead(on_gpu=True) == 128
    monkeypatch.setenv("HERON_FETCH_LOOKAHEAD", "40")
    settings = WorkerSettings.from_env()
    assert settings.lookahead(on_gpu=False) == settings.lookahead(on_gpu=True) == 40
    for bad in ("0", "many"):
        monkeypatch.setenv("HERON_FETCH_LOOKAHEAD", bad)
        with pytest.raises(ValueError, match="HERON_FETCH_LOOKAHEAD"):
            WorkerSettings.from_env()


@pytest.mark.slow
async def test_a_gone_gateways_items_are_terminated_not_computed(
        nats_server: NatsServer) -> None:
    """No responders on a gateway's inbox: the item computed when it went is terminated
    after the worker asked again for a few seconds, kept in progress meanwhile (the ack wait
    here is 1 s) while the worker goes on taking work; the gateway's items fetched during
    those seconds wait and are terminated unread, as are those fetched later. None comes
    back; a live gateway's items are answered as usual. A gateway wrongly found gone (cut
    off from NATS for a while) is asked again every 2 s and served again once it answers."""
    pool = f"g{uuid.uuid4().hex[:8]}"
    spec = WorkStreamSpec(pool=pool, ack_wait_s=1.0)
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    service = SlowService(0.2)
    metrics = WorkerMetrics()
    consumer = WorkConsumer(nc, service, spec, lookahead_items=2,  # type: ignore[arg-type]
                            metrics=metrics)
    gone = f"_INBOX.heron.gone.{uuid.uuid4().hex[:6]}"  # nobody subscribes
    live = f"_INBOX.heron.live.{uuid.uuid4().hex[:6]}"
    sub = await nc.subscribe(live + ".>")

    async def publish_gone(numbers: range) -> None:
        for i in numbers:
            await js.publish(work_subject(pool, "m"),
                             wire.encode({"items": [f"gone {i}"]}, wire.MSGPACK),
                             headers=WorkItemHeaders(f"g{i}", "encode", "m", f"{gone}.k{i}",
                                                     0, 1, None, 0).to_wire())

    def terminated(computed: str) -> float:
        line = f'heron_worker_terminated_items_total{{computed="{computed}",pool="{pool}"}} '
        text = metrics.render().decode()
        return float(text.split(line)[1].split()[0]) if line in text else 0.0

    try:
        await consumer.start()
        await publish_gone(range(1))
        await _publish(js, pool, f"{live}.k", ["live 0", "live 1", "live 2", "live 3"])
        assert sorted(await _answers(sub, 4)) == ["r0", "r1", "r2", "r3"]
        await publish_gone(range(1, 3))  # while the worker still asks the gone gateway
        for _ in range(200):
            if terminated("true") == 1:
                break
            await asyncio.sleep(0.05)
        assert terminated("true") == 1  # gone 0: computed for nobody
        await publish_gone(range(3, 10))  # known gone by now
        for _ in range(100):
            if terminated("false") == 9:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(1.5)  # a redelivery, had there been one, would show by now
        assert service.calls == ["gone 0", "live 0", "live 1", "live 2", "live 3"]
        assert terminated("false") == 9
        assert "heron_worker_redeliveries_total{" not in metrics.render().decode()
        assert (await js.stream_info(f"HERON_WORK_{pool}")).state.messages == 0

        back: list[str] = []

        async def confirm(msg: Any) -> None:  # the gateway, listening again
            await msg.respond(b"")
            if msg.data:  # a result; an empty message asks whether anyone listens
                back.append(wire.decode(msg.data, wire.MSGPACK)["request_id"])

        await nc.subscribe(gone + ".>", cb=confirm)
        await asyncio.sleep(2.1)  # the next item of that gateway asks its inbox again
        await publish_gone(range(10, 11))
        for _ in range(100):
            if back:
                break
            await asyncio.sleep(0.05)
        assert back == ["g10"] and service.calls[-1] == "gone 10"
    finally:
        await consumer.drain()
        await nc.close()
