"""Operator settings through the real commands: `heron gateway` answers and declares streams
with what its flags and variables say (the flag winning), `heron config` leases with its
variable's TTL, and a bad value stops each command with exit status 2 and one line, before
it binds its port."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import nats
import pytest

from heron.runtime.nats_names import (
    CONFIG_LEADER_BUCKET,
    work_consumer,
    work_stream,
)
from tests.support import local_http
from tests.support.cluster_procs import ConfigProcess, GatewayProcess
from tests.support.nats_server import NatsServer
from tests.support.servers import REPO, free_port


async def _stream_and_consumer(url: str, stream: str, consumer: str | None) -> tuple:
    nc = await nats.connect(url)
    try:
        js = nc.jetstream()
        info = await js.stream_info(stream)
        con = await js.consumer_info(stream, consumer) if consumer else None
        return info.config, con.config if con else None
    finally:
        await nc.close()


def test_gateway_settings_come_from_flags_then_variables(nats_server: NatsServer,
                                                         tmp_path: Path) -> None:
    pool = f"st{uuid.uuid4().hex[:8]}"
    env = {"HERON_GATEWAY_PROVISIONING_RETRY_AFTER_S": "9",  # the flag below wins
           "HERON_GATEWAY_PROVISIONING_ESTIMATE_S": "7",
           "HERON_STREAM_MAX_DELIVER": "3", "HERON_STREAM_FILE_STORAGE": "false"}
    gateway = GatewayProcess(nats_server.url, {"default": pool}, tmp_path, extra_env=env,
                             extra_args=["--provisioning-retry-after-s", "4",
                                         "--startup-grace-s", "0",
                                         "--stream-ack-wait-s", "7"])
    try:
        gateway.wait_ready()
        r = local_http.post(gateway.url + "/v1/encode/minilm", json={"items": ["hi"]}, timeout=10)
        assert r.status_code == 202, r.text  # no worker in this pool
        assert r.headers["retry-after"] == "4"
        assert 6.0 <= r.json()["estimated_wait_s"] <= 7.0  # counts down from 7
        stream, consumer = asyncio.run(_stream_and_consumer(
            nats_server.url, work_stream(pool), work_consumer(pool)))
    finally:
        gateway.stop()
    assert getattr(stream.storage, "value", stream.storage) == "memory"
    assert consumer.max_deliver == 3 and consumer.ack_wait == 7.0


@pytest.fixture
def own_nats(tmp_path: Path):
    """The lease bucket's TTL is set when it is created: a server of the test's own."""
    server = NatsServer(tmp_path / "nats").start()
    yield server
    server.stop()


def test_config_service_leases_with_its_variable_ttl(own_nats: NatsServer,
                                                     tmp_path: Path) -> None:
    service = ConfigProcess(own_nats.url, str(tmp_path / "store"), tmp_path,
                            extra_env={"HERON_CONFIG_LEASE_TTL_S": "3"})
    try:
        service.wait_ready()
        bucket, _ = asyncio.run(_stream_and_consumer(
            own_nats.url, f"KV_{CONFIG_LEADER_BUCKET}", None))
    finally:
        service.stop()
    assert bucket.max_age == 3.0


BAD = [
    (["heron.cli", "gateway", "--default-timeout-s", "nan"], {},
     "heron: config error: --default-timeout-s: 'nan': must be a finite number"),
    (["heron.cli", "worker"], {"HERON_STREAM_MAX_DELIVER": "0"},
     "heron: config error: HERON_STREAM_MAX_DELIVER: '0': must be at least 1"),
    (["heron.cli", "config", "--lease-ttl-s", "-1"], {},
     "heron: config error: --lease-ttl-s: '-1': must be more than 0"),
    (["heron.config_service", "--max-body-bytes", "lots"], {},
     "heron config: --max-body-bytes: 'lots': not a size"),
]


@pytest.mark.parametrize(("argv", "env", "line"), BAD, ids=[" ".join(a) for a, _, _ in BAD])
def test_a_bad_setting_exits_2_before_binding(argv: list[str], env: dict[str, str],
                                              line: str) -> None:
    port = free_port()
    proc = subprocess.run([sys.executable, "-m", *argv, "--port", str(port)],
                          capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={**os.environ, **env})
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    assert line in proc.stderr
    with socket.socket() as s:  # nothing ever listened there
        assert s.connect_ex(("127.0.0.1", port)) != 0
