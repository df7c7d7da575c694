"""Work that cannot run after its last delivery goes to the dead-letter stream and the
caller gets an error (real nats-server and WorkConsumer; the service is a stand-in whose
model never finishes loading)."""

from __future__ import annotations

import asyncio
import uuid

import nats

from heron.runtime.nats_names import (
    DLQ_STREAM,
    WorkStreamSpec,
    dlq_subject,
    work_stream,
    work_subject,
)
from heron.runtime.protocol import WorkItemHeaders
from heron.worker.consumer import WorkConsumer
from heron.worker.metrics import WorkerMetrics
from heron_sdk import wire
from heron_sdk.errors import ErrorCode, HeronError
from tests.support.nats_server import NatsServer


class ForeverLoading:
    """A service whose model is always still loading (503 MODEL_LOADING, retry soon)."""

    def __init__(self) -> None:
        self.calls = 0

    def items_in_forward(self) -> int:
        return 0

    def passes_busy(self) -> bool:
        return False

    async def encode(self, model: str, request: object) -> None:
        self.calls += 1
        raise HeronError(ErrorCode.MODEL_LOADING, f"model {model} is loading",
                         retry_after_s=0.05)


async def test_out_of_deliveries_goes_to_dlq_and_the_caller_hears(
        nats_server: NatsServer) -> None:
    pool = f"d{uuid.uuid4().hex[:8]}"
    spec = WorkStreamSpec(pool=pool, max_deliver=3, ack_wait_s=2.0)
    nc = await nats.connect(nats_server.url)
    service = ForeverLoading()
    metrics = WorkerMetrics()
    consumer = WorkConsumer(nc, service, spec, metrics=metrics)  # type: ignore[arg-type]
    await consumer.start()
    try:
        js = nc.jetstream()
        before = (await js.stream_info(DLQ_STREAM)).state.messages
        inbox = f"_INBOX.heron.dlqtest.{uuid.uuid4().hex[:6]}"
        sub = await nc.subscribe(inbox)
        body = wire.encode({"items": ["never computed"]}, wire.MSGPACK)
        await js.publish(work_subject(pool, "m"), body, headers=WorkItemHeaders(
            "r1", "encode", "m", inbox, 0, 1, None, 0).to_wire())
        probes = 0
        while True:  # answer as a gateway does: every message, probes (empty) included
            msg = await sub.next_msg(timeout=10)
            await msg.respond(b"")
            if msg.data:
                break
            probes += 1
        # each redelivery first asked whether this inbox still listens
        assert probes == 2
        result = wire.decode(msg.data, wire.MSGPACK)
        assert result["request_id"] == "r1"
        assert result["error"]["code"] == "MODEL_LOADING"
        assert "after 3 deliveries" in result["error"]["message"]
        assert service.calls == 3
        await asyncio.sleep(0.2)
        assert (await js.stream_info(DLQ_STREAM)).state.messages == before + 1
        dead = await js.get_last_msg(DLQ_STREAM, dlq_subject(pool))
        assert dead.data == body and dead.headers["Heron-Request-Id"] == "r1"
        assert (await js.stream_info(work_stream(pool))).state.messages == 0
        # what an operator's dashboard shows: two redeliveries, then one dead letter
        text = metrics.render().decode()
        assert f'heron_worker_redeliveries_total{{pool="{pool}"}} 2.0' in text
        assert f'heron_worker_dead_letters_total{{pool="{pool}"}} 1.0' in text
    finally:
        await consumer.drain()
        await nc.close()


async def test_unreadable_headers_go_to_dlq_at_once(nats_server: NatsServer) -> None:
    """A work item whose Heron-Item-Count is no number never runs and is not redelivered:
    it is dead-lettered on its first delivery, and the work stream is empty again."""
    pool = f"d{uuid.uuid4().hex[:8]}"
    nc = await nats.connect(nats_server.url)
    service = ForeverLoading()
    metrics = WorkerMetrics()
    spec = WorkStreamSpec(pool=pool)
    consumer = WorkConsumer(nc, service, spec, metrics=metrics)  # type: ignore[arg-type]
    await consumer.start()
    try:
        js = nc.jetstream()
        headers = WorkItemHeaders("r-bad", "encode", "m", "_INBOX.nobody", 0, 1, None,
                                  0).to_wire() | {"Heron-Item-Count": "many"}
        body = wire.encode({"items": ["never computed"]}, wire.MSGPACK)
        await js.publish(work_subject(pool, "m"), body, headers=headers)
        for _ in range(100):
            if (await js.stream_info(work_stream(pool))).state.messages == 0:
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)
        dead = await js.get_last_msg(DLQ_STREAM, dlq_subject(pool))
        assert dead.data == body and dead.headers["Heron-Item-Count"] == "many"
        assert (await js.stream_info(work_stream(pool))).state.messages == 0
        assert service.calls == 0
        assert f'heron_worker_dead_letters_total{{pool="{pool}"}} 1.0' in \
            metrics.render().decode()
    finally:
        await consumer.drain()
        await nc.close()
