"""Bulk jobs' files: where a job may read and write, its input rows, its shards' part files.
(The input is read shard by shard, never whole: heron/runtime/job_input.py.)

Where: a job names its input and output by URI, and a server that opens whatever URI a
client sends can be pointed at any file it can read (``file:///etc/passwd``) or any bucket
its credentials reach. ``PathPolicy`` allows ``file://`` paths under the operator's roots
(``HERON_JOB_ROOTS``) and ``s3://`` URIs of the operator's buckets (``HERON_JOB_BUCKETS``),
and nothing else: a ``..`` segment is refused outright, and a path is resolved to its real
path (symlinks followed) before it must be under a root, so a link out of a root is refused
too. The check comes before any open (403 JOB_PATH_FORBIDDEN), and the files are then opened
by the real path, the last component with ``O_NOFOLLOW``.

Shards: rows ``[i * shard_rows, (i + 1) * shard_rows)`` are shard ``i``. A finished shard is
one part file, written whole under a temporary name and renamed (an S3 put is atomic by
itself), named ``part-<index>-<failed rows>.msgpack``: listing the parts says which shards
are done and how many of their rows failed, without reading them.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import shutil
import sys
import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urlsplit

from heron_sdk import wire
from heron_sdk.errors import ErrorCode, HeronError, invalid_field

JOB_ROOTS_ENV = "HERON_JOB_ROOTS"
JOB_BUCKETS_ENV = "HERON_JOB_BUCKETS"
PART_NAME = re.compile(r"^part-(\d{6,})-(\d+)\.msgpack$")


# ---- where a job may read and write --------------------------------------------------------
@dataclass(frozen=True, slots=True)
class FileLocation:
    path: Path  # the real path: symlinks resolved, under an allowed root


@dataclass(frozen=True, slots=True)
class S3Location:
    bucket: str
    key: str


Location = FileLocation | S3Location


def forbidden(field_name: str, why: str) -> HeronError:
    return HeronError(ErrorCode.JOB_PATH_FORBIDDEN, f"{field_name}: {why}", field=field_name)


def split_list(text: str | None) -> list[str]:
    return [part.strip() for part in (text or "").split(",") if part.strip()]


@dataclass(frozen=True, slots=True)
class PathPolicy:
    """The roots (real paths) and buckets jobs may use; empty: none at all."""

    roots: tuple[Path, ...] = ()
    buckets: frozenset[str] = frozenset()

    @classmethod
    def of(cls, roots: Iterable[str | Path], buckets: Iterable[str] = ()) -> PathPolicy:
        return cls(tuple(Path(os.path.realpath(r)) for r in roots), frozenset(buckets))

    @classmethod
    def parse(cls, roots: str | None, buckets: str | None) -> PathPolicy:
        """From the settings' comma-separated lists."""
        return cls.of(split_list(roots), split_list(buckets))

    def check(self, uri: str, field_name: str) -> Location:
        """The location ``uri`` names, if jobs may use it; else 403 JOB_PATH_FORBIDDEN.
        Reads nothing but the file system's links (to resolve the real path)."""
        try:
            parts = urlsplit(uri)
        except ValueError:
            raise forbidden(field_name, "not a URI") from None
        if parts.query or parts.fragment:
            raise forbidden(field_name, "a query or fragment is not allowed")
        if parts.scheme == "file":
            return FileLocation(self._file(parts.netloc, unquote(parts.path), field_name))
        if parts.scheme == "s3":
            return self._s3(parts.netloc, parts.path.lstrip("/"), field_name)
        raise forbidden(field_name, "only file:// and s3:// URIs are allowed")

    def _file(self, host: str, path: str, field_name: str) -> Path:
        if host not in ("", "localhost"):
            raise forbidden(field_name, "a file:// URI names no host (file:///path)")
        if "\x00" in path or not path.startswith("/"):
            raise forbidden(field_name, "must be an absolute path (file:///path)")
        if any(segment in ("..", ".") for segment in path.split("/")):
            raise forbidden(field_name, "'..' and '.' segments are not allowed")
        if not self.roots:
            raise forbidden(field_name, f"no local paths are allowed ({JOB_ROOTS_ENV} is "
                            "not set)")
        real = Path(os.path.realpath(path))  # every symlink on the way, resolved
        if not any(real.is_relative_to(root) for root in self.roots):
            raise forbidden(field_name, f"{path} is not under an allowed root ("
                            f"{JOB_ROOTS_ENV}), symlinks resolved")
        return real

    def _s3(self, bucket: str, key: str, field_name: str) -> S3Location:
        if not bucket or not key:
            raise forbidden(field_name, "an s3:// URI names a bucket and a key")
        if any(segment in ("..", ".") for segment in key.split("/")):
            raise forbidden(field_name, "'..' and '.' segments are not allowed")
        if bucket not in self.buckets:
            raise forbidden(field_name, f"bucket {bucket!r} is not allowed ("
                            f"{JOB_BUCKETS_ENV})")
        return S3Location(bucket, key)


def s3_client() -> Any:
    """boto3's S3 client, configured by the environment (AWS_ENDPOINT_URL, credentials)."""
    import boto3  # only jobs on S3 pay for its import

    endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("HERON_S3_ENDPOINT")
    return boto3.client("s3", endpoint_url=endpoint or None)


def check_readable(location: Location, field_name: str) -> None:
    """422 when the input is not there (a file, or an S3 object)."""
    if isinstance(location, FileLocation):
        if not location.path.is_file():
            raise invalid_field(field_name, "no such file")
        return
    try:
        s3_client().head_object(Bucket=location.bucket, Key=location.key)
    except Exception as exc:
        raise invalid_field(field_name, f"cannot read it: {exc}") from None


# ---- input rows ----------------------------------------------------------------------------
@dataclass(slots=True)
class Rows:
    """Input rows ``first``, ``first + 1``, ... (numbered over the whole file): ``ids[k]``
    and ``texts[k]`` of row ``first + k``; a row that cannot be encoded (no text, not a
    string) has text None and its error in ``errors[k]``."""

    ids: list[str] = field(default_factory=list)
    texts: list[str | None] = field(default_factory=list)
    errors: dict[int, dict[str, str]] = field(default_factory=dict)
    first: int = 0

    def add(self, record: Any, text_field: str, id_field: str | None) -> None:
        row = self.first + len(self.ids)
        # A row whose id cannot be read is named by its number: "#12" (plain "12" when
        # ids are row numbers anyway), never an id another row may have.
        unknown = f"#{row}" if id_field else str(row)
        if not isinstance(record, Mapping):
            self._bad(unknown, "the row is not an object")
            return
        row_id = record.get(id_field) if id_field else row
        text = record.get(text_field)
        if row_id is None:
            self._bad(unknown, f"no {id_field!r} field")
        elif not isinstance(text, str):
            self._bad(str(row_id), f"the {text_field!r} field is missing or not a string")
        else:
            self.ids.append(str(row_id))
            self.texts.append(text)

    def _bad(self, row_id: str, why: str) -> None:
        self.errors[len(self.ids)] = {"code": ErrorCode.INVALID_FIELD.value,
                                      "message": f"row {self.first + len(self.ids)}: {why}"}
        self.ids.append(row_id)
        self.texts.append(None)


def parse_rows(data: bytes, fmt: str, text_field: str, id_field: str | None) -> Rows:
    """Every row of an input file's bytes at once. A job reads its input shard by shard
    instead (heron/runtime/job_input.py); this is that reading, over bytes in memory, as
    one shard. A row that cannot be read is a failed row (its error kept); a file that
    cannot be read at all is a 422 naming ``input``."""
    from heron.runtime.job_input import index_input  # they build on this module
    from heron.runtime.job_sources import BytesSource

    sharded = index_input(BytesSource(data), fmt, text_field, id_field, sys.maxsize)
    try:
        return sharded.read(0) if sharded.plan.count else Rows()
    finally:
        sharded.close()


# ---- shards -----------------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class ShardPlan:
    """How ``rows`` rows split into shards of ``shard_rows`` (the last one shorter)."""

    rows: int
    shard_rows: int

    @property
    def count(self) -> int:
        return math.ceil(self.rows / self.shard_rows)

    def bounds(self, index: int) -> tuple[int, int]:
        if not 0 <= index < self.count:
            raise IndexError(f"no shard {index} of {self.count}")
        start = index * self.shard_rows
        return start, min(start + self.shard_rows, self.rows)

    def rows_of(self, done: Iterable[int]) -> int:
        """Rows in the shards ``done``."""
        return sum(end - start for start, end in map(self.bounds, done))

    def missing(self, done: Mapping[int, int]) -> list[int]:
        return [i for i in range(self.count) if i not in done]


def part_name(index: int, failed: int) -> str:
    return f"part-{index:06d}-{failed}.msgpack"


def done_shards(names: Iterable[str]) -> dict[int, int]:
    """shard index -> failed rows, from the part files' names (others ignored)."""
    done = {}
    for name in names:
        match = PART_NAME.match(name)
        if match:
            done[int(match.group(1))] = int(match.group(2))
    return done


def encode_part(ids: list[str], rows: list[dict[str, Any]]) -> bytes:
    return wire.encode({"ids": ids, "rows": rows}, wire.MSGPACK)


def decode_part(data: bytes) -> tuple[list[str], list[dict[str, Any]]]:
    part = wire.decode(data, wire.MSGPACK)
    return list(part["ids"]), list(part["rows"])


def parts_of(output: Location, job_id: str) -> PartStore:
    """Where the job's part files go: beside its output, in a folder of its own."""
    if isinstance(output, S3Location):
        return S3Parts(output.bucket, f"{output.key}.{job_id}.parts/")
    return FileParts(output.path.with_name(f"{output.path.name}.{job_id}.parts"))


class PartStore(Protocol):
    def put(self, name: str, data: bytes) -> None: ...

    def names(self) -> list[str]: ...

    def get(self, name: str) -> bytes: ...

    def clear(self) -> None: ...


@dataclass(frozen=True, slots=True)
class FileParts:
    folder: Path

    def put(self, name: str, data: bytes) -> None:
        """Whole or not at all: written and synced under a temporary name, then renamed."""
        self.folder.mkdir(exist_ok=True)
        tmp = self.folder / f".{name}.{uuid.uuid4().hex[:8]}.tmp"
        with open(tmp, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.replace(tmp, self.folder / name)

    def names(self) -> list[str]:
        with contextlib.suppress(FileNotFoundError):
            return os.listdir(self.folder)
        return []

    def get(self, name: str) -> bytes:
        return (self.folder / name).read_bytes()

    def clear(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)


@dataclass(slots=True)
class S3Parts:
    bucket: str
    prefix: str
    client: Any = field(default_factory=s3_client)

    def put(self, name: str, data: bytes) -> None:
        self.client.put_object(Bucket=self.bucket, Key=self.prefix + name, Body=data)

    def names(self) -> list[str]:
        names = []
        for page in self.client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=self.prefix):
            names += [o["Key"][len(self.prefix):] for o in page.get("Contents", ())]
        return names

    def get(self, name: str) -> bytes:
        return self.client.get_object(Bucket=self.bucket, Key=self.prefix + name)["Body"].read()

    def clear(self) -> None:
        for name in self.names():
            self.client.delete_object(Bucket=self.bucket, Key=self.prefix + name)
