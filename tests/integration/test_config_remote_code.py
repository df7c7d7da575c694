"""A real ``heron config`` process and the two things a config that names only its id and
source may carry: no ``adapter`` (stored as "auto", routed to every bundle), and
``trust_remote_code`` (refused unless the operator started the service with
``--allow-remote-code`` or HERON_ALLOW_REMOTE_CODE=1)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.support import local_http
from tests.support.cluster_procs import ChildProcess
from tests.support.config_procs import ADMIN, own_nats, wait_status, write_bundles

pytestmark = pytest.mark.timeout(120)

HEADERS = {"Authorization": f"Bearer {ADMIN}"}
CUSTOM = {"id": "org/custom-code", "source": {"hub": "org/custom-code"},
          "trust_remote_code": True}


class Config:
    """`heron config` on its own nats-server and store, with the admin token."""

    def __init__(self, tmp_path: Path, args: list[str], env: dict[str, str]) -> None:
        self.nats = own_nats(tmp_path)
        nats_url = next(self.nats)
        self.proc = ChildProcess(
            "config", ["--nats", nats_url, "--store", str(tmp_path / "store"),
                       "--bundles-dir", str(write_bundles(tmp_path / "bundles")),
                       "--lease-ttl", "2", *args],
            tmp_path, {"HERON_ADMIN_TOKEN": ADMIN, "HERON_ALLOW_REMOTE_CODE": "", **env})
        self.url = self.proc.url
        wait_status(self.url, 30, leader=True, proc=self.proc.proc)

    def post(self, body: dict[str, Any]) -> httpx.Response:
        return local_http.post(f"{self.url}/v1/configs/models", json=body, headers=HEADERS,
                               timeout=30)

    def get(self, path: str) -> httpx.Response:
        return local_http.get(f"{self.url}{path}", headers=HEADERS, timeout=30)

    def stop(self) -> None:
        self.proc.stop()
        next(self.nats, None)  # the generator's cleanup stops the nats-server


def _start(tmp_path: Path, args: list[str], env: dict[str, str]) -> Iterator[Config]:
    service = Config(tmp_path, args, env)
    try:
        yield service
    finally:
        service.stop()


@pytest.fixture()
def default_service(tmp_path: Path) -> Iterator[Config]:
    yield from _start(tmp_path, [], {})


@pytest.fixture(params=["flag", "env"])
def allowing_service(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Config]:
    if request.param == "flag":
        yield from _start(tmp_path, ["--allow-remote-code"], {})
    else:
        yield from _start(tmp_path, [], {"HERON_ALLOW_REMOTE_CODE": "1"})


def test_remote_code_is_refused_by_default(default_service: Config) -> None:
    r = default_service.post(CUSTOM)
    assert r.status_code == 422, r.text
    error = r.json()["error"]
    assert error["code"] == "INVALID_FIELD" and error["field"] == "trust_remote_code"
    # It says why, and how the operator enables it.
    assert "every worker" in error["message"]
    assert "--allow-remote-code" in error["message"]
    assert "HERON_ALLOW_REMOTE_CODE=1" in error["message"]
    # Nothing was stored.
    assert default_service.get("/v1/configs/epoch").json()["epoch"] == 0
    assert default_service.get("/v1/configs/models/org/custom-code").status_code == 404
    # trust_remote_code: false (or null) is the default, and fine.
    for value in (False, None):
        body = {**CUSTOM, "id": f"org/plain-{value}".lower(), "trust_remote_code": value}
        assert default_service.post(body).status_code == 201


def test_a_config_without_adapter_is_stored_as_auto(default_service: Config) -> None:
    r = default_service.post({"id": "org/only-id", "source": {"path": "/models/x"}})
    assert r.status_code == 201, r.text
    bundles = [b["name"] for b in default_service.get("/v1/configs/bundles").json()["bundles"]]
    # "auto" may be any family: every bundle routes it (a worker whose bundle does not
    # serve the family it detects refuses the model at load).
    assert r.json()["bundles"] == sorted(bundles) == ["alpha", "beta", "sparsebox"]
    stored = default_service.get("/v1/configs/models/org/only-id").json()
    assert stored["model"]["adapter"] == "auto"
    assert "trust_remote_code" not in stored["model"]
    summary = {m["id"]: m for m in default_service.get("/v1/configs/models").json()["models"]}
    assert summary["org/only-id"]["adapter"] == "auto"
    # Asked for by name, any bundle takes it too; an explicit adapter stays checked.
    r = default_service.post({"id": "org/only-id-2", "source": {"hub": "org/x"},
                              "bundles": ["sparsebox"]})
    assert r.status_code == 201 and r.json()["bundles"] == ["sparsebox"], r.text
    r = default_service.post({"id": "org/dense-in-sparsebox", "adapter": "dense",
                              "source": {"hub": "org/x"}, "bundles": ["sparsebox"]})
    assert r.status_code == 422 and r.json()["error"]["field"] == "bundles", r.text
    # Posting it again with the adapter spelled "auto" is the same content: a no-op.
    again = default_service.post({"id": "org/only-id", "adapter": "auto",
                                  "source": {"path": "/models/x"}})
    assert again.status_code == 200 and again.json()["created"] is False, again.text


def test_remote_code_is_accepted_when_the_operator_allows_it(allowing_service: Config
                                                             ) -> None:
    r = allowing_service.post(CUSTOM)
    assert r.status_code == 201, r.text
    stored = allowing_service.get("/v1/configs/models/org/custom-code").json()["model"]
    assert stored["trust_remote_code"] is True and stored["adapter"] == "auto"
    export = allowing_service.get("/v1/configs/export").json()
    assert export["models"]["org/custom-code"]["trust_remote_code"] is True
    # The opt-in is part of the stored content: append-only, like the adapter.
    r = allowing_service.post({**CUSTOM, "trust_remote_code": False})
    assert r.status_code == 409, r.text
    assert r.json()["error"]["fields"] == ["trust_remote_code"]
    # New profiles keep it.
    r = allowing_service.post({**CUSTOM, "profiles": {"default": {}, "fast": {
        "max_wait_ms": 0}}})
    assert r.status_code == 201, r.text
    stored = allowing_service.get("/v1/configs/models/org/custom-code").json()["model"]
    assert stored["trust_remote_code"] is True and sorted(stored["profiles"]) == [
        "default", "fast"]
    assert allowing_service.post(CUSTOM).json()["created"] is False
