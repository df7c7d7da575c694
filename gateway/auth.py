"""API keys for the gateway's inference API (HERON_API_KEYS, comma-separated).

When set, every /v1/ route needs ``Authorization: Bearer <key>``; /healthz, /readyz and
/metrics stay open. These keys only ever authorise inference: config writes belong to the
config service and its admin token.
"""

from __future__ import annotations

import os

from starlette.requests import Request
from starlette.types import ASGIApp, Receive, Scope, Send

from heron.runtime.http import error_response, require_bearer
from heron_sdk.errors import HeronError


def api_keys_from_env() -> set[str]:
    return {k.strip() for k in os.environ.get("HERON_API_KEYS", "").split(",") if k.strip()}


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: set[str]) -> None:
        self.app = app
        self.keys = keys

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.keys and scope["type"] == "http" and scope["path"].startswith("/v1/"):
            request = Request(scope, receive)
            try:
                require_bearer(request.headers.get("authorization"), self.keys,
                               "the inference API")
            except HeronError as exc:
                await error_response(request, exc)(scope, receive, send)
                return
        await self.app(scope, receive, send)
