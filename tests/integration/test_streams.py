"""Work streams are declared from one definition, idempotently; mismatches are reported."""

from __future__ import annotations

import uuid

import nats
import pytest
from nats.js.api import RetentionPolicy, StorageType, StreamConfig

from heron.runtime.nats_names import (
    StreamMismatch,
    WorkStreamSpec,
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
