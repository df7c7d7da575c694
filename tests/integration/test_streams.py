"""Work streams are declared from one definition, idempotently; mismatches are reported."""

from __future__ import annotations

import uuid

import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig

from heron.runtime.nats_names import (
    Lane,
    StreamMismatch,
    WorkStreamSpec,
    bulk_consumer,
    ensure_work_stream,
    lane_consumer,
    lane_of,
    token,
    work_consumer,
    work_stream,
    work_subject,
)
from tests.support.nats_server import NatsServer


def test_names_are_subject_safe() -> None:
    assert work_subject("gpu-a", "sentence-transformers/all-MiniLM-L6-v2") == \
        "heron.work.gpu-a.sentence-transformers_all-MiniLM-L6-v2"
    assert token("a.b c*>") == "a_b_c"
    with pytest.raises(ValueError):
        token("...")


async def test_ensure_is_idempotent_and_reports_mismatch(nats_server: NatsServer) -> None:
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    pool = f"p{uuid.uuid4().hex[:8]}"
    try:
        spec = WorkStreamSpec(pool=pool)
        await ensure_work_stream(js, spec)
        await ensure_work_stream(js, spec)  # second side starting: no error, no change
        info = await js.stream_info(work_stream(pool))
        assert info.config.retention == RetentionPolicy.WORK_QUEUE
        assert info.config.storage == StorageType.FILE
        consumer = await js.consumer_info(work_stream(pool), work_consumer(pool))
        assert consumer.config.ack_wait == spec.ack_wait_s
        assert consumer.config.max_deliver == spec.max_deliver

        other = f"q{uuid.uuid4().hex[:8]}"
        await js.add_stream(StreamConfig(name=work_stream(other),
                                         subjects=[f"heron.work.{other}.>"],
                                         storage=StorageType.MEMORY))
        with pytest.raises(StreamMismatch, match="retention"):
            await ensure_work_stream(js, WorkStreamSpec(pool=other))
    finally:
        await nc.close()


async def test_each_lane_with_its_consumer(nats_server: NatsServer) -> None:
    """Priority 0, the other priorities and bulk jobs' shards share the pool's stream; each
    lane's consumer gets only its own messages. A consumer declared before the other lanes
    existed (its filter took every subject) is updated, not refused."""
    nc = await nats.connect(nats_server.url)
    js = nc.jetstream()
    pool = f"l{uuid.uuid4().hex[:8]}"
    spec = WorkStreamSpec(pool=pool)
    try:
        await js.add_stream(spec.stream_config())
        await js.add_consumer(work_stream(pool), ConsumerConfig(
            durable_name=work_consumer(pool), ack_policy=AckPolicy.EXPLICIT,
            filter_subject=f"heron.work.{pool}.>"))
        await ensure_work_stream(js, spec)
        await js.publish(work_subject(pool, "m"), b"priority 0")
        await js.publish(work_subject(pool, "m", lane_of(3)), b"priority 3")
        await js.publish(work_subject(pool, "m", lane_of(0, bulk=True)), b"bulk")
        await js.publish(work_subject(pool, "bulk"), b"a model named bulk")
        await js.publish(work_subject(pool, "low"), b"a model named low")
        got = {}
        for lane in Lane:
            sub = await js.pull_subscribe_bind(durable=lane_consumer(pool, lane),
                                               stream=work_stream(pool))
            msgs = await sub.fetch(10, timeout=1)
            got[lane] = sorted(m.data for m in msgs)
            for m in msgs:
                await m.ack()
        assert got == {Lane.FIRST: [b"a model named bulk", b"a model named low", b"priority 0"],
                       Lane.LOW: [b"priority 3"], Lane.BULK: [b"bulk"]}
        assert lane_consumer(pool, Lane.BULK) == bulk_consumer(pool)
    finally:
        await nc.close()
