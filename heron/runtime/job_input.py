"""A bulk job's input, read shard by shard: the gateway never holds the whole file.

A first pass (``open_input``) reads the file once, front to back, in blocks, and keeps only
where each shard's rows are: the byte offset of every ``shard_rows``-th row of a JSONL or
CSV file (a CSV file's rows are found by the csv module itself, so a quoted field's
newlines stay inside its row), a Parquet file's row count from its metadata (its columns
checked there too). The errors that fail a job as a whole (a CSV file that is not UTF-8 or
does not parse, Parquet columns missing: 422 naming ``input``; a file that cannot be read:
``input.uri``) come out of this pass, before any shard runs. ``ShardedInput.read(i)`` then
reads shard ``i``'s rows when the shard is computed: a byte range of a JSONL or CSV file,
rows ``[start, end)`` of a Parquet file (the record batches of its row groups, from a
cursor that moves forward, as shards are read in order). A job's memory is its shards in
flight and this index (one offset a shard), whatever the file's size.

Rows are numbered over the whole file (a row's id when there is no ``id_field``), blank
JSONL and CSV lines are no rows, and a row that cannot be read fails alone, as when a whole
file was parsed at once (``parse_rows``, heron/runtime/job_files.py, is this module over
bytes in memory).

Where the bytes come from (a local file, S3: ranged GETs, an input changed mid-job
refused): heron/runtime/job_sources.py.
"""

from __future__ import annotations

import contextlib
import csv
import io
import threading
from bisect import bisect_right
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from itertools import accumulate
from typing import IO, Any

import orjson

from heron.runtime.job_files import Location, Rows, ShardPlan
from heron.runtime.job_sources import Source, changed, source_of
from heron_sdk.errors import HeronError, invalid_field

PARQUET_BUFFER = 1 << 20  # Arrow reads a column chunk this much at a time, not whole
MAX_BATCH_ROWS = 1 << 16
BOM = b"\xef\xbb\xbf"
FORMATS = ("jsonl", "csv", "parquet")


# ---- JSONL and CSV: lines, and where shards start -----------------------------------------------
def lines_of(blocks: Iterable[bytes]) -> Iterator[tuple[int, bytes]]:
    """Each line with its ending and its byte offset, split as ``bytes.splitlines`` and
    universal newlines split (``\\n``, ``\\r\\n``, ``\\r``), whatever the blocks' bounds."""
    at = 0
    carry: list[bytes] = []  # a line not ended yet (a \r may have its \n in the next block)
    for block in blocks:
        if not block:
            continue
        if b"\n" not in block and b"\r" not in block and not (
                carry and carry[-1].endswith(b"\r")):
            carry.append(block)
            continue
        lines = b"".join((*carry, block)).splitlines(keepends=True)
        carry = [lines.pop()] if not lines[-1].endswith(b"\n") else []
        for line in lines:
            yield at, line
            at += len(line)
    if carry:
        yield at, b"".join(carry)


def index_jsonl(blocks: Iterable[bytes], shard_rows: int) -> tuple[list[int], int]:
    """Where each shard's first row starts, and the rows (blank lines are none)."""
    starts: list[int] = []
    rows = 0
    for at, line in lines_of(blocks):
        if line.isspace():
            continue
        if rows % shard_rows == 0:
            starts.append(at)
        rows += 1
    return starts, rows


def index_csv(blocks: Iterable[bytes], shard_rows: int
              ) -> tuple[list[int], int, list[str] | None]:
    """Where each shard's first row starts, the rows (blank lines are none, as
    ``csv.DictReader`` skips them) and the header (None: an empty file)."""
    taken = 0  # the end of the lines the csv reader has taken: it never reads ahead

    def texts() -> Iterator[str]:
        nonlocal taken
        for at, line in lines_of(blocks):
            taken = at + len(line)
            yield (line[len(BOM):] if at == 0 and line.startswith(BOM) else line
                   ).decode("utf-8")

    reader = csv.reader(texts())
    header = next(reader, None)
    starts: list[int] = []
    rows, at = 0, taken
    for record in reader:
        if record:
            if rows % shard_rows == 0:
                starts.append(at)
            rows += 1
        at = taken
    return starts, rows, header


def add_jsonl(rows: Rows, data: bytes, text_field: str, id_field: str | None) -> None:
    for line in data.splitlines():
        if not line.strip():
            continue
        try:
            record: Any = orjson.loads(line)
        except orjson.JSONDecodeError:
            record = None  # a failed row, not a failed job
        rows.add(record, text_field, id_field)


def add_csv(rows: Rows, data: bytes, header: list[str], text_field: str,
            id_field: str | None) -> None:
    reader = csv.DictReader(io.StringIO(data.decode("utf-8"), newline=""), fieldnames=header)
    for record in reader:
        rows.add(record, text_field, id_field)


# ---- Parquet: rows from a forward cursor -----------------------------------------------------
class ParquetRows:
    """A Parquet file's rows ``[start, end)`` of its ``columns``, read as record batches of
    its row groups; reads in order continue where the last one ended, others start again
    from the row group that holds their first row."""

    def __init__(self, file: IO[bytes], columns: list[str], batch_rows: int) -> None:
        import pyarrow.parquet as pq

        self.file, self.columns = file, columns
        self.batch_rows = max(1, min(batch_rows, MAX_BATCH_ROWS))
        self.parquet = pq.ParquetFile(file, buffer_size=PARQUET_BUFFER, pre_buffer=False)
        names = self.parquet.schema_arrow.names
        missing = [column for column in columns if column not in names]
        if missing:
            raise invalid_field("input", f"cannot read the Parquet file's columns {columns}: "
                                f"no column {missing[0]!r}")
        meta = self.parquet.metadata
        self.rows = meta.num_rows
        self.firsts = list(accumulate((meta.row_group(g).num_rows
                                       for g in range(meta.num_row_groups)), initial=0))
        self._batches: Iterator[Any] | None = None
        self._at = 0  # the row the next batch begins with
        self._pending: Any = None  # the rest of a batch a read ended in

    def _next(self) -> Any:
        assert self._batches is not None
        if self._pending is not None:
            batch, self._pending = self._pending, None
            return batch
        batch = next(self._batches, None)
        if batch is None:
            raise changed("fewer rows than its metadata said")
        return batch

    def _seek(self, start: int) -> None:
        group = max(bisect_right(self.firsts, start) - 1, 0)
        groups = list(range(group, len(self.firsts) - 1))
        self._batches = self.parquet.iter_batches(batch_size=self.batch_rows,
                                                  row_groups=groups, columns=self.columns,
                                                  use_threads=False)
        self._at, self._pending = self.firsts[group], None
        while self._at < start:
            batch = self._next()
            if self._at + len(batch) > start:
                self._pending = batch.slice(start - self._at)
                self._at = start
            else:
                self._at += len(batch)

    def read(self, start: int, end: int) -> dict[str, list[Any]]:
        import pyarrow as pa

        try:
            if self._batches is None or self._at != start:
                self._seek(start)
            pieces = []
            while self._at < end:
                batch = self._next()
                take = min(len(batch), end - self._at)
                pieces.append(batch.slice(0, take))
                if take < len(batch):
                    self._pending = batch.slice(take)
                self._at += take
        except BaseException:
            self._batches = None  # start again at the next read
            raise
        if not pieces:
            return {name: [] for name in self.columns}
        table = pa.Table.from_batches(pieces)
        return {name: table.column(name).to_pylist() for name in self.columns}

    def close(self) -> None:
        self._batches = self._pending = None
        self.file.close()


# ---- the index, and shard reads ------------------------------------------------------------
@dataclass(slots=True)
class ShardedInput:
    """A job's input, indexed: ``plan`` says its rows and shards, ``read(i)`` gives shard
    ``i``'s rows (numbered over the whole file). ``starts[i]`` is the byte offset of shard
    ``i``'s first row (JSONL, CSV), ``end`` the file's size at the first pass."""

    source: Source
    fmt: str
    text_field: str
    id_field: str | None
    plan: ShardPlan
    starts: list[int] = field(default_factory=list)
    end: int = 0
    header: list[str] | None = None
    parquet: ParquetRows | None = None
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def ordered(self) -> bool:
        """Whether reads are best made one at a time, in shard order (Parquet: a cursor
        that moves forward); JSONL and CSV shards are byte ranges, read in any order."""
        return self.parquet is not None

    def read(self, index: int) -> Rows:
        """Shard ``index``'s rows (blocking: run it in a thread; thread-safe)."""
        start, end = self.plan.bounds(index)
        rows = Rows(first=start)
        with self.lock if self.ordered else contextlib.nullcontext():
            try:
                self._read(index, start, end, rows)
            except HeronError:
                raise
            except (UnicodeDecodeError, csv.Error) as exc:  # it did parse at the first pass
                raise changed(f"shard {index}: {exc}") from None
            except Exception as exc:  # gone, unreadable, S3 refusing
                raise invalid_field("input.uri", f"cannot read the input: {exc}") from None
        if len(rows.ids) != end - start:
            raise changed(f"shard {index} has {len(rows.ids)} rows, not {end - start}")
        return rows

    def _read(self, index: int, start: int, end: int, rows: Rows) -> None:
        if self.parquet is not None:
            self.source.check()
            columns = self.parquet.read(start, end)
            texts = columns[self.text_field]
            ids = columns[self.id_field] if self.id_field else range(start, end)
            for text, row_id in zip(texts, ids, strict=True):
                record = {self.text_field: text}
                if self.id_field:
                    record[self.id_field] = row_id
                rows.add(record, self.text_field, self.id_field)
            return
        last = self.starts[index + 1] if index + 1 < len(self.starts) else self.end
        data = self.source.read(self.starts[index], last)
        if self.fmt == "jsonl":
            add_jsonl(rows, data, self.text_field, self.id_field)
        else:
            add_csv(rows, data, self.header or [], self.text_field, self.id_field)

    def close(self) -> None:
        with self.lock:  # after a read a cancelled run left going in its thread
            if self.parquet is not None:
                self.parquet.close()


def index_input(source: Source, fmt: str, text_field: str, id_field: str | None,
                shard_rows: int) -> ShardedInput:
    """The first pass over ``source``: 422 naming ``input`` (or ``input.uri``, a file
    that cannot be read) when the job cannot run at all."""
    if fmt not in FORMATS:
        raise invalid_field("input.format", f"unknown format {fmt!r}")
    plan = ShardPlan(0, shard_rows)
    sharded = ShardedInput(source, fmt, text_field, id_field, plan, end=source.size)
    try:
        if fmt == "jsonl":
            sharded.starts, rows = index_jsonl(source.blocks(), shard_rows)
        elif fmt == "csv":
            sharded.starts, rows, sharded.header = index_csv(source.blocks(), shard_rows)
        else:
            columns = list(dict.fromkeys([text_field] + ([id_field] if id_field else [])))
            sharded.parquet = _parquet(source, columns, shard_rows)
            rows = sharded.parquet.rows
    except HeronError:
        raise
    except (UnicodeDecodeError, csv.Error) as exc:
        raise invalid_field("input", f"not a UTF-8 CSV file: {exc}") from None
    except Exception as exc:  # gone since the job was made, unreadable, S3 refusing
        raise invalid_field("input.uri", f"cannot read the input: {exc}") from None
    sharded.plan = ShardPlan(rows, shard_rows)
    return sharded


def _parquet(source: Source, columns: list[str], shard_rows: int) -> ParquetRows:
    import pyarrow as pa

    file = source.open()
    try:
        return ParquetRows(file, columns, shard_rows)
    except (pa.ArrowException, KeyError) as exc:
        file.close()
        raise invalid_field("input", f"cannot read the Parquet file's columns {columns}: "
                            f"{exc}") from None
    except BaseException:
        file.close()
        raise


def open_input(location: Location, fmt: str, text_field: str, id_field: str | None,
               shard_rows: int) -> ShardedInput:
    """The first pass over the job's input (blocking: run it in a thread)."""
    try:
        source = source_of(location)
    except Exception as exc:  # gone since the job was made, unreadable, S3 refusing
        raise invalid_field("input.uri", f"cannot read the input: {exc}") from None
    return index_input(source, fmt, text_field, id_field, shard_rows)
