"""NatsLink, the NATS connection of the gateway, the worker and the config service, against
real nats-servers: it connects when the server starts late, sets up again after a restart
that lost the store, fails over between several URLs, is ready within seconds when the first
URLs of its list are down or hung (and so are the gateway and the config service), reports a
setup that fails, and closes at once while still connecting; and a worker, on its own,
declares its pool's stream again after a restart that lost the store, and is not ready while
it cannot consume."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import httpx
import nats
import pytest
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js.api import StreamConfig
from nats.js.errors import NotFoundError

from heron.runtime.nats_link import NatsLink
from heron.runtime.nats_names import (
    WorkStreamSpec,
    ensure_work_stream,
    work_consumer,
    work_stream,
)
from heron_sdk.types import EncodeRequest, Item
from tests.integration.test_worker_queue import _roundtrip as roundtrip
from tests.support import local_http
from tests.support.cluster_procs import ConfigProcess, GatewayProcess, WorkerProcess
from tests.support.nats_server import NatsServer
from tests.support.servers import free_port


class StreamHook:
    """A setup hook as the components have: declare a pool's work stream; count the calls
    and the ones that succeeded."""

    def __init__(self) -> None:
        self.pool = f"p{uuid.uuid4().hex[:8]}"
        self.calls = 0
        self.done = 0

    async def __call__(self, nc: NatsClient, js: JetStreamContext) -> None:
        self.calls += 1
        await ensure_work_stream(js, WorkStreamSpec(pool=self.pool))
        self.done += 1


async def until(check: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"{what} not within {timeout_s}s"
        await asyncio.sleep(0.05)


async def stream_exists(url: str, pool: str) -> bool:
    nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=0)
    try:
        await nc.jetstream().stream_info(work_stream(pool))
        return True
    except NotFoundError:
        return False
    finally:
        await nc.close()


@pytest.fixture()
def servers(tmp_path: Path) -> Iterator[list[NatsServer]]:
    """Two independent nats-servers, not started: each test starts what it needs."""
    made = [NatsServer(tmp_path / "a"), NatsServer(tmp_path / "b")]
    yield made
    for server in made:
        server.stop()


def started(link: NatsLink) -> NatsLink:
    link.start()
    return link


async def closing(link: NatsLink, body: Callable[[], Awaitable[None]]) -> None:
    try:
        await body()
    finally:
        await link.close()


async def test_connects_when_the_server_starts_late(servers: list[NatsServer],
                                                    caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO)
    server, hook = servers[0], StreamHook()
    link = started(NatsLink(server.url, name="late", setup=hook))

    async def body() -> None:
        await asyncio.sleep(1.2)  # a few refused tries
        assert not link.connected and not link.ready and hook.calls == 0
        assert link.last_error is not None and "cannot reach NATS" in link.last_error
        await asyncio.to_thread(server.start)
        await asyncio.wait_for(link.wait_set_up(), 15)
        assert link.ready and link.last_error is None and hook.calls == 1
        assert link.connected_url == server.url
        assert await stream_exists(server.url, hook.pool)
        # Lines come under the component's logger: the hook's package + ".nats".
        assert any(r.name == "tests.integration.nats" and "connected to NATS" in r.getMessage()
                   for r in caplog.records)

    await closing(link, body)


async def test_a_restart_that_lost_the_store_gets_its_streams_back(
        servers: list[NatsServer], tmp_path: Path) -> None:
    server, hook = servers[0], StreamHook()
    await asyncio.to_thread(server.start)
    link = started(NatsLink(server.url, name="restart", setup=hook, on_reconnect=hook))

    async def body() -> None:
        await asyncio.wait_for(link.wait_set_up(), 15)
        await asyncio.to_thread(server.stop)
        # nats-py marks itself reconnecting before its disconnected callback runs (which
        # says why): both come within milliseconds, in that order.
        await until(lambda: not link.connected and link.last_error is not None, 5,
                    "the disconnect noticed and said")
        assert not link.ready
        # The same port, an empty store: the stream is gone until someone declares it.
        servers.append(NatsServer(tmp_path / "fresh", port=server.port))
        await asyncio.to_thread(servers[-1].start)
        await until(lambda: link.ready and hook.done == 2, 15, "reconnect and re-setup")
        assert link.last_error is None
        assert await stream_exists(server.url, hook.pool)

    await closing(link, body)


async def test_several_urls_one_dead_and_failover(servers: list[NatsServer]) -> None:
    a, b = servers
    await asyncio.to_thread(a.start)
    dead = f"nats://127.0.0.1:{free_port()}"
    hook = StreamHook()
    # The form of --nats / HERON_NATS_URL for a NATS cluster: comma-separated.
    link = started(NatsLink(f"{dead}, {a.url},{b.url}", name="multi", setup=hook,
                            on_reconnect=hook))

    async def body() -> None:
        assert link.servers == [dead, a.url, b.url]
        await asyncio.wait_for(link.wait_set_up(), 15)
        assert link.connected_url == a.url  # b is not up yet, the first one never is
        await asyncio.to_thread(b.start)
        await asyncio.to_thread(a.stop)
        await until(lambda: link.connected_url == b.url, 15, "failover to the other server")
        # b never had the stream: the reconnect hook declared it there.
        await until(lambda: hook.done == 2, 15, "re-setup on b")
        assert link.last_error is None
        assert await stream_exists(b.url, hook.pool)
        assert link.ready

    await closing(link, body)


@pytest.fixture()
def hung_node() -> Iterator[str]:
    """A "node" that accepts TCP connections and never speaks (a nats-server that hangs,
    or a host whose port a load balancer holds open): a client waits on it until its
    connect timeout."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)  # the kernel completes handshakes; nothing ever sends INFO
    try:
        yield f"nats://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


async def test_down_seed_nodes_before_the_live_one_cost_seconds_at_most(
        servers: list[NatsServer], hung_node: str) -> None:
    """--nats a,b,c whose first nodes are down (refused) or hung: the link is ready on the
    node that is up within a few seconds, whatever order the client tries them in (it
    shuffles them): a refused node costs nothing, a hung one its connect timeout (2 s)."""
    live = servers[0]
    await asyncio.to_thread(live.start)
    refused = [f"nats://127.0.0.1:{free_port()}" for _ in range(2)]
    for urls, within_s in (([refused[0], live.url], 3.0),
                           ([refused[0], refused[1], live.url], 3.0),
                           ([hung_node, refused[0], live.url], 5.0)):
        for _ in range(3):  # each try shuffles the list anew
            hook = StreamHook()
            link = started(NatsLink(",".join(urls), name="seeds", setup=hook))
            began = time.monotonic()
            try:
                await asyncio.wait_for(link.wait_set_up(), within_s)
                assert link.ready and link.connected_url == live.url
            finally:
                await link.close()
            assert time.monotonic() - began < within_s


def test_components_start_with_their_first_seed_node_down(tmp_path: Path) -> None:
    """`heron gateway` and `heron config` with --nats <down>,<down>,<up>: ready (NATS set
    up) as soon as they would be with the live node alone."""
    server = NatsServer(tmp_path / "nats").start()
    urls = ",".join([f"nats://127.0.0.1:{free_port()}", f"nats://127.0.0.1:{free_port()}",
                     server.url])
    gateway = GatewayProcess(urls, {"default": f"p{uuid.uuid4().hex[:8]}"}, tmp_path)
    config = ConfigProcess(urls, str(tmp_path / "store"), tmp_path)
    try:
        for process in (gateway, config):
            process.wait_ready(timeout_s=30)
            readiness = local_http.get(process.url + "/readyz", timeout=5).json()
            assert readiness["nats_connected"] is True, readiness
    finally:
        gateway.stop()
        config.stop()
        server.stop()


async def test_a_failing_setup_is_reported_and_retried(servers: list[NatsServer]) -> None:
    server, hook = servers[0], StreamHook()
    await asyncio.to_thread(server.start)
    nc = await nats.connect(server.url)
    js = nc.jetstream()
    # Someone declared the pool's stream with other settings: the setup must not reuse it.
    await js.add_stream(StreamConfig(name=work_stream(hook.pool),
                                     subjects=[f"other.{hook.pool}.>"]))
    link = started(NatsLink(server.url, name="mismatch", setup=hook))

    async def body() -> None:
        await until(lambda: hook.calls >= 1 and link.last_error is not None, 10, "a failure")
        assert link.connected and not link.ready
        assert "other settings" in (link.last_error or "")
        await js.delete_stream(work_stream(hook.pool))
        await asyncio.wait_for(link.wait_set_up(), 15)  # retried with a backoff
        assert link.ready and link.last_error is None and hook.calls >= 2

    try:
        await closing(link, body)
    finally:
        await nc.close()


async def test_close_while_connecting_is_prompt(servers: list[NatsServer]) -> None:
    server, hook = servers[0], StreamHook()
    link = started(NatsLink(server.url, name="closing", setup=hook))
    await asyncio.sleep(0.7)
    began = time.monotonic()
    await link.close()
    assert time.monotonic() - began < 1.0
    await asyncio.to_thread(server.start)
    await asyncio.sleep(1.5)  # nothing keeps trying in the background
    assert link.nc is None and not link.connected and hook.calls == 0


def test_a_worker_declares_its_stream_again_when_nats_lost_its_store(tmp_path: Path) -> None:
    """No gateway around: the worker itself brings its pool's stream and consumer back, and
    consumes from them."""
    server = NatsServer(tmp_path / "nats").start()
    fresh = NatsServer(tmp_path / "fresh", port=server.port)
    pool = f"p{uuid.uuid4().hex[:8]}"
    worker = WorkerProcess(server.url, pool, tmp_path)
    try:
        worker.wait_ready()
        assert asyncio.run(stream_exists(server.url, pool))
        server.stop()
        fresh.start()  # the same address, an empty store

        async def consumer_back() -> None:
            deadline = time.monotonic() + 20
            while True:
                nc = await nats.connect(server.url)
                try:
                    await nc.jetstream().consumer_info(work_stream(pool), work_consumer(pool))
                    return
                except NotFoundError:
                    assert time.monotonic() < deadline, "the worker never declared again"
                finally:
                    await nc.close()
                await asyncio.sleep(0.2)

        asyncio.run(consumer_back())
        body = EncodeRequest(items=[Item("after the restart")]).to_wire()
        results = asyncio.run(roundtrip(server.url, pool, [("r1", body, None)], timeout_s=30))
        assert "error" not in results["r1"] and len(results["r1"]["body"]["items"]) == 1
    finally:
        worker.stop()
        fresh.stop()
        server.stop()


def test_a_worker_that_cannot_consume_is_not_ready_and_says_why(tmp_path: Path) -> None:
    """The pool's stream exists with other settings (limits, not work-queue retention): the
    worker's models warm up, but it cannot create its consumer, so /readyz stays 503 with the
    reason rather than claiming a worker that serves no one is ready."""
    server = NatsServer(tmp_path / "nats").start()
    pool = f"p{uuid.uuid4().hex[:8]}"

    async def squat() -> None:  # what an operator's mistake would leave behind
        nc = await nats.connect(server.url)
        try:
            spec = WorkStreamSpec(pool=pool).stream_config()
            await nc.jetstream().add_stream(StreamConfig(name=spec.name,
                                                         subjects=spec.subjects))
        finally:
            await nc.close()

    asyncio.run(squat())
    worker = WorkerProcess(server.url, pool, tmp_path)
    try:
        deadline, body = time.monotonic() + 120, {}
        while time.monotonic() < deadline:
            try:
                answer = local_http.get(worker.url + "/readyz", timeout=2)
            except httpx.ConnectError:  # not listening yet
                time.sleep(0.2)
                continue
            body = answer.json()
            # Models warm, then the consumer's creation fails a JetStream round trip later:
            # in between the status is "disconnected" and the reason says it is setting up.
            if body.get("status") == "disconnected" and "retention" in body.get("error", ""):
                break
            if body.get("status") == "disconnected":
                assert "setting up the consumers" in body["error"], body
            assert answer.status_code == 503, body  # never ready while it cannot consume
            time.sleep(0.2)
        assert body.get("status") == "disconnected", body
        assert set(body["models"].values()) == {"ready"} and body["nats_connected"] is True
        assert work_stream(pool) in body["error"] and "retention" in body["error"]
        time.sleep(1.5)  # set-up keeps failing: still not ready
        assert local_http.get(worker.url + "/readyz", timeout=2).status_code == 503
    finally:
        worker.stop()
        server.stop()
