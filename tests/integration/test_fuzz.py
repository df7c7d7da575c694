"""No body makes a server answer 5xx: a bounded slice of bench/fuzz.py's cases (the same
code, 300 bodies a server) against `heron serve`, the gateway of a real cluster and the config
service, each healthy afterwards; and the rules the fuzz holds the parsers to, one by one:
unknown fields are a 422 naming them, NaN in msgpack is a 422, JSON's NaN literal is a 400,
YAML nested 5,000 deep is a 400, OpenAI's optional fields are accepted."""

from __future__ import annotations

import math
import pickle
from collections.abc import Iterator
from typing import Any

import httpx
import msgpack
import openai
import pytest
from openai import OpenAI

from bench.fuzz import (
    ADMIN_TOKEN,
    ENCODE_CHECK,
    ServerReport,
    Target,
    config_routes,
    fuzz_server,
    inference_routes,
    pool_routes,
)
from heron.config_service.routes import CONFIG_OPERATIONS
from heron.gateway.routes import GATEWAY_OPERATIONS
from heron.runtime.front import INFERENCE_OPERATIONS
from tests.support import config_procs, local_http
from tests.support.nats_server import NatsServer

# 300 bodies a server at 4 at a time: about 10-20 s each on 2 busy cores.
SLICE = 300
SEED = 20260


def assert_clean(report: ServerReport) -> None:
    summary = report.to_json()
    assert report.bodies == SLICE and report.complete, summary
    assert report.failures == 0, summary["examples"][:3]
    assert report.healthy_after == "ok", report.healthy_after
    assert len({s for s in report.statuses if s.startswith("2")}) >= 1  # some were valid
    assert summary["statuses"].get("422", 0) and summary["statuses"].get("400", 0)


def serve_routes() -> list[Any]:
    # The test bundle serves a cross-encoder and a token classifier: valid score and
    # extract bodies reach a model, as encode's and the OpenAI route's do.
    return inference_routes(score="tiny-cross-encoder", extract="tiny-ner")


@pytest.mark.slow
def test_heron_serve_answers_no_5xx_to_a_fuzz_slice(base_url: str) -> None:
    target = Target("serve", base_url, serve_routes(), INFERENCE_OPERATIONS, ENCODE_CHECK)
    assert_clean(fuzz_server(target, bodies=SLICE, seed=SEED, concurrency=4,
                             time_limit_s=120))


@pytest.mark.slow
def test_the_gateway_answers_no_5xx_to_a_fuzz_slice(cluster_url: str) -> None:
    target = Target("gateway", cluster_url, serve_routes() + pool_routes("test"),
                    (*INFERENCE_OPERATIONS, *GATEWAY_OPERATIONS), ENCODE_CHECK)
    try:
        assert_clean(fuzz_server(target, bodies=SLICE, seed=SEED, concurrency=4,
                                 time_limit_s=120))
    finally:  # the leases its valid bodies made (names fuzz-0 to fuzz-7)
        for i in range(8):
            local_http.delete(f"{cluster_url}/v1/pools/fuzz-{i}", timeout=30)


@pytest.fixture(scope="module")
def config_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A config service with the admin token, its own store and nats-server (the fuzz's
    valid posts add models nobody else reads)."""
    root = tmp_path_factory.mktemp("config-fuzz")
    nats = NatsServer(root / "nats").start()
    service = config_procs.InProcessConfig(nats.url, root / "store",
                                           config_procs.write_bundles(root / "bundles"),
                                           admin_token=ADMIN_TOKEN,
                                           lease_ttl_s=config_procs.LONG_LEASE_S)
    try:
        service.start()
        yield service.url
    finally:
        service.stop()
        nats.stop()


AUTH = {"Authorization": f"Bearer {ADMIN_TOKEN}"}


@pytest.mark.slow
def test_the_config_service_answers_no_5xx_to_a_fuzz_slice(config_url: str) -> None:
    check = ("POST", "/v1/configs/models", config_procs.model_body("org/fuzz-check"))
    target = Target("config", config_url, config_routes(["alpha", "beta", "sparsebox"]),
                    CONFIG_OPERATIONS, check, headers=AUTH)
    assert_clean(fuzz_server(target, bodies=SLICE, seed=SEED, concurrency=4,
                             time_limit_s=120))


# ---- the rules, one by one --------------------------------------------------------------------
def error_of(r: httpx.Response) -> tuple[int, str, str | None]:
    error = r.json()["error"]
    return r.status_code, error["code"], error.get("field")


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/encode/minilm", {"items": ["a"], "top_n": 3}),
    ("/v1/score/minilm", {"query": "q", "items": ["a"], "top_n": 3}),
    ("/v1/extract/tiny-ner", {"items": ["a"], "top_n": 3}),
])
def test_an_unknown_field_is_a_422_naming_it(base_url: str, path: str, body: dict) -> None:
    r = local_http.post(base_url + path, json=body, timeout=60)
    assert error_of(r) == (422, "INVALID_FIELD", "top_n")
    assert r.json()["error"]["message"].startswith("unknown field 'top_n'; known: ")


def test_an_unknown_field_is_openais_400_naming_it_on_embeddings(base_url: str) -> None:
    r = local_http.post(base_url + "/v1/embeddings", json={"model": "minilm", "input": "a",
                                                      "top_n": 3}, timeout=60)
    error = r.json()["error"]
    assert (r.status_code, error["code"], error["param"]) == (400, "invalid_field", "top_n")
    assert error["message"].startswith("unknown field 'top_n'; known: ")


def test_unknown_fields_are_refused_through_the_gateway_too(cluster_url: str) -> None:
    r = local_http.post(cluster_url + "/v1/encode/minilm",
                        json={"items": [{"text": "a", "metadata": {}}]}, timeout=60)
    assert error_of(r) == (422, "INVALID_FIELD", "items[0].metadata")
    r = local_http.post(cluster_url + "/v1/pools", json={"name": "fz", "bundle": "test",
                                                    "replicas": 2}, timeout=60)
    assert error_of(r) == (422, "INVALID_FIELD", "replicas")


def test_nan_timeout_in_msgpack_is_a_422_not_a_504(base_url: str, cluster_url: str) -> None:
    for url in (base_url, cluster_url):
        for value in (math.nan, math.inf):
            r = local_http.post(url + "/v1/encode/minilm",
                                content=msgpack.packb({"items": ["a"], "timeout_s": value}),
                                headers={"Content-Type": "application/msgpack",
                                    "Accept": "application/json"}, timeout=60)
            assert error_of(r) == (422, "INVALID_FIELD", "timeout_s"), url
            assert r.json()["error"]["message"] == "timeout_s: must be a finite number"
    r = local_http.post(cluster_url + "/v1/pools", content=msgpack.packb(
        {"name": "fz", "bundle": "test", "ttl_s": math.nan}),
        headers={"Content-Type": "application/msgpack", "Accept": "application/json"})
    assert error_of(r) == (422, "INVALID_FIELD", "ttl_s")


def test_nan_threshold_in_msgpack_is_a_422(base_url: str) -> None:
    r = local_http.post(base_url + "/v1/extract/tiny-ner",
                        content=msgpack.packb({"items": ["a"], "threshold": math.nan}),
                        headers={"Content-Type": "application/msgpack",
                                 "Accept": "application/json"}, timeout=60)
    assert error_of(r) == (422, "INVALID_FIELD", "threshold")


@pytest.mark.parametrize("literal", [b"NaN", b"Infinity", b"-Infinity", b"1e999"])
def test_a_json_nan_literal_is_refused(base_url: str, literal: bytes) -> None:
    r = local_http.post(base_url + "/v1/encode/minilm",
                        content=b'{"items": ["a"], "timeout_s": ' + literal + b"}",
                        headers={"Content-Type": "application/json"}, timeout=60)
    assert error_of(r)[:2] == (400, "MALFORMED_BODY")


def test_a_numpy_object_array_in_a_request_is_refused_unopened(base_url: str) -> None:
    evil = {b"nd": True, b"type": "|O", b"kind": b"O", b"shape": [1],
            b"data": pickle.dumps(["unpickled"])}
    r = local_http.post(base_url + "/v1/encode/minilm",
                        content=msgpack.packb({"items": evil}, use_bin_type=True),
                        headers={"Content-Type": "application/msgpack",
                                 "Accept": "application/json"}, timeout=60)
    assert error_of(r) == (422, "INVALID_FIELD", "items")


@pytest.mark.parametrize("raw", [b"[" * 5000 + b"]" * 5000, b"- " * 5000 + b"x"])
def test_yaml_nested_5000_deep_is_a_400_like_json(config_url: str, raw: bytes) -> None:
    url = config_url + "/v1/configs/models"
    yaml_answer = local_http.post(url, content=raw, headers={**AUTH, "Content-Type":
                                                        "application/yaml"}, timeout=60)
    json_answer = local_http.post(url, content=b"[" * 5000 + b"]" * 5000,
                                  headers={**AUTH, "Content-Type": "application/json"}, timeout=60)
    assert error_of(yaml_answer)[:2] == error_of(json_answer)[:2] == (400, "MALFORMED_BODY")
    assert local_http.get(config_url + "/healthz", timeout=10).status_code == 200


def test_yaml_nan_in_a_config_is_a_422(config_url: str) -> None:
    raw = b"id: org/fz\nsource: {hub: org/fz}\nprofiles: {default: {max_wait_ms: .nan}}\n"
    r = local_http.post(config_url + "/v1/configs/models", content=raw,
                        headers={**AUTH, "Content-Type": "application/yaml"}, timeout=60)
    assert error_of(r) == (422, "INVALID_FIELD", "profiles.default.max_wait_ms")
    assert r.json()["error"]["message"].endswith("must be a finite number")


def test_openai_optional_fields_are_accepted(base_url: str) -> None:
    client = OpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    res = client.embeddings.create(model="minilm", input=["a heron"], user="user-1234",
                                   dimensions=64, encoding_format="float")
    assert len(res.data[0].embedding) == 64
    with pytest.raises(openai.BadRequestError, match="unknown field 'top_n'"):
        client.embeddings.create(model="minilm", input="a", extra_body={"top_n": 1})

