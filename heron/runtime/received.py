"""When the server received a request: the start of its deadline.

A request's deadline counts from the moment its first bytes were parsed, not from when its
handler ran. Under overload the two are far apart: the event loop parses requests as
they come but runs their handlers in turn, and a deadline started in the handler lets a
request that waited seconds in that line still be admitted (2,000 concurrent requests
through one gateway: handlers started up to several seconds after the bytes arrived).

``RECEIVED_AT_HTTP`` is uvicorn's httptools protocol with three additions: it stamps
``scope["heron.received_at"]`` (``time.monotonic()``) when a request's message begins, it
writes a response's head and body in one write (``_HeadWithBody``: on a gateway at 2,500
one-text requests a second, uvicorn's two writes a response were its largest single cost),
and it tells a request's handler when its connection is lost (``DisconnectHook`` in
``scope["heron.disconnect"]``: a callback, where a task per request waiting for ASGI's
``http.disconnect`` cost a gateway 3-4% of its CPU).
Every Heron server runs uvicorn with it (``http=RECEIVED_AT_HTTP``; the gateway with its
subclass ``HotPostHttpTools``, heron.runtime.hot_posts, which serves the inference POSTs
itself); ``received_at`` falls back to now under any other server (tests' ASGI transports).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

SCOPE_KEY = "heron.received_at"
DISCONNECT_KEY = "heron.disconnect"


class DisconnectHook:
    """Whether a request's connection was lost before its response was complete, and the
    one callback (if any) to call when it is."""

    __slots__ = ("callback", "gone")

    def __init__(self) -> None:
        self.gone = False
        self.callback: Callable[[], None] | None = None

    def lost(self) -> None:
        self.gone = True
        callback, self.callback = self.callback, None
        if callback is not None:
            callback()


class ReceivedAtHttpTools(HttpToolsProtocol):
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[SCOPE_KEY] = time.monotonic()  # type: ignore[literal-required]
        self.scope[DISCONNECT_KEY] = DisconnectHook()  # type: ignore[literal-required]

    def connection_lost(self, exc: Exception | None) -> None:
        cycle = self.cycle
        super().connection_lost(exc)
        if cycle is not None and not cycle.response_complete:
            hook = cycle.scope.get(DISCONNECT_KEY)
            if isinstance(hook, DisconnectHook):
                hook.lost()

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is not None and not isinstance(cycle.transport, _HeadWithBody):
            cycle.transport = _HeadWithBody(cycle.transport)  # type: ignore[assignment]


class _HeadWithBody:
    """A response's transport that holds its head (status line and headers, uvicorn's first
    write) until the body's first write, and sends both in one: one send() and one TCP
    segment a response, not two. A head whose body never comes is sent when the connection
    closes. Everything else is the transport's."""

    __slots__ = ("_head", "_transport", "_wrote")

    def __init__(self, transport: Any) -> None:
        self._transport = transport
        self._head: bytes | None = None
        self._wrote = False

    def write(self, data: bytes) -> None:
        if not self._wrote:  # uvicorn's first write of a response is its head
            self._wrote = True
            if data.endswith(b"\r\n\r\n") and not data.startswith(b"HTTP/1.1 100 "):
                self._head = data
                return
        if self._head is not None:
            data, self._head = self._head + data, None
        self._transport.write(data)

    def close(self) -> None:
        if self._head is not None:
            self._transport.write(self._head)
            self._head = None
        self._transport.close()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)


RECEIVED_AT_HTTP = ReceivedAtHttpTools


def received_at(scope: Mapping[str, Any]) -> float:
    """The monotonic time the request arrived (now, when the server did not stamp it)."""
    stamp = scope.get(SCOPE_KEY)
    return stamp if isinstance(stamp, float) else time.monotonic()
