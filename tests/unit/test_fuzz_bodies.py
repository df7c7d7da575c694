"""bench/fuzz.py's bodies: the valid ones are valid (the schema allows them and the parsers
take them), every mutation is drawn, and a case is the same bytes on every run."""

from __future__ import annotations

import random
from collections import Counter
from typing import Any

import jsonschema_rs
import pytest

from bench.fuzz import PATTERNS, Target, config_routes, inference_routes, pool_routes
from bench.fuzz_bodies import SchemaSampler, check_pattern
from bench.fuzz_mutations import MUTATIONS
from heron.config_service.body import parse_posted
from heron.config_service.routes import CONFIG_OPERATIONS
from heron.gateway.routes import GATEWAY_OPERATIONS
from heron.runtime.front import INFERENCE_OPERATIONS
from heron.runtime.openai_compat import parse_embeddings_request
from heron.runtime.openapi import openapi_document
from heron_sdk.errors import HeronError
from heron_sdk.pools import PoolSpec, renew_ttl
from heron_sdk.types import EncodeRequest, ExtractRequest, ScoreRequest

GATEWAY_DOC = openapi_document((*INFERENCE_OPERATIONS, *GATEWAY_OPERATIONS), title="t",
                               version="t")
CONFIG_DOC = openapi_document(CONFIG_OPERATIONS, title="t", version="t")
PARSERS = {"EncodeBody": EncodeRequest.from_wire, "ScoreBody": ScoreRequest.from_wire,
           "ExtractBody": ExtractRequest.from_wire,
           "EmbeddingsBody": parse_embeddings_request, "PoolCreateBody": PoolSpec.from_wire,
           "PoolRenewBody": lambda body: renew_ttl(body, 300.0)}


def _validator(document: dict[str, Any], name: str) -> Any:
    root = {"$ref": f"#/components/schemas/{name}", "components": document["components"]}
    return jsonschema_rs.Draft202012Validator(root).is_valid


@pytest.mark.parametrize("component", list(PARSERS))
def test_valid_bodies_are_ones_the_schema_allows_and_the_parser_takes(component: str) -> None:
    valid = _validator(GATEWAY_DOC, component)
    sampler = SchemaSampler(random.Random(1), GATEWAY_DOC["components"]["schemas"], PATTERNS)
    for minimal in (False, True):
        for _ in range(150):
            body = sampler.sample({"$ref": f"#/components/schemas/{component}"},
                                  minimal=minimal)
            assert valid(body), body
            try:
                PARSERS[component](body)
            except HeronError as exc:  # the parser takes what the schema allows
                raise AssertionError(f"{body!r}: {exc}") from exc


def test_valid_config_bodies_are_valid() -> None:
    valid = _validator(CONFIG_DOC, "ModelConfigBody")
    sampler = SchemaSampler(random.Random(2), CONFIG_DOC["components"]["schemas"], PATTERNS)
    for _ in range(200):
        body = sampler.sample({"$ref": "#/components/schemas/ModelConfigBody"})
        assert valid(body), body
        parse_posted(body)


def test_the_name_generators_match_the_patterns() -> None:
    for pattern, make in PATTERNS.items():
        check_pattern(pattern, make)


TARGETS = {
    "serve": Target("serve", "", inference_routes(), INFERENCE_OPERATIONS,
                    ("POST", "/", {})),
    "gateway": Target("gateway", "", inference_routes() + pool_routes("default"),
                      (*INFERENCE_OPERATIONS, *GATEWAY_OPERATIONS), ("POST", "/", {})),
    "config": Target("config", "", config_routes(["alpha"]), CONFIG_OPERATIONS,
                     ("POST", "/", {})),
}


def test_every_mutation_is_drawn_and_cases_replay_byte_for_byte() -> None:
    kinds: Counter[str] = Counter()
    for name, target in TARGETS.items():
        first = target.factory(7)
        cases = [first.case(i) for i in range(600)]
        kinds.update(case.kind for case in cases)
        again = target.factory(7)
        for i in (599, 3, 250, 0):  # any order: each case has its own generator
            assert again.case(i) == cases[i], (name, i)
        assert target.factory(8).case(3) != cases[3]
    drawn = {k for k, (_, weight) in MUTATIONS.items() if weight > 0} | {"no_auth"}
    assert set(kinds) == drawn
