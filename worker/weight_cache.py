"""The local weight cache directory: layout, completeness markers, use times, pins, LRU cleanup.

Layout under the cache root (``$HERON_CACHE_DIR``, default ``~/.cache/heron/models``)::

    <safe model id>/<safe revision>/         one model directory (config.json, weights, ...)
    <safe model id>/<safe revision>/.complete    manifest (JSON), written before the rename
    <safe model id>/<safe revision>/.last_used   its mtime is the last time a load used it
    <safe model id>/.<safe revision>.lock    flock target: shared while pinned, exclusive to evict
    .staging/    fills in progress (renamed into place when whole)
    .trash/      evicted directories on their way out
    .cleanup.lock   one cleanup at a time per cache root

A fill (from S3 or the Hub) writes into ``.staging/``, writes ``.complete`` last and renames
the directory into place, so a model directory at its final path is always whole. An
eviction renames the directory into ``.trash/`` before deleting it, for the same reason.
Several worker processes may share one cache root: pins are shared ``flock`` locks, which an
evicting process cannot take exclusively, so no process deletes weights another is loading.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any, NamedTuple

from heron.worker.weight_stats import STATS

log = logging.getLogger("heron.worker.weights")

MARKER = ".complete"
# A model directory has one of these at its root (a sentence-transformers Router: only
# modules.json; GLiNER: gliner_config.json; a PEFT LoRA adapter: adapter_config.json).
DESCRIPTORS = ("config.json", "modules.json", "gliner_config.json", "adapter_config.json")
LAST_USED = ".last_used"
STAGING = ".staging"
TRASH = ".trash"
CLEANUP_LOCK = ".cleanup.lock"
# A directory used this recently may still be loading in a process that did not pin it.
RECENT_USE_S = 600.0
# A staging directory this old belongs to a process that died mid-fill.
STALE_STAGING_S = 24 * 3600.0
DEFAULT_MAX_DISK_PERCENT = 90.0


def cache_root() -> Path:
    env = os.environ.get("HERON_CACHE_DIR")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "heron" / "models"
    return root.absolute()  # pins and evictions compare absolute paths


def safe_name(text: str) -> str:
    """A single path segment (and S3 key segment): runs outside [A-Za-z0-9._-] become --."""
    name = re.sub(r"[^A-Za-z0-9._-]+", "--", text)
    return "--" if name in ("", ".", "..") else name


@dataclass(frozen=True)
class CacheKey:
    """One model revision: the unit the cache stores, pins and evicts."""

    model_id: str
    revision: str | None = None

    @property
    def relative(self) -> PurePosixPath:
        return PurePosixPath(safe_name(self.model_id), safe_name(self.revision or "main"))

    def __str__(self) -> str:
        return f"{self.model_id}@{self.revision or 'main'}"


def model_dir(key: CacheKey, root: Path | None = None) -> Path:
    return (root or cache_root()) / key.relative


def is_complete(path: Path) -> bool:
    """A fill's marker, or a directory an operator copied in by hand (it has one of
    DESCRIPTORS)."""
    return any((path / name).is_file() for name in (MARKER, *DESCRIPTORS))


def model_files(path: Path) -> dict[str, int]:
    """Relative posix path -> size of every file of a model directory, dot-names excluded
    (markers, huggingface-hub's .cache/)."""
    files = {}
    for item in sorted(path.rglob("*")):
        relative = item.relative_to(path)
        if item.is_file() and not any(part.startswith(".") for part in relative.parts):
            files[relative.as_posix()] = item.stat().st_size
    return files


def last_used(path: Path) -> float:
    for candidate in (path / LAST_USED, path / MARKER, path):
        with contextlib.suppress(OSError):
            return candidate.stat().st_mtime
    return 0.0


def touch_used(path: Path) -> None:
    try:
        (path / LAST_USED).touch()
    except OSError as exc:  # a read-only cache (baked into an image) is never cleaned anyway
        log.debug("cannot record use of %s: %s", path, exc)


# ---- locks and pins --------------------------------------------------------------------

def _lock_path(path: Path) -> Path:
    return path.parent / f".{path.name}.lock"


def _open_lock(path: Path) -> int | None:
    """An fd on ``path``'s lock file, or None where the cache cannot be written."""
    try:
        return os.open(_lock_path(path), os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        log.debug("no lock file for %s: %s", path, exc)
        return None


def _under(path: Path, root: Path) -> bool:
    return path.is_relative_to(root) and path != root


class _Pin(NamedTuple):
    fd: int | None
    count: int


_pins: dict[Path, _Pin] = {}
_pins_lock = threading.Lock()


def pin_weights(path: Path) -> None:
    """Keep ``path`` from being evicted until as many ``unpin_weights(path)`` calls: in this
    process (a count) and in every process sharing the cache (a shared flock). Paths outside
    the cache (``source.path``, packages) are never evicted; pinning them only counts."""
    path = Path(path).absolute()
    fd = _open_lock(path) if _under(path, cache_root()) else None
    if fd is not None:
        fcntl.flock(fd, fcntl.LOCK_SH)
    _add_pin(path, fd)


def _add_pin(path: Path, fd: int | None) -> None:
    with _pins_lock:
        held = _pins.get(path)
        if held is None:
            _pins[path] = _Pin(fd, 1)
            return
        _pins[path] = _Pin(held.fd, held.count + 1)
    if fd is not None:
        os.close(fd)  # the first pin's fd already holds the shared lock


def unpin_weights(path: Path) -> None:
    path = Path(path).absolute()
    with _pins_lock:
        held = _pins.get(path)
        if held is None:
            return
        if held.count > 1:
            _pins[path] = _Pin(held.fd, held.count - 1)
            return
        del _pins[path]
    if held.fd is not None:
        os.close(held.fd)  # closing releases the flock


def pinned_paths() -> set[Path]:
    with _pins_lock:
        return set(_pins)


def open_cached(key: CacheKey, *, pin: bool = False) -> Path | None:
    """The cached directory for ``key`` if it is whole (its use recorded, pinned if asked),
    else None. The shared lock held while looking keeps an eviction from racing the look."""
    path = model_dir(key)
    if not path.is_dir():
        return None
    fd = _open_lock(path)
    try:
        if fd is not None:
            fcntl.flock(fd, fcntl.LOCK_SH)
        if not is_complete(path):
            return None
        touch_used(path)
        if pin:
            _add_pin(path, fd)
            fd = None
        return path
    finally:
        if fd is not None:
            os.close(fd)


# ---- filling ---------------------------------------------------------------------------

@contextlib.contextmanager
def staging_dir(key: CacheKey) -> Iterator[Path]:
    """A fresh directory on the cache's filesystem for a fill; gone afterwards unless
    ``install`` moved it into place."""
    staging = cache_root() / STAGING
    staging.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix=f"{'--'.join(key.relative.parts)}.", dir=staging))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def write_manifest(path: Path, manifest: dict[str, Any]) -> None:
    (path / MARKER).write_text(json.dumps(manifest, indent=1, sort_keys=True))


def install(staging: Path, key: CacheKey, manifest: dict[str, Any]) -> Path:
    """Make a filled staging directory the cached copy of ``key``: flush its files, write
    the marker last, rename it into place. If another process installed ``key`` first,
    its copy wins and ours is dropped."""
    for item in staging.rglob("*"):
        if item.is_file():
            _fsync_file(item)
    write_manifest(staging, manifest)
    _fsync_file(staging / MARKER)
    (staging / LAST_USED).touch()  # recent: no cleanup takes it before its load pins it
    final = model_dir(key)
    final.parent.mkdir(parents=True, exist_ok=True)
    for _ in range(2):
        try:
            os.rename(staging, final)  # replaces an empty directory; fails on a full one
        except OSError:
            if is_complete(final):
                log.info("%s: another process filled %s first; using its copy", key, final)
                return final
            _move_to_trash(final)  # a leftover without config.json: not a model
            continue
        _fsync_dir(final.parent)
        return final
    raise OSError(f"could not move {staging} into place at {final}")


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):
        _fsync_file(path)


def _move_to_trash(path: Path) -> Path | None:
    trash = path.parents[1] / TRASH if _under(path, cache_root()) else path.parent
    trash.mkdir(parents=True, exist_ok=True)
    target = Path(tempfile.mkdtemp(prefix=f"{path.parent.name}--{path.name}.", dir=trash))
    try:
        os.rename(path, target / "model")
    except FileNotFoundError:
        target.rmdir()
        return None
    return target


# ---- cleanup ---------------------------------------------------------------------------

def parse_bytes(text: str) -> int:
    """``1073741824``, ``500M``, ``50G``, ``1TiB``: binary units."""
    match = re.fullmatch(r"\s*(\d+)\s*(?:([KMGT])(?:i?B)?|B)?\s*", text, re.IGNORECASE)
    if not match:
        raise ValueError(f"not a byte count: {text!r} (use e.g. 500M, 50G, 1T)")
    power = " KMGT".index(match[2].upper()) if match[2] else 0
    return int(match[1]) * 1024**power


@dataclass(frozen=True)
class CacheBudget:
    """How much the cache may hold: at most ``max_bytes`` of model directories (if set), and
    no model directory kept while the filesystem is more than ``max_disk_percent`` full."""

    max_bytes: int | None = None
    max_disk_percent: float = DEFAULT_MAX_DISK_PERCENT

    @classmethod
    def from_env(cls) -> CacheBudget:
        raw_bytes = os.environ.get("HERON_CACHE_MAX_BYTES", "").strip()
        raw_percent = os.environ.get("HERON_CACHE_MAX_DISK_PERCENT", "").strip()
        try:
            max_bytes = parse_bytes(raw_bytes) if raw_bytes else None
        except ValueError as exc:
            raise ValueError(f"HERON_CACHE_MAX_BYTES: {exc}") from None
        try:
            percent = float(raw_percent) if raw_percent else DEFAULT_MAX_DISK_PERCENT
        except ValueError:
            percent = -1.0
        if not 0 < percent <= 100:
            raise ValueError(
                f"HERON_CACHE_MAX_DISK_PERCENT: must be a number in (0, 100], got {raw_percent!r}")
        return cls(max_bytes, percent)

    def excess(self, cached_bytes: int, disk: DiskUsage, incoming_bytes: int = 0) -> int:
        """Bytes to free so that ``incoming_bytes`` more still fit the budget (<= 0: none)."""
        over = -1
        if self.max_bytes is not None:
            over = cached_bytes + incoming_bytes - self.max_bytes
        if self.max_disk_percent < 100:
            allowed = disk.total * self.max_disk_percent / 100
            over = max(over, int(disk.used + incoming_bytes - allowed))
        return over


class DiskUsage(NamedTuple):
    total: int
    used: int


@dataclass(frozen=True)
class CachedModel:
    path: Path
    size: int
    last_used: float


def cached_models(root: Path | None = None) -> list[CachedModel]:
    """Every whole model directory in the cache, least recently used first."""
    root = root or cache_root()
    found = []
    for model in _children(root):
        for revision in _children(model):
            if is_complete(revision):
                size = sum(f.stat().st_size for f in revision.rglob("*") if f.is_file())
                found.append(CachedModel(revision.absolute(), size, last_used(revision)))
    return sorted(found, key=lambda m: m.last_used)


def _children(path: Path) -> list[Path]:
    try:
        return [p for p in path.iterdir() if p.is_dir() and not p.name.startswith(".")]
    except OSError:
        return []


def enforce_cache_budget(*, keep: Iterable[Path] = (), incoming_bytes: int = 0,
                         budget: CacheBudget | None = None) -> list[CachedModel]:
    """Evict least recently used model directories until the cache fits its budget with
    ``incoming_bytes`` to spare. Never evicts ``keep``, a pinned directory (in any process
    sharing the cache) or one used in the last RECENT_USE_S seconds. Returns the evicted."""
    root = cache_root()
    if not root.is_dir():
        return []
    budget = budget or CacheBudget.from_env()
    keep = {Path(p).absolute() for p in keep}
    lock_fd = os.open(root / CLEANUP_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX)  # two cleanups at once would both free the excess
        _sweep_leftovers(root)
        models = cached_models(root)
        usage = shutil.disk_usage(root)
        excess = budget.excess(sum(m.size for m in models), DiskUsage(usage.total, usage.used),
                               incoming_bytes)
        if excess <= 0:
            return []
        evicted = []
        pinned = pinned_paths()
        for model in models:
            if excess <= 0:
                break
            if model.path in keep or model.path in pinned or not _evict(model):
                continue
            evicted.append(model)
            excess -= model.size
        if excess > 0:
            log.warning("weight cache %s is still %d bytes over budget (%s); what is left is "
                        "pinned or used in the last %.0fs", root, excess, budget, RECENT_USE_S)
        return evicted
    finally:
        os.close(lock_fd)


def _evict(model: CachedModel) -> bool:
    fd = _open_lock(model.path)
    if fd is None:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False  # pinned by some process
        # Looked at again under the lock: a load may have touched it since the listing.
        age = time.time() - last_used(model.path)
        if age < RECENT_USE_S:
            return False
        trash = _move_to_trash(model.path)
    finally:
        os.close(fd)
    if trash is None:
        return False
    shutil.rmtree(trash, ignore_errors=True)
    STATS.record_eviction(model.size)
    log.info("weight cache: evicted %s (%d bytes, last used %.0fs ago)",
             model.path, model.size, age)
    return True


def _sweep_leftovers(root: Path) -> None:
    """Trash left by an interrupted eviction; staging left by a process that died."""
    for trash in _all_children(root / TRASH):
        shutil.rmtree(trash, ignore_errors=True)
    now = time.time()
    for staging in _all_children(root / STAGING):
        with contextlib.suppress(OSError):
            if now - staging.stat().st_mtime > STALE_STAGING_S:
                shutil.rmtree(staging, ignore_errors=True)


def _all_children(path: Path) -> list[Path]:
    try:
        return list(path.iterdir())
    except OSError:
        return []
