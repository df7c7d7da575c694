"""Image URLs end to end over loopback: a tiny image server (http.server in a thread, on
127.0.0.1) and a real `heron serve` with tiny CLIP that allows 127.0.0.1
(--image-url-hosts), a gateway that allows it in front of a real `heron worker`, and a
gateway that allows nothing (the default).

A fetched image gives the vector of the same bytes sent inline (JSON and msgpack, items
and score's query, the SDK's Item.of_image_url). A host not on the list is refused by name
and never receives a request; a redirect is followed only to a listed host; a 404, a
refused connection, too many redirects and a slow answer are 422 IMAGE_FETCH_FAILED naming
the item, within the timeout; an oversized body is 413 whether or not it declares its
length. Through the cluster the gateway fetches, and the worker gets the bytes.
"""

from __future__ import annotations

import base64
import contextlib
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import numpy as np
import pytest
import yaml

from heron.gateway.settings import GatewaySettings
from heron_sdk import Client, Item, wire
from heron_sdk.images import MAX_IMAGE_BYTES
from tests.support import local_http
from tests.support.gateway_harness import GatewayThread, start_worker, unique
from tests.support.nats_server import NatsServer
from tests.support.servers import ServerProcess, free_port, start_serve
from tests.support.tiny_vision import build_tiny_clip, image_bytes

PNG = image_bytes(40, 30, "PNG", 11)
OTHER = image_bytes(24, 24, "PNG", 12)
# --image-url-timeout-s of the servers here. At 1 s, a CI run's fetch of a redirect on a
# loaded 2-core host ran out of it (IMAGE_FETCH_FAILED where IMAGE_URL_REFUSED was due).
TIMEOUT_S = 3.0
SLOW_S = 6.0  # how long /slow takes to answer
CLIP = "/v1/encode/tiny-clip"


class ImageServer:
    """A loopback HTTP server of a few paths, recording every request it gets (path and
    Host header)."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str]] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:  # quiet
                pass

            def do_GET(self) -> None:
                outer.requests.append((self.path, self.headers.get("Host", "")))
                outer.answer(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self.base = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def answer(self, h: BaseHTTPRequestHandler) -> None:
        path = h.path
        if path in ("/a.png", "/other.png"):
            self._send(h, 200, PNG if path == "/a.png" else OTHER)
        elif path == "/big":  # no Content-Length: read until the connection closes
            h.send_response(200)
            h.send_header("Content-Type", "image/png")
            h.end_headers()
            chunk = b"\0" * 65536
            with contextlib.suppress(OSError):  # the fetcher hangs up at the limit
                for _ in range(MAX_IMAGE_BYTES // len(chunk) + 2):
                    h.wfile.write(chunk)
        elif path == "/big-declared":  # says so up front
            h.send_response(200)
            h.send_header("Content-Length", str(MAX_IMAGE_BYTES + 1))
            h.end_headers()
            with contextlib.suppress(OSError):  # the fetcher hangs up on the header
                h.wfile.write(b"\0" * 1024)
        elif path == "/slow":
            time.sleep(SLOW_S)
            self._send(h, 200, PNG)
        elif path == "/to-allowed":
            self._redirect(h, "/a.png")
        elif path == "/to-localhost":
            self._redirect(h, f"http://localhost:{self.port}/a.png")
        elif path == "/loop":
            self._redirect(h, "/loop")
        else:
            self._send(h, 404, b"not found")

    @staticmethod
    def _send(h: BaseHTTPRequestHandler, status: int, body: bytes) -> None:
        h.send_response(status)
        h.send_header("Content-Length", str(len(body)))
        h.end_headers()
        h.wfile.write(body)

    @classmethod
    def _redirect(cls, h: BaseHTTPRequestHandler, location: str) -> None:
        h.send_response(302)
        h.send_header("Location", location)
        h.send_header("Content-Length", "0")
        h.end_headers()

    def paths(self) -> list[str]:
        return [path for path, _ in self.requests]


@pytest.fixture(scope="module")
def images() -> Iterator[ImageServer]:
    server = ImageServer()
    server.thread.start()
    yield server
    server.server.shutdown()
    server.server.server_close()


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("image-urls")
    checkpoint = build_tiny_clip(root / "clip")
    (root / "models").mkdir()
    config = {"id": "test/tiny-clip", "aliases": ["tiny-clip"], "adapter": "clip",
              "source": {"path": str(checkpoint)}, "profiles": {"default": {}}}
    (root / "models" / "tiny-clip.yaml").write_text(yaml.safe_dump(config))
    path = root / "bundle.yaml"
    path.write_text(yaml.safe_dump({"name": "image-urls", "models": ["tiny-clip.yaml"]}))
    return path


@pytest.fixture(scope="module")
def serve(bundle: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    proc = start_serve(bundle, tmp_path_factory.mktemp("image-urls-logs"),
                       extra_args=["--workers", "1", "--image-url-hosts", "127.0.0.1",
                                   "--image-url-timeout-s", str(TIMEOUT_S)])
    yield proc
    proc.stop()


@pytest.fixture(scope="module")
def http(serve: ServerProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=serve.url, timeout=30) as client:
        yield client


def dense(body: dict) -> np.ndarray:
    return np.array([row["dense"] for row in body["items"]], dtype=np.float32)


def inline(http: httpx.Client, *files: bytes) -> np.ndarray:
    items = [{"image": base64.b64encode(f).decode()} for f in files]
    r = http.post(CLIP, json={"items": items})
    assert r.status_code == 200, r.text
    return dense(r.json())


def refusal(r: httpx.Response, status: int, code: str, field: str) -> str:
    assert r.status_code == status, r.text[:500]
    error = r.json()["error"]
    assert (error["code"], error["field"]) == (code, field)
    return error["message"]


# ---- heron serve ---------------------------------------------------------------------------
def test_a_fetched_image_is_the_image_sent_inline(http: httpx.Client,
                                                  images: ImageServer) -> None:
    want = inline(http, PNG, OTHER)
    r = http.post(CLIP, json={"items": [{"image": f"{images.base}/a.png", "id": "u"},
                                        {"image": f"{images.base}/other.png"}]})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(dense(r.json()), want, atol=1e-6)
    assert r.json()["items"][0]["id"] == "u"
    assert "image_fetch" in r.headers["server-timing"]
    # msgpack: the URL as a string, the answer the same
    packed = http.post(CLIP, content=wire.encode({"items": [{"image": f"{images.base}/a.png"}]},
                                                 wire.MSGPACK),
                       headers={"content-type": wire.MSGPACK})
    assert packed.status_code == 200, packed.text
    np.testing.assert_allclose(dense(wire.decode(packed.content, wire.MSGPACK)), want[:1],
                               atol=1e-6)
    # a URL given several times is fetched once
    before = images.paths().count("/a.png")
    r = http.post(CLIP, json={"items": [{"image": f"{images.base}/a.png"}] * 3})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(dense(r.json()), np.repeat(want[:1], 3, axis=0), atol=1e-6)
    assert images.paths().count("/a.png") == before + 1
    # a redirect to a listed host is followed
    r = http.post(CLIP, json={"items": [{"image": f"{images.base}/to-allowed"}]})
    assert r.status_code == 200, r.text
    np.testing.assert_allclose(dense(r.json()), want[:1], atol=1e-6)


def test_score_and_the_sdk_take_urls(serve: ServerProcess, http: httpx.Client,
                                     images: ImageServer) -> None:
    query = {"image": base64.b64encode(PNG).decode()}
    docs = ["a photo of a cat", {"image": base64.b64encode(OTHER).decode()}]
    want = http.post("/v1/score/tiny-clip", json={"query": query, "items": docs}).json()
    by_url = http.post("/v1/score/tiny-clip", json={
        "query": {"image": f"{images.base}/a.png"},
        "items": [docs[0], {"image": f"{images.base}/other.png"}]})
    assert by_url.status_code == 200, by_url.text
    assert by_url.json()["results"] == want["results"]
    with Client(serve.url) as client:
        got = client.encode("tiny-clip", [Item.of_image_url(f"{images.base}/a.png"), PNG])
        np.testing.assert_allclose(got.dense[0], got.dense[1], atol=1e-6)
        ranked = client.score("tiny-clip", Item.of_image_url(f"{images.base}/a.png"),
                              [docs[0], OTHER])
        assert [(r.index, round(r.score, 5)) for r in ranked.results] == [
            (r["index"], round(r["score"], 5)) for r in want["results"]]


def test_a_host_not_on_the_list_is_never_asked(http: httpx.Client,
                                               images: ImageServer) -> None:
    for url, why in ((f"http://localhost:{images.port}/never.png", "host 'localhost'"),
                     (f"http://127.0.0.1.nip.io:{images.port}/never.png",
                      "host '127.0.0.1.nip.io'"),
                     (f"http://user:pw@127.0.0.1:{images.port}/never.png", "credentials")):
        message = refusal(http.post(CLIP, json={"items": ["text", {"image": url}]}), 422,
                          "IMAGE_URL_REFUSED", "items[1].image")
        assert why in message
    assert "/never.png" not in images.paths()


def test_a_redirect_to_a_host_not_on_the_list_is_refused(http: httpx.Client,
                                                         images: ImageServer) -> None:
    before = len(images.requests)
    message = refusal(http.post(CLIP, json={"items": [{"image": f"{images.base}/to-localhost"}]}),
                      422, "IMAGE_URL_REFUSED", "items[0].image")
    assert "'localhost'" in message
    assert images.paths()[before:] == ["/to-localhost"]  # the redirect's target not asked
    refusal(http.post(CLIP, json={"items": [{"image": f"{images.base}/loop"}]}), 422,
            "IMAGE_FETCH_FAILED", "items[0].image")


def test_a_failed_fetch_names_its_item(http: httpx.Client, images: ImageServer) -> None:
    message = refusal(http.post(CLIP, json={"items": [
        "text", {"image": f"{images.base}/a.png"}, {"image": f"{images.base}/missing.png"}]}),
        422, "IMAGE_FETCH_FAILED", "items[2].image")
    assert "404" in message
    closed = f"http://127.0.0.1:{free_port()}/a.png"  # nothing listens there
    refusal(http.post(CLIP, json={"items": [{"image": closed}]}), 422, "IMAGE_FETCH_FAILED",
            "items[0].image")
    refusal(http.post("/v1/score/tiny-clip", json={
        "query": {"image": f"{images.base}/missing.png"}, "items": ["x"]}), 422,
        "IMAGE_FETCH_FAILED", "query.image")


@pytest.mark.parametrize("path", ["/big", "/big-declared"])
def test_an_oversized_image_is_cut_off(http: httpx.Client, images: ImageServer,
                                       path: str) -> None:
    message = refusal(http.post(CLIP, json={"items": [{"image": images.base + path}]}), 413,
                      "IMAGE_TOO_LARGE", "items[0].image")
    assert str(MAX_IMAGE_BYTES) in message


def test_a_slow_server_times_out_within_the_bound(http: httpx.Client,
                                                  images: ImageServer) -> None:
    started = time.monotonic()
    message = refusal(http.post(CLIP, json={"items": [{"image": f"{images.base}/a.png"},
                                                      {"image": f"{images.base}/slow"}]}),
                      422, "IMAGE_FETCH_FAILED", "items[1].image")
    elapsed = time.monotonic() - started
    assert TIMEOUT_S <= elapsed < TIMEOUT_S + 1.5 < SLOW_S, elapsed
    assert f"within {TIMEOUT_S:g} s" in message
    # The server is fine afterwards.
    assert http.post(CLIP, json={"items": [{"image": f"{images.base}/a.png"}]}).status_code == 200


# ---- the gateway ---------------------------------------------------------------------------
def test_a_gateway_refuses_urls_by_default(nats_server: NatsServer,
                                           images: ImageServer) -> None:
    gateway = GatewayThread(nats_server.url, {}).start(wait_ready=False)
    try:
        r = local_http.post(gateway.url + CLIP, json={"items": [{"image": f"{images.base}/d.png"}]},
                            timeout=30)
        message = refusal(r, 422, "IMAGE_URL_REFUSED", "items[0].image")
        assert "HERON_IMAGE_URL_HOSTS" in message
        assert "/d.png" not in images.paths()
    finally:
        gateway.stop()


def test_through_the_cluster_the_gateway_fetches(bundle: Path, nats_server: NatsServer,
                                                 http: httpx.Client, images: ImageServer,
                                                 tmp_path_factory: pytest.TempPathFactory
                                                 ) -> None:
    """The worker allows no hosts: it answers because it gets the bytes."""
    pool = unique("image-urls")
    worker = start_worker(nats_server.url, pool, bundle, tmp_path_factory.mktemp("urls-worker"))
    settings = GatewaySettings(image_url_hosts="127.0.0.1", image_url_timeout_s=TIMEOUT_S)
    gateway = GatewayThread(nats_server.url, {str(bundle): pool}, settings=settings).start()
    try:
        gateway.wait_for_capacity(pool, 60, worker.log)
        want = inline(http, PNG)
        with httpx.Client(base_url=gateway.url, timeout=30) as client:
            r = client.post(CLIP, json={"items": [{"image": f"{images.base}/a.png"}]})
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(dense(r.json()), want, atol=1e-5)
            refusal(client.post(CLIP, json={"items": [
                {"image": f"http://localhost:{images.port}/a.png"}]}), 422,
                "IMAGE_URL_REFUSED", "items[0].image")
            refusal(client.post(CLIP, json={"items": [{"image": f"{images.base}/nope"}]}),
                    422, "IMAGE_FETCH_FAILED", "items[0].image")
    finally:
        gateway.stop()
        worker.stop()
