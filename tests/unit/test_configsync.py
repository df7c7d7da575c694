"""Folding config deltas into a snapshot: newer applies once; twice or late changes nothing."""

from __future__ import annotations

import asyncio
import contextlib
import copy

import orjson

from heron.runtime.configsync import ConfigFollower, apply_delta
from heron.runtime.protocol import ConfigDelta


def snapshot() -> dict:
    return {"epoch": 3, "models": {"a": {"id": "a"}},
            "bundles": {"b1": {"adapters": ["dense"], "models": ["a"], "hash": "h3"}}}


def delta(epoch: int, model_id: str = "m", bundles: tuple[str, ...] = ("b1",)) -> ConfigDelta:
    return ConfigDelta(epoch, {"id": model_id, "adapter": "dense"}, bundles,
                       {b: f"h{epoch}" for b in bundles})


def test_a_newer_delta_applies() -> None:
    snap = snapshot()
    assert apply_delta(snap, delta(4))
    assert snap["epoch"] == 4 and snap["models"]["m"]["adapter"] == "dense"
    assert snap["bundles"]["b1"]["models"] == ["a", "m"] and snap["bundles"]["b1"]["hash"] == "h4"


def test_twice_or_late_changes_nothing() -> None:
    snap = snapshot()
    apply_delta(snap, delta(4))
    after = copy.deepcopy(snap)
    assert not apply_delta(snap, delta(4))  # the same delta again
    assert not apply_delta(snap, delta(2, "old"))  # an old one, late
    assert snap == after


def test_new_bundle_in_a_delta_is_created() -> None:
    snap = snapshot()
    assert apply_delta(snap, delta(5, bundles=("b1", "b2")))
    assert snap["bundles"]["b2"]["models"] == ["m"] and snap["bundles"]["b2"]["hash"] == "h5"


async def test_resyncs_reuse_one_connection() -> None:
    """Every resync's GET goes over the follower's one client: making a client per call
    built an SSL context on the event loop each time (30 ms here, every 30 s)."""
    connections = 0
    export = orjson.dumps({"epoch": 7, "models": {}, "bundles": {}})

    async def serve(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal connections
        connections += 1
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                body = b'{"epoch": 7}' if head.split()[1].endswith(b"/epoch") else export
                writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\n"
                             b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
                await writer.drain()
        writer.close()

    server = await asyncio.start_server(serve, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    changes: list[dict] = []
    follower = ConfigFollower(f"http://127.0.0.1:{port}", on_change=changes.append)
    try:
        for _ in range(5):
            assert await follower._remote_epoch() == 7
        await follower.bootstrap()
        assert follower.epoch == 7 and follower.ready and len(changes) == 1
        assert connections == 1
    finally:
        await follower.stop()
        server.close()
        await server.wait_closed()
