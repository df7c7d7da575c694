"""Model config and bundle schema: one module, read by the worker (and later the config
service), so a config is valid in one place or in none.

A bad config fails at load with the file, the field and the reason::

    bundles/models/x.yaml: profiles.default.max_batch_tokens: must be a positive integer
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import yaml

from heron.runtime.adapters import ADAPTERS, AUTO  # the one table of model families
from heron_sdk.errors import ErrorCode, HeronError, invalid_field
from heron_sdk.types import (
    ADAPTER_NAME_PATTERN,
    MAX_INTEGER,
    RequestOptions,
    check_adapter_name,
    integral,
    shown,
)

# sentence-transformers' pooling modes; "last" is an older name of "lasttoken".
POOLINGS = ("mean", "cls", "max", "lasttoken", "weightedmean", "mean_sqrt_len_tokens", "last")
PRECISIONS = ("auto", "fp32", "fp16", "bf16")
ACTIVATIONS = ("sigmoid", "softmax", "none")
DEVICES = ("auto", "cpu", "cuda")
PACKINGS = ("auto", "off")
MUVERA_MAX_K_SIM = 16  # 65,536 buckets per repetition: more is never a useful encoding
# LoRA adapters a worker keeps loaded per model unless the config says otherwise: each is a
# few MB (rank 8 on a base model's attention projections), so a handful costs little.
DEFAULT_MAX_LORAS = 4


class ConfigError(ValueError):
    def __init__(self, source: str, field_name: str, reason: str) -> None:
        super().__init__(f"{source}: {field_name}: {reason}")
        self.source = source
        self.field = field_name
        self.reason = reason


@dataclass(frozen=True, slots=True)
class WeightSource:
    """Where weights come from: exactly one of package, path or hub."""

    package: str | None = None  # a Python package that ships the weights ...
    subdir: str = ""  # ... in this folder of it
    path: str | None = None  # a local directory
    hub: str | None = None  # a Hugging Face Hub repo id
    revision: str | None = None


@dataclass(frozen=True, slots=True)
class Profile:
    max_batch_tokens: int = 16384
    max_batch_items: int = 128
    max_wait_ms: float = 5.0  # the adaptive wait's bound (0: never wait; batcher.py)
    max_sequence_length: int | None = None  # None: the model's own limit
    precision: str = "auto"  # auto: fp16 on CUDA; bf16 autocast on CPUs with native bf16, else fp32
    device: str = "auto"
    # None below: what the checkpoint's own files say (heron/runtime/checkpoint.py); for a
    # bare transformers checkpoint, mean pooling, normalized, no prompts, sigmoid.
    pooling: str | None = None
    normalize: bool | None = None
    query_instruction: str | None = None  # prepended to query texts
    document_instruction: str | None = None  # prepended to document texts
    activation: str | None = None  # cross-encoder score activation
    max_queue_items: int = 8192
    packing: str = "auto"  # auto: pack batches (no padding) where the model family allows
    # MUVERA fixed-dimensional encoding of a multi-vector model's output (worker/muvera.py):
    # 2**k_sim buckets x dim_proj dims x repetitions; the seed makes every worker agree.
    muvera_k_sim: int = 5
    muvera_dim_proj: int = 16
    muvera_repetitions: int = 20
    muvera_seed: int = 42


@dataclass(frozen=True, slots=True)
class ModelConfig:
    id: str
    adapter: str  # "auto": the family the checkpoint's files describe (the worker reads them)
    source: WeightSource
    profiles: Mapping[str, Profile]
    aliases: tuple[str, ...] = ()
    description: str = ""
    # Run Python code that ships with the checkpoint (its config.json auto_map). Off by
    # default; the config service refuses it unless its operator allowed it.
    trust_remote_code: bool = False
    # LoRA adapters (PEFT format) a request may name: name -> where its files come from,
    # in the shape of ``source``; and how many a worker keeps loaded at once (LRU).
    loras: Mapping[str, WeightSource] = field(default_factory=dict)
    max_loras: int = DEFAULT_MAX_LORAS

    @property
    def profile(self) -> Profile:
        return self.profiles["default"]

    def to_dict(self) -> dict[str, Any]:
        """The config as YAML/JSON would write it: parse_model_config(to_dict()) == self."""
        source = _source_dict(self.source)
        profiles = {name: {k: v for k, v in asdict(p).items() if v is not None}
                    for name, p in sorted(self.profiles.items())}
        out: dict[str, Any] = {"id": self.id, "adapter": self.adapter, "source": source,
                               "profiles": profiles}
        if self.aliases:
            out["aliases"] = list(self.aliases)
        if self.description:
            out["description"] = self.description
        if self.trust_remote_code:
            out["trust_remote_code"] = True
        if self.loras:
            out["loras"] = {name: _source_dict(src) for name, src in sorted(self.loras.items())}
        if self.max_loras != DEFAULT_MAX_LORAS:
            out["max_loras"] = self.max_loras
        return out

    def canonical(self) -> dict[str, Any]:
        data = asdict(self)
        data["profiles"] = {k: asdict(v) for k, v in sorted(self.profiles.items())}
        data["aliases"] = list(self.aliases)
        # Left out when unused, so configs without adapters keep the hash they always had.
        data.pop("loras"), data.pop("max_loras")
        if self.loras:
            data["loras"] = {k: asdict(v) for k, v in sorted(self.loras.items())}
            data["max_loras"] = self.max_loras
        return data


def _source_dict(source: WeightSource) -> dict[str, str]:
    return {k: v for k, v in asdict(source).items()
            if v is not None and not (k == "subdir" and v == "")}


@dataclass(frozen=True, slots=True)
class Bundle:
    name: str
    models: tuple[ModelConfig, ...]
    adapters: tuple[str, ...] = ADAPTERS
    description: str = ""
    preload: tuple[str, ...] | None = None  # None: load every model at start
    source: str = ""

    @property
    def config_hash(self) -> str:
        return bundle_config_hash(self.models)


def bundle_config_hash(models: tuple[ModelConfig, ...] | list[ModelConfig]) -> str:
    """SHA-256 of canonical JSON of the models' configs (sorted by id)."""
    canonical = [m.canonical() for m in sorted(models, key=lambda m: m.id)]
    blob = json.dumps(canonical, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()


def default_bundles_dir() -> Path:
    env = os.environ.get("HERON_BUNDLES_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "bundles"


# ---- parsing -------------------------------------------------------------------------

_PROFILE_FIELDS: dict[str, tuple[type | tuple[type, ...], Any]] = {
    "max_batch_tokens": (int, "positive"),
    "max_batch_items": (int, "positive"),
    "max_wait_ms": ((int, float), "non-negative"),
    "max_sequence_length": (int, "positive"),
    "precision": (str, PRECISIONS),
    "device": (str, DEVICES),
    "pooling": (str, POOLINGS),
    "normalize": (bool, None),
    "query_instruction": (str, None),
    "document_instruction": (str, None),
    "activation": (str, ACTIVATIONS),
    "max_queue_items": (int, "positive"),
    "packing": (str, PACKINGS),
    "muvera_k_sim": (int, "positive"),
    "muvera_dim_proj": (int, "positive"),
    "muvera_repetitions": (int, "positive"),
    "muvera_seed": (int, "positive"),
}


# Fields whose null means "not set": the checkpoint (or the model's own limit) decides.
_NULLABLE = frozenset({"max_sequence_length", "pooling", "normalize", "query_instruction",
                       "document_instruction", "activation"})


def parse_profile(data: Any, src: str, where: str) -> Profile:
    if not isinstance(data, Mapping):
        raise ConfigError(src, where, "must be a mapping")
    values: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{where}.{key}"
        if key not in _PROFILE_FIELDS:
            raise ConfigError(src, name, f"unknown field; known: {sorted(_PROFILE_FIELDS)}")
        kind, rule = _PROFILE_FIELDS[key]
        if value is None and key in _NULLABLE:
            continue
        # YAML reads .nan and .inf, msgpack carries them: no setting means either.
        if isinstance(value, float) and not math.isfinite(value) and rule in (
                "positive", "non-negative"):
            raise ConfigError(src, name, "must be a finite number")
        if kind is int:
            value = integral(value)  # 2.0 is 2: JSON (and its Schema) have one number type
        if (isinstance(value, bool) and kind is not bool) or not isinstance(value, kind):
            raise ConfigError(src, name,
                              f"must be of type {_type_name(kind)}, got {shown(value)}")
        if rule == "positive" and value <= 0:
            raise ConfigError(src, name, "must be a positive integer")
        # A bound keeps every stored config writable as JSON (orjson stops at 64 bits) and
        # its float a real number (YAML reads .inf and .nan, msgpack carries them).
        if rule == "positive" and value > MAX_INTEGER:
            raise ConfigError(src, name, f"must be at most {MAX_INTEGER}")
        if rule == "non-negative" and not (0 <= value <= MAX_INTEGER):
            raise ConfigError(src, name, f"must be a number from 0 to {MAX_INTEGER}")
        if key == "muvera_k_sim" and value > MUVERA_MAX_K_SIM:
            raise ConfigError(src, name, f"must be at most {MUVERA_MAX_K_SIM} (2^k buckets)")
        if isinstance(rule, tuple) and value not in rule:
            raise ConfigError(src, name, f"must be one of {list(rule)}, got {shown(value)}")
        values[key] = float(value) if key == "max_wait_ms" else value
    return Profile(**values)


def _type_name(kind: type | tuple[type, ...]) -> str:
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return "|".join(k.__name__ for k in kinds)


def parse_source(data: Any, src: str, where: str = "source") -> WeightSource:
    if not isinstance(data, Mapping):
        raise ConfigError(src, where, "must be a mapping with one of package, path, hub")
    known = {"package", "subdir", "path", "hub", "revision"}
    for key, value in data.items():
        if key not in known:
            raise ConfigError(src, f"{where}.{key}", f"unknown field; known: {sorted(known)}")
        if not isinstance(value, str) or (not value and key != "subdir"):
            raise ConfigError(src, f"{where}.{key}", "must be a non-empty string")
    kinds = [k for k in ("package", "path", "hub") if k in data]
    if len(kinds) != 1:
        raise ConfigError(src, where, "needs exactly one of package, path, hub")
    return WeightSource(**data)


_LORA_NAME = re.compile(ADAPTER_NAME_PATTERN.removeprefix("^").removesuffix("$"))


def parse_loras(data: Any, src: str) -> dict[str, WeightSource]:
    """``loras``: adapter name -> its source (null: none)."""
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(src, "loras", "must be a mapping of adapter name to its source")
    out = {}
    for name, source in data.items():
        if not isinstance(name, str) or not _LORA_NAME.fullmatch(name):
            raise ConfigError(src, f"loras.{shown(name)}", "adapter names are 1 to 64 "
                              "letters, digits and ._-, starting with a letter or digit")
        out[name] = parse_source(source, src, f"loras.{name}")
    return out


def parse_model_config(data: Any, src: str = "<model config>") -> ModelConfig:
    if not isinstance(data, Mapping):
        raise ConfigError(src, "(root)", "must be a mapping")
    known = {"id", "adapter", "source", "profiles", "aliases", "description",
             "trust_remote_code", "loras", "max_loras"}
    for key in data:
        if key not in known:
            raise ConfigError(src, str(key), f"unknown field; known: {sorted(known)}")
    model_id = data.get("id")
    if not isinstance(model_id, str) or not model_id.strip():
        raise ConfigError(src, "id", "is required and must be a non-empty string")
    adapter = data.get("adapter")
    if adapter is None:
        adapter = AUTO
    if adapter not in ADAPTERS:
        raise ConfigError(src, "adapter",
                          f"must be one of {list(ADAPTERS)}, got {shown(adapter)}")
    if "source" not in data:
        raise ConfigError(src, "source", "is required")
    # null (a YAML key left empty) means the default; other falsy values (false, 0, "")
    # are mistakes and refused like any wrong type, not read as "absent".
    profiles_raw = data.get("profiles")
    if profiles_raw is None:
        profiles_raw = {"default": {}}
    if not isinstance(profiles_raw, Mapping):
        raise ConfigError(src, "profiles", "must be a mapping of profile name to settings")
    if "default" not in profiles_raw:
        raise ConfigError(src, "profiles", "must contain a 'default' profile")
    profiles = {str(name): parse_profile({} if p is None else p, src, f"profiles.{name}")
                for name, p in profiles_raw.items()}
    aliases = data.get("aliases")
    if aliases is None:
        aliases = []
    if not isinstance(aliases, list) or not all(isinstance(a, str) and a for a in aliases):
        raise ConfigError(src, "aliases", "must be a list of non-empty strings")
    description = data.get("description")
    if description is None:
        description = ""
    if not isinstance(description, str):
        raise ConfigError(src, "description", "must be a string")
    remote = data.get("trust_remote_code")
    if remote is None:
        remote = False
    if not isinstance(remote, bool):
        raise ConfigError(src, "trust_remote_code", "must be true or false")
    max_loras = integral(data.get("max_loras"))
    if max_loras is None:
        max_loras = DEFAULT_MAX_LORAS
    if (isinstance(max_loras, bool) or not isinstance(max_loras, int)
            or not 0 < max_loras <= MAX_INTEGER):
        raise ConfigError(src, "max_loras", f"must be an integer from 1 to {MAX_INTEGER}")
    return ModelConfig(id=model_id, adapter=adapter, source=parse_source(data["source"], src),
                       profiles=profiles, aliases=tuple(aliases), description=description,
                       trust_remote_code=remote, loras=parse_loras(data.get("loras"), src),
                       max_loras=max_loras)


def _read_yaml(path: Path) -> Any:
    try:
        return yaml.safe_load(path.read_text())
    except OSError as exc:
        raise ConfigError(str(path), "(file)", f"cannot be read: {exc.strerror}") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), "(file)", f"is not valid YAML: {exc}") from exc


def load_model_config(path: Path) -> ModelConfig:
    return parse_model_config(_read_yaml(path), str(path))


def load_bundle(name_or_path: str | Path, bundles_dir: Path | None = None) -> Bundle:
    """Load ``bundles/<name>.yaml`` (or a path) and the model configs it names."""
    bundles_dir = bundles_dir or default_bundles_dir()
    path = Path(name_or_path)
    if path.suffix not in (".yaml", ".yml"):
        path = bundles_dir / f"{name_or_path}.yaml"
    src = str(path)
    data = _read_yaml(path)
    if not isinstance(data, Mapping):
        raise ConfigError(src, "(root)", "must be a mapping")
    known = {"name", "description", "adapters", "models", "preload"}
    for key in data:
        if key not in known:
            raise ConfigError(src, str(key), f"unknown field; known: {sorted(known)}")
    name = data.get("name")
    if not isinstance(name, str) or not name:
        raise ConfigError(src, "name", "is required and must be a non-empty string")
    adapters = data.get("adapters") or list(ADAPTERS)
    if not isinstance(adapters, list):
        raise ConfigError(src, "adapters", "must be a list")
    for i, a in enumerate(adapters):
        if a not in ADAPTERS:
            raise ConfigError(src, f"adapters[{i}]", f"must be one of {list(ADAPTERS)}")
    entries = data.get("models")
    if not isinstance(entries, list) or not entries:
        raise ConfigError(src, "models", "must be a non-empty list of model config files")
    models: list[ModelConfig] = []
    for i, entry in enumerate(entries):
        if not isinstance(entry, str):
            raise ConfigError(src, f"models[{i}]", "must be a file name under models/")
        model_path = path.parent / "models" / entry
        if not model_path.exists():
            raise ConfigError(src, f"models[{i}]", f"file {model_path} does not exist")
        model = load_model_config(model_path)
        if model.adapter != AUTO and model.adapter not in adapters:
            raise ConfigError(src, f"models[{i}]",
                              f"model {model.id} uses adapter {model.adapter!r}, "
                              f"which the bundle does not list")
        models.append(model)
    names = [n for m in models for n in (m.id, *m.aliases)]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ConfigError(src, "models", f"model ids/aliases appear twice: {dupes}")
    preload = data.get("preload")
    if preload is not None and (not isinstance(preload, list) or
                                not all(p in names for p in preload)):
        raise ConfigError(src, "preload", "must be a list of model ids the bundle serves")
    return Bundle(name=name, models=tuple(models), adapters=tuple(adapters),
                  description=str(data.get("description") or ""),
                  preload=None if preload is None else tuple(preload), source=src)


def lora_source(config: ModelConfig, name: str | None) -> WeightSource | None:
    """Where LoRA adapter ``name`` of ``config`` comes from (None: no adapter was asked
    for); 404 ADAPTER_NOT_FOUND for a name the config does not list."""
    if name is None:
        return None
    source = config.loras.get(name)
    if source is None:
        listed = (f"it has {', '.join(sorted(config.loras))}" if config.loras
                  else "it has no adapters")
        raise HeronError(ErrorCode.ADAPTER_NOT_FOUND,
                         f"model {config.id} has no LoRA adapter {name!r}; {listed}",
                         field="adapter")
    return source


def split_adapter(model: str, options: RequestOptions, field_name: str = "model") -> str:
    """``model@adapter`` -> ``model``, with the adapter put in ``options`` (where the body
    named the same one, or none). 422 for ``model@`` (no name) or a name the body
    contradicts. A name without "@" is returned as is (the route's, the OpenAI and rerank
    bodies' ``model``; heron_sdk.types.MODEL_ADAPTER_PATTERN states the rule)."""
    base, at, name = model.rpartition("@")
    if not at:
        return model
    if not base:
        raise invalid_field(field_name, f"{shown(model)} names no model before '@'")
    if not name:
        raise invalid_field(field_name, f"{shown(model)} names no adapter after '@'")
    check_adapter_name(name, field_name)
    if options.adapter is not None and options.adapter != name:
        raise invalid_field("adapter", f"{shown(options.adapter)} contradicts the "
                            f"{shown(name)} of {field_name} {shown(model)}")
    options.adapter = name
    return base


def model_config_from_dir(model_id: str, adapter: str | None, path: str | Path,
                          **profile: Any) -> ModelConfig:
    """A config for a local model directory (used by ``heron serve --model-dir``, tests)."""
    return parse_model_config({"id": model_id, "adapter": adapter or AUTO,
                               "source": {"path": str(path)},
                               "profiles": {"default": profile}}, f"<{model_id}>")


__all__ = ["ADAPTERS", "Bundle", "ConfigError", "ModelConfig", "Profile", "WeightSource",
           "bundle_config_hash", "default_bundles_dir", "load_bundle", "load_model_config",
           "lora_source", "model_config_from_dir", "parse_model_config", "split_adapter"]
