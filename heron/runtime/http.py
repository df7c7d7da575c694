"""Server-side HTTP helpers shared by the worker and the gateway (Starlette).

Content negotiation, the body size limit, and the one mapping from HeronError to an HTTP
response, so every server answers errors the same way.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import math
import time
from collections.abc import Awaitable, Mapping
from typing import Any, TypeVar

from opentelemetry.trace import SpanKind
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response

from heron.runtime import telemetry
from heron.runtime.logs import RequestContext, bind_request, current_request
from heron.runtime.received import DISCONNECT_KEY, DisconnectHook
from heron_sdk import wire
from heron_sdk.errors import ErrorCode, HeronError
from heron_sdk.ids import request_id_from
from heron_sdk.types import MAX_BODY_BYTES

log = logging.getLogger("heron.http")

# How long every Heron server keeps an idle keep-alive connection open (uvicorn's default
# is 5 s). A client whose own idle limit is also 5 s (httpx's default, so the SDK's) can
# send a request on a connection in the instant the server closes it, and gets a reset with
# no answer: a CI run of test_gateway_admission did. Clients and load balancers should
# drop an idle connection before the server does (an AWS ALB keeps one 60 s). 75 s is
# nginx's default.
HTTP_KEEP_ALIVE_S = 75

T = TypeVar("T")
# What nginx logs for "the client closed the connection before the answer": no client sees
# it (there is nobody to send it to); it only labels metrics and access logs.
CLIENT_CLOSED_STATUS = 499


class ClientDisconnected(Exception):
    """The client went away while its request was being served; the work was cancelled."""


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work`` (after the body was read), cancelling it if the client disconnects
    first: a caller that has gone costs no compute (queued items are skipped). The work
    runs in the calling task. Under Heron's uvicorn protocol (heron.runtime.received) the
    lost connection calls back; under any other server a watcher task waits for ASGI's
    ``http.disconnect``."""
    current = asyncio.current_task()
    assert current is not None
    gone = finished = False

    def cancel() -> None:
        nonlocal gone
        # ``finished``: a callback scheduled just before the work ended must not cancel
        # whatever the task does next.
        if not finished:
            gone = True
            current.cancel()

    hook = request.scope.get(DISCONNECT_KEY)
    watcher: asyncio.Future[None] | None = None
    if isinstance(hook, DisconnectHook):
        if hook.gone:
            if asyncio.iscoroutine(work):
                work.close()
            raise ClientDisconnected(request.url.path)
        hook.callback = cancel
    else:
        def on_disconnect(future: asyncio.Future[None]) -> None:
            if not future.cancelled() and future.exception() is None:
                cancel()

        watcher = asyncio.ensure_future(_disconnected(request))
        watcher.add_done_callback(on_disconnect)
    try:
        return await work
    except asyncio.CancelledError:
        if not gone:
            raise
        current.uncancel()
        raise ClientDisconnected(request.url.path) from None
    finally:
        finished = True
        if watcher is not None:
            watcher.cancel()
        elif isinstance(hook, DisconnectHook):
            hook.callback = None


async def _disconnected(request: Request) -> None:
    while True:  # the body is consumed: the next message is the disconnect
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def read_body(request: Request, limit: int = MAX_BODY_BYTES) -> tuple[Any, str]:
    """Decode the request body (413 past ``limit``, 400 malformed or nested too deep, 415
    unknown type): no numpy arrays, whatever a msgpack body holds (wire.decode_request)."""
    fmt = wire.request_format(request.headers.get("content-type"))
    return wire.decode_request(await read_raw(request, limit), fmt), fmt


async def read_raw(request: Request, limit: int = MAX_BODY_BYTES) -> bytes:
    """The raw body, 413 past ``limit`` (declared or streamed: chunked bodies too); a client
    gone before its body ended is ClientDisconnected.

    Read from ASGI's ``receive`` itself, once: Starlette's ``Request.stream()`` is an async
    generator, which the event loop registers in a weak set on its first step (1-2% of a
    gateway's CPU at one-text requests, in cProfile)."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise HeronError(ErrorCode.PAYLOAD_TOO_LARGE,
                         f"body of {declared} bytes is over the {limit}-byte limit")
    chunks: list[bytes] = []
    size = 0
    receive = request.receive
    while True:
        message = await receive()
        if message["type"] != "http.request":  # http.disconnect
            raise ClientDisconnected(request.url.path)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise HeronError(ErrorCode.PAYLOAD_TOO_LARGE,
                             f"body is over the {limit}-byte limit")
        chunks.append(chunk)
        if not message.get("more_body", False):
            return chunks[0] if len(chunks) == 1 else b"".join(chunks)


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
    request_id = request_id_of(request)
    if request_id is not None:  # an inference request's error names it, like its answer
        headers["X-Request-Id"] = request_id
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


async def client_gone_handler(request: Request, exc: Exception) -> Response:
    """A client that left before its body arrived: nobody to answer, and no error of the
    server's. The 499 only labels access logs and metrics."""
    return Response(status_code=CLIENT_CLOSED_STATUS)


EXCEPTION_HANDLERS = {
    HeronError: heron_error_handler,
    HTTPException: http_error_handler,
    ClientDisconnected: client_gone_handler,
    Exception: unexpected_error_handler,
}


def error_handler(exc: Exception) -> Any:
    """The handler EXCEPTION_HANDLERS gives ``exc``: its first class ``exc`` is an instance
    of (the table runs from the most specific to ``Exception``, as Starlette picks)."""
    return next(handler for cls, handler in EXCEPTION_HANDLERS.items() if isinstance(exc, cls))


def require_bearer(authorization: str | None, tokens: set[str], what: str) -> None:
    """401 without a bearer token, 403 with one that is not in ``tokens``."""
    scheme, _, token = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise HeronError(ErrorCode.UNAUTHORIZED,
                         f"{what} needs 'Authorization: Bearer <token>'")
    # Constant-time comparison: no timing hint of how much of a token matched.
    if not any(hmac.compare_digest(token.strip().encode(), t.encode()) for t in tokens):
        raise HeronError(ErrorCode.FORBIDDEN, f"this token does not authorise {what}")


# ---- per-request observability ---------------------------------------------------------------
# The id RequestScope gave an inference request, in its ASGI scope (not ``request.state``:
# Starlette builds a State object a request for it).
REQUEST_ID_KEY = "heron.request_id"


def request_id_of(request: Request) -> str | None:
    """The id of an inference request being served (None for any other request)."""
    return request.scope.get(REQUEST_ID_KEY)


def server_timing(phases: Mapping[str, float]) -> str:
    """``Server-Timing`` from phase -> seconds: ``tokenize;dur=0.62, ...`` (milliseconds)."""
    return ", ".join([f"{name};dur={seconds * 1000:.2f}" for name, seconds in phases.items()])


# Route name (as metrics label them) -> its template, the span's ``http.route``.
ROUTE_TEMPLATES = {"encode": "/v1/encode/{model}", "score": "/v1/score/{model}",
                   "extract": "/v1/extract/{model}", "embeddings": "/v1/embeddings",
                   "rerank_v1": "/v1/rerank", "rerank_v2": "/v2/rerank",
                   "provision": "/v1/models/{model}/provision",
                   # TEI's routes (heron.runtime.tei_api)
                   "tei_embed": "/embed", "tei_embed_sparse": "/embed_sparse",
                   "tei_rerank": "/rerank", "tei_predict": "/predict",
                   "tei_tokenize": "/tokenize", "tei_decode": "/decode", "tei_info": "/info",
                   "tei_root": "/"}


class RequestScope:
    """What an inference request leaves besides its answer: its id (the client's
    ``X-Request-Id`` when usable, else a new one), a log context carrying the id to every
    line logged while it is served, and, with tracing on, a server span that continues
    the client's ``traceparent`` (a malformed one starts a new trace). ``finish`` logs the
    request's one summary line: debug for answers, warning for 5xx, error for 500."""

    __slots__ = ("context", "log", "request", "request_id", "span", "started")

    def __init__(self, request: Request, scope: str, route_name: str,
                 log: logging.Logger) -> None:
        self.started = time.monotonic()
        self.request = request
        self.log = log
        self.request_id = request_id_from(request.headers.get("x-request-id"))
        request.scope[REQUEST_ID_KEY] = self.request_id  # error responses echo it
        self.context: RequestContext = bind_request(self.request_id)
        self.span = telemetry.start_span(
            scope, "request", kind=SpanKind.SERVER, parent=telemetry.extract(request.headers),
            attributes={"http.request.method": request.method, "url.path": request.url.path,
                        "http.route": ROUTE_TEMPLATES.get(route_name, route_name),
                        "heron.route": route_name, "heron.request_id": self.request_id},
        ) if telemetry.enabled() else None

    def finish(self, status: int, model: str | None) -> None:
        if model is not None and self.context.model is None:
            self.context.model = model
        level = (logging.DEBUG if status < 500 else
                 logging.ERROR if status == 500 else logging.WARNING)
        if self.log.isEnabledFor(level):
            elapsed_ms = round((time.monotonic() - self.started) * 1000, 2)
            self.log.log(level, "%s %s %d %.2f ms", self.request.method,
                         self.request.url.path, status, elapsed_ms,
                         extra={"status": status, "duration_ms": elapsed_ms})
        if self.span is not None:
            attributes: dict[str, Any] = {"http.response.status_code": status}
            if self.context.model is not None:
                attributes["heron.model"] = self.context.model
            telemetry.end_span(self.span, attributes=attributes,
                               error=f"HTTP {status}" if status >= 500 else None)


def note_route(model: str, pool: str | None = None) -> None:
    """The request being served is for ``model`` (in ``pool``): its log lines and span say so."""
    context = current_request()
    if context is not None:
        context.model, context.pool = model, pool
    if telemetry.enabled():
        attributes = {"heron.model": model}
        if pool is not None:
            attributes["heron.pool"] = pool
        telemetry.set_attributes(attributes)
