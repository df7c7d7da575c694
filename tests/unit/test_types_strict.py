"""The request parsers refuse what they cannot read right: unknown fields, NaN and the
infinities, bodies nested too deep, msgpack-numpy maps; what the SDK and the gateway send
(``to_wire``) they read back unchanged."""

from __future__ import annotations

import math
import pickle
from typing import Any, get_args

import msgpack
import numpy as np
import orjson
import pytest

from heron.config_service.body import decode as decode_config
from heron.config_service.body import parse_posted
from heron.gateway.routes import GATEWAY_OPERATIONS
from heron.runtime import api_types
from heron.runtime.front import INFERENCE_OPERATIONS
from heron.runtime.modelconfig import ConfigError, parse_profile
from heron.runtime.openai_compat import EMBEDDINGS_FIELDS, parse_embeddings_request
from heron.runtime.openapi import openapi_document
from heron_sdk import wire
from heron_sdk.errors import HeronError
from heron_sdk.types import (
    ENCODE_FIELDS,
    EXTRACT_FIELDS,
    INPUT_TYPES,
    ITEM_FIELDS,
    SCORE_FIELDS,
    EncodeRequest,
    ExtractRequest,
    Item,
    RequestOptions,
    ScoreRequest,
)

SCHEMAS = openapi_document((*INFERENCE_OPERATIONS, *GATEWAY_OPERATIONS), title="t",
                           version="t")["components"]["schemas"]
PARSERS = {"encode": EncodeRequest.from_wire, "score": ScoreRequest.from_wire,
           "extract": ExtractRequest.from_wire, "embeddings": parse_embeddings_request}
VALID: dict[str, dict[str, Any]] = {
    "encode": {"items": ["a"]}, "score": {"query": "q", "items": ["a"]},
    "extract": {"items": ["a"]}, "embeddings": {"model": "m", "input": "a"}}


def refusal(parse: Any, body: Any) -> HeronError:
    with pytest.raises(HeronError) as info:
        parse(body)
    return info.value


@pytest.mark.parametrize("route", list(PARSERS))
@pytest.mark.parametrize("key", ["top_n", "Items", "", "x" * 500])
def test_an_unknown_field_is_a_422_naming_it(route: str, key: str) -> None:
    error = refusal(PARSERS[route], {**VALID[route], key: 3})
    assert (error.status, error.code) == (422, "INVALID_FIELD")
    assert error.field == (key if len(key) <= 80 else key[:77] + "...")
    assert error.message.startswith("unknown field ") and "; known: " in error.message
    assert len(error.message) < 400  # a 500-character key is shown cut short


def test_keys_that_are_not_strings_are_unknown_fields_too() -> None:
    for key in (5, b"items", None, 1.5):  # msgpack maps may have any of these
        error = refusal(EncodeRequest.from_wire, {"items": ["a"], key: 1})
        assert error.code == "INVALID_FIELD" and error.field == str(key)


def test_an_unknown_key_in_an_item_object_names_its_path() -> None:
    error = refusal(EncodeRequest.from_wire, {"items": ["a", {"text": "b", "meta": 1}]})
    assert error.field == "items[1].meta"
    assert error.message == "unknown field 'items[1].meta'; known: id, image, text, tokens"
    # Only encode takes token ids: score and extract name the text fields alone.
    error = refusal(ScoreRequest.from_wire, {"query": "q", "items": [{"tokens": [1]}]})
    assert error.message == "unknown field 'items[0].tokens'; known: id, image, text"


@pytest.mark.parametrize(("component", "fields"), [
    ("EncodeBody", ENCODE_FIELDS), ("ScoreBody", SCORE_FIELDS),
    ("ExtractBody", EXTRACT_FIELDS), ("EmbeddingsBody", EMBEDDINGS_FIELDS),
    ("ItemObject", ITEM_FIELDS)])
def test_the_document_closes_each_body_on_the_fields_the_parser_knows(
        component: str, fields: frozenset[str]) -> None:
    schema = SCHEMAS[component]
    assert schema["additionalProperties"] is False
    assert set(schema["properties"]) == fields


def test_what_to_wire_writes_from_wire_reads_back() -> None:
    """The SDK sends to_wire(); the gateway forwards it to workers, which parse it again."""
    options = RequestOptions(truncate=False, priority=3, timeout_s=2.5, encoding="base64")
    items = [Item("a"), Item("b", id="7")]
    requests = [EncodeRequest(items, ("dense", "sparse"), "float16", 64, True, "q: ", options),
                EncodeRequest([*items, Item.of_tokens([101, 7], "t")], is_query=True,
                              input_type="search_query"),
                ScoreRequest("q", items, 2, options),
                ScoreRequest("q", items, max_tokens_per_doc=16),
                ExtractRequest(items, ["PER"], 0.5, options)]
    for request in requests:
        body = wire.decode_request(wire.encode(request.to_wire(), wire.MSGPACK), wire.MSGPACK)
        assert type(request).from_wire(body) == request


@pytest.mark.parametrize(("route", "name"), [
    ("encode", "timeout_s"), ("encode", "dims"), ("encode", "priority"),
    ("score", "top_k"), ("score", "timeout_s"), ("extract", "threshold"),
    ("embeddings", "dimensions")])
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_nan_and_the_infinities_in_msgpack_are_a_422_naming_the_field(
        route: str, name: str, value: float) -> None:
    raw = msgpack.packb({**VALID[route], name: value})
    error = refusal(PARSERS[route], wire.decode_request(raw, wire.MSGPACK))
    assert (error.status, error.field) == (422, name)
    assert error.message == f"{name}: must be a finite number"


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999", b"nan"])
def test_json_has_no_nan_or_infinity(literal: bytes) -> None:
    raw = b'{"items": ["a"], "timeout_s": ' + literal + b"}"
    error = refusal(lambda body: wire.decode_request(body, wire.JSON), raw)
    assert (error.status, error.code) == (400, "MALFORMED_BODY")


def test_openai_optional_fields_are_accepted_and_user_is_a_string() -> None:
    body = {"model": "m", "input": ["a"], "encoding_format": "base64", "dimensions": 8,
            "user": "user-1234"}
    model, req, encoding = parse_embeddings_request(body)
    assert (model, [i.text for i in req.items], encoding, req.dims) == ("m", ["a"], "base64", 8)
    assert parse_embeddings_request({**body, "user": None})[0] == "m"
    assert refusal(parse_embeddings_request, {**body, "user": 5}).field == "user"


@pytest.mark.parametrize(("given", "tokens"), [
    ([5, 6], [(5, 6)]), ([[5], [6, 7]], [(5,), (6, 7)]), ([5.0, 6], [(5, 6)])])
def test_openai_token_id_inputs_are_items_of_tokens(given: list, tokens: list) -> None:
    _, req, _ = parse_embeddings_request({"model": "m", "input": given})
    assert [i.tokens for i in req.items] == tokens
    assert all(i.text == "" for i in req.items)


@pytest.mark.parametrize("given", [[], [[]], [-1], [["a"]], ["a", 1], [[1], "a"], [1.5],
                                   [True], [2**31]])
def test_openai_bad_inputs_are_refused_naming_input(given: list) -> None:
    error = refusal(parse_embeddings_request, {"model": "m", "input": given})
    assert error.status == 422 and error.field is not None and error.field.startswith("input")


def test_input_type_sets_the_side_and_is_query_alone_still_works() -> None:
    assert EncodeRequest.from_wire({"items": ["a"], "input_type": "search_query"}).is_query
    assert not EncodeRequest.from_wire({"items": ["a"], "input_type": "clustering"}).is_query
    assert EncodeRequest.from_wire({"items": ["a"], "is_query": True}).is_query
    # Given, input_type decides the side, and the wire form carries it alone.
    req = EncodeRequest.from_wire({"items": ["a"], "is_query": True, "input_type": "document"})
    assert not req.is_query and "is_query" not in req.to_wire()
    assert refusal(EncodeRequest.from_wire, {"items": ["a"], "input_type": "q"}).field == (
        "input_type")


def test_the_schema_names_the_same_input_types_as_the_parser() -> None:
    assert set(get_args(api_types.InputType)) == set(INPUT_TYPES)


@pytest.mark.parametrize("depth", [33, 1000, 5000, 100_000])
@pytest.mark.parametrize("fmt", [wire.JSON, wire.MSGPACK])
def test_a_body_nested_too_deep_is_a_400(depth: int, fmt: str) -> None:
    raw = (b"[" * depth + b"]" * depth) if fmt == wire.JSON else b"\x91" * depth + b"\xc0"
    error = refusal(lambda body: wire.decode_request(body, fmt), raw)
    assert (error.status, error.code) == (400, "MALFORMED_BODY")


def test_thirty_two_levels_are_read() -> None:
    assert wire.decode_request(b"[" * 32 + b"]" * 32, wire.JSON) is not None
    wire.check_depth({"items": [{"text": "a"}]}, limit=3)
    with pytest.raises(HeronError):
        wire.check_depth({"items": [{"text": []}]}, limit=3)


UNPICKLED: list[str] = []


def _unpickled(what: str) -> str:
    UNPICKLED.append(what)
    return what


class _Payload:
    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return _unpickled, ("ran",)


def test_an_object_array_is_never_unpickled() -> None:
    """msgpack-numpy's own decoder unpickles a dtype-O array: code the sender chose."""
    evil = {b"nd": True, b"type": "|O", b"kind": b"O", b"shape": [1],
            b"data": pickle.dumps(_Payload())}
    raw = msgpack.packb({"items": [evil]}, use_bin_type=True)
    with pytest.raises(HeronError) as info:
        wire.decode(raw, wire.MSGPACK)  # answers and messages between processes
    assert info.value.code == "MALFORMED_BODY"
    body = wire.decode_request(raw, wire.MSGPACK)  # requests: the map stays a map
    assert refusal(EncodeRequest.from_wire, body).field == "items[0].b'nd'"
    assert UNPICKLED == []


def test_numeric_arrays_still_travel() -> None:
    for value in (np.arange(6, dtype=np.float32).reshape(2, 3), np.zeros((0, 4), np.float16),
                  np.array([1, 2], dtype=np.int32), np.float32(1.5), np.int64(3)):
        back = wire.decode(wire.encode({"v": value}, wire.MSGPACK), wire.MSGPACK)["v"]
        assert back.dtype == value.dtype and np.array_equal(back, value)
    for bad in ({b"nd": True, b"type": "<f4", b"shape": [10**9], b"data": b""},
                {b"nd": False, b"type": "<f8", b"data": b""},
                {b"nd": True, b"type": "<U1", b"shape": [1], b"data": b"a\0\0\0"}):
        with pytest.raises(HeronError):
            wire.decode(msgpack.packb(bad, use_bin_type=True), wire.MSGPACK)


def test_error_messages_do_not_grow_with_the_body() -> None:
    huge = "x" * 1_000_000
    deep: Any = "leaf"
    for _ in range(900):
        deep = [deep]
    for value in (huge, deep):
        error = refusal(EncodeRequest.from_wire, {"items": ["a"], "output_types": [value]})
        assert error.code == "UNSUPPORTED_OUTPUT" and len(error.message) < 300


# ---- the config service's bodies ------------------------------------------------------------
YAML = "application/yaml"


@pytest.mark.parametrize("raw", [b"[" * 5000 + b"]" * 5000, b"- " * 5000 + b"x",
                                 b"a: " + b"{b: " * 5000 + b"1" + b"}" * 5000])
def test_yaml_nested_5000_deep_is_a_400_not_a_recursion_error(raw: bytes) -> None:
    error = refusal(lambda body: decode_config(body, YAML), raw)
    assert (error.status, error.code) == (400, "MALFORMED_BODY")
    assert "deeper than 32 levels" in error.message


@pytest.mark.parametrize("raw", [b'description: "\\ud800"', b'"\\udfff": 1',
                                 b"id: " + b"9" * 5000])
def test_yaml_values_no_json_could_hold_are_a_400(raw: bytes) -> None:
    assert refusal(lambda body: decode_config(body, YAML), raw).code == "MALFORMED_BODY"


@pytest.mark.parametrize(("text", "field"), [
    ("max_wait_ms: .nan", "profiles.default.max_wait_ms"),
    ("max_wait_ms: -.inf", "profiles.default.max_wait_ms"),
    ("max_batch_tokens: .inf", "profiles.default.max_batch_tokens"),
    ("muvera_k_sim: .nan", "profiles.default.muvera_k_sim")])
def test_yaml_nan_and_infinity_in_a_config_are_a_422(text: str, field: str) -> None:
    raw = ("id: org/m\nsource: {hub: org/m}\nprofiles:\n  default:\n    " + text).encode()
    error = refusal(parse_posted, decode_config(raw, YAML))
    assert (error.status, error.field) == (422, field)
    assert error.message == f"{field}: must be a finite number"


def test_msgpack_nan_in_a_config_is_a_422() -> None:
    raw = msgpack.packb({"id": "org/m", "source": {"hub": "org/m"},
                         "profiles": {"default": {"max_wait_ms": math.nan}}})
    error = refusal(parse_posted, decode_config(raw, "application/msgpack"))
    assert error.field == "profiles.default.max_wait_ms"


def test_a_config_body_is_depth_checked_in_every_format() -> None:
    deep = b"[" * 40 + b"]" * 40
    for ctype, raw in ((YAML, deep), ("application/json", deep),
                       ("application/msgpack", b"\x91" * 40 + b"\xc0")):
        assert refusal(lambda body, t=ctype: decode_config(body, t), raw).status == 400


def test_profile_numbers_must_be_finite() -> None:
    for key in ("max_wait_ms", "max_batch_items", "max_queue_items"):
        with pytest.raises(ConfigError, match="must be a finite number"):
            parse_profile({key: math.inf}, "t", "p")
    assert parse_profile({"max_wait_ms": 2}, "t", "p").max_wait_ms == 2.0


def test_orjson_refuses_what_the_stdlib_json_module_accepts() -> None:
    """Python's json module reads NaN and Infinity; the body decoder must not."""
    with pytest.raises(orjson.JSONDecodeError):
        orjson.loads(b"[NaN]")
