"""`heron up` honours leased pools: a lease gets its workers, and loses them when it ends."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from heron_sdk.pools import POOL_HEADER
from tests.integration.test_up import UpProcess
from tests.support import local_http


@pytest.mark.slow
def test_a_leased_pool_gets_its_worker_until_the_lease_ends(tmp_path: Path) -> None:
    # No static worker: every worker that starts is the lease's.
    up = UpProcess(tmp_path, "--workers", "0", "--min-workers", "0")
    name = "team-up"
    pool_url = f"{up.url}/v1/pools/{name}"

    def lease_workers() -> list[str]:
        return [c for c in up.child_commands() if " worker " in c and f"--pool {name}" in c]

    try:
        up.wait_for(lambda: local_http.get(up.url + "/readyz", timeout=1).status_code == 200)
        created = local_http.post(up.url + "/v1/pools", timeout=10, json={
            "name": name, "bundle": "default", "workers": 1, "ttl_s": 60})
        assert created.status_code == 201, created.text
        up.wait_for(lambda: local_http.get(pool_url, timeout=2).json()["healthy_workers"] == 1,
                    timeout_s=120)
        assert len(lease_workers()) == 1
        assert f"starting for leased pool {name}" in up.log.read_text()

        r = local_http.post(up.url + "/v1/encode/minilm", json={"items": ["leased", "pool"]},
                            headers={POOL_HEADER: name}, timeout=30)
        assert r.status_code == 200, r.text
        assert len(r.json()["items"]) == 2 and len(r.json()["items"][0]["dense"]) == 384
        pools = local_http.get(up.url + "/readyz", timeout=2).json()["pools"]
        assert pools[name]["kind"] == "lease" and pools["default"]["healthy_workers"] == 0

        # Shorten the lease and stop renewing it: it expires, and its worker is stopped.
        renewed = local_http.post(pool_url + "/renew", json={"ttl_s": 2}, timeout=10)
        assert renewed.status_code == 200
        up.wait_for(lambda: local_http.get(pool_url, timeout=2).status_code == 404, timeout_s=10)
        up.wait_for(lambda: not lease_workers()  # logged just after the process is reaped
                    and re.search(rf"worker {name}-\d+ stopped", up.log.read_text()),
                    timeout_s=60)
        gone = local_http.post(up.url + "/v1/encode/minilm", json={"items": ["x"]},
                               headers={POOL_HEADER: name}, timeout=10)
        assert gone.status_code == 404 and gone.json()["error"]["code"] == "POOL_NOT_FOUND"
    finally:
        assert up.stop() == 0
