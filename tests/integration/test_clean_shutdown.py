"""SIGTERM is how Kubernetes, `heron up` and an operator stop a Heron server: each of `heron
config`, `heron gateway`, `heron worker` and `heron serve` drains, then exits 0 with no
traceback in its log (after serving a request, so its NATS connection and models are in
use when the signal comes)."""

from __future__ import annotations

import signal
import time
import uuid
from pathlib import Path

import pytest

from tests.support import local_http
from tests.support.cluster_procs import ChildProcess, ConfigProcess, GatewayProcess, WorkerProcess
from tests.support.nats_server import NatsServer
from tests.support.servers import start_serve


@pytest.mark.slow
def test_sigterm_stops_every_server_with_exit_0_and_no_traceback(
        nats_server: NatsServer, tmp_path: Path) -> None:
    pool = f"stop{uuid.uuid4().hex[:6]}"
    config = ConfigProcess(nats_server.url, str(tmp_path / "store"), tmp_path)
    gateway = GatewayProcess(nats_server.url, {"default": pool}, tmp_path)
    worker = WorkerProcess(nats_server.url, pool, tmp_path)
    children: list[ChildProcess] = [config, gateway, worker]
    serve = None
    try:
        serve = start_serve("default", tmp_path, extra_args=["--workers", "1"])
        for child in children:
            child.wait_ready()
        body = {"items": ["stop cleanly"], "timeout_s": 30}
        deadline = time.monotonic() + 30
        while local_http.post(gateway.url + "/v1/encode/minilm", json=body,
                              timeout=30).status_code != 200:  # through NATS and the worker
            assert time.monotonic() < deadline, gateway.log_tail()
            time.sleep(0.2)
        assert local_http.post(serve.url + "/v1/encode/minilm", json=body).status_code == 200
        assert local_http.get(config.url + "/v1/configs/epoch").status_code == 200

        for child in children:
            child.proc.send_signal(signal.SIGTERM)
        serve.proc.send_signal(signal.SIGTERM)
        exits = {child.kind: child.proc.wait(60) for child in children}
        exits["serve"] = serve.proc.wait(60)
        logs = {child.kind: child.log_path.read_text(errors="replace") for child in children}
        logs["serve"] = serve.log()
        assert exits == dict.fromkeys(("config", "gateway", "worker", "serve"), 0), \
            (exits, {k: v[-2000:] for k, v in logs.items()})
        for kind, log in logs.items():
            assert "Traceback" not in log, (kind, log[-4000:])
    finally:
        for child in children:
            child.stop()
        if serve is not None:
            serve.stop()
