"""When the server received a request: the start of its deadline.

A request's deadline counts from the moment its first bytes were parsed, not from when its
handler ran. Under overload the two are far apart: the event loop parses requests as
they come but runs their handlers in turn, and a deadline started in the handler lets a
request that waited seconds in that line still be admitted (2,000 concurrent requests
through one gateway: handlers started up to several seconds after the bytes arrived).

``RECEIVED_AT_HTTP`` is uvicorn's httptools protocol with one addition: it stamps
``scope["heron.received_at"]`` (``time.monotonic()``) when a request's message begins.
Every Heron server runs uvicorn with it (``http=RECEIVED_AT_HTTP``); ``received_at``
falls back to now under any other server (tests' ASGI transports).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

SCOPE_KEY = "heron.received_at"


class ReceivedAtHttpTools(HttpToolsProtocol):
    def on_message_begin(self) -> None:
        super().on_message_begin()
        self.scope[SCOPE_KEY] = time.monotonic()  # type: ignore[literal-required]


RECEIVED_AT_HTTP = ReceivedAtHttpTools


def received_at(scope: Mapping[str, Any]) -> float:
    """The monotonic time the request arrived (now, when the server did not stamp it)."""
    stamp = scope.get(SCOPE_KEY)
    return stamp if isinstance(stamp, float) else time.monotonic()
