"""NATS going away and coming back: requests fail fast (503) while it is down, the gateway
reconnects by itself, and work queued before a restart (file store) is still answered."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from heron.gateway.settings import GatewaySettings
from tests.integration.test_gateway_api import last_seq
from tests.support import local_http
from tests.support.gateway_harness import (
    FakeWorker,
    GatewayThread,
    fake_vector,
    unique,
    write_bundles,
)
from tests.support.nats_server import NatsServer


def wait_ready(url: str, timeout_s: float = 20) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if local_http.get(url + "/readyz").status_code == 200:
            return
        time.sleep(0.1)
    raise AssertionError(f"{url} not ready after {timeout_s}s")


@pytest.fixture()
def own_nats(tmp_path: Path) -> Iterator[NatsServer]:
    server = NatsServer(tmp_path / "nats").start()
    yield server
    server.stop()


def test_nats_down_is_a_503_after_the_reconnect_wait_and_the_gateway_reconnects(
        own_nats: NatsServer, tmp_path: Path) -> None:
    root = write_bundles(tmp_path / "bundles", {"b": ["dense"]})
    pool = unique("pool")
    worker = FakeWorker(own_nats.url, pool, "b").start()
    gateway = GatewayThread(own_nats.url, {"b": pool}, root,
                            GatewaySettings(startup_grace_s=2.0)).start()
    try:
        gateway.wait_for_capacity(pool, 10)  # its first beat may outlast the grace
        ok = local_http.post(gateway.url + "/v1/encode/b-dense", json={"items": ["hello"]})
        assert ok.status_code == 200, ok.text

        own_nats.stop()
        time.sleep(0.3)  # the client notices the closed socket
        for _ in range(3):
            started = time.monotonic()
            r = local_http.post(gateway.url + "/v1/encode/b-dense", json={"items": ["hello"]},
                                timeout=10)
            # It waits nats_reconnect_wait_s (2 s) for a reconnect, then answers 503.
            assert 1.5 < time.monotonic() - started < 3.5
            assert r.status_code == 503 and r.json()["error"]["code"] == "NATS_UNAVAILABLE"
            assert int(r.headers["retry-after"]) >= 1
        assert local_http.get(gateway.url + "/readyz").status_code == 503
        assert local_http.get(gateway.url + "/healthz").status_code == 200

        own_nats.start()
        wait_ready(gateway.url)
        deadline = time.monotonic() + 15
        while True:  # the worker reconnects and beats again on its own schedule
            r = local_http.post(gateway.url + "/v1/encode/b-dense", json={"items": ["again"]},
                                timeout=10)
            if r.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.3)
        assert r.status_code == 200, r.text
        assert r.json()["items"][0]["dense"] == fake_vector("again").tolist()
    finally:
        gateway.stop()
        worker.stop()


def test_work_queued_before_a_restart_is_answered_after_it(own_nats: NatsServer,
                                                           tmp_path: Path) -> None:
    root = write_bundles(tmp_path / "bundles", {"b": ["dense"]})
    pool = unique("pool")
    idle = FakeWorker(own_nats.url, pool, "b", answer=False).start()  # beats, never pulls
    gateway = GatewayThread(own_nats.url, {"b": pool}, root).start()
    responses: list[httpx.Response] = []
    request = threading.Thread(target=lambda: responses.append(local_http.post(
        gateway.url + "/v1/encode/b-dense", json={"items": ["kept", "safe"], "timeout_s": 30},
        timeout=40)))
    worker = None
    try:
        # Its first beat may come after the gateway's startup grace (1.5 s) on a loaded
        # host, and the request would get a 202 (a CI run did): wait for it first.
        gateway.wait_for_capacity(pool, 10)
        request.start()
        deadline = time.monotonic() + 10
        while last_seq(own_nats.url, pool) < 1:
            assert time.monotonic() < deadline, f"the work item was never published: {responses}"
            time.sleep(0.05)
        idle.stop()
        own_nats.stop()
        own_nats.start()  # same store dir: the queued work item survives
        wait_ready(gateway.url)
        worker = FakeWorker(own_nats.url, pool, "b").start()
        request.join(30)
        assert responses and responses[0].status_code == 200, responses
        rows = responses[0].json()["items"]
        assert [row["dense"] for row in rows] == [fake_vector("kept").tolist(),
                                                  fake_vector("safe").tolist()]
    finally:
        gateway.stop()
        if worker is not None:
            worker.stop()
        request.join(1)


def test_after_an_outage_a_warm_pool_waits_for_its_late_worker_and_a_cold_one_does_not(
        own_nats: NatsServer, tmp_path: Path) -> None:
    """NATS restarted: a worker that reconnects late (a loaded host) is still waited for,
    past the heartbeat timeout, because its pool was warm when NATS went away; a pool whose
    worker had gone silent before that answers 202 after the heartbeat timeout, not the
    longer grace; and no wait outlasts the request's deadline."""
    root = write_bundles(tmp_path / "bundles", {"b": ["dense"], "c": ["dense"]})
    warm, cold = unique("pool"), unique("pool")
    worker = FakeWorker(own_nats.url, warm, "b").start()
    gone = FakeWorker(own_nats.url, cold, "c").start()
    # A longer grace than the default 10 s: margin for a slow host, the same test.
    gateway = GatewayThread(own_nats.url, {"b": warm, "c": cold}, root,
                            GatewaySettings(reconnect_grace_s=20.0)).start()
    late: FakeWorker | None = None
    answers: list[tuple[httpx.Response, float]] = []

    def ask() -> None:
        started = time.monotonic()
        r = local_http.post(gateway.url + "/v1/encode/b-dense",
                            json={"items": ["late"], "timeout_s": 30}, timeout=40)
        answers.append((r, time.monotonic() - started))

    request = threading.Thread(target=ask)
    try:
        gateway.wait_for_capacity(warm, 10)
        gateway.wait_for_capacity(cold, 10)
        gone.stop()  # its last beat said ready, but it is stale before NATS goes away
        time.sleep(3.5)  # the heartbeat timeout (3 s)
        worker.stop()  # silent from here on: its last beat said ready
        silent_since = time.monotonic()
        own_nats.stop()
        own_nats.start()
        wait_ready(gateway.url)
        # Past the heartbeat timeout (3 s): the gateway no longer counts the old beat.
        time.sleep(max(0.0, 3.5 - (time.monotonic() - silent_since)))
        request.start()
        started = time.monotonic()
        r = local_http.post(gateway.url + "/v1/encode/c-dense", json={"items": ["x"]}, timeout=10)
        assert r.status_code == 202 and r.json()["pool"] == cold, r.text
        assert time.monotonic() - started < 5.0  # what is left of the 3 s, not of 20 s
        short = time.monotonic()  # the warm pool's wait ends at the request's deadline
        r = local_http.post(gateway.url + "/v1/encode/b-dense",
                            json={"items": ["short"], "timeout_s": 1.0}, timeout=10)
        assert r.status_code == 202 and r.json()["pool"] == warm, r.text
        assert 0.9 < time.monotonic() - short < 3.0
        time.sleep(max(0.0, 3.5 - (time.monotonic() - started)))
        assert not answers, answers  # still waiting for the warm pool's worker
        late = FakeWorker(own_nats.url, warm, "b").start()
        request.join(30)
        assert answers, "no answer"
        answer, took = answers[0]
        assert answer.status_code == 200, answer.text
        assert answer.json()["items"][0]["dense"] == fake_vector("late").tolist()
        assert took > 3.0
    finally:
        gateway.stop()
        for fake in (worker, gone, late):  # stopping one twice is harmless
            if fake is not None:
                fake.stop()
        if request.is_alive():
            request.join(1)


# ---- start-up without NATS --------------------------------------------------------------
def test_gateway_starts_without_nats_and_becomes_ready_when_it_appears(
        tmp_path: Path) -> None:
    server = NatsServer(tmp_path / "nats")
    gateway = GatewayThread(server.url, {"default": unique("pool")}).start(wait_ready=False)
    try:
        assert local_http.get(gateway.url + "/healthz").status_code == 200
        ready = local_http.get(gateway.url + "/readyz")
        assert ready.status_code == 503 and ready.headers["retry-after"]
        assert ready.json()["nats_connected"] is False
        started = time.monotonic()
        r = local_http.post(gateway.url + "/v1/encode/minilm", json={"items": ["a"]})
        assert r.status_code == 503 and r.json()["error"]["code"] == "NATS_UNAVAILABLE"
        assert r.headers["retry-after"] and time.monotonic() - started < 1.0
        server.start()
        deadline = time.monotonic() + 15
        while local_http.get(gateway.url + "/readyz").status_code != 200:
            assert time.monotonic() < deadline, "gateway never connected"
            time.sleep(0.1)
    finally:
        gateway.stop()
        server.stop()
