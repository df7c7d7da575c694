"""Model names and aliases resolve to (model id, bundle, pool); 404 and 422 are decided here."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from heron.gateway.app import parse_pool_pairs
from heron.gateway.registry import BundleDirSource, RouteTable, check_encode_outputs, describe
from heron.runtime.modelconfig import ConfigError
from heron_sdk.errors import ErrorCode, HeronError
from heron_sdk.types import EncodeRequest, Item

ADAPTERS = {"dense": "enc", "sparse": "spl", "multi_vector": "mv", "cross_encoder": "rr",
            "token_classifier": "ner"}


def write_bundles(root: Path) -> Path:
    (root / "models").mkdir()
    for adapter, alias in ADAPTERS.items():
        (root / "models" / f"{alias}.yaml").write_text(yaml.safe_dump(
            {"id": f"org/{alias}-model", "aliases": [alias], "adapter": adapter,
             "source": {"path": "/nonexistent"}}))
    (root / "one.yaml").write_text(yaml.safe_dump(
        {"name": "one", "models": ["enc.yaml", "spl.yaml", "mv.yaml"]}))
    (root / "two.yaml").write_text(yaml.safe_dump(
        {"name": "two", "models": ["rr.yaml", "ner.yaml"]}))
    (root / "dup.yaml").write_text(yaml.safe_dump({"name": "dup", "models": ["enc.yaml"]}))
    return root


@pytest.fixture()
def registry(tmp_path: Path) -> RouteTable:
    reg = RouteTable(BundleDirSource({"one": "cpu", "two": "gpu"}, write_bundles(tmp_path)))
    reg.load()
    return reg


def test_names_and_aliases_resolve_to_bundle_and_pool(registry: RouteTable) -> None:
    route = registry.resolve("enc")
    assert (route.model_id, route.bundle, route.pool) == ("org/enc-model", "one", "cpu")
    assert registry.resolve("org/rr-model").pool == "gpu"
    assert registry.canonical_id("ner") == "org/ner-model"
    assert registry.canonical_id("nope") is None
    assert registry.pools() == {"cpu": "one", "gpu": "two"}
    assert len(registry.models()) == 5


def test_unknown_model_is_404(registry: RouteTable) -> None:
    with pytest.raises(HeronError) as err:
        registry.resolve("no/such")
    assert err.value.code is ErrorCode.MODEL_NOT_FOUND and err.value.status == 404


@pytest.mark.parametrize(("model", "task", "ok"), [
    ("enc", "encode", True), ("enc", "score", True), ("enc", "extract", False),
    ("spl", "encode", True), ("spl", "score", False), ("mv", "encode", True),
    ("mv", "score", True), ("rr", "score", True), ("rr", "encode", False),
    ("ner", "extract", True), ("ner", "encode", False)])
def test_task_follows_the_adapter(registry: RouteTable, model: str, task: str,
                                  ok: bool) -> None:
    if ok:
        assert registry.route_for(model, task).config.aliases == (model,)
    else:
        with pytest.raises(HeronError) as err:
            registry.route_for(model, task)
        assert err.value.code is ErrorCode.UNSUPPORTED_TASK and err.value.status == 422


@pytest.mark.parametrize(("model", "body", "ok"), [
    ("enc", {"output_types": ["dense"]}, True),
    ("enc", {"output_types": ["sparse"]}, False),
    ("mv", {"output_types": ["multi_vector", "dense"]}, True),
    ("spl", {"output_types": ["sparse"], "output_dtype": "float16"}, True),
    ("spl", {"output_types": ["sparse"], "output_dtype": "binary"}, False),
    ("spl", {}, False)])  # default output is dense
def test_output_types_follow_the_adapter(registry: RouteTable, model: str, body: dict,
                                         ok: bool) -> None:
    req = EncodeRequest.from_wire({"items": ["a"], **body})
    route = registry.route_for(model, "encode")
    if ok:
        check_encode_outputs(route, req)
    else:
        with pytest.raises(HeronError) as err:
            check_encode_outputs(route, req)
        assert err.value.code is ErrorCode.UNSUPPORTED_OUTPUT


def test_a_pool_serves_one_bundle_and_a_name_one_model(tmp_path: Path) -> None:
    root = write_bundles(tmp_path)
    with pytest.raises(ConfigError, match="already serves bundle"):
        RouteTable(BundleDirSource({"one": "p", "two": "p"}, root)).load()
    with pytest.raises(ConfigError, match="served by bundles"):
        RouteTable(BundleDirSource({"one": "a", "dup": "b"}, root)).load()
    with pytest.raises(ConfigError):
        RouteTable(BundleDirSource({"missing": "a"}, root)).load()


def test_the_default_bundle_loads() -> None:
    registry = RouteTable(BundleDirSource({"default": "default"}))
    registry.load()
    route = registry.route_for("minilm", "encode")
    assert route.model_id == "sentence-transformers/all-MiniLM-L6-v2"
    shown = describe(route, "ready")
    assert shown["pool"] == "default" and shown["state"] == "ready"
    assert shown["output_types"] == ["dense"] and shown["tasks"] == ["encode", "score"]
    assert EncodeRequest([Item("x")]).output_types == ("dense",)


def test_pool_pairs() -> None:
    assert parse_pool_pairs([]) == {"default": "default"}
    assert parse_pool_pairs(["default=cpu", "sparse=gpu-a"]) == {"default": "cpu",
                                                                 "sparse": "gpu-a"}
    assert parse_pool_pairs(["sparse"]) == {"sparse": "sparse"}
    for bad in (["=x"], ["a="], ["a=x", "a=y"]):
        with pytest.raises(ConfigError):
            parse_pool_pairs(bad)


def test_unloaded_registry_answers_not_ready_not_unknown() -> None:
    from heron.gateway.configs import ConfigServiceSource
    from heron.gateway.registry import RouteTable
    from heron_sdk.errors import ErrorCode, HeronError

    registry = RouteTable(ConfigServiceSource({"default": "default"}))
    try:
        registry.resolve("minilm")
    except HeronError as exc:
        assert exc.code is ErrorCode.NOT_READY and exc.status == 503
        assert exc.retry_after_s
    else:
        raise AssertionError("resolved a model before any config arrived")
