"""The TEI routes' pure parts: their bodies' parsers take exactly what the OpenAPI document
allows and refuse the rest with a 4xx TEI documents; every HeronError a TEI route can meet
maps to a documented status in TEI's error shape; API keys guard the TEI routes (and leave a
gateway's page open); CORS origins are checked where they are set; and the settings that
choose the model and the origins are flags and variables of every inference server."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import httpx
import jsonschema_rs
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings

from heron.gateway.settings import GatewaySettings
from heron.runtime import tei_types as tei
from heron.runtime.auth import ApiKeyMiddleware
from heron.runtime.cors import parse_origins
from heron.runtime.front import INFERENCE_OPERATIONS
from heron.runtime.modelconfig import ConfigError
from heron.runtime.openapi import openapi_document
from heron.runtime.tei_api import TEI_OPERATIONS, TEI_PATHS, tei_error
from heron.worker.settings import WorkerSettings
from heron_sdk.errors import ErrorCode, HeronError
from tests.support.schema_agreement import parser_agrees_with_schema

DOC = openapi_document(INFERENCE_OPERATIONS, title="t", version="t")
_SCHEMA = schemathesis.openapi.from_dict(DOC)
PARSERS: dict[str, Callable[[Any], Any]] = {
    "/embed": tei.parse_embed, "/embed_sparse": tei.parse_embed_sparse,
    "/rerank": tei.parse_rerank, "/predict": tei.parse_predict,
    "/tokenize": tei.parse_tokenize, "/decode": tei.parse_decode, "/": tei.parse_root}
# What a refused body may get (TEI's statuses for what is wrong with a request).
REFUSED = {400, 413, 415, 422}


def _validator(path: str) -> Callable[[Any], bool]:
    schema = DOC["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    root = {**schema, "components": DOC["components"]}
    return jsonschema_rs.Draft202012Validator(root).is_valid


@pytest.mark.parametrize("path", list(PARSERS))
@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE,
                                  schemathesis.GenerationMode.NEGATIVE])
def test_parsers_accept_what_the_schema_allows_and_refuse_the_rest(
        path: str, mode: schemathesis.GenerationMode) -> None:
    valid, parse = _validator(path), PARSERS[path]
    strategy = _SCHEMA[path]["POST"].as_strategy(generation_mode=mode)

    # 75 cases a route and mode: a negative /rerank case takes about 45 ms on 2 cores (150
    # took this file to 26 s); tests/integration/test_api_schema.py sends such bodies live.
    @settings(max_examples=75, suppress_health_check=list(HealthCheck), deadline=None)
    @given(strategy)
    def check(case: Any) -> None:
        body = case.body
        refused = parser_agrees_with_schema(body, parse, valid)
        if refused is not None:
            status, answer = tei_error(refused)
            assert status in REFUSED, (body, refused)
            assert set(answer) == {"error", "error_type"}

    check()


@pytest.mark.parametrize(("body", "parsed"), [
    ({"inputs": "a"}, {"single_text": True}),
    ({"inputs": ["a", "b"], "prompt_name": "passage", "dimensions": 8.0},
     {"input_type": "document", "dims": 8}),
    ({"inputs": ["a"], "prompt_name": "search_query", "normalize": False},
     {"input_type": "search_query", "normalize": False}),
])
def test_embed_bodies_map_to_heron_options(body: dict[str, Any],
                                           parsed: dict[str, Any]) -> None:
    call = tei.parse_embed(body)
    assert call.items is not None
    if parsed.pop("single_text", False):
        assert [i.text for i in call.items] == ["a"]
    for name, value in parsed.items():
        assert getattr(call, name) == value


@pytest.mark.parametrize(("body", "status", "kind", "words"), [
    ({"inputs": []}, 400, "Empty", "`inputs` cannot be empty"),
    ({"inputs": [101, 102]}, 422, "Validation", "token-id input"),
    ({"inputs": "a", "truncation_direction": "left"}, 422, "Validation", "only 'right'"),
    ({"inputs": "a", "encoding_format": "base64"}, 422, "Validation", "only 'float'"),
    ({"inputs": ["a"] * 2049}, 422, "Validation", "maximum allowed batch size 2048"),
    ({"inputs": "a", "normalise": True}, 422, "Validation", "unknown field"),
    ([], 400, "Validation", "must be an object"),
])
def test_bad_embed_bodies_get_tei_errors(body: Any, status: int, kind: str,
                                         words: str) -> None:
    with pytest.raises(HeronError) as caught:
        tei.parse_embed(body)
    assert tei_error(caught.value) == (status, {"error": caught.value.message,
                                                "error_type": kind})
    assert words in caught.value.message


def test_predict_takes_pairs_and_decode_takes_ids() -> None:
    single = tei.parse_predict({"inputs": ["q", "d"]})
    assert single.single and single.pairs == [("q", "d")]
    batch = tei.parse_predict({"inputs": [["q", "d"], ["r", "e"]]})
    assert not batch.single and batch.pairs == [("q", "d"), ("r", "e")]
    for wrong in (["q"], ["q", "d", "e"], [["q"]], "q"):
        with pytest.raises(HeronError):
            tei.parse_predict({"inputs": wrong})
    assert tei.parse_decode({"ids": [1, 2.0]}).sequences == [(1, 2)]
    assert tei.parse_decode({"ids": [[1], [2, 3]]}).sequences == [(1,), (2, 3)]
    for wrong in ([], [[]], [-1], [True], [1.5]):
        with pytest.raises(HeronError):
            tei.parse_decode({"ids": wrong})
    assert tei.parse_root({"query": "q", "texts": ["a"]})[0] == "rerank"
    assert tei.parse_root({"inputs": "a"})[0] == "embed"


def test_every_error_a_tei_route_meets_has_a_documented_status() -> None:
    """Auth, routing and config-service codes never come through a TEI handler."""
    elsewhere = {ErrorCode.UNAUTHORIZED, ErrorCode.FORBIDDEN, ErrorCode.NOT_FOUND,
                 ErrorCode.METHOD_NOT_ALLOWED, ErrorCode.NOT_LEADER,
                 ErrorCode.CONTENT_CONFLICT, ErrorCode.POOL_CONFLICT}
    for op in TEI_OPERATIONS:
        documented = {int(s) for s in DOC["paths"][op.path][op.method.lower()]["responses"]}
        for code in set(ErrorCode) - elsewhere:
            status, body = tei_error(HeronError(code, "why"))
            assert status in documented, (op.path, code, status)
            assert body["error_type"] in ("Unhealthy", "Backend", "Overloaded", "Validation",
                                          "Empty")
    assert tei_error(HeronError(ErrorCode.UNSUPPORTED_TASK, "x"))[0] == 424
    assert tei_error(HeronError(ErrorCode.MODEL_LOADING, "x", retry_after_s=2))[1][
        "error_type"] == "Unhealthy"
    assert tei_error(HeronError(ErrorCode.QUEUE_FULL, "x"))[1]["error_type"] == "Overloaded"


def test_api_keys_guard_the_tei_routes_and_leave_the_page_open() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"ok"})

    guarded = ApiKeyMiddleware(app, {"k"}, guarded=TEI_PATHS)

    async def statuses() -> dict[tuple[str, str], int]:
        transport = httpx.ASGITransport(app=guarded)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as client:
            calls = [("POST", "/embed"), ("POST", "/"), ("GET", "/info"), ("GET", "/"),
                     ("GET", "/healthz"), ("POST", "/v1/encode/m")]
            return {(m, p): (await client.request(m, p)).status_code for m, p in calls}

    assert asyncio.run(statuses()) == {
        ("POST", "/embed"): 401, ("POST", "/"): 401, ("GET", "/info"): 401,
        ("GET", "/"): 200, ("GET", "/healthz"): 200, ("POST", "/v1/encode/m"): 401}


@pytest.mark.parametrize(("text", "origins"), [
    (None, ()), ("", ()), (" https://a.example , http://localhost:3000 ",
                           ("https://a.example", "http://localhost:3000")),
    ("https://a.example,*", ("*",))])
def test_cors_origins_read(text: str | None, origins: tuple[str, ...]) -> None:
    assert parse_origins(text) == origins


@pytest.mark.parametrize("text", ["https://a.example/", "a.example", "https://a/b",
                                  "https://a.example?x=1"])
def test_a_value_no_browser_sends_as_its_origin_is_a_config_error(text: str) -> None:
    with pytest.raises(ValueError, match="must be an origin"):
        parse_origins(text)
    for cls in (WorkerSettings, GatewaySettings):
        with pytest.raises(ConfigError, match="--cors-origins / HERON_CORS_ORIGINS"):
            cls(cors_origins=text)


def test_the_settings_are_the_same_variables_everywhere() -> None:
    environ = {"HERON_DEFAULT_MODEL": "minilm, rerank", "HERON_CORS_ORIGINS": "*"}
    for cls in (WorkerSettings, GatewaySettings):
        read = cls.from_env(environ)
        assert (read.default_model, read.cors_origins) == ("minilm, rerank", "*")
        assert (cls().default_model, cls().cors_origins) == (None, None)
    with pytest.raises(ConfigError, match="names no model"):
        WorkerSettings(default_model=" , ")
