"""CORS for browsers calling a server's API from another origin (``--cors-origins``,
HERON_CORS_ORIGINS): off unless origins are set; then Starlette's CORSMiddleware answers
preflights and adds the headers to the answers for an allowed ``Origin``.

Credentials (cookies, HTTP authentication a browser keeps) are never allowed: Heron uses
none, and with ``*`` a browser would refuse them anyway. An API key still works from a
browser: it is an ``Authorization`` header the page sets, which a preflight allows.
"""

from __future__ import annotations

import re

from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware

# What a browser's Origin header holds: scheme://host[:port], no path, no trailing slash.
_ORIGIN = re.compile(r"[a-zA-Z][a-zA-Z0-9+.-]*://[^/\s?#,]+")
ALLOWED_METHODS = ("GET", "POST", "DELETE")
# Answer headers a page's script may read (the rest are the CORS-safelisted ones).
EXPOSED_HEADERS = ("X-Request-Id", "Server-Timing", "Retry-After")
PREFLIGHT_MAX_AGE_S = 600


def parse_origins(text: str | None) -> tuple[str, ...]:
    """The origins of a ``--cors-origins`` value (empty: CORS off). ValueError for an entry
    a browser would never send as its Origin (a path, a trailing slash, no scheme)."""
    origins = tuple(part.strip() for part in (text or "").split(",") if part.strip())
    for origin in origins:
        if origin != "*" and not _ORIGIN.fullmatch(origin):
            raise ValueError(f"each entry must be an origin, scheme://host[:port] (no path, "
                             f"no trailing slash), or *; not {origin!r}")
    if "*" in origins:
        return ("*",)
    return origins


def cors_middleware(origins: tuple[str, ...]) -> list[Middleware]:
    """The middleware for ``origins`` (none when empty: a server without CORS pays
    nothing). Preflights are answered before API keys are checked: a browser sends none."""
    if not origins:
        return []
    return [Middleware(CORSMiddleware, allow_origins=list(origins),
                       allow_methods=list(ALLOWED_METHODS), allow_headers=["*"],
                       allow_credentials=False, expose_headers=list(EXPOSED_HEADERS),
                       max_age=PREFLIGHT_MAX_AGE_S)]
