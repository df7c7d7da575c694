"""HERON_STREAM_REPLICAS=3, as deploy/k8s sets it, on a real 3-node JetStream cluster:
every stream and bucket Heron declares gets three replicas, and a worker declaring the
same work stream after the gateway finds no mismatch."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import nats
import pytest

from heron.gateway.settings import GatewaySettings
from heron.runtime.nats_names import (
    CONFIG_STREAM,
    DLQ_STREAM,
    POOLS_BUCKET,
    RESULTS_BUCKET,
    WorkStreamSpec,
    ensure_config_stream,
    ensure_dlq_stream,
    ensure_pools_bucket,
    ensure_results_bucket,
    ensure_work_stream,
    work_stream,
)
from tests.support.nats_server import NatsCluster


@pytest.fixture
def nats_cluster(tmp_path: Path):
    cluster = NatsCluster(tmp_path).start()
    try:
        yield cluster.urls
    finally:
        cluster.stop()


async def _connect(urls: list[str]):
    deadline = time.monotonic() + 20
    while True:
        try:
            nc = await nats.connect(servers=urls, connect_timeout=1, max_reconnect_attempts=1)
            js = nc.jetstream()
            await js.account_info()  # answers once the cluster has a meta leader
            return nc, js
        except Exception:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.2)


async def test_streams_and_buckets_get_three_replicas(nats_cluster, monkeypatch):
    monkeypatch.setenv("HERON_STREAM_REPLICAS", "3")
    nc, js = await _connect(nats_cluster)
    try:
        # The gateway first; right after start-up the cluster may not have all three peers
        # yet ("insufficient resources"), so its first declaration is retried briefly.
        deadline = time.monotonic() + 20
        while True:
            try:
                await ensure_work_stream(js, GatewaySettings().stream_spec("default"))
                break
            except nats.errors.Error:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.2)
        await ensure_work_stream(js, WorkStreamSpec(pool="default"))  # a worker, after it
        await ensure_dlq_stream(js)
        await ensure_config_stream(js)
        await ensure_pools_bucket(js)
        await ensure_results_bucket(js, 1 << 20, 3600.0, 1 << 18)  # a worker's, when on
        for stream in (work_stream("default"), DLQ_STREAM, CONFIG_STREAM,
                       f"KV_{POOLS_BUCKET}", f"KV_{RESULTS_BUCKET}"):
            info = await js.stream_info(stream)
            assert info.config.num_replicas == 3, stream
            assert info.cluster is not None and len(info.cluster.replicas or []) == 2, stream
    finally:
        await nc.close()
