"""Where the config service keeps its files: a directory (default) or an S3 prefix.

Both backends offer the same four blocking calls on small objects named by relative keys
(``journal.json``, ``changes/000000000001.json``); a write replaces the whole object
atomically (directory: temp file + fsync + os.replace; S3: one PutObject), so a reader sees
the old content or the new, never a mix. The layout on top of them is config_service/store.py.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import urlparse


class StoreError(RuntimeError):
    """The store cannot be read or written (missing bucket, permissions, corrupt file)."""


class Blobs(Protocol):
    def read(self, key: str) -> bytes | None: ...

    def write(self, key: str, data: bytes) -> None: ...

    def delete(self, key: str) -> None: ...

    def list(self, prefix: str) -> list[str]: ...

    def describe(self) -> str: ...


class DirBlobs:
    def __init__(self, root: Path) -> None:
        self.root = root

    def describe(self) -> str:
        return str(self.root)

    def _path(self, key: str) -> Path:
        return self.root / key

    def read(self, key: str) -> bytes | None:
        try:
            return self._path(key).read_bytes()
        except FileNotFoundError:
            return None

    def write(self, key: str, data: bytes) -> None:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp)
            raise
        _fsync_dir(path.parent)

    def delete(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            self._path(key).unlink()

    def list(self, prefix: str) -> list[str]:
        folder = self._path(prefix)
        if not folder.is_dir():
            return []
        return sorted(f"{prefix.rstrip('/')}/{p.name}" for p in folder.iterdir()
                      if p.is_file() and not p.name.startswith("."))


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def s3_endpoint() -> str | None:
    return os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("HERON_S3_ENDPOINT") or None


class S3Blobs:
    """``s3://bucket/prefix``: keys live under ``prefix/``. The bucket must exist."""

    def __init__(self, bucket: str, prefix: str, *, endpoint_url: str | None = None,
                 client: Any = None) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        if client is None:
            import boto3  # only S3 stores need boto3
            from botocore.config import Config

            # Bounded: the store's objects are small JSON documents, and a call that hangs
            # on botocore's defaults (60 s a read, five tries) holds the thread it runs in,
            # which a stopping service then waits for; a failed read is retried by the
            # service's own loop.
            client = boto3.client("s3", endpoint_url=endpoint_url or s3_endpoint(),
                                  config=Config(connect_timeout=5, read_timeout=10,
                                                retries={"mode": "standard",
                                                         "max_attempts": 2}))
        self.client = client

    def describe(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def _key(self, key: str) -> str:
        return f"{self.prefix}/{key}" if self.prefix else key

    def read(self, key: str) -> bytes | None:
        try:
            answer = self.client.get_object(Bucket=self.bucket, Key=self._key(key))
        except self.client.exceptions.NoSuchKey:
            return None
        except Exception as exc:
            raise StoreError(f"cannot read {self.describe()}/{key}: {exc}") from exc
        return answer["Body"].read()

    def write(self, key: str, data: bytes) -> None:
        try:
            self.client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data,
                                   ContentType="application/json")
        except Exception as exc:
            raise StoreError(f"cannot write {self.describe()}/{key}: {exc}") from exc

    def delete(self, key: str) -> None:
        try:
            self.client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except Exception as exc:
            raise StoreError(f"cannot delete {self.describe()}/{key}: {exc}") from exc

    def list(self, prefix: str) -> list[str]:
        full = self._key(prefix.rstrip("/") + "/")
        strip = len(self.prefix) + 1 if self.prefix else 0
        keys: list[str] = []
        try:
            pages = self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=full)
            for page in pages:
                keys.extend(obj["Key"][strip:] for obj in page.get("Contents", []))
        except Exception as exc:
            raise StoreError(f"cannot list {self.describe()}/{prefix}: {exc}") from exc
        return sorted(keys)


def open_blobs(url: str | Path) -> Blobs:
    """A directory path (or ``file://`` URL) or ``s3://bucket/prefix``."""
    text = str(url)
    if text.startswith("s3://"):
        parsed = urlparse(text)
        if not parsed.netloc:
            raise StoreError(f"{text}: an S3 store needs a bucket: s3://bucket/prefix")
        return S3Blobs(parsed.netloc, parsed.path)
    if text.startswith("file://"):
        text = urlparse(text).path
    if "://" in text:
        raise StoreError(f"{text}: a store is a directory or s3://bucket/prefix")
    return DirBlobs(Path(text).expanduser())
