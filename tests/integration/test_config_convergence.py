"""Gateways and workers follow the config service: a POSTed model routes and serves on a
live cluster without restarts; late and cut-off gateways converge (real processes)."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from tests.support import local_http
from tests.support.cluster_procs import ConfigProcess, GatewayProcess, WorkerProcess
from tests.support.nats_server import NatsServer
from tests.support.tcp_proxy import TcpProxy

pytestmark = pytest.mark.slow
RESYNC = {"HERON_CONFIG_RESYNC_S": "1"}
# Each config epoch a gateway applies is an info line: a failed wait shows which it had.
INFO_LOGS = ["--log-level", "info"]


def tiny_config(model_id: str, path: Path) -> dict:
    return {"id": model_id, "adapter": "dense", "source": {"path": str(path)},
            "profiles": {"default": {"pooling": "mean", "max_sequence_length": 64}},
            "bundles": ["default"]}


def wait(check: Callable[[], bool], timeout_s: float = 30, every: float = 0.05,
         explain: Callable[[], str] | None = None) -> float:
    started = time.monotonic()
    while not check():
        assert time.monotonic() - started < timeout_s, \
            f"timed out after {timeout_s} s" + (f"\n{explain()}" if explain else "")
        time.sleep(every)
    return time.monotonic() - started


def listing(gateway: GatewayProcess) -> str:
    """What a gateway answers on /v1/models and /readyz, and its log: why a wait failed."""
    parts = []
    for path in ("/v1/models", "/readyz"):
        try:
            r = local_http.get(gateway.url + path, timeout=5)
            parts.append(f"GET {path}: {r.status_code} {r.text[:2000]}")
        except httpx.HTTPError as exc:
            parts.append(f"GET {path}: {exc!r}")
    return "\n".join([*parts, gateway.log_tail()])


def model_ids(gateway: GatewayProcess) -> set[str]:
    r = local_http.get(gateway.url + "/v1/models", timeout=5)
    return {m["id"] for m in r.json()["data"]} if r.status_code == 200 else set()


def test_post_routes_within_a_second_and_serves_without_restart(
        nats_server: NatsServer, config_service: ConfigProcess, tmp_path: Path,
        tiny_models: dict[str, Path]) -> None:
    pool = f"c{uuid.uuid4().hex[:8]}"
    args = ["--config", config_service.url]
    worker = WorkerProcess(nats_server.url, pool, tmp_path, extra_args=args)
    gateway = GatewayProcess(nats_server.url, {"default": pool}, tmp_path, extra_args=args,
                             extra_env=RESYNC)
    try:
        worker.wait_ready()
        gateway.wait_ready()
        assert "sentence-transformers/all-MiniLM-L6-v2" in model_ids(gateway)
        model_id = f"live/{uuid.uuid4().hex[:6]}"
        posted = time.monotonic()
        r = local_http.post(config_service.url + "/v1/configs/models",
                            json=tiny_config(model_id, tiny_models["tiny-sentencepiece"]))
        assert r.status_code == 201, r.text
        wait(lambda: model_id in model_ids(gateway), timeout_s=10)
        routed_after = time.monotonic() - posted
        print(f"gateway routes the new model {routed_after:.3f}s after its POST")
        assert routed_after < 2.0
        # The worker loads it live; the gateway's answer comes from it.
        def encoded() -> bool:
            resp = local_http.post(gateway.url + f"/v1/encode/{model_id}",
                                   json={"items": ["hello live model"]}, timeout=30)
            return resp.status_code == 200 and len(resp.json()["items"][0]["dense"]) == 32
        wait(encoded, timeout_s=60, every=0.3)

        # Built from heartbeats (one a second): the beat after the load says ready.
        def status() -> dict:
            return local_http.get(gateway.url + f"/v1/configs/models/{model_id}/status").json()

        wait(lambda: status().get("workers", [{}])[0].get("state") == "ready", timeout_s=5)
        final = status()
        assert final["applied_by"] == 1 and final["workers"][0]["state"] == "ready"
        assert final["workers"][0]["bundle_hash_matches"] is True
    finally:
        worker.stop()
        gateway.stop()


def test_late_and_cut_off_gateways_converge(nats_server: NatsServer, config_service: ConfigProcess,
                                            tmp_path: Path,
                                            tiny_models: dict[str, Path]) -> None:
    pool = f"c{uuid.uuid4().hex[:8]}"
    proxy = TcpProxy(nats_server.port).open()
    cut_off = GatewayProcess(proxy.url, {"default": pool}, tmp_path,
                             extra_args=["--config", config_service.url, *INFO_LOGS],
                             extra_env=RESYNC)
    try:
        cut_off.wait_ready()
        proxy.cut()  # this gateway loses NATS: it will miss every delta below
        ids = [f"batch/{uuid.uuid4().hex[:6]}-{i}" for i in range(10)]
        for model_id in ids:
            r = local_http.post(config_service.url + "/v1/configs/models",
                                json=tiny_config(model_id, tiny_models["tiny-dense-cls"]))
            assert r.status_code == 201, r.text
        late = GatewayProcess(nats_server.url, {"default": pool}, tmp_path,
                              extra_args=["--config", config_service.url, *INFO_LOGS],
                              extra_env=RESYNC)
        try:
            late.wait_ready()
            wait(lambda: set(ids) <= model_ids(late), timeout_s=30,
                 explain=lambda: listing(late))
            proxy.open()
            wait(lambda: set(ids) <= model_ids(cut_off), timeout_s=30,
                 explain=lambda: listing(cut_off))
            assert model_ids(late) == model_ids(cut_off)
            epoch = local_http.get(config_service.url + "/v1/configs/epoch").json()["epoch"]
            for gw in (late, cut_off):
                status = local_http.get(gw.url + f"/v1/configs/models/{ids[-1]}/status").json()
                assert status.get("epoch") == epoch, status
        finally:
            late.stop()
    finally:
        cut_off.stop()
        proxy.close()


def test_followers_need_the_admin_token_for_export(nats_server: NatsServer,
                                                   tmp_path: Path) -> None:
    token = {"HERON_ADMIN_TOKEN": "s3cret"}
    service = ConfigProcess(nats_server.url, str(tmp_path / "store"), tmp_path,
                            extra_env=token)
    service.wait_ready()
    pool = f"c{uuid.uuid4().hex[:8]}"
    args = ["--config", service.url]
    with_token = GatewayProcess(nats_server.url, {"default": pool}, tmp_path,
                                extra_args=args, extra_env=token)
    without = GatewayProcess(nats_server.url, {"default": pool}, tmp_path, extra_args=args,
                             extra_env={"HERON_ADMIN_TOKEN": ""})
    try:
        with_token.wait_ready()
        assert "sentence-transformers/all-MiniLM-L6-v2" in model_ids(with_token)
        # Without the token the export is refused: the gateway stays not ready, and says
        # so instead of answering "unknown model".
        time.sleep(1.5)
        assert local_http.get(without.url + "/readyz").status_code == 503
        r = local_http.post(without.url + "/v1/encode/minilm", json={"items": ["x"]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "NOT_READY"
        # An inference key is no admin token: it cannot write configs.
        r = local_http.post(service.url + "/v1/configs/models", json={"id": "x/y"},
                            headers={"authorization": "Bearer some-inference-key"})
        assert r.status_code == 403
    finally:
        with_token.stop()
        without.stop()
        service.stop()
