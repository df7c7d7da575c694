"""The config service on an S3 store: moto's S3 server on loopback, reached with boto3
over real HTTP (nothing patched). Writes land as objects, a restart keeps every model and
the epoch, bad input leaves the bucket as it was, a missing bucket keeps it not ready."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import httpx
import pytest

from heron.config_service.blobs import S3Blobs
from heron.config_service.store import ConfigStore
from tests.support import local_http
from tests.support.config_procs import InProcessConfig, MotoS3, model_body, own_nats, write_bundles

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoS3]:
    server = MotoS3(tmp_path_factory.mktemp("moto"))
    yield server
    server.stop()


@pytest.fixture()
def s3_env(moto: MotoS3, monkeypatch: pytest.MonkeyPatch) -> Any:
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto.url)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    return boto3.client("s3", endpoint_url=moto.url)


@pytest.fixture()
def nats_url(tmp_path: Path) -> Iterator[str]:
    yield from own_nats(tmp_path)


def objects(s3: Any, bucket: str) -> dict[str, str]:
    listing = s3.list_objects_v2(Bucket=bucket).get("Contents", [])
    return {o["Key"]: o["ETag"] for o in listing}


def test_s3_store_survives_restart(s3_env: Any, nats_url: str, tmp_path: Path) -> None:
    s3 = s3_env
    s3.create_bucket(Bucket="heron-cfg")
    bundles_dir = write_bundles(tmp_path / "bundles")
    url = "s3://heron-cfg/prod/config"
    first = InProcessConfig(nats_url, url, bundles_dir).start()
    try:
        assert first.post(model_body("org/a")).status_code == 201
        assert first.post(model_body("org/b", bundles=["beta"])).status_code == 201
        before = objects(s3, "heron-cfg")
        assert sorted(before) == ["prod/config/changes/000000000001.json",
                                  "prod/config/changes/000000000002.json",
                                  "prod/config/journal.json"]
        for body, status in ((model_body("org/a", description="changed"), 409),
                             (model_body("../x"), 422), (b"x" * ((1 << 20) + 1), 413)):
            assert first.post(body).status_code == status
        assert objects(s3, "heron-cfg") == before
        export = first.get("/v1/configs/export").json()
    finally:
        first.stop()

    journal = ConfigStore(S3Blobs("heron-cfg", "prod/config", client=s3)).read_journal()
    assert journal.epoch == 2 and not journal.unpublished()

    second = InProcessConfig(nats_url, url, bundles_dir).start()
    try:
        assert second.get("/v1/configs/export").json() == export
        r = second.post(model_body("org/c"))
        assert r.status_code == 201 and r.json()["epoch"] == 3
    finally:
        second.stop()


def test_missing_bucket_is_not_ready(s3_env: Any, nats_url: str, tmp_path: Path) -> None:
    service = InProcessConfig(nats_url, "s3://no-such-bucket/x",
                              write_bundles(tmp_path / "bundles"))
    service.thread.start()
    try:
        deadline = time.monotonic() + 20
        status: dict[str, Any] = {}
        while time.monotonic() < deadline and not status.get("last_error"):
            try:
                r = local_http.get(f"{service.url}/readyz", timeout=2)
                status = r.json()
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        assert r.status_code == 503
        assert status["store_loaded"] is False and "no-such-bucket" in status["last_error"]
        assert service.post(model_body()).status_code == 503
    finally:
        service.stop()
