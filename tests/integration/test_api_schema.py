"""Live servers answer as their OpenAPI document says: schemathesis sends bodies the document
allows and bodies it refuses (JSON and msgpack) to `heron serve` and to the gateway of a real
cluster (nats-server, a `heron worker`), each body of an operation both serve to both, and
every answer must be documented, match its schema, never be a 5xx, and refuse what the
document refuses; the config service of its own (a fresh store and nats-server: its POSTs
add models) gets the same, with the admin token. The document each server serves at
/openapi.json is the one generated from its declared operations, and /docs shows it with
assets from the installed swagger-ui-bundle package."""

from __future__ import annotations

import copy
import json
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import msgpack
import msgpack_numpy
import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis.config import SchemathesisConfig
from schemathesis.core.errors import UnsupportedSchema
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from heron.config_service.routes import CONFIG_OPERATIONS
from heron.gateway.routes import GATEWAY_OPERATIONS
from heron.gateway.settings import GatewaySettings
from heron.runtime.front import INFERENCE_OPERATIONS
from heron.runtime.openapi import ApiOperation, openapi_document
from heron_sdk.results import jsonable
from tests.support import config_procs, local_http
from tests.support.gateway_harness import GatewayThread, unique, write_bundles
from tests.support.nats_server import NatsServer

# The session bundle's tiny models, one per family (fast on 2 cores), and one name that
# is not served: path parameters and the embeddings `model` are drawn from these.
MODELS = ["tiny-dense-cls", "tiny-sparse", "tiny-multi-vector", "tiny-cross-encoder",
          "tiny-ner", "test/tiny-dense-cls", "no-such-model"]
# Per operation: valid cases, and fewer invalid ones; an operation with fewer distinct cases
# stops sooner. About 20-70 ms a case on the 2-core CI machine: 100 of each took the file to
# 137 s once 32 operations were served twice, and 100 and 50 to 239 s once 52 were. Valid
# cases stay at 100: at 50, one CI run's derandomized cases for the gateway's encode held no
# body a model could answer 2xx (its served models take different options). The deep
# fuzzing is bench/fuzz.py (10,000 bodies).
MAX_EXAMPLES = 100
INVALID_EXAMPLES = 30
NEGATIVE_ATTEMPTS = 3  # runs of an operation's invalid cases that may meet UnsupportedSchema
CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance,
          response_headers_conformance]
# A schema-violating body must get a 4xx the document lists (413: over a limit).
REFUSALS = ["400", "401", "403", "404", "413", "415", "422"]
# Valid bodies are kept this small (small_bodies); invalid ones use the real limits.
SMALL_ITEMS, SMALL_TEXT = 8, 2000
# A deadline the caller set shorter than this may honestly end in 504 DEADLINE_EXCEEDED.
UNMEETABLE_DEADLINE_S = 1.0


@schemathesis.serializer("application/msgpack")
def _msgpack_body(ctx: Any, value: Any) -> bytes:
    try:
        return msgpack.packb(value, default=msgpack_numpy.encode)
    except (OverflowError, TypeError, ValueError):
        return b"\xc1"  # not msgpack (an int past 64 bits): a 400, as any undecodable body


@schemathesis.deserializer("application/msgpack")
def _msgpack_answer(ctx: Any, response: Any) -> Any:
    return jsonable(msgpack.unpackb(response.content, object_hook=msgpack_numpy.decode))


def served_document(url: str, operations: tuple[ApiOperation, ...], title: str
                    ) -> dict[str, Any]:
    """The server's /openapi.json, checked to be the document of its declared operations."""
    served = local_http.get(url + "/openapi.json", timeout=30).json()
    expected = openapi_document(operations, title=title, version=served["info"]["version"])
    assert served == json.loads(json.dumps(expected))
    return served


def with_known_models(document: dict[str, Any]) -> dict[str, Any]:
    """The document with model names drawn from MODELS (else nearly every case is a 404)."""
    out = copy.deepcopy(document)
    for item in out["paths"].values():
        for op in item.values():
            for param in op.get("parameters", []):
                if param["name"] == "model":
                    param["schema"] = {"type": "string", "enum": MODELS}
    out["components"]["schemas"]["EmbeddingsBody"]["properties"]["model"] = {
        "type": "string", "enum": MODELS}
    return out


def small_bodies(document: dict[str, Any]) -> dict[str, Any]:
    """The document with valid bodies kept small: at most SMALL_ITEMS items of at most
    SMALL_TEXT characters. Every body it allows, the real document allows, and the servers
    answer in milliseconds (2048 long texts could honestly take the gateway's 30 s default
    deadline on 2 busy cores). Invalid bodies come from the real document."""
    out = copy.deepcopy(document)

    def clamp(node: Any) -> None:
        if isinstance(node, dict):
            if node.get("maxItems", 0) > SMALL_ITEMS:
                node["maxItems"] = SMALL_ITEMS
            if node.get("maxLength", 0) > SMALL_TEXT:
                node["maxLength"] = SMALL_TEXT
            for value in node.values():
                clamp(value)
        elif isinstance(node, list):
            for value in node:
                clamp(value)

    for name, component in out["components"]["schemas"].items():
        if name.endswith("Body") or name == "ItemObject":
            clamp(component)
    return out


def deadline_too_short(case: Any, response: Any) -> bool:
    body = case.body if isinstance(case.body, dict) else {}
    timeout_s = body.get("timeout_s")
    return (response.status_code == 504 and isinstance(timeout_s, int | float)
            and timeout_s < UNMEETABLE_DEADLINE_S)


def fuzz(urls: dict[str, str], document: dict[str, Any], path: str, method: str, *,
         headers: dict[str, str] | None = None, max_examples: int = MAX_EXAMPLES,
         invalid_examples: int | None = None,
         positive: Callable[[dict[str, Any]], dict[str, Any]] = small_bodies) -> list[str]:
    """Send ``max_examples`` valid cases (from ``positive(document)``) and
    ``invalid_examples`` (default: INVALID_EXAMPLES) invalid ones (from ``document``) to one
    operation of each server in ``urls`` (name: base URL), with ``headers``; the failures,
    described. Each drawn case goes to every server: drawing it is most of the cost (the
    hypothesis engine was two thirds of a pytest process's CPU in this file)."""
    config = SchemathesisConfig.from_dict(
        {"checks": {"negative_data_rejection": {"expected-statuses": REFUSALS}}})
    operations = {
        mode: schemathesis.openapi.from_dict(
            positive(document) if mode is schemathesis.GenerationMode.POSITIVE
            else document, config=config)[path][method.upper()]
        for mode in schemathesis.GenerationMode}
    failures: list[str] = []
    statuses: dict[str, Counter[int]] = {name: Counter() for name in urls}
    sent: Counter[str | None] = Counter()  # the bodies' content types
    spec = document["paths"][path][method]
    modes = [schemathesis.GenerationMode.POSITIVE]
    if "requestBody" in spec or "parameters" in spec:  # something to make invalid
        modes.append(schemathesis.GenerationMode.NEGATIVE)
    for mode in modes:
        fuzz_mode(urls, operations[mode], mode, failures, statuses, sent, headers=headers,
                  max_examples=max_examples if mode is schemathesis.GenerationMode.POSITIVE
                  else invalid_examples or min(INVALID_EXAMPLES, max_examples))
    for name in urls:
        print(f"{name} {method.upper()} {path}: {dict(sorted(statuses[name].items()))} "
              f"{dict(sent)}")
    for media in spec.get("requestBody", {}).get("content", {}):
        if not sent[media]:
            failures.append(f"no body was sent as {media}")
    names_a_model = "{model}" in path or path == "/v1/embeddings"
    for name in urls:
        if names_a_model and not any(200 <= status < 300 for status in statuses[name]):
            failures.append(f"{name}: no request was answered 2xx")  # its models answer some
    return failures


def names_an_unlisted_model(case: Any) -> bool:
    """The case names a model outside MODELS. An invalid case made so by its model alone
    may name a real one (a mutation of ``sentence-transformers/all-MiniLM-L6-v2`` drew
    ``all-MiniLM-L6-v2``, an alias heron serve answers), so no refusal is owed for it."""
    body = case.body if isinstance(case.body, dict) else {}
    names = [(case.path_parameters or {}).get("model"), body.get("model")]
    return any(isinstance(n, str) and n not in MODELS for n in names)


def fuzz_mode(urls: dict[str, str], operation: Any, mode: schemathesis.GenerationMode,
              failures: list[str], statuses: dict[str, Counter[int]],
              sent: Counter[str | None], *, headers: dict[str, str] | None = None,
              max_examples: int = MAX_EXAMPLES) -> None:
    negative = mode is schemathesis.GenerationMode.NEGATIVE

    @settings(max_examples=max_examples, deadline=None, database=None,
              phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(operation.as_strategy(generation_mode=mode))
    def one_case(case: Any) -> None:
        sent[case.media_type] += 1
        checks = CHECKS + ([negative_data_rejection]
                           if negative and not names_an_unlisted_model(case) else [])
        for name, url in urls.items():
            response = case.call(base_url=url, timeout=60, headers=headers)
            statuses[name][response.status_code] += 1
            problem = None
            if response.status_code >= 500 and not deadline_too_short(case, response):
                problem = "server error"
            else:
                try:
                    case.validate_response(response, checks=checks)
                except (Exception, BaseExceptionGroup) as exc:  # schemathesis' FailureGroup
                    problem = " / ".join(str(exc).split("\n\n")[:3])
            if problem is not None:
                failures.append(f"{name}: {mode.value} {response.status_code} {problem} "
                                f"body={repr(case.body)[:300]} "
                                f"answer={response.content[:300]!r}")

    for attempt in range(1, NEGATIVE_ATTEMPTS + 1):
        try:
            one_case()
            return
        except Unsatisfiable:  # e.g. a {name} path parameter: nothing invalid can be sent
            assert mode is schemathesis.GenerationMode.NEGATIVE
            return
        except UnsupportedSchema:
            # schemathesis cannot draw some invalid bodies of a closed object (an undeclared
            # key whose complement it cannot spell: "a `not` ... below the document root"),
            # and the draw ends the run: about 1 local run in 10 of the config service's
            # model POST met one. Fresh draws (a random run's) go on; a derandomized run
            # would meet it again, and fails.
            if mode is schemathesis.GenerationMode.POSITIVE or attempt == NEGATIVE_ATTEMPTS:
                raise


def operations_of(operations: tuple[ApiOperation, ...]) -> list[tuple[str, str]]:
    return [(op.path, op.method.lower()) for op in operations]


@pytest.fixture(scope="module")
def serve_document(base_url: str) -> dict[str, Any]:
    return with_known_models(served_document(base_url, INFERENCE_OPERATIONS, "Heron"))


@pytest.fixture(scope="module")
def gateway_document(cluster_url: str) -> dict[str, Any]:
    return with_known_models(served_document(
        cluster_url, (*INFERENCE_OPERATIONS, *GATEWAY_OPERATIONS), "Heron gateway"))


@pytest.mark.parametrize(("path", "method"), operations_of(INFERENCE_OPERATIONS))
def test_heron_serve_and_the_gateway_answer_as_documented(
        base_url: str, cluster_url: str, serve_document: dict[str, Any],
        gateway_document: dict[str, Any], path: str, method: str) -> None:
    """The operations both serve, with the same cases sent to both (their documents
    describe these operations alike)."""
    assert gateway_document["paths"][path] == serve_document["paths"][path]
    shared = gateway_document["components"]["schemas"]
    assert {name: shared.get(name) for name in serve_document["components"]["schemas"]} \
        == serve_document["components"]["schemas"]
    failures = fuzz({"heron serve": base_url, "gateway": cluster_url}, serve_document,
                    path, method)
    assert not failures, f"{len(failures)} answers broke the document:\n" + "\n".join(
        failures[:5])


@pytest.mark.parametrize(("path", "method"), operations_of(GATEWAY_OPERATIONS))
def test_the_gateway_answers_as_documented(cluster_url: str,
                                           gateway_document: dict[str, Any],
                                           path: str, method: str) -> None:
    failures = fuzz({"gateway": cluster_url}, gateway_document, path, method)
    assert not failures, f"{len(failures)} answers broke the document:\n" + "\n".join(
        failures[:5])


@pytest.fixture(scope="module")
def cold_gateway_url(nats_server: NatsServer, tmp_path_factory: pytest.TempPathFactory
                     ) -> Iterator[str]:
    """A gateway whose one pool has no worker: every inference request is a 202."""
    root = write_bundles(tmp_path_factory.mktemp("cold-bundles"),
                         {"cold": ["dense", "rerank", "ner"]})
    gateway = GatewayThread(nats_server.url, {"cold": unique("cold")}, root,
                            GatewaySettings(startup_grace_s=0.2)).start()
    try:
        yield gateway.url
    finally:
        gateway.stop()


@pytest.mark.parametrize("media_type", ["application/json", "application/msgpack"])
def test_a_provisioning_answer_is_documented(cold_gateway_url: str, media_type: str) -> None:
    document = served_document(cold_gateway_url, (*INFERENCE_OPERATIONS, *GATEWAY_OPERATIONS),
                               "Heron gateway")
    schema = schemathesis.openapi.from_dict(document)
    calls = [("/v1/encode/{model}", "cold-dense", {"items": ["a"]}),
             ("/v1/score/{model}", "cold-rerank", {"query": "q", "items": ["a"]}),
             ("/v1/extract/{model}", "cold-ner", {"items": ["a"]}),
             ("/v1/models/{model}/provision", "cold-dense", None),
             # Routes of other APIs answer 503 + Retry-After: their clients know no 202.
             ("/v1/embeddings", None, {"model": "cold-dense", "input": "a"}),
             ("/v2/rerank", None, {"model": "cold-rerank", "query": "q", "documents": ["a"]}),
             ("/v1/rerank", None, {"model": "cold-rerank", "query": "q", "documents": ["a"]})]
    for path, model, body in calls:
        operation = schema[path]["POST"]
        params = {} if model is None else {"path_parameters": {"model": model}}
        if body is not None:
            params.update(body=body, media_type=media_type if model else "application/json")
        case = operation.Case(**params)
        response = case.call(base_url=cold_gateway_url, timeout=30,
                             headers={"Accept": media_type})
        assert response.status_code == (202 if model else 503), (path, response.content[:300])
        assert int(response.headers["retry-after"][0]) >= 1  # schemathesis lower-cases names
        case.validate_response(response, checks=CHECKS)


def test_docs_page_serves_swagger_ui_from_the_package(base_url: str) -> None:
    page = local_http.get(base_url + "/docs", timeout=30)
    assert page.status_code == 200
    assert page.headers["content-type"].startswith("text/html")
    assert "http://" not in page.text and "https://" not in page.text  # no CDN
    assert 'url: "openapi.json"' in page.text
    for asset in ("swagger-ui.css", "swagger-ui-bundle.js", "swagger-ui-standalone-preset.js"):
        assert f'"docs/{asset}"' in page.text
        answer = local_http.get(f"{base_url}/docs/{asset}", timeout=30)
        assert answer.status_code == 200, asset
        assert len(answer.content) > 1000
    missing = local_http.get(base_url + "/docs/no-such-asset.js", timeout=30)
    assert missing.status_code == 404
    assert missing.json()["error"]["code"] == "NOT_FOUND"


# ---- the config service ------------------------------------------------------------------------
# Its routes answer in milliseconds; 50 cases per operation and mode keep the whole addition
# to about half a minute on 2 cores.
CONFIG_EXAMPLES = 50
CONFIG_MODELS = ["base/dense", "base/beta", "base/sparse", "no/such-model"]
CONFIG_BUNDLES = ["alpha", "beta", "sparsebox", "no-such-bundle"]


@pytest.fixture(scope="module")
def config_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A config service with the admin token, its own store and its own nats-server (the
    writer lease is one per NATS): the POSTs below add models nobody else reads."""
    root = tmp_path_factory.mktemp("config-schema")
    nats = NatsServer(root / "nats").start()
    service = config_procs.InProcessConfig(
        nats.url, root / "store", config_procs.write_bundles(root / "bundles"),
        lease_ttl_s=config_procs.LONG_LEASE_S)
    try:
        service.start()
        yield service.url
    finally:
        service.stop()
        nats.stop()


@pytest.fixture(scope="module")
def config_document(config_url: str) -> dict[str, Any]:
    return served_document(config_url, CONFIG_OPERATIONS, "Heron config service")


def with_config_names(document: dict[str, Any]) -> dict[str, Any]:
    """Valid cases' path names drawn from what the service knows (else nearly every case
    is a 404). Invalid cases keep the real document: a name outside these lists may be a
    model the POSTs added, rightly answered 200."""
    out = small_bodies(document)
    # Bundles the service has and the adapters they serve, so that valid posts are mostly
    # stored (201) rather than refused for a bundle no test has.
    body = out["components"]["schemas"]["ModelConfigBody"]["properties"]
    body["bundles"] = {"type": "array", "minItems": 1, "maxItems": 2,
                       "items": {"enum": CONFIG_BUNDLES[:3]}}
    body["adapter"] = {"type": "string", "enum": ["dense", "sparse"]}
    body["loras"] = {"type": "null"}  # LoRA configs: tests/integration/test_lora.py
    names = {"model": CONFIG_MODELS, "name": CONFIG_BUNDLES}
    for item in out["paths"].values():
        for op in item.values():
            for param in op.get("parameters", []):
                param["schema"] = {"type": "string", "enum": names[param["name"]]}
    return out


def without_property_names(node: Any) -> Any:
    """The document less its ``propertyNames`` (the LoRA names' pattern): schemathesis
    cannot make invalid cases from one (it becomes a ``not`` it does not support)."""
    if isinstance(node, dict):
        return {k: without_property_names(v) for k, v in node.items() if k != "propertyNames"}
    if isinstance(node, list):
        return [without_property_names(v) for v in node]
    return node


@pytest.mark.parametrize(("path", "method"), operations_of(CONFIG_OPERATIONS))
def test_the_config_service_answers_as_documented(config_url: str,
                                                  config_document: dict[str, Any],
                                                  path: str, method: str) -> None:
    failures = fuzz({"config service": config_url}, without_property_names(config_document),
                    path, method,
                    headers={"Authorization": f"Bearer {config_procs.ADMIN}"},
                    max_examples=CONFIG_EXAMPLES, invalid_examples=CONFIG_EXAMPLES,
                    positive=with_config_names)
    assert not failures, f"{len(failures)} answers broke the document:\n" + "\n".join(
        failures[:5])


def test_a_yaml_post_and_its_reads_are_documented(config_url: str,
                                                  config_document: dict[str, Any]) -> None:
    """A model posted as YAML is stored (201), then read back as the document says."""
    schema = schemathesis.openapi.from_dict(config_document)
    headers = {"Authorization": f"Bearer {config_procs.ADMIN}"}
    body = config_procs.model_body("org/schema-yaml", description="posted as YAML")
    post = schema["/v1/configs/models"]["POST"].Case(body=body, media_type="application/yaml")
    answer = post.call(base_url=config_url, timeout=30, headers=headers)
    assert answer.status_code == 201, answer.content[:300]
    post.validate_response(answer, checks=CHECKS)
    assert answer.json()["bundles"] == ["alpha", "beta"]  # every bundle serving `dense`
    read = schema["/v1/configs/export"]["GET"].Case()
    export = read.call(base_url=config_url, timeout=30, headers=headers)
    read.validate_response(export, checks=CHECKS)
    stored = export.json()["models"]["org/schema-yaml"]
    assert stored["description"] == "posted as YAML"
    assert stored["profiles"]["default"]["max_batch_tokens"] == 4096
