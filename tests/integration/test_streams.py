"""Work streams are declared from one definition, idempotently; mismatches are reported."""

from __future__ import annotations

import uuid

import nats
import pytest
from nats.js.api import AckPolicy, ConsumerConfig, RetentionPolicy, StorageType, StreamConfig

from heron.runtime.nats_names import (
    StreamMismatch,
    WorkStreamSpec,
    bulk_consumer,
    ensure_work_stream,
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


async def test_two_lanes_each_with_its_consumer(nats_server: NatsServer) -> None:
    """Interactive work and bulk jobs' shards share the pool's stream; each lane's consumer
    gets only its own messages. A consumer declared before the bulk lane existed (its
    filter took every subject) is updated, not refused."""
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
        await js.publish(work_subject(pool, "m"), b"interactive")
        await js.publish(work_subject(pool, "m", bulk=True), b"bulk")
        await js.publish(work_subject(pool, "bulk"), b"a model named bulk")
        got = {}
        for durable in (work_consumer(pool), bulk_consumer(pool)):
            sub = await js.pull_subscribe_bind(durable=durable, stream=work_stream(pool))
            msgs = await sub.fetch(10, timeout=1)
            got[durable] = sorted(m.data for m in msgs)
            for m in msgs:
                await m.ack()
        assert got == {work_consumer(pool): [b"a model named bulk", b"interactive"],
                       bulk_consumer(pool): [b"bulk"]}
    finally:
        await nc.close()
