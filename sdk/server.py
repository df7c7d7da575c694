"""Server-side HTTP helpers shared by the worker and the gateway (Starlette).

Content negotiation, the body size limit, and the one mapping from HeronError to an HTTP
response, so every server answers errors the same way.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
from collections.abc import Awaitable
from typing import Any, TypeVar

from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from sdk import wire
from sdk.errors import ErrorCode, HeronError
from sdk.types import MAX_BODY_BYTES

log = logging.getLogger("heron.http")

T = TypeVar("T")
# What nginx logs for "the client closed the connection before the answer": no client sees
# it (there is nobody to send it to); it only labels metrics and access logs.
CLIENT_CLOSED_STATUS = 499


class ClientDisconnected(Exception):
    """The client went away while its request was being served; the work was cancelled."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` (after the body was read), cancelling it if the client disconnects
    first: a caller that has gone costs no compute (queued items are skipped)."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    raise ClientDisconnected(request.url.path)


async def _disconnected(request: Request) -> None:
    while True:  # the body is consumed: the next message is the disconnect
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> tuple[Any, str]:
    """Decode the request body (413 past ``limit``, 400 malformed, 415 unknown type)."""
    fmt = wire.request_format(request.headers.get("content-type"))
    return wire.decode(await read_raw(request, limit), fmt), fmt


async def read_raw(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The raw body, 413 past ``limit`` (declared or streamed: chunked bodies too)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HeronError(ErrorCode.PAYLOAD_TOO_LARGE,
                         f"body of {declared} bytes is over the {limit}-byte limit")
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise HeronError(ErrorCode.PAYLOAD_TOO_LARGE,
                             f"body is over the {limit}-byte limit")
        chunks.append(chunk)
    return b"".join(chunks)


def respond(request: Request, body: Any, *, status: int = 200, request_fmt: str | None = None,
            headers: dict[str, str] | None = None) -> Response:
    """Encode ``body`` in the format the client accepts (msgpack or JSON)."""
    fmt = wire.response_format(request.headers.get("accept"),
                               request_fmt or wire.media_type(
                                   request.headers.get("content-type")) or wire.JSON)
    return Response(wire.encode(body, fmt), status_code=status, media_type=fmt,
                    headers=headers)


def error_response(request: Request, error: HeronError) -> Response:
    headers = {}
    if error.retry_after_s is not None:
        headers["Retry-After"] = str(max(1, math.ceil(error.retry_after_s)))
    return respond(request, error.to_body(), status=error.status, headers=headers)


async def heron_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HeronError)
    return error_response(request, exc)


async def http_error_handler(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    code = {404: ErrorCode.NOT_FOUND, 405: ErrorCode.METHOD_NOT_ALLOWED}.get(
        exc.status_code, ErrorCode.MALFORMED_BODY)
    body = {"error": {"code": code.value, "message": str(exc.detail)}}
    return respond(request, body, status=exc.status_code, request_fmt=wire.JSON)


async def unexpected_error_handler(request: Request, exc: Exception) -> Response:
    log.exception("unhandled error on %s %s", request.method, request.url.path)
    return error_response(request, HeronError(ErrorCode.INTERNAL,
                                              f"internal error: {type(exc).__name__}"))


EXCEPTION_HANDLERS = {
    HeronError: heron_error_handler,
    HTTPException: http_error_handler,
    Exception: unexpected_error_handler,
}


def require_bearer(authorization: str | None, tokens: set[str], what: str) -> None:
    """401 without a bearer token, 403 with one that is not in ``tokens``."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise HeronError(ErrorCode.UNAUTHORIZED,
                         f"{what} needs 'Authorization: Bearer <token>'")
    # Constant-time comparison: no timing hint of how much of a token matched.
    if not any(hmac.compare_digest(token.strip().encode(), t.encode()) for t in tokens):
        raise HeronError(ErrorCode.FORBIDDEN, f"this token does not authorise {what}")
