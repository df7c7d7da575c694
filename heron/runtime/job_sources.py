"""Where a bulk job's input bytes come from, read in pieces: a local file, an S3 object, bytes
in memory (heron/runtime/job_input.py indexes them and reads shards from them).

Each is the file as it was when the job's first pass began: ``size`` is its size then, a
local file's identity (device, inode, size, mtime) is checked at every open, and every S3
GET names the ETag the first pass saw (``IfMatch``), so an input changed while its job runs
fails the job (422 naming ``input.uri``) rather than mixing two versions of it.

An S3 object is read whole by one streaming GET, a byte range by one ranged GET, and, for
pyarrow (Parquet), through ``RangedFile``: a seekable file over ranged GETs of aligned
4 MiB blocks, the last four kept. Nothing goes to disk, nothing is held whole.
"""

from __future__ import annotations

import io
import os
from collections import OrderedDict
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Protocol

from heron.runtime.job_files import FileLocation, Location, s3_client
from heron_sdk.errors import HeronError, invalid_field

BLOCK = 1 << 20  # bytes a whole read yields at a time
S3_BLOCK = 4 << 20  # bytes of one ranged GET of a RangedFile
S3_BLOCKS_KEPT = 4


def changed(why: str) -> HeronError:
    return invalid_field("input.uri", f"the input changed while the job ran ({why})")


# ---- where the bytes come from -----------------------------------------------------------
class Source(Protocol):
    """An input file as it was when the first pass began (``size`` bytes)."""

    size: int

    def blocks(self) -> Iterator[bytes]:
        """The whole file, front to back, in blocks."""
        ...

    def read(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``."""
        ...

    def open(self) -> IO[bytes]:
        """A seekable file (for pyarrow)."""
        ...

    def check(self) -> None:
        """Raise (422) if the file is no longer the one the first pass read."""
        ...


def _stamp(stat: os.stat_result) -> tuple[int, int, int, int]:
    return stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns


@dataclass(slots=True)
class LocalSource:
    """A local file, opened by its real path, never through a link (``O_NOFOLLOW``)."""

    path: Path
    size: int
    stamp: tuple[int, int, int, int]

    @classmethod
    def of(cls, path: Path) -> LocalSource:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            stat = os.fstat(fd)
        finally:
            os.close(fd)
        return cls(path, stat.st_size, _stamp(stat))

    def _fd(self) -> int:
        fd = os.open(self.path, os.O_RDONLY | os.O_NOFOLLOW)
        if _stamp(os.fstat(fd)) != self.stamp:
            os.close(fd)
            raise changed("its size, time or inode is not what it was")
        return fd

    def blocks(self) -> Iterator[bytes]:
        with os.fdopen(self._fd(), "rb", buffering=0) as file:
            left = self.size
            while left > 0 and (block := file.read(min(BLOCK, left))):
                left -= len(block)
                yield block

    def read(self, start: int, end: int) -> bytes:
        fd = self._fd()
        try:
            pieces, at = [], start
            while at < end and (piece := os.pread(fd, end - at, at)):
                pieces.append(piece)
                at += len(piece)
            return b"".join(pieces)
        finally:
            os.close(fd)

    def open(self) -> IO[bytes]:
        return os.fdopen(self._fd(), "rb")

    def check(self) -> None:
        if _stamp(os.stat(self.path, follow_symlinks=False)) != self.stamp:
            raise changed("its size, time or inode is not what it was")


@dataclass(slots=True)
class S3Source:
    """An S3 object; every GET names the ETag it had (``IfMatch``)."""

    bucket: str
    key: str
    size: int
    etag: str
    client: Any

    @classmethod
    def of(cls, bucket: str, key: str, client: Any | None = None) -> S3Source:
        client = client or s3_client()
        head = client.head_object(Bucket=bucket, Key=key)
        return cls(bucket, key, int(head["ContentLength"]), head["ETag"], client)

    def _body(self, **extra: Any) -> Any:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=self.key,
                                          IfMatch=self.etag, **extra)["Body"]
        except Exception as exc:
            code = getattr(exc, "response", {}).get("Error", {}).get("Code")
            if code in ("PreconditionFailed", "412"):
                raise changed("its ETag is not what it was") from None
            raise

    def blocks(self) -> Iterator[bytes]:
        if self.size == 0:
            return
        body = self._body()
        try:
            while block := body.read(BLOCK):
                yield block
        finally:
            body.close()

    def read(self, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        body = self._body(Range=f"bytes={start}-{end - 1}")
        try:
            return bytes(body.read())
        finally:
            body.close()

    def open(self) -> IO[bytes]:
        return RangedFile(self)  # type: ignore[return-value]

    def check(self) -> None:
        """(A GET checks the ETag itself; this is for reads a RangedFile's kept blocks
        answer.)"""
        if self.client.head_object(Bucket=self.bucket, Key=self.key)["ETag"] != self.etag:
            raise changed("its ETag is not what it was")


@dataclass(slots=True)
class BytesSource:
    """A file's bytes in memory (``parse_rows``, tests)."""

    data: bytes
    size: int = field(init=False)

    def __post_init__(self) -> None:
        self.size = len(self.data)

    def blocks(self) -> Iterator[bytes]:
        for at in range(0, self.size, BLOCK):
            yield self.data[at:at + BLOCK]

    def read(self, start: int, end: int) -> bytes:
        return self.data[start:end]

    def open(self) -> IO[bytes]:
        return io.BytesIO(self.data)

    def check(self) -> None:
        pass


class RangedFile(io.RawIOBase):
    """An S3 object as a seekable, read-only file: ranged GETs of aligned ``S3_BLOCK``
    blocks, the last ``S3_BLOCKS_KEPT`` of them kept (Arrow reads the columns of a row group
    in turns); a read longer than a block is one GET of its own, kept by nobody."""

    def __init__(self, source: S3Source) -> None:
        super().__init__()
        self.source = source
        self.pos = 0
        self.kept: OrderedDict[int, bytes] = OrderedDict()

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.source.size}[whence]
        if base + offset < 0:
            raise ValueError("negative seek position")
        self.pos = base + offset
        return self.pos

    def _block(self, number: int) -> bytes:
        if number in self.kept:
            self.kept.move_to_end(number)
            return self.kept[number]
        start = number * S3_BLOCK
        block = self.kept[number] = self.source.read(start, min(start + S3_BLOCK,
                                                                 self.source.size))
        while len(self.kept) > S3_BLOCKS_KEPT:
            self.kept.popitem(last=False)
        return block

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        wanted = min(len(view), self.source.size - self.pos)
        if wanted <= 0:
            return 0
        if wanted > S3_BLOCK:
            data = self.source.read(self.pos, self.pos + wanted)
            view[:len(data)] = data
            self.pos += len(data)
            return len(data)
        got = 0
        while got < wanted:
            number, offset = divmod(self.pos, S3_BLOCK)
            piece = self._block(number)[offset:offset + wanted - got]
            if not piece:
                break
            view[got:got + len(piece)] = piece
            got += len(piece)
            self.pos += len(piece)
        return got

    def close(self) -> None:
        self.kept.clear()
        super().close()


def source_of(location: Location) -> Source:
    if isinstance(location, FileLocation):
        return LocalSource.of(location.path)
    return S3Source.of(location.bucket, location.key)
