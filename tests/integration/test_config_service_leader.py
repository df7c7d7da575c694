"""Two config services on one NATS and one store: exactly one writes; kill -9 it and the
other takes over within a few lease TTLs, continuing the epoch from the shared store."""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from heron.runtime.nats_names import config_all_subject
from tests.support import local_http
from tests.support.config_procs import (
    LeaderConfigProcess,
    model_body,
    own_nats,
    read_deltas,
    wait_status,
    write_bundles,
)

pytestmark = pytest.mark.timeout(180)

TTL_S = 1.5


@pytest.fixture()
def nats_url(tmp_path: Path) -> Iterator[str]:
    yield from own_nats(tmp_path)


def wait_for(predicate, timeout_s: float, what: str) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while time.monotonic() - start < timeout_s:
        if predicate():
            return time.monotonic() - start
        time.sleep(0.05)
    raise TimeoutError(what)


def test_one_writer_and_takeover(nats_url: str, tmp_path: Path) -> None:
    bundles_dir = write_bundles(tmp_path / "bundles")
    store = tmp_path / "store"
    procs = [LeaderConfigProcess(nats_url, store, bundles_dir, tmp_path, lease_ttl_s=TTL_S)
             for _ in range(2)]
    try:
        for p in procs:
            wait_status(p.url, 60, proc=p.proc)
        wait_for(lambda: sum(p.status()["leader"] for p in procs) == 1, 10 * TTL_S,
                 "no leader elected")
        time.sleep(TTL_S)  # and it stays exactly one
        leaders = [p for p in procs if p.status()["leader"]]
        assert len(leaders) == 1, [p.status() for p in procs]
        leader, standby = leaders[0], next(p for p in procs if p is not leaders[0])
        assert standby.status()["leader_id"] == leader.status()["instance_id"]

        refused = standby.post(model_body("org/refused"))
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["code"] == "NOT_LEADER"
        assert int(refused.headers["retry-after"]) >= 1
        assert leader.post(model_body("org/one")).status_code == 201
        # The standby follows the store: its reads catch up without a write of its own.
        wait_for(lambda: local_http.get(f"{standby.url}/v1/configs/epoch").json()["epoch"] == 1,
                 10, "the standby did not see epoch 1")
        assert local_http.get(f"{standby.url}/v1/configs/models/org/one").status_code == 200

        leader.stop(signal.SIGKILL)
        took = wait_for(lambda: standby.status()["leader"], 4 * TTL_S + 2,
                        "the standby did not take over")
        assert took <= 4 * TTL_S + 2
        r = standby.post(model_body("org/two"))
        assert r.status_code == 201 and r.json()["epoch"] == 2, r.text
        epochs = [d["epoch"] for _, d in read_deltas(nats_url, config_all_subject(),
                                                     expect=2)]
        assert epochs == [1, 2]

        # The old leader comes back: it is the standby now, and says who leads.
        back = LeaderConfigProcess(nats_url, store, bundles_dir, tmp_path, lease_ttl_s=TTL_S)
        procs.append(back)
        status = wait_status(back.url, 60, proc=back.proc)
        assert status["leader"] is False and status["epoch"] == 2
        assert back.post(model_body("org/three")).status_code == 503

        # A clean stop hands the lease over at once (no TTL to wait out).
        standby.stop(signal.SIGTERM)
        took = wait_for(lambda: back.status()["leader"], 3 * TTL_S,
                        "no takeover after a clean stop")
        assert took <= TTL_S + 1, took
        assert back.post(model_body("org/three")).json()["epoch"] == 3
    finally:
        for p in procs:
            p.stop()
