"""The Starlette app of a server with the inference API: the front's routes (Heron's own and
the other APIs it speaks), the server's own routes, /openapi.json and /docs, CORS, API keys,
and the one error mapping; and ``InferenceApp``, which takes the hot inference POSTs straight
to their handlers."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from functools import cache
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute

from heron import __version__
from heron.runtime import heap
from heron.runtime.auth import api_key_middleware
from heron.runtime.backend import InferenceBackend
from heron.runtime.cors import cors_middleware, parse_origins
from heron.runtime.front import INFERENCE_OPERATIONS, InferenceFront
from heron.runtime.http import EXCEPTION_HANDLERS, error_handler
from heron.runtime.image_urls import DEFAULT_TIMEOUT_S, ImageFetcher
from heron.runtime.openapi import ApiOperation, docs_routes, openapi_document
from heron.runtime.rerank_api import rerank_routes
from heron.runtime.settings import listed
from heron.runtime.tei_api import TEI_PATHS, tei_routes
from heron_sdk.types import MAX_BODY_BYTES


def api_docs_routes(operations: Sequence[ApiOperation], title: str) -> list[BaseRoute]:
    """``GET /openapi.json`` and ``GET /docs`` for ``operations`` (heron.runtime.openapi)."""
    frozen = tuple(operations)

    @cache  # the routes never change while the process runs: build the document once
    def document() -> dict[str, Any]:
        return openapi_document(frozen, title=title, version=__version__)

    return docs_routes(document)



Lifespan = Callable[[Starlette], AbstractAsyncContextManager[None]]


def build_inference_app(backend: InferenceBackend, *, title: str,
                        lifespan: Lifespan | None = None,
                        extra_routes: Sequence[BaseRoute] = (),
                        extra_operations: Sequence[ApiOperation] = (),
                        max_in_flight: int | None = None,
                        max_body_bytes: int = MAX_BODY_BYTES,
                        default_model: str | None = None,
                        cors_origins: str | None = None,
                        image_url_hosts: str | None = None,
                        image_url_timeout_s: float = DEFAULT_TIMEOUT_S) -> Starlette:
    """The app of a server with the inference API: the front's routes, then the server's
    own (``extra_routes``, described by ``extra_operations``), /openapi.json and /docs, CORS,
    API keys from HERON_API_KEYS, and the one error mapping. ``max_in_flight``: inference
    requests at once before 429 QUEUE_FULL (None: no bound here); ``max_body_bytes``: the
    largest request body before 413; ``default_model``: the models the TEI routes use
    (comma-separated; heron.runtime.tei_api); ``cors_origins``: the origins browsers may call
    from (comma-separated, ``*``; None: no CORS; heron.runtime.cors); ``image_url_hosts``:
    the hosts image URLs are fetched from, within ``image_url_timeout_s`` (comma-separated;
    None: image URLs are refused; heron.runtime.image_urls)."""
    fetcher = ImageFetcher(image_url_hosts, image_url_timeout_s, max_body_bytes,
                           user_agent=f"heron/{__version__}")
    front = InferenceFront(backend, max_in_flight, max_body_bytes, fetcher)
    routes = [*front.routes(), *rerank_routes(front),
              *tei_routes(front, listed(default_model)), *extra_routes,
              *api_docs_routes((*INFERENCE_OPERATIONS, *extra_operations), title)]
    cors = cors_middleware(parse_origins(cors_origins))
    keys = api_key_middleware(guarded=TEI_PATHS)
    # CORS outermost: a preflight is answered before API keys are asked for (a browser
    # sends none with it), and a 401 still carries the headers the page needs to read it.
    app = InferenceApp(routes=routes, exception_handlers=dict(EXCEPTION_HANDLERS),
                       lifespan=_closing(fetcher, lifespan), middleware=[*cors, *keys])
    if not keys:  # API keys are checked by middleware: then every route goes there
        app.hot_routes = {"/v1/encode/": front.encode, "/v1/score/": front.score,
                          "/v1/extract/": front.extract}
        app.hot_exact = {"/v1/embeddings": front.embeddings}
        # A browser's request (it has an Origin) goes through the CORS middleware; the
        # rest, every client that is not a page, still takes the short way.
        app.hot_unless_origin = bool(cors)
    return app


def _closing(fetcher: ImageFetcher, lifespan: Lifespan | None) -> Lifespan:
    """``lifespan``, the heap settled once it has started and thawed when it ends
    (heron.runtime.heap), then the image fetcher's connections closed."""

    @asynccontextmanager
    async def run(app: Starlette) -> AsyncIterator[None]:
        try:
            if lifespan is None:
                heap.settle()
                yield
            else:
                async with lifespan(app):
                    heap.settle()  # start-up's objects leave the collector's full walks
                    yield
        finally:
            heap.thaw()
            await fetcher.aclose()

    return run


class InferenceApp(Starlette):
    """Starlette, with the inference POSTs taken straight to their handlers: past the
    router's matching of every route and three middleware layers, which cost a gateway about
    10% of its CPU a request (py-spy, one-text requests). The handlers' errors get the same
    responses as through the stack (heron.runtime.http's handlers); every other request,
    and every request while API keys are set, goes through Starlette as before."""

    hot_routes: dict[str, Callable[[Request], Awaitable[Response]]] = {}  # path prefix ->
    hot_exact: dict[str, Callable[[Request], Awaitable[Response]]] = {}  # exact path ->
    hot_unless_origin = False  # CORS is on: a request with an Origin header takes the stack

    def hot_route(self, path: str, has_origin: bool
                  ) -> tuple[Callable[[Request], Awaitable[Response]],
                             dict[str, str] | None] | None:
        """The handler of a POST to ``path`` (and its path parameters) when it takes the
        short way; None when it goes through Starlette's stack."""
        if has_origin and self.hot_unless_origin:
            return None
        handler = self.hot_exact.get(path)
        if handler is not None:
            return handler, None
        if not path.startswith("/v1/"):
            return None
        prefix = path[:path.find("/", 4) + 1]
        handler = self.hot_routes.get(prefix)
        model = path[len(prefix):]
        if handler is None or not model:
            return None
        return handler, {"model": model}

    async def serve_hot(self, request: Request,
                        handler: Callable[[Request], Awaitable[Response]]) -> Response:
        """``handler``'s response, or the one the stack's error handlers give its error."""
        try:
            return await handler(request)
        except Exception as exc:
            return await error_handler(exc)(request, exc)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            route = self.hot_route(scope["path"], self.hot_unless_origin and _has_origin(scope))
            if route is not None:
                handler, path_params = route
                scope["app"] = self
                if path_params is not None:
                    scope["path_params"] = path_params
                response = await self.serve_hot(Request(scope, receive, send), handler)
                await response(scope, receive, send)
                return
        await super().__call__(scope, receive, send)


def _has_origin(scope: Any) -> bool:
    """Whether the request has an Origin header (a browser's cross-origin request)."""
    return any(name == b"origin" for name, _ in scope["headers"])
