"""LoRA adapter files: where they are (the weight tiers models use) and what they say.

An adapter is a PEFT LoRA checkpoint, as ``PeftModel.save_pretrained`` writes it:
``adapter_config.json`` and ``adapter_model.safetensors``: the LoRA pairs, and the modules
of ``modules_to_save`` saved whole (a classifier head trained with the adapter: PEFT's
``SEQ_CLS`` task adds ``classifier`` and ``score`` itself). Its source has the shape of a
model's (``path``, ``package`` + ``subdir``, or ``hub`` + ``revision``); a ``hub`` adapter
goes through the same tiers as a model's weights (local cache, the S3 cluster cache, the
Hub: worker/weights.py), cached under its repository id.

Reading is torch-free (safetensors' numpy loader): it runs on a short-lived thread while the
model's inference thread keeps serving, and torch tensors are made on that thread later
(worker/lora.py). Anything Heron would compute differently from PEFT is refused here, with
the reason, rather than served: DoRA, trained biases, embedding or convolution LoRA,
``fan_in_fan_out`` layers, a LoRA layer inside a module saved whole.
"""

from __future__ import annotations

import importlib.util
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from heron.runtime.modelconfig import WeightSource
from heron.worker.weight_cache import CacheKey

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
# PEFT's saved keys: "base_model.model.<module path>.lora_A.weight" (the adapter's own name
# is removed on save; a raw state dict keeps it as ".lora_A.<name>.weight").
_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])"
                  r"(?:\.[^.]+)?\.weight$")
# adapter_config.json settings that change what the adapter computes in ways this module
# does not: each must be absent or falsy.
# (Settings that only choose initial weights, such as loftq_config or eva_config, change
# nothing at inference: the saved weights are what counts.)
_UNSUPPORTED = ("use_dora", "fan_in_fan_out", "lora_bias", "layer_replication",
                "target_parameters", "alora_invocation_tokens", "use_qalora",
                "trainable_token_indices", "arrow_config", "use_bdlora", "kasa_config",
                "monteclora_config", "velora_config")


class LoraFileError(ValueError):
    """The adapter's files are missing, malformed, or ask for something Heron does not
    compute (permanent: the request gets 502 MODEL_LOAD_FAILED naming the reason)."""


@dataclass(slots=True)
class LoraModule:
    """One adapted linear layer: ``y += scale * B (A x)``."""

    a: np.ndarray  # [r, in_features]
    b: np.ndarray  # [out_features, r]
    scale: float


@dataclass(slots=True)
class LoraFile:
    """An adapter as read from disk: PEFT module path -> its LoRA weights, and PEFT module
    path -> the state dict of a module it saved whole (``modules_to_save``)."""

    name: str
    rank: int
    modules: dict[str, LoraModule]
    saved: dict[str, dict[str, np.ndarray]] = field(default_factory=dict)

    @property
    def nbytes(self) -> int:
        return (sum(m.a.nbytes + m.b.nbytes for m in self.modules.values())
                + sum(a.nbytes for state in self.saved.values() for a in state.values()))


def resolve_lora(model_id: str, name: str, source: WeightSource) -> Path:
    """A local directory with the adapter's files (WeightsUnavailable or
    WeightsTemporarilyUnavailable from the tiers, LoraFileError for a directory without
    them)."""
    label = f"{model_id}@{name}"
    if source.path is not None:
        path = Path(source.path).expanduser()
    elif source.package is not None:
        spec = importlib.util.find_spec(source.package)
        if spec is None or not spec.submodule_search_locations:
            raise LoraFileError(f"{label}: the Python package {source.package!r} that ships "
                                "the adapter is not installed")
        path = Path(next(iter(spec.submodule_search_locations))) / source.subdir
    else:
        assert source.hub is not None
        from heron.worker.weights import _resolve_hub_model  # the models' own tiers

        path = _resolve_hub_model(label, source.hub, CacheKey(source.hub, source.revision),
                                  False)
    if not (path / ADAPTER_CONFIG).is_file():
        raise LoraFileError(f"{label}: {path} has no {ADAPTER_CONFIG} (not a PEFT adapter)")
    return path


def read_lora(path: Path, name: str) -> LoraFile:
    """The adapter's config and weights, checked against what Heron computes."""
    try:
        config = json.loads((path / ADAPTER_CONFIG).read_text())
    except (OSError, ValueError) as exc:
        raise LoraFileError(f"{path / ADAPTER_CONFIG} cannot be read: {exc}") from exc
    if not isinstance(config, dict):
        raise LoraFileError(f"{path / ADAPTER_CONFIG} is not a JSON object")
    kind = config.get("peft_type")
    if kind != "LORA":
        raise LoraFileError(f"{name}: peft_type is {kind!r}; only LORA adapters are served")
    asked = [key for key in _UNSUPPORTED if config.get(key)]
    if asked:
        raise LoraFileError(f"{name}: adapter_config.json sets {', '.join(asked)}, which "
                            "Heron does not compute")
    if config.get("bias", "none") != "none":
        raise LoraFileError(f"{name}: bias {config.get('bias')!r}: trained biases are not "
                            "applied; only bias 'none' is served")
    weights = path / ADAPTER_WEIGHTS
    if not weights.is_file():
        raise LoraFileError(f"{name}: {path} has no {ADAPTER_WEIGHTS} (save the adapter with "
                            "safe_serialization, PEFT's default)")
    from safetensors.numpy import load_file

    try:
        tensors = load_file(str(weights))
    except Exception as exc:  # a truncated or foreign file: safetensors' own errors
        raise LoraFileError(f"{name}: {weights} cannot be read: {exc}") from exc
    to_save = _modules_to_save(config, name)
    pairs: dict[str, dict[str, np.ndarray]] = {}
    saved: dict[str, dict[str, np.ndarray]] = {}
    for key, array in tensors.items():
        match = _KEY.match(key)
        if match is not None:
            pairs.setdefault(match["module"], {})[match["ab"]] = array
            continue
        found = _saved_module(key.removeprefix("base_model.model."), to_save)
        if found is None:
            raise LoraFileError(
                f"{name}: weight {key!r} is neither a LoRA A/B matrix nor part of a module "
                "in modules_to_save (embedding LoRA and biases are not served)")
        saved.setdefault(found[0], {})[found[1]] = array
    if not pairs and not saved:
        raise LoraFileError(f"{name}: {weights} holds no LoRA weights")
    for module in pairs:
        inside = next((m for m in saved if module == m or module.startswith(f"{m}.")), None)
        if inside is not None:
            raise LoraFileError(f"{name}: LoRA layer {module} is inside {inside}, which the "
                                "adapter saves whole (modules_to_save)")
    modules = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise LoraFileError(f"{name}: {module} has lora_{''.join(ab)} without its pair")
        a, b = ab["A"], ab["B"]
        if a.ndim != 2 or b.ndim != 2 or a.shape[0] != b.shape[1]:
            raise LoraFileError(f"{name}: {module}: A {a.shape} and B {b.shape} are not a "
                                "linear LoRA pair")
        modules[module] = LoraModule(a, b, _scale(config, module, a.shape[0], name))
    rank = max((m.a.shape[0] for m in modules.values()), default=0)
    return LoraFile(name, rank, modules, saved)


def _modules_to_save(config: dict[str, Any], name: str) -> list[list[str]]:
    """adapter_config.json's ``modules_to_save``, each name split at its dots."""
    names = config.get("modules_to_save") or []
    if not isinstance(names, list) or not all(isinstance(n, str) and n for n in names):
        raise LoraFileError(f"{name}: modules_to_save must be a list of module names, got "
                            f"{names!r}")
    return [n.split(".") for n in dict.fromkeys(names)]


def _saved_module(key: str, to_save: list[list[str]]) -> tuple[str, str] | None:
    """(module path, parameter name) of a saved key, for the outermost module whose path
    ends with a ``modules_to_save`` name (PEFT's match), or None. PEFT saves such a module's
    state dict under its own path (``classifier.weight``, ``classifier.out_proj.bias``)."""
    parts = key.split(".")
    for end in range(1, len(parts)):
        if any(parts[max(0, end - len(n)):end] == n for n in to_save):
            return ".".join(parts[:end]), ".".join(parts[end:])
    return None


def _scale(config: dict[str, Any], module: str, rank: int, name: str) -> float:
    """PEFT's scaling: lora_alpha / r (/ sqrt(r) with rsLoRA), each possibly overridden for
    this module by rank_pattern / alpha_pattern."""
    r = _by_pattern(config.get("rank_pattern"), module, config.get("r", 8))
    alpha = _by_pattern(config.get("alpha_pattern"), module, config.get("lora_alpha", 8))
    if not isinstance(r, int) or isinstance(r, bool) or r <= 0 or not isinstance(
            alpha, int | float) or isinstance(alpha, bool):
        raise LoraFileError(f"{name}: {module}: r {r!r} and lora_alpha {alpha!r} must be "
                            "numbers (r a positive integer)")
    if r != rank:
        raise LoraFileError(f"{name}: {module}: the config says rank {r}, the weights {rank}")
    return float(alpha) / (math.sqrt(r) if config.get("use_rslora") else r)


def _by_pattern(patterns: Any, module: str, default: Any) -> Any:
    """PEFT's get_pattern_key: the first pattern, in order, that matches the end of the
    module path at a dot boundary."""
    if not patterns:
        return default
    if not isinstance(patterns, dict):
        raise LoraFileError(f"rank_pattern/alpha_pattern must be objects, got {patterns!r}")
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default
