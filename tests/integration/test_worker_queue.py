"""`heron worker` in queue mode, driven the way a gateway drives it: work items on the
pool's JetStream stream, results on a NATS inbox (real nats-server, real worker process)."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import nats
import numpy as np
import pytest

from heron.runtime.nats_names import (
    STATUS_WILDCARD,
    WorkStreamSpec,
    ensure_work_stream,
    work_stream,
    work_subject,
)
from heron.runtime.protocol import WorkItemHeaders
from heron_sdk import wire
from heron_sdk.types import EncodeRequest, Item
from tests.support import local_http
from tests.support.cluster_procs import WorkerProcess
from tests.support.nats_server import NatsServer

MINILM = "sentence-transformers/all-MiniLM-L6-v2"


@pytest.fixture()
def pool() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def worker_pool() -> str:
    return f"t{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def worker(nats_server: NatsServer, worker_pool: str,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    """One worker for the tests that only send it work: a start is 6-8 s of CPU here."""
    w = WorkerProcess(nats_server.url, worker_pool, tmp_path_factory.mktemp("worker"))
    w.wait_ready()
    yield w
    w.stop()


async def _roundtrip(nats_url: str, pool: str, requests: list[tuple[str, dict, float | None]],
                     timeout_s: float = 60, allow_partial: bool = False) -> dict[str, dict]:
    """Publish (request_id, wire body, deadline) encode work items; collect results."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await ensure_work_stream(js, WorkStreamSpec(pool=pool))
    results: dict[str, dict] = {}
    done = asyncio.Event()

    received = 0

    async def on_result(msg) -> None:
        nonlocal received
        received += 1
        await msg.respond(b"")  # confirm, as a gateway does
        body = wire.decode(msg.data, wire.MSGPACK)
        results[body["request_id"]] = body
        if len(results) == len(requests):
            done.set()

    inbox = f"_INBOX.heron.test{uuid.uuid4().hex[:6]}"
    await nc.subscribe(inbox + ".>", cb=on_result)
    for request_id, body, deadline in requests:
        headers = WorkItemHeaders(request_id, "encode", MINILM, f"{inbox}.{request_id}", 0,
                                  len(body.get("items", [])), deadline, 0).to_wire()
        await js.publish(work_subject(pool, MINILM), wire.encode(body, wire.MSGPACK),
                         headers=headers)
    try:
        await asyncio.wait_for(done.wait(), timeout_s)
    except TimeoutError:
        if not allow_partial:
            raise
    finally:
        # Workers ack right after the confirmation we sent: give the acks a moment to land.
        for _ in range(40):
            left = (await js.stream_info(work_stream(pool))).state.messages
            if left == 0 or not done.is_set():
                break
            await asyncio.sleep(0.05)
        await nc.close()
    results["_left_in_stream"] = {"messages": left, "received": received}
    return results


def test_queue_mode_answers_like_single_node(worker: WorkerProcess, nats_server: NatsServer,
                                             worker_pool: str, http: httpx.Client) -> None:
    texts = ["queue mode works", "over JetStream", "and a NATS inbox"]
    body = EncodeRequest(items=[Item(t, id=str(i)) for i, t in enumerate(texts)]).to_wire()
    results = asyncio.run(_roundtrip(nats_server.url, worker_pool, [("r1", body, None)]))
    got = results["r1"]
    assert got["start"] == 0 and got["count"] == 3 and "error" not in got
    vectors = np.stack([i["dense"] for i in got["body"]["items"]])
    expected = http.post("/v1/encode/minilm", json={"items": texts}).json()
    np.testing.assert_allclose(vectors, [i["dense"] for i in expected["items"]], atol=2e-5)
    assert [i["id"] for i in got["body"]["items"]] == ["0", "1", "2"]
    assert results["_left_in_stream"]["messages"] == 0  # acked: work-queue retention


def test_expired_and_bad_work_items_are_answered_not_computed(
        worker: WorkerProcess, nats_server: NatsServer, worker_pool: str) -> None:
    before = items_done(local_http.get(worker.url + "/metrics").text)
    requests = [("late", {"items": ["too late"]}, time.time() - 1),
                ("bad", {"items": []}, None),
                ("ok", {"items": ["fine"]}, time.time() + 30)]
    results = asyncio.run(_roundtrip(nats_server.url, worker_pool, requests))
    assert results["late"]["error"]["code"] == "DEADLINE_EXCEEDED"
    assert results["bad"]["error"]["code"] == "INVALID_FIELD"
    assert len(results["ok"]["body"]["items"]) == 1
    assert results["_left_in_stream"]["messages"] == 0
    metrics = local_http.get(worker.url + "/metrics").text
    # Only the good item reached the model (the warm-up batch is not counted as items).
    assert items_done(metrics) - before == 1.0


def test_heartbeats_describe_the_worker(worker: WorkerProcess, nats_server: NatsServer,
                                        worker_pool: str) -> None:
    async def first_beat() -> dict:
        nc = await nats.connect(nats_server.url)
        got: asyncio.Future = asyncio.get_running_loop().create_future()

        async def on_beat(msg) -> None:
            beat = wire.decode(msg.data, wire.MSGPACK)
            if beat["pool"] == worker_pool and not got.done():
                got.set_result((msg.subject, beat))

        await nc.subscribe(STATUS_WILDCARD, cb=on_beat)
        try:
            return await asyncio.wait_for(got, 5)
        finally:
            await nc.close()

    subject, beat = asyncio.run(first_beat())
    assert subject == f"heron.status.{worker_pool}.{worker.worker_id}"
    assert beat["ready"] is True and beat["bundle"] == "default"
    assert beat["models"] == {MINILM: "ready"} and len(beat["bundle_hash"]) == 64
    assert beat["memory_rss"] > 0 and beat["address"] == worker.url


def test_the_beat_that_says_ready_goes_out_when_the_worker_is(
        nats_server: NatsServer, pool: str, tmp_path: Path) -> None:
    """A worker's first ready heartbeat leaves when it starts consuming, not at its next
    tick: until a gateway hears it, the gateway answers 202 for a pool whose worker is
    ready (up to a second, with the beats alone)."""
    beats: list[tuple[float, bool]] = []  # (arrival, ready), this worker's beats
    loop = asyncio.new_event_loop()
    subscribed = threading.Event()
    done = asyncio.Event()

    async def listen() -> None:
        nc = await nats.connect(nats_server.url)

        async def on_beat(msg) -> None:
            beats.append((time.monotonic(), wire.decode(msg.data, wire.MSGPACK)["ready"]))

        await nc.subscribe(f"heron.status.{pool}.>", cb=on_beat)
        await nc.flush()
        subscribed.set()
        await done.wait()
        await nc.close()

    listener = threading.Thread(target=loop.run_until_complete, args=(listen(),))
    listener.start()
    assert subscribed.wait(10)
    w = WorkerProcess(nats_server.url, pool, tmp_path)
    try:
        deadline = time.monotonic() + w.ready_timeout_s
        while True:
            with contextlib.suppress(httpx.HTTPError):
                if local_http.get(w.url + "/readyz", timeout=1).status_code == 200:
                    break
            assert time.monotonic() < deadline and w.proc.poll() is None, w.log_tail()
            time.sleep(0.01)
        ready_at = time.monotonic()
        while not any(ready for _, ready in beats) and time.monotonic() < ready_at + 5:
            time.sleep(0.01)
        lags = [(round(at - ready_at, 3), ready) for at, ready in beats]  # from /readyz
        first_ready = next((lag for lag, ready in lags if ready), None)
        # The tick alone: 0 to 1 s after /readyz; at once: a few ms, before it or after.
        assert first_ready is not None and first_ready < 0.2, lags[-4:]
        assert any(not ready for _, ready in lags)  # it did beat before, not ready
    finally:
        w.stop()
        loop.call_soon_threadsafe(done.set)
        listener.join(10)
        loop.close()


def test_sigterm_drains_and_exits_cleanly(nats_server: NatsServer, pool: str,
                                          tmp_path: Path) -> None:
    w = WorkerProcess(nats_server.url, pool, tmp_path)
    w.wait_ready()
    texts = [f"drain item {i} " * 8 for i in range(64)]

    async def run() -> dict:
        task = asyncio.create_task(_roundtrip(
            nats_server.url, pool,
            [(f"r{i}", {"items": texts[i: i + 8]}, None) for i in range(0, 64, 8)],
            timeout_s=20, allow_partial=True))
        await asyncio.sleep(0.3)  # work is in flight
        w.proc.send_signal(signal.SIGTERM)
        return await task

    results = asyncio.run(run())
    assert w.proc.wait(60) == 0
    answered = {k: v for k, v in results.items() if k != "_left_in_stream"}
    # Everything it took was finished and answered; the rest is still queued, not lost.
    assert all("error" not in r for r in answered.values())
    stats = results["_left_in_stream"]
    assert stats["received"] == len(answered)  # no result twice
    assert len(answered) + stats["messages"] == 8  # answered or still queued: none lost


def items_done(metrics: str) -> float:
    return sum(float(x.split()[-1]) for x in metrics.splitlines()
               if x.startswith("heron_worker_items_total") and MINILM in x)


@pytest.mark.slow
def test_two_workers_share_work_and_survive_kill_9(nats_server: NatsServer, pool: str,
                                                   tmp_path: Path, http: httpx.Client) -> None:
    """500 single-item requests; one of two workers is killed -9 mid-way. Every request is
    answered with the right vector (the dead worker's items come back after the ack wait)."""
    a, b = WorkerProcess(nats_server.url, pool, tmp_path), WorkerProcess(nats_server.url, pool,
                                                                          tmp_path)
    try:
        a.wait_ready()
        b.wait_ready()
        texts = [f"request {i} about herons" for i in range(500)]

        async def run() -> dict:
            task = asyncio.create_task(_roundtrip(
                nats_server.url, pool, [(f"r{i}", {"items": [t]}, None)
                                        for i, t in enumerate(texts)], timeout_s=90))
            await asyncio.sleep(1.0)
            async with httpx.AsyncClient() as client:
                done_by_a = items_done((await client.get(a.url + "/metrics")).text)
            a.proc.send_signal(signal.SIGKILL)
            return {**await task, "_a": {"items": done_by_a}}

        results = asyncio.run(run())
        assert a.proc.wait(10) == -signal.SIGKILL
        answered = {k: v for k, v in results.items() if not k.startswith("_")}
        assert len(answered) == 500 and all("error" not in r for r in answered.values())
        for i in (0, 137, 499):
            want = http.post("/v1/encode/minilm", json={"items": [texts[i]]}).json()
            np.testing.assert_allclose(answered[f"r{i}"]["body"]["items"][0]["dense"],
                                       want["items"][0]["dense"], atol=2e-5)
        # Both shared the load: a had computed some before it died, b the rest.
        assert results["_a"]["items"] > 0
        assert items_done(local_http.get(b.url + "/metrics").text) > 0
        assert results["_left_in_stream"]["messages"] == 0
    finally:
        a.stop(signal.SIGKILL)
        b.stop()


def test_an_answer_too_large_for_nats_is_refused_at_once(tmp_path: Path) -> None:
    """NATS carries at most max_payload bytes a message. A result over it cannot be sent, and
    sending it again would fail again until the caller's deadline: the worker answers 413
    PAYLOAD_TOO_LARGE at once (and acks), and smaller requests keep working."""
    server = NatsServer(tmp_path / "nats", max_payload=32 * 1024).start()
    pool = f"p{uuid.uuid4().hex[:8]}"
    w = WorkerProcess(server.url, pool, tmp_path)
    try:
        w.wait_ready()
        texts = [f"text number {i} of a request whose answer is large" for i in range(40)]
        big = EncodeRequest(items=[Item(t) for t in texts]).to_wire()  # 40 x 384 floats
        small = EncodeRequest(items=[Item(t) for t in texts[:4]]).to_wire()
        started = time.monotonic()
        results = asyncio.run(_roundtrip(server.url, pool, [("big", big, None),
                                                            ("small", small, None)],
                                         timeout_s=30))
        assert time.monotonic() - started < 15  # not after redeliveries or a deadline
        error = results["big"]["error"]
        assert error["code"] == "PAYLOAD_TOO_LARGE" and "fewer items" in error["message"]
        assert len(results["small"]["body"]["items"]) == 4
        assert results["_left_in_stream"]["messages"] == 0
    finally:
        w.stop()
        server.stop()
