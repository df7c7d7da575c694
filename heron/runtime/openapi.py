"""The OpenAPI 3.1 document of a Heron server, generated from the routes' typed bodies.

Every HTTP app (``heron serve``, the gateway, the config service) declares its routes as
``ApiOperation`` values next to their handlers; ``openapi_document`` turns those into the
document served at ``GET /openapi.json``, and ``docs_routes`` adds that route and a human
page at ``GET /docs`` whose assets come from an installed package (no CDN).

CONTRACT (kept stable while the front and this module are built in parallel):
- ``ApiOperation`` fields and ``openapi_document`` / ``docs_routes`` signatures below.
- ``request`` and the values of ``responses`` are Python types describing the JSON wire
  shape of the body (dataclasses or TypedDicts with type hints); None means no body.

Beyond the declared ``responses``, the document adds what every route of its kind can
answer, so the declarations cannot forget them: 400/413/415/422 where a body is read,
404 where the path names something, 401/403 where ``auth`` is set. An error status's
schema lists exactly the codes heron_sdk.errors maps to it.
"""

from __future__ import annotations

import html
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import BaseRoute, Mount, Route
from starlette.staticfiles import StaticFiles
from swagger_ui_bundle import swagger_ui_path  # the /docs page's assets, as a package

from heron.runtime.api_types import ErrorBody
from heron.runtime.json_schema import JsonSchema, SchemaBuilder
from heron_sdk.errors import STATUS_BY_CODE

MSGPACK = "application/msgpack"
JSON = "application/json"
# Errors (one handler for every route) and 202s answer in the format Accept names, whatever
# the route's own answers are (/v1/embeddings answers 200 in JSON only).
NEGOTIATED_MEDIA = (JSON, MSGPACK)


@dataclass(frozen=True, slots=True)
class ApiOperation:
    """One route of the public API, as the document describes it."""

    method: str  # "GET", "POST", ...
    path: str  # Starlette-style: "/v1/encode/{model:path}" is written "/v1/encode/{model}"
    operation_id: str
    summary: str
    tag: str  # "inference", "models", "health", "pools", "configs", ...
    request: type | None = None  # the body's wire type; None: no body
    responses: Mapping[int, type | None] = field(default_factory=dict)  # status -> body type
    # Content types the request body may have (JSON always; msgpack where the route takes it).
    request_media: tuple[str, ...] = ("application/json",)
    auth: bool = False  # guarded by the API key (or admin token) when one is configured
    # Content types of the 2xx answers (negotiated by Accept); errors and 202s may always
    # be either (NEGOTIATED_MEDIA).
    response_media: tuple[str, ...] = ("application/json",)
    description: str = ""  # longer text under the summary (Markdown)
    request_required: bool = True  # False: the body may be empty (e.g. /renew)
    # The route speaks another API (OpenAI's, Cohere's, TEI's): its errors take this body,
    # a refused body is always ``dialect_status`` (that API's), and it answers no 202. API
    # keys (401, 403) and the last-resort 500 stay Heron's.
    dialect_error: type | None = None
    dialect_status: int = 400


# What each status means, as the document's response descriptions say it.
STATUS_TEXT = {
    200: "OK", 201: "Created", 202: "Provisioning: no capacity yet; retry after Retry-After",
    400: "Malformed body", 401: "No bearer token", 403: "Token not allowed",
    404: "Not found", 405: "Method not allowed", 409: "Conflict", 413: "Too large",
    415: "Unsupported Content-Type", 422: "Invalid field", 429: "Overloaded; retry after "
    "Retry-After", 500: "Internal error", 502: "Model failed to load",
    503: "Not available yet; retry after Retry-After", 504: "Deadline exceeded",
}
# Statuses sent with a Retry-After header (whole seconds, at least 1).
RETRY_AFTER_STATUSES = frozenset({202, 429, 503})
BODY_ERRORS = (400, 413, 415, 422)
_PATH_PARAM = re.compile(r"{([^}:]+)(?::[^}]+)?}")


def error_codes(status: int) -> list[str]:
    """The codes heron_sdk.errors answers with ``status``, in the table's order."""
    return [code.value for code, s in STATUS_BY_CODE.items() if s == status]


def openapi_document(operations: Iterable[ApiOperation], *, title: str,
                     version: str) -> dict[str, Any]:
    """The OpenAPI 3.1 document for ``operations``."""
    builder = SchemaBuilder()
    paths: dict[str, dict[str, Any]] = {}
    tags: list[str] = []
    any_auth = False
    for op in operations:
        path = _PATH_PARAM.sub(r"{\1}", op.path)
        item = paths.setdefault(path, {})
        method = op.method.lower()
        if method in item:
            raise ValueError(f"{op.method} {path} is declared twice")
        item[method] = _operation(builder, op, path)
        if op.tag not in tags:
            tags.append(op.tag)
        any_auth = any_auth or op.auth
    components: dict[str, Any] = {"schemas": builder.components}
    if any_auth:
        components["securitySchemes"] = {"bearer": {
            "type": "http", "scheme": "bearer",
            "description": "An API key (gateway, HERON_API_KEYS) or the admin token "
                           "(config service), when one is configured."}}
    return {"openapi": "3.1.0",
            "info": {"title": title, "version": version},
            "jsonSchemaDialect": "https://json-schema.org/draft/2020-12/schema",
            "tags": [{"name": t} for t in tags],
            "paths": paths, "components": components}


def _operation(builder: SchemaBuilder, op: ApiOperation, path: str) -> dict[str, Any]:
    out: dict[str, Any] = {"operationId": op.operation_id, "summary": op.summary,
                           "tags": [op.tag]}
    if op.description:
        out["description"] = op.description
    params = _PATH_PARAM.findall(path)
    if params:
        out["parameters"] = [{
            "name": name, "in": "path", "required": True,
            "schema": {"type": "string", "minLength": 1},
            **({"description": "A model id or alias; it may contain '/'."}
               if name == "model" else {})} for name in params]
    if op.request is not None:
        body_schema = builder.of(op.request)
        out["requestBody"] = {"required": op.request_required, "content": {
            media: {"schema": body_schema} for media in op.request_media}}
    statuses: dict[int, Any] = dict(op.responses)
    if not any(200 <= s < 300 for s in statuses):
        statuses[200] = Any  # undeclared answer: any JSON (a document needs one response)
    if op.dialect_error is not None:
        statuses.pop(202, None)
        for status, body in list(statuses.items()):
            if body is ErrorBody and status != 500:
                statuses[status] = op.dialect_error
        if op.request is not None:
            statuses.setdefault(op.dialect_status, op.dialect_error)
    elif op.request is not None:
        for status in BODY_ERRORS:
            statuses.setdefault(status, ErrorBody)
    if params:
        statuses.setdefault(404, ErrorBody)
    if op.auth:
        statuses.setdefault(401, ErrorBody)
        statuses.setdefault(403, ErrorBody)
        out["security"] = [{"bearer": []}, {}]  # optional: only when a key is configured
    out["responses"] = {str(status): _response(builder, status, statuses[status], op)
                        for status in sorted(statuses)}
    return out


def _response(builder: SchemaBuilder, status: int, body: Any,
              op: ApiOperation) -> dict[str, Any]:
    out: dict[str, Any] = {"description": STATUS_TEXT.get(status, str(status))}
    if body is ErrorBody:
        codes = error_codes(status)
        if not codes:
            raise ValueError(f"{op.operation_id}: no error code answers {status}")
        out["description"] += ": " + ", ".join(codes)
        schema, media = _error_schema(builder, status, codes), NEGOTIATED_MEDIA
    elif body is not None and body is op.dialect_error:
        schema, media = builder.of(body), ("application/json",)
    elif body is not None:
        # A 202 goes out like an error, in the format Accept asks for, on every route.
        schema = builder.of(body)
        media = NEGOTIATED_MEDIA if status == 202 else op.response_media
    else:
        schema, media = None, ()
    if schema is not None:
        out["content"] = {m: {"schema": schema} for m in media}
    if status in RETRY_AFTER_STATUSES:
        out["headers"] = {"Retry-After": {
            "description": "Seconds to wait before retrying (whole, at least 1).",
            "schema": {"type": "string", "pattern": "^[0-9]+$"}}}
    return out


def _error_schema(builder: SchemaBuilder, status: int, codes: list[str]) -> JsonSchema:
    """ErrorBody with ``code`` narrowed to the codes of ``status`` (a component each)."""
    name = f"Error{status}"
    if name not in builder.components:
        builder.of(ErrorBody)  # ErrorDetail and ErrorCode, for the field descriptions
        detail = dict(builder.components["ErrorDetail"])
        detail["properties"] = {**detail["properties"],
                                "code": {"type": "string", "enum": codes}}
        detail["title"] = f"ErrorDetail{status}"
        builder.components[name] = {
            "title": name, "type": "object", "required": ["error"],
            "description": f"An error answered with HTTP {status}.",
            "properties": {"error": detail}}
    return {"$ref": builder.ref_prefix + name}


# ---- GET /openapi.json and GET /docs --------------------------------------------------------
# Relative URLs: the page works behind a proxy that mounts the server under a prefix.
_DOCS_PAGE = """<!doctype html>
<html lang="en">
<head>
  <meta charset="utf-8">
  <title>{title}</title>
  <link rel="stylesheet" href="docs/swagger-ui.css">
</head>
<body>
  <div id="swagger-ui"></div>
  <script src="docs/swagger-ui-bundle.js"></script>
  <script src="docs/swagger-ui-standalone-preset.js"></script>
  <script>
    window.ui = SwaggerUIBundle({{
      url: "openapi.json", dom_id: "#swagger-ui", deepLinking: true,
      presets: [SwaggerUIBundle.presets.apis, SwaggerUIStandalonePreset],
      layout: "StandaloneLayout"
    }});
  </script>
</body>
</html>
"""


def docs_routes(document: Callable[[], dict[str, Any]]) -> list[BaseRoute]:
    """``GET /openapi.json`` (the document ``document()`` returns) and ``GET /docs``."""
    cached: list[dict[str, Any]] = []

    def current() -> dict[str, Any]:
        if not cached:  # built once, on first use: the routes do not change at run time
            cached.append(document())
        return cached[0]

    async def openapi_json(request: Request) -> Response:
        return JSONResponse(current())

    async def docs_page(request: Request) -> Response:
        title = str(current().get("info", {}).get("title", "API"))
        return HTMLResponse(_DOCS_PAGE.format(title=html.escape(title)))

    return [
        Route("/openapi.json", openapi_json, methods=["GET"]),
        Route("/docs", docs_page, methods=["GET"]),
        Mount("/docs", app=StaticFiles(directory=swagger_ui_path),
              name="docs-assets"),
    ]

