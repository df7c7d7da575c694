"""Counters for the weight tiers, as plain numbers: whoever exports metrics reads a snapshot
(``weight_cache_stats()``) and publishes it; this module depends on no metrics library."""

from __future__ import annotations

import copy
import threading
from dataclasses import dataclass, field

# Tier names, as they appear in the counters, logs and errors.
PATH = "path"
PACKAGE = "package"
LOCAL = "local"
S3 = "s3"
HUB = "hub"


@dataclass
class CacheStats:
    """Plain ints and dicts (tier -> count; absent means 0), so dataclasses.asdict and JSON
    take it as is."""

    hits: dict[str, int] = field(default_factory=dict)      # tier -> resolutions it served
    misses: dict[str, int] = field(default_factory=dict)    # tier -> looked, not there
    errors: dict[str, int] = field(default_factory=dict)    # tier -> failed to answer
    transient_failures: int = 0   # resolutions that ended in WeightsTemporarilyUnavailable
    evictions: int = 0
    evicted_bytes: int = 0
    downloaded_bytes: dict[str, int] = field(default_factory=dict)  # tier -> bytes fetched
    s3_uploads: int = 0
    s3_upload_failures: int = 0
    s3_uploaded_bytes: int = 0


class _Stats:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._stats = CacheStats()

    def snapshot(self) -> CacheStats:
        with self._lock:
            return copy.deepcopy(self._stats)

    def reset(self) -> None:
        with self._lock:
            self._stats = CacheStats()

    def hit(self, tier: str, downloaded_bytes: int = 0) -> None:
        with self._lock:
            _add(self._stats.hits, tier, 1)
            if downloaded_bytes:
                _add(self._stats.downloaded_bytes, tier, downloaded_bytes)

    def miss(self, tier: str) -> None:
        with self._lock:
            _add(self._stats.misses, tier, 1)

    def error(self, tier: str) -> None:
        with self._lock:
            _add(self._stats.errors, tier, 1)

    def transient_failure(self) -> None:
        with self._lock:
            self._stats.transient_failures += 1

    def record_eviction(self, size: int) -> None:
        with self._lock:
            self._stats.evictions += 1
            self._stats.evicted_bytes += size

    def record_upload(self, size: int | None) -> None:
        """``size`` None: the upload failed."""
        with self._lock:
            if size is None:
                self._stats.s3_upload_failures += 1
            else:
                self._stats.s3_uploads += 1
                self._stats.s3_uploaded_bytes += size


def _add(counts: dict[str, int], tier: str, n: int) -> None:
    counts[tier] = counts.get(tier, 0) + n


STATS = _Stats()


def weight_cache_stats() -> CacheStats:
    """A copy of the counters since the process started."""
    return STATS.snapshot()
