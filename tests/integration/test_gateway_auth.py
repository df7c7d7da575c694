"""HERON_API_KEYS guards the gateway's inference API; health stays open."""

from __future__ import annotations

import uuid
from pathlib import Path

from tests.support import local_http
from tests.support.cluster_procs import GatewayProcess
from tests.support.nats_server import NatsServer


def test_api_keys(nats_server: NatsServer, tmp_path: Path) -> None:
    gateway = GatewayProcess(nats_server.url, {"default": f"k{uuid.uuid4().hex[:6]}"},
                             tmp_path, extra_env={"HERON_API_KEYS": "key-a, key-b"})
    try:
        gateway.wait_ready()  # /readyz is open
        url = gateway.url
        assert local_http.get(url + "/healthz").status_code == 200
        assert local_http.get(url + "/metrics").status_code == 200
        body = {"items": ["x"]}
        none = local_http.post(url + "/v1/encode/minilm", json=body)
        assert none.status_code == 401 and none.json()["error"]["code"] == "UNAUTHORIZED"
        wrong = local_http.post(url + "/v1/encode/minilm", json=body,
                                headers={"authorization": "Bearer nope"})
        assert wrong.status_code == 403 and wrong.json()["error"]["code"] == "FORBIDDEN"
        assert local_http.get(url + "/v1/models").status_code == 401
        ok = local_http.get(url + "/v1/models", headers={"authorization": "Bearer key-b"})
        assert ok.status_code == 200
        # A valid key gets past auth (no worker in this pool, so: provisioning).
        r = local_http.post(url + "/v1/encode/minilm", json=body,
                            headers={"authorization": "Bearer key-a"}, timeout=10)
        assert r.status_code == 202
    finally:
        gateway.stop()
