"""The config service's append-only rules (Registry.plan/apply) and body parsing, without
NATS or HTTP."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from heron.config_service.body import check_name, decode, parse_posted
from heron.config_service.state import ContentConflict, Registry
from heron.runtime.modelconfig import (
    ConfigError,
    bundle_config_hash,
    load_bundle,
    parse_model_config,
)
from heron_sdk import wire
from heron_sdk.errors import ErrorCode, HeronError
from tests.support.config_procs import model_body, write_bundles


@pytest.fixture()
def bundles_dir(tmp_path: Path) -> Path:
    return write_bundles(tmp_path / "bundles")


@pytest.fixture()
def registry(bundles_dir: Path) -> Registry:
    return Registry.from_bundles_dir(bundles_dir)


def model(**kw: Any) -> Any:
    return parse_model_config(model_body(**kw))


def test_base_is_epoch_zero_with_sdk_hashes(registry: Registry, bundles_dir: Path) -> None:
    assert registry.epoch == 0
    for name in ("alpha", "beta", "sparsebox"):
        assert registry.bundle_hash(name) == load_bundle(name, bundles_dir).config_hash
    export = registry.export()
    assert export["bundles"]["alpha"] == {"adapters": ["dense", "sparse"],
                                          "models": ["base/dense"],
                                          "hash": registry.bundle_hash("alpha")}


def test_new_model_routes_to_bundles_serving_its_adapter(registry: Registry) -> None:
    change = registry.plan(model(), None)
    assert change is not None and change.epoch == 1 and change.new_model
    assert change.bundles == ("alpha", "beta")
    before = registry.bundles_hash()
    registry.apply(change)
    assert registry.epoch == 1
    assert change.bundles_hash == {b: registry.bundle_hash(b) for b in ("alpha", "beta")}
    assert registry.bundle_hash("sparsebox") == before["sparsebox"]
    assert registry.bundle_hash("alpha") == bundle_config_hash(
        [registry.models["base/dense"], registry.models["org/new-dense"]])
    delta = change.delta()
    assert delta.epoch == 1 and delta.model == change.model.to_dict()
    assert delta.bundles == ("alpha", "beta")


def test_plan_changes_nothing(registry: Registry) -> None:
    before = registry.export()
    assert registry.plan(model(), ["beta"]) is not None
    assert registry.export() == before


def test_identical_is_noop_and_new_profile_merges(registry: Registry) -> None:
    registry.apply(registry.plan(model(), None))  # type: ignore[arg-type]
    assert registry.plan(model(), None) is None
    body = model_body()
    body["profiles"]["fast"] = {"max_batch_tokens": 512}
    change = registry.plan(parse_model_config(body), None)
    assert change is not None and not change.new_model and change.epoch == 2
    assert sorted(change.model.profiles) == ["default", "fast"]
    registry.apply(change)
    assert registry.plan(model(), None) is None  # omitting a profile does not remove it


def test_conflicts_name_every_field(registry: Registry) -> None:
    registry.apply(registry.plan(model(), None))  # type: ignore[arg-type]
    body = model_body(adapter="sparse", description="new", aliases=["x"])
    body["profiles"]["default"] = {"max_batch_tokens": 1, "pooling": "cls"}
    with pytest.raises(ContentConflict) as info:
        registry.plan(parse_model_config(body), None)
    assert info.value.fields == ["adapter", "aliases", "description",
                                 "profiles.default.max_batch_tokens",
                                 "profiles.default.pooling"]
    assert info.value.status == 409
    assert info.value.to_body()["error"]["fields"] == info.value.fields


@pytest.mark.parametrize(("bundles", "field"), [(["nope"], "bundles"),
                                                (["sparsebox"], "bundles")])
def test_bad_bundles(registry: Registry, bundles: list[str], field: str) -> None:
    with pytest.raises(HeronError) as info:
        registry.plan(model(), bundles)
    assert info.value.code == ErrorCode.INVALID_FIELD and info.value.field == field


def test_adapter_no_bundle_serves(registry: Registry) -> None:
    with pytest.raises(HeronError) as info:
        registry.plan(model(adapter="cross_encoder"), None)
    assert info.value.field == "adapter"


def test_name_clashes(registry: Registry) -> None:
    with pytest.raises(ContentConflict):
        registry.plan(model(model_id="org/x", aliases=["base/beta"]), None)


def test_existing_model_gains_a_bundle(registry: Registry) -> None:
    change = registry.plan(parse_model_config({"id": "base/beta", "adapter": "dense",
                                               "source": {"hub": "base/beta"}}), ["alpha"])
    assert change is not None and change.bundles == ("alpha", "beta")
    registry.apply(change)
    assert registry.model_bundles("base/beta") == ["alpha", "beta"]


def test_bundles_dir_conflicting_model(tmp_path: Path) -> None:
    root = write_bundles(tmp_path / "b")
    (root / "models" / "beta.yaml").write_text(yaml.safe_dump(
        {"id": "base/dense", "adapter": "dense", "source": {"hub": "other"}}))
    with pytest.raises(ConfigError):
        Registry.from_bundles_dir(root)


# ---- bodies ---------------------------------------------------------------------------
def test_decode_by_content_type() -> None:
    body = model_body()
    assert decode(yaml.safe_dump(body).encode(), "application/yaml") == body
    assert decode(yaml.safe_dump(body).encode(), None) == body
    assert decode(wire.encode(body, wire.JSON), "application/json; charset=utf-8") == body
    assert decode(wire.encode(body, wire.MSGPACK), "application/msgpack") == body
    for ctype, code in (("text/html", ErrorCode.UNSUPPORTED_MEDIA_TYPE),
                        ("application/json", ErrorCode.MALFORMED_BODY)):
        with pytest.raises(HeronError) as info:
            decode(b"id: [", ctype)
        assert info.value.code == code
    with pytest.raises(HeronError) as info:
        decode(b"a: &x 1\nb: *x\n", "application/yaml")
    assert "aliases" in info.value.message


@pytest.mark.parametrize("name", ["org/name", "all-MiniLM-L6-v2", "a_b.c+d", "x" * 200,
                                  "BAAI/bge-small-en-v1.5"])
def test_safe_names(name: str) -> None:
    check_name(name, "id")


@pytest.mark.parametrize("name", ["../x", "a/../b", "a b", "/abs", "a/", "a//b", "x" * 201,
                                  "a\\b", "a\nb", ".hidden", "-x", "a/.."])
def test_unsafe_names(name: str) -> None:
    with pytest.raises(HeronError) as info:
        check_name(name, "id")
    assert info.value.code == ErrorCode.INVALID_FIELD and info.value.field == "id"


def test_parse_posted_bundles_field() -> None:
    posted = parse_posted(model_body(bundles=["beta", "alpha", "beta"]))
    assert posted.bundles == ["alpha", "beta"] and posted.model.id == "org/new-dense"
    assert parse_posted(model_body()).bundles is None
    for bad in ([], "alpha", [1]):
        with pytest.raises(HeronError) as info:
            parse_posted(model_body(bundles=bad))
        assert info.value.field == "bundles"
    with pytest.raises(HeronError) as info:
        parse_posted(model_body(profiles={"fast": {}}))
    assert info.value.field == "profiles"
