"""The tests' one-off HTTP requests (readiness polls, a single POST), on one client per
test process instead of httpx.get()'s new client per call.

A new httpx client builds an SSL context, loading certifi's CA bundle, even for plain
http: 47 ms of CPU a call on this 2-core machine, against 0.3 ms for a request on a client
that exists. A readiness poll every 0.2 s spent a quarter of a core that way while a
server started, and `make test` starts about 80 of them. Like httpx.get(), this client
keeps no connection open between requests, so none goes out on a socket that a stopped
server left behind; like it, a request's timeout defaults to 5 s.
"""

from __future__ import annotations

from typing import Any

import httpx

_client = httpx.Client(timeout=5.0, limits=httpx.Limits(max_keepalive_connections=0))


def request(method: str, url: str, **kwargs: Any) -> httpx.Response:
    return _client.request(method, url, **kwargs)


def get(url: str, **kwargs: Any) -> httpx.Response:
    return _client.request("GET", url, **kwargs)


def post(url: str, **kwargs: Any) -> httpx.Response:
    return _client.request("POST", url, **kwargs)


def delete(url: str, **kwargs: Any) -> httpx.Response:
    return _client.request("DELETE", url, **kwargs)
