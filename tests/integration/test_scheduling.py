"""Scheduling against the session's `heron serve`: a caller that has gone costs no compute,
and priorities order the queue."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import socket
import time

import httpx
import pytest

from heron.runtime.nats_names import Lane
from tests.support import local_http
from tests.support.gateway_harness import FakeWorker, GatewayThread, unique
from tests.support.nats_server import NatsServer

LONG = "the heron waits in the shallows for a fish to swim past its feet " * 20  # > 256 tok


def items_computed(http: httpx.Client, model: str) -> float:
    text = http.get("/metrics").text
    match = re.search(rf'^heron_worker_items_total{{model="{re.escape(model)}"}} (\S+)$', text,
                      re.MULTILINE)
    return float(match.group(1)) if match else 0.0


def test_a_request_whose_client_left_is_not_computed(base_url: str, http: httpx.Client) -> None:
    model = "sentence-transformers/all-MiniLM-L6-v2"
    before = items_computed(http, model)

    async def scenario() -> int:
        async with httpx.AsyncClient(base_url=base_url, timeout=120) as client:
            busy = asyncio.create_task(client.post(
                "/v1/encode/minilm", json={"items": [f"{n} {LONG}" for n in range(120)]}))
            await asyncio.sleep(0.3)  # the long request is queued and running
            # Queued behind it (a lower priority), then abandoned by its client.
            with contextlib.suppress(httpx.TimeoutException):
                await client.post("/v1/encode/minilm", timeout=0.3, json={
                    "items": [f"abandoned {n}" for n in range(400)], "priority": 3})
            r = await busy
            assert r.status_code == 200
            # Anything still queued from the abandoned request is older and of a higher
            # priority than this one: once this is answered, the queue has been worked off.
            last = await client.post("/v1/encode/minilm",
                                     json={"items": ["last in line"], "priority": 9})
            assert last.status_code == 200
            return len(r.json()["items"])

    done = asyncio.run(scenario())
    computed = items_computed(http, model) - before
    assert done == 120
    assert computed < 120 + 64, f"{computed} items computed; the 400 abandoned ones must not be"
    # The server is fine and serves the next request.
    assert http.post("/v1/encode/minilm", json={"items": ["still here"]}).status_code == 200


@pytest.mark.parametrize("heron_http", [True, False], ids=["heron-protocol", "asgi-only"])
def test_the_gateway_stops_waiting_for_a_client_that_left(nats_server: NatsServer,
                                                          heron_http: bool) -> None:
    """Told by Heron's protocol that the connection was lost, or (any other server) by
    ASGI's http.disconnect."""
    pool = unique("gone")
    worker = FakeWorker(nats_server.url, pool, "default", answer=False).start()  # never answers
    gateway = GatewayThread(nats_server.url, {"default": pool}, heron_http=heron_http).start()
    try:
        gateway.wait_for_capacity(pool, 10)
        with pytest.raises(httpx.TimeoutException):
            local_http.post(gateway.url + "/v1/encode/minilm", timeout=0.5,
                            json={"items": ["nobody will answer"] * 10})
        # Without the disconnect watch these 10 items would count against the pool's
        # backlog for the whole default timeout (30 s).
        deadline = time.monotonic() + 3
        while gateway.gateway.dispatcher.outstanding(pool):
            assert time.monotonic() < deadline, "the gateway kept waiting"
            time.sleep(0.05)
        text = local_http.get(gateway.url + "/metrics").text
        assert 'status="499"' in text
    finally:
        gateway.stop()
        worker.stop()


def _half_a_body(port: int, path: str) -> None:
    """Headers that promise 1,000 bytes, 20 of them, then the connection closes."""
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        conn.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n".encode()
                     + b"Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
                     + b'{"items": ["a text"')
        time.sleep(0.3)  # the handler is reading the body when the client leaves


def test_a_client_gone_before_its_body_ended_is_a_499_not_an_error(
        nats_server: NatsServer, caplog: pytest.LogCaptureFixture) -> None:
    """An inference request (the front's own path) and an admin POST (through
    Starlette's stack) whose clients leave halfway through their bodies: the inference
    request counts as 499 (client closed), nothing is logged as an unhandled error, and
    the gateway answers the next request."""
    pool = unique("halfbody")
    worker = FakeWorker(nats_server.url, pool, "default").start()
    gateway = GatewayThread(nats_server.url, {"default": pool}, heron_http=True).start()
    try:
        gateway.wait_for_capacity(pool, 10)
        _half_a_body(gateway.port, "/v1/encode/minilm")
        _half_a_body(gateway.port, "/v1/jobs")
        deadline = time.monotonic() + 5
        pattern = re.compile(r'heron_gateway_requests_total\{[^}]*route="encode"[^}]*'
                             r'status="499"\} 1\.0')
        while not pattern.search(local_http.get(gateway.url + "/metrics").text):
            assert time.monotonic() < deadline, "the half-sent request was not counted 499"
            time.sleep(0.05)
        r = local_http.post(gateway.url + "/v1/encode/minilm", json={"items": ["next"]}, timeout=10)
        assert r.status_code == 200
        assert not [rec for rec in caplog.records if rec.levelno >= logging.ERROR]
    finally:
        gateway.stop()
        worker.stop()


@pytest.mark.parametrize("lanes", [tuple(Lane), (Lane.FIRST, Lane.BULK)],
                         ids=["workers-pull-every-lane", "a-worker-from-before-the-low-lane"])
def test_a_lower_priority_goes_on_a_lane_every_worker_pulls(nats_server: NatsServer,
                                                             lanes: tuple[Lane, ...]) -> None:
    """Priority 1 and up go on the pool's low lane only when every worker's heartbeat says
    it pulls that lane; with a worker from before it (its beats name no lanes), on the
    first lane, so a rolling upgrade in either order loses nothing."""
    pool = unique("lanes")
    worker = FakeWorker(nats_server.url, pool, "default", lanes=lanes).start()
    gateway = GatewayThread(nats_server.url, {"default": pool}).start()
    try:
        gateway.wait_for_capacity(pool, 10)
        for priority in (0, 2):
            r = local_http.post(gateway.url + "/v1/encode/minilm", timeout=10, json={
                "items": [f"priority {priority}"], "priority": priority, "timeout_s": 5})
            assert r.status_code == 200, r.text
            assert (".low." in worker.subjects[-1]) == (priority > 0 and Lane.LOW in lanes)
    finally:
        gateway.stop()
        worker.stop()
