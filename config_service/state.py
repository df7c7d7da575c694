"""The config service's model registry in memory: bundles (from the bundles dir, epoch 0)
plus every accepted change on top, and the append-only rules a POST is checked against.

``Registry.plan`` validates a posted model and returns the Change it would make (or None
for identical content) without touching anything; ``Registry.apply`` folds a committed
Change in. The store (config_service/store.py) persists Changes; nothing here does I/O
beyond reading the bundles dir.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from heron.runtime.adapters import AUTO
from heron.runtime.modelconfig import (
    ConfigError,
    ModelConfig,
    bundle_config_hash,
    load_bundle,
    parse_model_config,
)
from heron.runtime.protocol import ConfigDelta
from heron_sdk.errors import ErrorCode, HeronError, invalid_field


class ContentConflict(HeronError):
    """409: the post changes content that exists. ``fields`` names every difference."""

    def __init__(self, message: str, fields: list[str]) -> None:
        super().__init__(ErrorCode.CONTENT_CONFLICT, message,
                         field=fields[0] if fields else None)
        self.fields = fields

    def to_body(self) -> dict[str, Any]:
        body = super().to_body()
        body["error"]["fields"] = self.fields
        return body


@dataclass(frozen=True, slots=True)
class Change:
    """One accepted POST: the model as it is after the change, and who routes it."""

    epoch: int
    model: ModelConfig
    bundles: tuple[str, ...]  # every bundle that routes the model after the change
    bundles_hash: dict[str, str]  # those bundles' config hash after the change
    new_model: bool  # True: a new model; False: new profiles/bundles for an existing one
    idempotency_key: str | None = None
    body_sha256: str | None = None
    at: float = field(default_factory=time.time)

    @property
    def id(self) -> str:
        return self.model.id

    def answer(self) -> dict[str, Any]:
        """The 201 answer: ``created`` says a new epoch was made (200 no-ops say false)."""
        return {"id": self.id, "epoch": self.epoch, "bundles": list(self.bundles),
                "created": True}

    def delta(self) -> ConfigDelta:
        """The message that announces this change (heron.runtime.protocol)."""
        return ConfigDelta(self.epoch, self.model.to_dict(), self.bundles,
                           dict(self.bundles_hash))

    def to_json(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "id": self.id, "model": self.model.to_dict(),
                "bundles": list(self.bundles), "bundles_hash": self.bundles_hash,
                "new_model": self.new_model, "idempotency_key": self.idempotency_key,
                "body_sha256": self.body_sha256, "at": self.at}

    @classmethod
    def from_json(cls, data: dict[str, Any], src: str) -> Change:
        return cls(epoch=int(data["epoch"]), model=parse_model_config(data["model"], src),
                   bundles=tuple(data["bundles"]), bundles_hash=dict(data["bundles_hash"]),
                   new_model=bool(data.get("new_model", True)),
                   idempotency_key=data.get("idempotency_key"),
                   body_sha256=data.get("body_sha256"), at=float(data.get("at", 0.0)))


@dataclass(slots=True)
class BundleInfo:
    name: str
    adapters: tuple[str, ...]
    description: str
    models: list[str]  # ids, base order, then in the order they were added


class Registry:
    def __init__(self, bundles: list[BundleInfo], models: dict[str, ModelConfig]) -> None:
        self.bundles = {b.name: b for b in bundles}
        self.models = dict(models)
        self.updated: dict[str, int] = dict.fromkeys(models, 0)  # id -> epoch last changed
        self.epoch = 0

    @classmethod
    def from_bundles_dir(cls, bundles_dir: Path) -> Registry:
        """Every ``*.yaml`` in the dir is a bundle (sdk load_bundle): epoch 0's content."""
        infos: list[BundleInfo] = []
        models: dict[str, ModelConfig] = {}
        for path in sorted(bundles_dir.glob("*.yaml")):
            bundle = load_bundle(path, bundles_dir)
            if any(info.name == bundle.name for info in infos):
                raise ConfigError(str(path), "name", f"bundle {bundle.name!r} appears twice")
            for model in bundle.models:
                seen = models.setdefault(model.id, model)
                if seen != model:
                    raise ConfigError(str(path), "models", f"model {model.id} differs from "
                                      "the model of that id in another bundle")
            infos.append(BundleInfo(bundle.name, bundle.adapters, bundle.description,
                                    [m.id for m in bundle.models]))
        return cls(infos, models)

    # ---- reads ----------------------------------------------------------------------
    def resolve(self, name: str) -> ModelConfig | None:
        if name in self.models:
            return self.models[name]
        return next((m for m in self.models.values() if name in m.aliases), None)

    def model_bundles(self, model_id: str) -> list[str]:
        return sorted(b.name for b in self.bundles.values() if model_id in b.models)

    def bundle_hash(self, name: str) -> str:
        return bundle_config_hash([self.models[i] for i in self.bundles[name].models])

    def bundles_hash(self) -> dict[str, str]:
        return {name: self.bundle_hash(name) for name in sorted(self.bundles)}

    def bundle_view(self, name: str) -> dict[str, Any]:
        info = self.bundles[name]
        return {"name": name, "adapters": list(info.adapters), "models": list(info.models),
                "hash": self.bundle_hash(name), "description": info.description}

    def model_summary(self, model: ModelConfig) -> dict[str, Any]:
        return {"id": model.id, "adapter": model.adapter, "aliases": list(model.aliases),
                "profiles": sorted(model.profiles), "bundles": self.model_bundles(model.id),
                "epoch": self.updated.get(model.id, 0)}

    def export(self) -> dict[str, Any]:
        return {"epoch": self.epoch,
                "models": {i: m.to_dict() for i, m in sorted(self.models.items())},
                "bundles": {name: {"adapters": list(b.adapters), "models": list(b.models),
                                   "hash": self.bundle_hash(name)}
                            for name, b in sorted(self.bundles.items())}}

    # ---- the append-only rules --------------------------------------------------------
    def plan(self, model: ModelConfig, requested: list[str] | None, *,
             idempotency_key: str | None = None, body_sha256: str | None = None
             ) -> Change | None:
        """The Change this post makes (epoch + 1), or None: identical content, a no-op.
        Raises 422 (bundles) or 409 (conflicting content or names); changes nothing.

        A model whose adapter is "auto" may go to any bundle: its family is known only
        once a worker reads the checkpoint, and a worker whose bundle does not serve that
        family refuses the model when it loads it."""
        for name in requested or ():
            info = self.bundles.get(name)
            if info is None:
                raise invalid_field("bundles", f"unknown bundle {name!r}; known: "
                                    f"{sorted(self.bundles)}")
            if not serves(info, model):
                raise invalid_field("bundles", f"bundle {name!r} does not serve adapter "
                                    f"{model.adapter!r} (it serves {list(info.adapters)})")
        existing = self.models.get(model.id)
        if existing is None:
            self._check_names(model)
            bundles = set(requested or [b.name for b in self.bundles.values()
                                        if serves(b, model)])
            if not bundles:
                raise invalid_field("adapter", f"no bundle serves adapter {model.adapter!r};"
                                    f" known bundles: {sorted(self.bundles)}")
            merged, new_model = model, True
        else:
            diffs = diff_models(existing, model)
            if diffs:
                raise ContentConflict(
                    f"model {model.id} exists with other content; a config is append-only "
                    f"(add new profiles, or post under a new id). Differs: "
                    f"{', '.join(diffs)}", diffs)
            profiles = {**model.profiles, **existing.profiles}
            loras = {**model.loras, **existing.loras}  # adapters, like profiles, only grow
            merged = replace(existing, profiles=dict(sorted(profiles.items())),
                             loras=dict(sorted(loras.items())))
            current = set(self.model_bundles(model.id))
            bundles = current | set(requested or ())
            if merged == existing and bundles == current:
                return None
            new_model = False
        hashes = {}
        for name in sorted(bundles):
            ids = self.bundles[name].models
            models = [merged if i == model.id else self.models[i] for i in ids]
            if model.id not in ids:
                models.append(merged)
            hashes[name] = bundle_config_hash(models)
        return Change(epoch=self.epoch + 1, model=merged, bundles=tuple(sorted(bundles)),
                      bundles_hash=hashes, new_model=new_model, idempotency_key=idempotency_key,
                      body_sha256=body_sha256)

    def _check_names(self, model: ModelConfig) -> None:
        taken = {n: m.id for m in self.models.values() for n in (m.id, *m.aliases)}
        clashes = [n for n in (model.id, *model.aliases) if n in taken]
        if clashes:
            fields = ["id" if n == model.id else "aliases" for n in clashes]
            raise ContentConflict(
                "names already in use: " + ", ".join(f"{n!r} (by model {taken[n]})"
                                                     for n in clashes), fields)

    def apply(self, change: Change) -> None:
        if change.epoch != self.epoch + 1:
            raise ValueError(f"change of epoch {change.epoch} applied at epoch {self.epoch}")
        model_id = change.id
        self.models[model_id] = change.model
        for name in change.bundles:
            info = self.bundles.get(name)
            if info is None:  # a bundle the bundles dir no longer has: keep the model
                continue
            if model_id not in info.models:
                info.models.append(model_id)
        self.updated[model_id] = change.epoch
        self.epoch = change.epoch


def serves(bundle: BundleInfo, model: ModelConfig) -> bool:
    """Whether ``bundle`` may route ``model``: it serves the model's adapter, or the
    adapter is "auto" (decided by the worker, from the checkpoint)."""
    return model.adapter == AUTO or model.adapter in bundle.adapters


def diff_models(have: ModelConfig, got: ModelConfig) -> list[str]:
    """The fields of ``got`` that differ from ``have`` (profiles only ``got`` has are new,
    not differences)."""
    diffs: list[str] = []
    if have.adapter != got.adapter:
        diffs.append("adapter")
    a, b = asdict(have.source), asdict(got.source)
    diffs += [f"source.{k}" for k in sorted(a) if a[k] != b[k]]
    if have.aliases != got.aliases:
        diffs.append("aliases")
    if have.description != got.description:
        diffs.append("description")
    if have.trust_remote_code != got.trust_remote_code:
        diffs.append("trust_remote_code")
    for name in sorted(set(have.profiles) & set(got.profiles)):
        p, q = asdict(have.profiles[name]), asdict(got.profiles[name])
        diffs += [f"profiles.{name}.{k}" for k in sorted(p) if p[k] != q[k]]
    diffs += [f"loras.{name}" for name in sorted(set(have.loras) & set(got.loras))
              if have.loras[name] != got.loras[name]]
    if have.max_loras != got.max_loras:
        diffs.append("max_loras")
    return diffs
