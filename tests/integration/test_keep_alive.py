"""An idle keep-alive connection outlives a client's own idle limit (httpx's default of
5 s, the SDK's): the client drops it first, so no request is sent in the instant the
server closes it (a reset with no answer)."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import httpx

from heron.config_service.app import uvicorn_config as config_service_uvicorn_config
from heron.gateway.app import uvicorn_config as gateway_uvicorn_config
from heron.runtime.http import HTTP_KEEP_ALIVE_S

HTTPX_KEEPALIVE_EXPIRY_S = httpx.Limits().keepalive_expiry or 0.0  # the SDK's clients' limit


def _get(sock: socket.socket, host: str) -> bytes:
    """GET /healthz on an open connection; the response's status line ("" if closed)."""
    sock.sendall(f"GET /healthz HTTP/1.1\r\nHost: {host}\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(4096)
        if not chunk:
            return b""
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length:"))
    while len(body) < length:
        body += sock.recv(4096)
    return head.split(b"\r\n")[0]


def test_heron_serve_keeps_an_idle_connection_past_a_clients_idle_limit(
        base_url: str) -> None:
    url = urlsplit(base_url)
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        assert _get(sock, url.netloc) == b"HTTP/1.1 200 OK"
        time.sleep(HTTPX_KEEPALIVE_EXPIRY_S + 1.0)  # uvicorn's default (5 s) closed it here
        assert _get(sock, url.netloc) == b"HTTP/1.1 200 OK"  # the same connection


def test_the_gateway_and_the_config_service_keep_idle_connections_as_long() -> None:
    assert HTTP_KEEP_ALIVE_S > 2 * HTTPX_KEEPALIVE_EXPIRY_S
    gateway = gateway_uvicorn_config(None, host="127.0.0.1", port=1)  # type: ignore[arg-type]
    config = config_service_uvicorn_config(None, host="127.0.0.1",  # type: ignore[arg-type]
                                           port=1)
    assert gateway.timeout_keep_alive == config.timeout_keep_alive == HTTP_KEEP_ALIVE_S
