"""The S3 cluster cache: one copy of each Hub model per cluster, read by every worker.

Layout under ``HERON_WEIGHTS_S3=s3://bucket/prefix``::

    <prefix>/<safe model id>/<safe revision>/<file>        config.json, 1_Pooling/config.json, ...
    <prefix>/<safe model id>/<safe revision>/.complete     JSON manifest: {"files": {name: size}}

The names are the local cache's (worker/weight_cache.py). ``.complete`` is written after
every file it lists and deleted before any of them is replaced, so a reader that finds it
finds every file, whole; a copy without it (an upload cut short) is not there.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Any
from urllib.parse import urlparse

from heron.worker.weight_cache import DESCRIPTORS, MARKER, CacheKey

WEIGHTS_S3_ENV = "HERON_WEIGHTS_S3"

# Error codes S3 (and S3-compatible stores) answer when asked to come back later.
_RETRY_LATER_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestLimitExceeded", "TooManyRequests",
    "TooManyRequestsException", "RequestThrottled", "ServiceUnavailable", "InternalError",
    "RequestTimeout", "429", "500", "502", "503", "504",
})


class S3TierError(RuntimeError):
    """The cluster cache could not answer. ``transient``: it said to try again later."""

    def __init__(self, message: str, *, transient: bool) -> None:
        super().__init__(message)
        self.transient = transient


def s3_endpoint() -> str | None:
    """The same endpoint variables as the config service's S3 store."""
    return os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("HERON_S3_ENDPOINT") or None


@dataclass
class S3WeightCache:
    bucket: str
    prefix: str
    client: Any

    @classmethod
    def from_url(cls, url: str, client: Any = None) -> S3WeightCache:
        parsed = urlparse(url)
        if parsed.scheme != "s3" or not parsed.netloc:
            raise ValueError(f"{WEIGHTS_S3_ENV} must look like s3://bucket/prefix, got {url!r}")
        if client is None:
            import boto3
            from botocore.config import Config

            # Short connect timeout: an unreachable cluster cache should cost seconds, not
            # minutes, before the Hub is tried. Retry count: boto3's (AWS_MAX_ATTEMPTS).
            client = boto3.client("s3", endpoint_url=s3_endpoint(), config=Config(
                connect_timeout=5, read_timeout=60, retries={"mode": "standard"}))
        return cls(parsed.netloc, parsed.path.strip("/"), client)

    @classmethod
    def from_env(cls) -> S3WeightCache | None:
        url = os.environ.get(WEIGHTS_S3_ENV, "").strip()
        return cls.from_url(url) if url else None

    def location(self, key: CacheKey) -> str:
        return f"s3://{self.bucket}/{self._key(key, '')}"

    def _key(self, key: CacheKey, name: str) -> str:
        parts = [self.prefix, *key.relative.parts, name]
        return "/".join(p for p in parts if p) + ("/" if not name else "")

    def read_manifest(self, key: CacheKey) -> dict[str, Any] | None:
        try:
            answer = self.client.get_object(Bucket=self.bucket, Key=self._key(key, MARKER))
            body = answer["Body"].read()
        except Exception as exc:
            if _error_code(exc) in ("NoSuchKey", "404"):
                return None
            raise _tier_error(exc, f"reading {self.location(key)}{MARKER}") from exc
        try:
            manifest = json.loads(body)
            manifest["files"] = manifest_files(manifest)
        except (ValueError, TypeError, KeyError) as exc:
            raise S3TierError(f"{self.location(key)}{MARKER} is not a valid manifest: {exc}",
                              transient=False) from exc
        return manifest

    def fetch(self, key: CacheKey, manifest: dict[str, Any], dest: Path) -> int:
        """Download the files ``manifest`` lists into ``dest``; returns the bytes fetched.
        OSError (a full disk) passes through as is."""
        total = 0
        for name, size in manifest["files"].items():
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            try:
                self.client.download_file(self.bucket, self._key(key, name), str(target))
            except Exception as exc:
                if _is_local_os_error(exc):
                    raise  # this machine's disk, not S3
                raise _tier_error(exc, f"downloading {self.location(key)}{name}") from exc
            if target.stat().st_size != size:
                raise S3TierError(
                    f"{self.location(key)}{name} has {target.stat().st_size} bytes, its "
                    f"manifest says {size} (a copy being replaced?)", transient=True)
            total += size
        return total

    def upload(self, key: CacheKey, src: Path, manifest: dict[str, Any]) -> int:
        """Upload a whole model directory, manifest last; returns the bytes uploaded."""
        try:
            # A copy being replaced stops being whole now, not when its first file changes.
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key, MARKER))
            total = 0
            for name, size in manifest["files"].items():
                self.client.upload_file(str(src / name), self.bucket, self._key(key, name))
                total += size
            self.client.put_object(Bucket=self.bucket, Key=self._key(key, MARKER),
                                   Body=json.dumps(manifest, sort_keys=True).encode(),
                                   ContentType="application/json")
        except Exception as exc:
            raise _tier_error(exc, f"uploading to {self.location(key)}") from exc
        return total


def manifest_files(manifest: dict[str, Any]) -> dict[str, int]:
    """The manifest's files, checked: relative paths inside the model directory, sizes."""
    files = manifest["files"]
    # adapter_config.json: the cluster cache holds LoRA adapters too (worker/lora_files.py)
    if not isinstance(files, dict) or not set(DESCRIPTORS) & set(files):
        raise ValueError(f"files must map names to sizes and include one of "
                         f"{', '.join(DESCRIPTORS)}")
    for name, size in files.items():
        parts = PurePosixPath(name).parts
        if not parts or name.startswith("/") or ".." in parts or not isinstance(size, int):
            raise ValueError(f"bad entry {name!r}: {size!r}")
    return files


def _is_local_os_error(exc: BaseException) -> bool:
    """An OSError of the local filesystem; some of botocore's network errors are OSErrors."""
    from botocore.exceptions import BotoCoreError

    return isinstance(exc, OSError) and not isinstance(exc, BotoCoreError)


def _error_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return str(response.get("Error", {}).get("Code") or "") or None
    return None


def _http_status(exc: BaseException) -> int:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        return int(response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    return 0


def _chain(exc: BaseException) -> list[BaseException]:
    """``exc`` and what it wraps: causes, and boto3's RetriesExceededError.last_exception."""
    found: list[BaseException] = []
    current: BaseException | None = exc
    while current is not None and current not in found:
        found.append(current)
        current = (getattr(current, "last_exception", None) or current.__cause__
                   or current.__context__)
    return found


def _tier_error(exc: BaseException, doing: str) -> S3TierError:
    """botocore's many failures in three kinds: asked to retry later or cut off (transient),
    not answering or refusing (permanent)."""
    from boto3.exceptions import RetriesExceededError
    from botocore.exceptions import (
        ConnectionClosedError,
        NoCredentialsError,
        ReadTimeoutError,
    )
    from botocore.exceptions import ConnectionError as S3ConnectionError

    chain = _chain(exc)
    for e in chain:
        code, status = _error_code(e), _http_status(e)
        if code in _RETRY_LATER_CODES or status == 429 or status >= 500:
            return S3TierError(f"throttled or unavailable while {doing} ({code}): {e}",
                               transient=True)
    if any(isinstance(e, (ReadTimeoutError, ConnectionClosedError, RetriesExceededError))
           for e in chain):
        return S3TierError(f"connection dropped while {doing}: {exc}", transient=True)
    if any(isinstance(e, S3ConnectionError) for e in chain):  # refused, no route, timeout
        return S3TierError(f"unreachable while {doing}: {exc}", transient=False)
    if any(isinstance(e, NoCredentialsError) for e in chain):
        return S3TierError(f"no AWS credentials for {doing}", transient=False)
    return S3TierError(f"failed while {doing}: {type(exc).__name__}: {exc}", transient=False)
