"""The inference POSTs a gateway's HTTP protocol serves itself (heron.runtime.hot_posts):
byte for byte the answers of uvicorn's ASGI path, over keep-alive, pipelining and
``Connection: close``, and every request it leaves to uvicorn still answered right.

Two gateways on one nats-server and one fake worker's pool: one runs Heron's protocol (as
``heron gateway`` does), the other uvicorn's own, and raw sockets send both the same bytes.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from typing import Any

import msgpack
import pytest

from heron.gateway.settings import GatewaySettings
from heron.runtime.hot_posts import HotPostHttpTools
from tests.support.gateway_harness import FakeWorker, GatewayThread, fake_vector, unique
from tests.support.nats_server import NatsServer

MODEL_PATH = "/v1/encode/minilm"
# Headers whose values differ between two answers to the same request.
VARYING = {b"date", b"server-timing"}


def post(path: str, body: bytes, *, content_type: str = "application/json",
         extra: str = "") -> bytes:
    return (f"POST {path} HTTP/1.1\r\nHost: gw\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\n{extra}\r\n").encode() + body


def encode_body(*texts: str) -> bytes:
    return json.dumps({"items": list(texts), "cache": False}).encode()


class RawAnswer:
    def __init__(self, status_line: bytes, headers: list[tuple[bytes, bytes]], body: bytes):
        self.status = int(status_line.split()[1])
        self.status_line = status_line
        self.headers = headers
        self.body = body

    def header(self, name: bytes) -> bytes | None:
        return next((v for n, v in self.headers if n == name), None)

    def comparable(self) -> tuple[bytes, list[tuple[bytes, bytes]], bytes]:
        """Everything but the values that differ from one answer to the next."""
        return (self.status_line,
                [(n, b"" if n in VARYING else v) for n, v in self.headers], self.body)

    def json(self) -> Any:
        return json.loads(self.body)


class RawClient:
    """One connection; reads answers one after another from whatever came in."""

    def __init__(self, port: int) -> None:
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=10)
        self.buffer = b""

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> bool:
        chunk = self.sock.recv(65536)
        self.buffer += chunk
        return bool(chunk)

    def answer(self) -> RawAnswer:
        while b"\r\n\r\n" not in self.buffer:
            assert self._fill(), f"connection closed mid-answer: {self.buffer!r}"
        head, self.buffer = self.buffer.split(b"\r\n\r\n", 1)
        status_line, *lines = head.split(b"\r\n")
        headers = [(n.strip().lower(), v.strip())
                   for n, v in (line.split(b":", 1) for line in lines)]
        length = int(next(v for n, v in headers if n == b"content-length"))
        while len(self.buffer) < length:
            assert self._fill(), "connection closed mid-body"
        body, self.buffer = self.buffer[:length], self.buffer[length:]
        return RawAnswer(status_line, headers, body)

    def closed_by_server(self) -> bool:
        return self.buffer == b"" and not self._fill()

    def close(self) -> None:
        self.sock.close()


def one_exchange(port: int, request: bytes) -> RawAnswer:
    client = RawClient(port)
    try:
        client.send(request)
        return client.answer()
    finally:
        client.close()


@pytest.fixture()
def served(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The paths Heron's protocol served itself, in order."""
    paths: list[str] = []
    serve = HotPostHttpTools._serve

    async def counted(self: HotPostHttpTools, exchange: Any) -> None:
        paths.append(exchange.scope["path"])
        await serve(self, exchange)

    monkeypatch.setattr(HotPostHttpTools, "_serve", counted)
    return paths


@pytest.fixture()
def gateways(nats_server: NatsServer) -> Iterator[tuple[GatewayThread, GatewayThread]]:
    """(Heron's protocol, uvicorn's own) over one pool; bodies over 4,000 bytes are 413."""
    pool = unique("hot")
    worker = FakeWorker(nats_server.url, pool, "default").start()
    settings = GatewaySettings(max_body_bytes=4000)
    hot = GatewayThread(nats_server.url, {"default": pool}, settings=settings,
                        heron_http=True).start()
    plain = GatewayThread(nats_server.url, {"default": pool}, settings=settings).start()
    try:
        hot.wait_for_capacity(pool, 10)
        plain.wait_for_capacity(pool, 10)
        yield hot, plain
    finally:
        hot.stop()
        plain.stop()
        worker.stop()


REQUESTS = {
    "encode": post(MODEL_PATH, encode_body("a heron", "stands still"),
                   extra="X-Request-Id: req-1\r\n"),
    "encode-msgpack": post(MODEL_PATH, msgpack.packb({"items": ["one"],
                                                      "cache": False}),
                           content_type="application/msgpack",
                           extra="Accept: application/msgpack\r\nX-Request-Id: req-2\r\n"),
    "an-item-fails": post(MODEL_PATH, encode_body("fine", "boom"),
                          extra="X-Request-Id: req-3\r\n"),
    "score": post("/v1/score/minilm", json.dumps(
        {"query": "q", "items": ["short", "a longer text"]}).encode(),
        extra="X-Request-Id: req-4\r\n"),
    "openai": post("/v1/embeddings", json.dumps(
        {"model": "minilm", "input": ["x y z"]}).encode(), extra="X-Request-Id: req-5\r\n"),
    "unknown-model": post("/v1/encode/no-such-model", encode_body("x"),
                          extra="X-Request-Id: req-6\r\n"),
    "malformed": post(MODEL_PATH, b'{"items": [', extra="X-Request-Id: req-7\r\n"),
    "wrong-type": post(MODEL_PATH, b"<xml/>", content_type="text/xml",
                       extra="X-Request-Id: req-8\r\n"),
    "over-the-body-limit": post(MODEL_PATH, encode_body("x" * 5000),
                                extra="X-Request-Id: req-9\r\n"),
}


STATUSES = {"encode": 200, "encode-msgpack": 200, "an-item-fails": 422, "score": 200,
            "openai": 200, "unknown-model": 404, "malformed": 400, "wrong-type": 415,
            "over-the-body-limit": 413}


@pytest.mark.parametrize("name", list(REQUESTS))
def test_a_hot_post_is_answered_as_uvicorns_path_answers_it(
        gateways: tuple[GatewayThread, GatewayThread], served: list[str], name: str) -> None:
    hot, plain = gateways
    expected = one_exchange(plain.port, REQUESTS[name])
    assert served == []  # uvicorn's own protocol serves everything through ASGI
    got = one_exchange(hot.port, REQUESTS[name])
    assert len(served) == 1, "Heron's protocol did not serve the request itself"
    assert got.comparable() == expected.comparable()
    assert got.status == STATUSES[name], got.body
    assert got.header(b"x-request-id") == f"req-{list(REQUESTS).index(name) + 1}".encode()


def test_keep_alive_pipelining_and_connection_close(
        gateways: tuple[GatewayThread, GatewayThread], served: list[str]) -> None:
    hot, _ = gateways
    client = RawClient(hot.port)
    try:
        # Four requests in one write: two hot, a GET (uvicorn's path), another hot.
        client.send(post(MODEL_PATH, encode_body("first")) + post(MODEL_PATH,
                    encode_body("second text")) + b"GET /healthz HTTP/1.1\r\nHost: gw\r\n\r\n"
                    + post(MODEL_PATH, encode_body("fourth, the last")))
        answers = [client.answer() for _ in range(4)]
        assert [a.status for a in answers] == [200] * 4, [a.body for a in answers]
        for answer, text in zip([answers[0], answers[1], answers[3]],
                                ["first", "second text", "fourth, the last"], strict=True):
            assert answer.json()["items"][0]["dense"] == fake_vector(text).tolist()
        assert answers[2].json() == {"status": "ok"}
        # The same connection serves the next request after the pipeline drained.
        client.send(post(MODEL_PATH, encode_body("again")))
        assert client.answer().json()["items"][0]["dense"] == fake_vector("again").tolist()
        # A client that says close gets its answer, told so, and the connection closes.
        client.send(post(MODEL_PATH, encode_body("bye"), extra="Connection: close\r\n"))
        last = client.answer()
        assert last.status == 200
        assert last.header(b"connection") == b"close"
        assert client.closed_by_server()
    finally:
        client.close()
    # The first and the last two; those pipelined behind an unanswered one queue in uvicorn.
    assert served[0] == MODEL_PATH and len(served) >= 3


def test_what_the_protocol_leaves_to_uvicorn_is_answered(
        gateways: tuple[GatewayThread, GatewayThread], served: list[str]) -> None:
    """A chunked body, ``Expect: 100-continue``, HTTP/1.0 and a body over the protocol's
    1 MiB take uvicorn's path and are answered (the last a 413 from its declared length,
    before its body is sent)."""
    hot, _ = gateways
    body = encode_body("chunked text")
    chunked = (f"POST {MODEL_PATH} HTTP/1.1\r\nHost: gw\r\nContent-Type: application/json"
               f"\r\nTransfer-Encoding: chunked\r\n\r\n{len(body):x}\r\n").encode() + body \
        + b"\r\n0\r\n\r\n"
    answer = one_exchange(hot.port, chunked)
    assert answer.status == 200
    assert answer.json()["items"][0]["dense"] == fake_vector("chunked text").tolist()

    client = RawClient(hot.port)
    try:
        body = encode_body("after a continue")
        client.send(f"POST {MODEL_PATH} HTTP/1.1\r\nHost: gw\r\nContent-Type: "
                    f"application/json\r\nContent-Length: {len(body)}\r\n"
                    "Expect: 100-continue\r\n\r\n".encode())
        while b"\r\n\r\n" not in client.buffer:
            assert client._fill()
        assert client.buffer.startswith(b"HTTP/1.1 100 Continue\r\n\r\n")
        client.buffer = client.buffer[len(b"HTTP/1.1 100 Continue\r\n\r\n"):]
        client.send(body)
        answer = client.answer()
        assert answer.status == 200
        assert answer.json()["items"][0]["dense"] == fake_vector("after a continue").tolist()
    finally:
        client.close()

    old = post(MODEL_PATH, encode_body("old client")).replace(b"HTTP/1.1", b"HTTP/1.0", 1)
    client = RawClient(hot.port)
    try:
        client.send(old)
        answer = client.answer()
        assert answer.status == 200
        assert answer.json()["items"][0]["dense"] == fake_vector("old client").tolist()
        assert client.closed_by_server()
    finally:
        client.close()

    huge = post(MODEL_PATH, b"").replace(b"Content-Length: 0",
                                         f"Content-Length: {1024 * 1024 + 1}".encode())
    answer = one_exchange(hot.port, huge + b'{"items": ')
    assert answer.status == 413
    assert answer.json()["error"]["code"] == "PAYLOAD_TOO_LARGE"
    assert served == []  # none of these went the protocol's own way
