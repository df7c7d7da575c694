"""The local weight cache: LRU cleanup under a byte budget, pins (in this process and in
another process sharing the cache), whole-or-nothing installs, the markers, the settings."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from heron.runtime.modelconfig import parse_model_config
from heron.worker import weight_cache
from heron.worker.weight_cache import (
    MARKER,
    CacheBudget,
    CacheKey,
    DiskUsage,
    cached_models,
    enforce_cache_budget,
    install,
    model_dir,
    open_cached,
    parse_bytes,
    pin_weights,
    pinned_paths,
    staging_dir,
    unpin_weights,
)
from heron.worker.weight_stats import weight_cache_stats
from heron.worker.weights import WeightsUnavailable, resolve_weights
from tests.support.servers import REPO

HOUR = 3600.0


@pytest.fixture()
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    root = tmp_path / "cache"
    monkeypatch.setenv("HERON_CACHE_DIR", str(root))
    monkeypatch.setenv("HERON_CACHE_MAX_DISK_PERCENT", "100")  # only the byte budget counts
    monkeypatch.delenv("HERON_CACHE_MAX_BYTES", raising=False)
    monkeypatch.delenv("HERON_WEIGHTS_S3", raising=False)
    return root


def fake_model(name: str, size: int, used_hours_ago: float) -> Path:
    """A whole cached model of ``size`` bytes (config.json included), last used back then."""
    path = model_dir(CacheKey(f"org/{name}"))
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    (path / MARKER).write_text("{}")
    (path / "model.safetensors").write_bytes(b"\0" * (size - 4))  # markers count too
    used = time.time() - used_hours_ago * HOUR
    (path / ".last_used").write_text("")
    os.utime(path / ".last_used", (used, used))
    os.utime(path / MARKER, (used, used))
    return path


def names(paths: list) -> list[str]:
    return sorted(p.path.parent.name.removeprefix("org--") for p in paths)


def test_least_recently_used_go_first_and_pinned_stay(cache: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    old = fake_model("old", 1000, used_hours_ago=5)
    older_pinned = fake_model("older-pinned", 1000, used_hours_ago=9)
    fake_model("middle", 1000, used_hours_ago=3)
    fake_model("newer", 1000, used_hours_ago=1)
    recent = fake_model("recent", 1000, used_hours_ago=0)  # may be loading somewhere: kept
    assert names(cached_models()) == ["middle", "newer", "old", "older-pinned", "recent"]

    before = weight_cache_stats()
    monkeypatch.setenv("HERON_CACHE_MAX_BYTES", "3000")
    pin_weights(older_pinned)
    try:
        evicted = enforce_cache_budget()
    finally:
        unpin_weights(older_pinned)
    # 5000 bytes cached, 3000 allowed: the two least recently used unpinned ones go.
    assert names(evicted) == ["middle", "old"]
    assert not old.exists() and older_pinned.exists() and recent.exists()
    assert names(cached_models()) == ["newer", "older-pinned", "recent"]
    after = weight_cache_stats()
    assert after.evictions - before.evictions == 2
    assert after.evicted_bytes - before.evicted_bytes == 2000
    assert not any((cache / weight_cache.TRASH).iterdir())

    # Within budget, nothing more goes. With less room, the unpinned old one is first.
    assert enforce_cache_budget() == []
    monkeypatch.setenv("HERON_CACHE_MAX_BYTES", "2000")
    assert names(enforce_cache_budget()) == ["older-pinned"]


def test_room_is_made_for_an_incoming_model_but_never_by_evicting_keep(cache: Path) -> None:
    a = fake_model("a", 1000, used_hours_ago=4)
    b = fake_model("b", 1000, used_hours_ago=2)
    budget = CacheBudget(max_bytes=2000)
    assert enforce_cache_budget(budget=budget) == []
    assert names(enforce_cache_budget(budget=budget, incoming_bytes=500, keep=[a])) == ["b"]
    assert a.exists() and not b.exists()


def test_a_pin_held_by_another_process_stops_eviction(cache: Path) -> None:
    model = fake_model("shared", 1000, used_hours_ago=5)
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time; from pathlib import Path; from heron.worker.weight_cache import "
         "pin_weights; pin_weights(Path(sys.argv[1])); print('pinned', flush=True); "
         "time.sleep(60)", str(model)],
        cwd=REPO, stdout=subprocess.PIPE, text=True, env={**os.environ})
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "pinned"
        assert enforce_cache_budget(budget=CacheBudget(max_bytes=0)) == []
        assert model.exists()
    finally:
        holder.kill()
        holder.wait()
    # The lock dies with its process; now it can go.
    assert names(enforce_cache_budget(budget=CacheBudget(max_bytes=0))) == ["shared"]


def test_pins_count_and_are_released(cache: Path) -> None:
    model = fake_model("counted", 1000, used_hours_ago=5)
    pin_weights(model)
    pin_weights(model)
    unpin_weights(model)
    assert model in pinned_paths()
    assert enforce_cache_budget(budget=CacheBudget(max_bytes=0)) == []
    unpin_weights(model)
    assert model not in pinned_paths()
    assert names(enforce_cache_budget(budget=CacheBudget(max_bytes=0))) == ["counted"]


def test_install_is_whole_or_nothing_and_the_first_copy_wins(cache: Path) -> None:
    key = CacheKey("org/m", "v1")
    with staging_dir(key) as staging:
        (staging / "config.json").write_text('{"first": true}')
        # Mid-fill: nothing at the final path, nothing listed, nothing to open.
        assert open_cached(key) is None and cached_models() == []
        final = install(staging, key, {"files": {"config.json": 15}})
    assert final == model_dir(key) and (final / MARKER).is_file()
    assert open_cached(key) == final.absolute()

    with staging_dir(key) as staging:
        (staging / "config.json").write_text('{"second": true}')
        assert install(staging, key, {"files": {"config.json": 16}}) == final
        leftover = staging
    assert (final / "config.json").read_text() == '{"first": true}'
    assert not leftover.exists()


def test_leftovers_of_dead_processes_are_swept(cache: Path) -> None:
    fake_model("kept", 10, used_hours_ago=1)
    stale = cache / weight_cache.STAGING / "org--m--main.dead"
    fresh = cache / weight_cache.STAGING / "org--m--main.alive"
    trash = cache / weight_cache.TRASH / "org--x--main.cut-short" / "model"
    for path in (stale, fresh, trash):
        path.mkdir(parents=True)
        (path / "config.json").write_text("{}")
    long_ago = time.time() - weight_cache.STALE_STAGING_S - 60
    os.utime(stale, (long_ago, long_ago))
    assert enforce_cache_budget(budget=CacheBudget(max_bytes=10**9)) == []
    assert not stale.exists() and fresh.exists() and not trash.exists()
    assert names(cached_models()) == ["kept"]


def test_resolving_from_the_cache_records_use_and_can_pin(cache: Path) -> None:
    model = fake_model("used", 1000, used_hours_ago=5)
    config = parse_model_config({"id": "org/used", "adapter": "dense",
                                 "source": {"hub": "org/used"}})
    before = weight_cache_stats()
    path = resolve_weights(config, pin=True)
    try:
        assert path == model.absolute()
        assert time.time() - weight_cache.last_used(model) < 60
        assert path in pinned_paths()
    finally:
        unpin_weights(path)
    assert weight_cache_stats().hits.get("local", 0) - before.hits.get("local", 0) == 1


def test_disk_percent_budget() -> None:
    disk = DiskUsage(total=1000, used=950)
    assert CacheBudget(max_disk_percent=90).excess(400, disk) == 50
    assert CacheBudget(max_disk_percent=90).excess(400, disk, incoming_bytes=100) == 150
    assert CacheBudget(max_disk_percent=100).excess(400, disk) < 0
    assert CacheBudget(max_bytes=300, max_disk_percent=100).excess(400, disk) == 100
    # Both limits: the larger shortfall wins.
    assert CacheBudget(max_bytes=390, max_disk_percent=90).excess(400, disk) == 50


def test_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    assert [parse_bytes(s) for s in ("1000", "2K", "500M", "50G", "1TiB", "3gb")] == [
        1000, 2048, 500 << 20, 50 << 30, 1 << 40, 3 << 30]
    with pytest.raises(ValueError, match="not a byte count"):
        parse_bytes("lots")
    monkeypatch.setenv("HERON_CACHE_MAX_BYTES", "50G")
    monkeypatch.setenv("HERON_CACHE_MAX_DISK_PERCENT", "80")
    assert CacheBudget.from_env() == CacheBudget(50 << 30, 80.0)
    monkeypatch.delenv("HERON_CACHE_MAX_BYTES")
    monkeypatch.delenv("HERON_CACHE_MAX_DISK_PERCENT")
    assert CacheBudget.from_env() == CacheBudget(None, 90.0)
    monkeypatch.setenv("HERON_CACHE_MAX_DISK_PERCENT", "120")
    with pytest.raises(ValueError, match="HERON_CACHE_MAX_DISK_PERCENT"):
        CacheBudget.from_env()


def test_bad_cache_settings_fail_the_load_clearly(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERON_CACHE_DIR", str(tmp_path / "fresh-root"))  # first use: checked
    monkeypatch.setenv("HERON_CACHE_MAX_BYTES", "a lot")
    config = parse_model_config({"id": "org/m", "adapter": "dense",
                                 "source": {"hub": "org/m"}})
    with pytest.raises(WeightsUnavailable, match="HERON_CACHE_MAX_BYTES"):
        resolve_weights(config)


def test_bad_s3_setting_fails_a_hub_load_clearly(cache: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERON_WEIGHTS_S3", "bucket/prefix")
    config = parse_model_config({"id": "org/m", "adapter": "dense",
                                 "source": {"hub": "org/m"}})
    with pytest.raises(WeightsUnavailable, match=r"HERON_WEIGHTS_S3 must look like s3://"):
        resolve_weights(config)
