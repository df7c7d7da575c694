"""API keys for the public inference API (HERON_API_KEYS, comma-separated), on every server
that serves it: ``heron serve``, a worker's own HTTP API and the gateway.

When set, every /v1/ route, and every route of another API served outside /v1/ (TEI's
/embed, /info, POST /, ...: ``guarded``), needs ``Authorization: Bearer <key>``; /healthz,
/readyz, /metrics, /openapi.json, /docs (and the gateway's cluster page) stay open. These keys only
ever authorise inference: config writes belong to the config service and its admin token.
"""

from __future__ import annotations

import os

from starlette.middleware import Middleware
from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from heron.runtime.http import error_response, require_bearer
from heron_sdk.errors import HeronError

API_KEYS_ENV = "HERON_API_KEYS"


def api_keys_from_env() -> set[str]:
    return {k.strip() for k in os.environ.get(API_KEYS_ENV, "").split(",") if k.strip()}


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: set[str],
                 guarded: frozenset[tuple[str, str]] = frozenset()) -> None:
        self.app = app
        self.keys = keys
        self.guarded = guarded  # (method, exact path) outside /v1/ that need a key too

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.keys and scope["type"] == "http" and (
                scope["path"].startswith("/v1/")
                or (scope["method"], scope["path"]) in self.guarded):
            request = Request(scope, receive)
            try:
                require_bearer(request.headers.get("authorization"), self.keys,
                               "the inference API")
            except HeronError as exc:
                await error_response(request, exc)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def api_key_middleware(keys: set[str] | None = None,
                       guarded: frozenset[tuple[str, str]] = frozenset()) -> list[Middleware]:
    """The middleware list of a server with the inference API: none without keys, so an
    open server pays nothing per request for the check. ``guarded``: (method, exact path)
    pairs outside /v1/ that need a key as well (GET / of a gateway's page stays open)."""
    keys = api_keys_from_env() if keys is None else keys
    return [Middleware(ApiKeyMiddleware, keys=keys, guarded=guarded)] if keys else []
