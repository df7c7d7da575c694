"""The inference POSTs served by the HTTP protocol itself, past uvicorn's ASGI cycle.

A gateway spends its CPU on one-text requests, and uvicorn's cycle a request is a fixed part
of it: the RequestResponseCycle and its event, a task started before the body has arrived,
ASGI's ``receive`` and two ``send`` messages, and 12 regex searches over the response's
headers (measured apart on the slow 2-core machine: uvicorn with a bare ASGI app 79 µs a
request, a bare httptools protocol 14 µs). ``HotPostHttpTools`` serves the requests an
``InferenceApp`` takes straight to its handlers (``InferenceApp.hot_route``: encode, score,
extract, /v1/embeddings) without that cycle: it buffers the body (the request says its
length, at most ``HOT_BODY_BYTES``), starts one task when the body is complete, runs the
same handler with the same Starlette ``Request`` and error mapping, and writes the
response's status line, headers and body in one write.

Everything else takes uvicorn's path unchanged: other methods and routes, chunked bodies,
bodies over ``HOT_BODY_BYTES``, ``Expect: 100-continue``, upgrades, HTTP/1.0, a request
pipelined behind one not answered yet, an app wrapped in middleware by uvicorn (proxy
headers), and a server with a concurrency limit. A request taken here looks the same to its
handler (scope, headers, ``heron.received_at``, the disconnect hook) and to its client
(status, headers, body, keep-alive and ``Connection: close``, graceful shutdown).
"""

from __future__ import annotations

import asyncio
import urllib.parse
from collections.abc import Awaitable, Callable
from typing import Any

import httptools
from starlette.requests import Request
from starlette.responses import Response
from uvicorn.protocols.http.httptools_impl import STATUS_LINE
from uvicorn.protocols.utils import get_client_addr, get_path_with_query_string

from heron.runtime.received import ReceivedAtHttpTools

# The largest body served here: a one-text request is a few hundred bytes, 64 long texts a
# few hundred KiB. A bigger body takes uvicorn's path, which streams it under flow control
# (here a body is held whole before its task starts).
HOT_BODY_BYTES = 1024 * 1024
HotHandler = Callable[[Request], Awaitable[Response]]


class _Signal:
    """The ``message_event`` uvicorn's protocol sets when the connection is lost: a waiter
    only when a handler asks ``receive`` for a second message (none of the hot handlers do)."""

    __slots__ = ("_waiter",)

    def __init__(self) -> None:
        self._waiter: asyncio.Future[None] | None = None

    def set(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    async def wait(self) -> None:
        if self._waiter is None:
            self._waiter = asyncio.get_running_loop().create_future()
        await self._waiter


class HotExchange:
    """One hot request on a connection: what uvicorn's protocol reads of its cycle
    (``response_complete``, ``disconnected``, ``keep_alive``, ``message_event``, ``scope``)
    and the body's chunks."""

    __slots__ = ("chunks", "disconnected", "handler", "keep_alive", "message_event",
                 "response_complete", "scope")

    def __init__(self, scope: Any, handler: HotHandler, keep_alive: bool) -> None:
        self.scope = scope
        self.handler = handler
        self.keep_alive = keep_alive
        self.chunks: list[bytes] = []
        self.disconnected = False
        self.response_complete = False
        self.message_event = _Signal()


class HotPostHttpTools(ReceivedAtHttpTools):
    """Heron's uvicorn protocol (heron.runtime.received), serving hot inference POSTs itself."""

    _hot: HotExchange | None = None  # the request whose body is being read

    def on_headers_complete(self) -> None:
        exchange = self._take_hot()
        if exchange is None:
            super().on_headers_complete()
            return
        self.cycle = exchange  # type: ignore[assignment]
        self._hot = exchange

    def on_body(self, body: bytes) -> None:
        hot = self._hot
        if hot is None:
            super().on_body(body)
        else:
            hot.chunks.append(body)

    def on_message_complete(self) -> None:
        hot = self._hot
        if hot is None:
            super().on_message_complete()
            return
        self._hot = None
        self._start(hot)

    def connection_lost(self, exc: Exception | None) -> None:
        hot = self._hot
        super().connection_lost(exc)  # marks the exchange disconnected
        if hot is not None:  # its body never ended: served as gone (a 499), as by uvicorn
            self._hot = None
            self._start(hot)

    def _start(self, exchange: HotExchange) -> None:
        task = self.loop.create_task(self._serve(exchange))
        task.add_done_callback(self.tasks.discard)
        self.tasks.add(task)

    def _take_hot(self) -> HotExchange | None:
        """The request just parsed as a hot exchange, or None for uvicorn's path."""
        parser = self.parser
        if (parser.get_method() != b"POST" or self.expect_100_continue
                or parser.should_upgrade() or parser.get_http_version() != "1.1"
                or self.limit_concurrency is not None):
            return None
        existing = self.cycle
        if existing is not None and not existing.response_complete:
            return None  # pipelined behind a request not answered yet: queued by uvicorn
        hot_route = getattr(self.app, "hot_route", None)
        if hot_route is None:
            return None
        length = origin = None
        for name, value in self.headers:
            if name == b"content-length":
                length = value
            elif name == b"origin":
                origin = value
        if length is None or not length.isdigit() or int(length) > HOT_BODY_BYTES:
            return None
        parsed = httptools.parse_url(self.url)
        raw_path: bytes = parsed.path
        path = raw_path.decode("ascii")
        if "%" in path:
            path = urllib.parse.unquote(path)
        route = hot_route(path, origin is not None)
        if route is None:
            return None
        handler, path_params = route
        scope = self.scope
        scope["method"] = "POST"
        scope["path"] = self.root_path + path
        scope["raw_path"] = self.root_path.encode("ascii") + raw_path
        scope["query_string"] = parsed.query or b""
        scope["app"] = self.app
        if path_params is not None:
            scope["path_params"] = path_params
        return HotExchange(scope, handler, parser.should_keep_alive())

    async def _serve(self, exchange: HotExchange) -> None:
        chunks = exchange.chunks
        body = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            if not delivered and not exchange.disconnected:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            if not exchange.disconnected and not exchange.response_complete:
                await exchange.message_event.wait()
            return {"type": "http.disconnect"}

        request = Request(exchange.scope, receive)
        try:
            response = await self.app.serve_hot(request, exchange.handler)
        except BaseException as exc:  # as uvicorn's cycle: a 500, and the error logged
            self.logger.error("Exception in ASGI application\n", exc_info=exc)
            response = Response(b"Internal Server Error", status_code=500,
                                media_type="text/plain")
            exchange.keep_alive = False
        self._write(exchange, response)
        if response.background is not None:
            await response.background()

    def _write(self, exchange: HotExchange, response: Response) -> None:
        """The whole response in one write, as uvicorn would have written it."""
        if exchange.disconnected or self.transport.is_closing():
            exchange.response_complete = True  # nobody to answer
            return
        status = response.status_code
        if self.access_log:
            scope = exchange.scope
            self.access_logger.info('%s - "%s %s HTTP/%s" %d', get_client_addr(scope), "POST",
                                    get_path_with_query_string(scope), "1.1", status)
        parts = [STATUS_LINE[status]]
        for name, value in (*self.server_state.default_headers, *response.raw_headers):
            if name == b"connection" and b"close" in value.lower():
                exchange.keep_alive = False
            parts += (name, b": ", value, b"\r\n")
        if not exchange.keep_alive:
            parts.append(b"connection: close\r\n")
        parts += (b"\r\n", response.body)
        self.transport.write(b"".join(parts))
        exchange.response_complete = True
        if not exchange.keep_alive:
            self.transport.close()
        self.on_response_complete()


HOT_POST_HTTP = HotPostHttpTools
