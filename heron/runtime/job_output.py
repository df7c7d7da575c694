"""A bulk job's output: its part files joined in input order, written whole or not at all.

Every input row is one output row: its id, its vectors (one column per output type), and
its error (``error_code``, ``error``), null where it was encoded. The output is written
under a temporary name beside its final one and renamed (S3: written locally, then
uploaded, which S3 makes visible whole), so a reader never sees half a file and a job that
is joined twice (its gateway died between writing and recording success) writes the same
file again.

- ``parquet``: columns ``id`` (string), one per output type (``dense``/``muvera``: a list
  of numbers; ``multi_vector``: a list of lists; ``sparse``: ``{indices, values}``),
  ``error_code`` and ``error`` (strings).
- ``jsonl``: one object a line with the same keys.
- with ``chunking``, a column ``chunks`` too: each row's chunks, a list of ``{start, end,
  <output type>...}`` (character offsets into the row's text); the row's own output-type
  columns then hold only the pooled ``dense`` (``pool: "mean"``), or nothing.
- ``npy``: the dense vectors alone, one row per input row (a failed row is NaN), and beside
  it ``<output>.rows.jsonl`` with each row's ``id`` and ``error``.
"""

from __future__ import annotations

import os
import tempfile
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from heron.runtime.job_files import (
    FileLocation,
    Location,
    PartStore,
    ShardPlan,
    decode_part,
    part_name,
    s3_client,
)
from heron_sdk.types import EncodeRequest

Shards = Iterator[tuple[list[str], list[dict[str, Any]]]]
NPY_ROWS_SUFFIX = ".rows.jsonl"


@dataclass(frozen=True, slots=True)
class Columns:
    """What an output row holds: ``row_types``, the output types of the row itself, and,
    for a chunked job, ``chunk_types``, those of each of its chunks (None: not chunked)."""

    row_types: tuple[str, ...]
    chunk_types: tuple[str, ...] | None = None

    @classmethod
    def of(cls, request: EncodeRequest) -> Columns:
        chunking = request.chunking
        if chunking is None:
            return cls(request.output_types)
        return cls(("dense",) if chunking.pool else (), request.output_types)

    def kept(self, row: Mapping[str, Any]) -> dict[str, Any]:
        """What the output keeps of an encoded row: its vectors (and chunks), or its error."""
        if "error" in row:
            return {"error": row["error"]}
        out = {kind: row[kind] for kind in self.row_types if kind in row}
        if self.chunk_types is not None:
            out["chunks"] = [{"start": chunk["start"], "end": chunk["end"],
                              **{k: chunk[k] for k in self.chunk_types if k in chunk}}
                             for chunk in row.get("chunks") or ()]
        return out

    def names(self) -> tuple[str, ...]:
        """The output's columns besides id and error."""
        return self.row_types + (() if self.chunk_types is None else ("chunks",))


def plain(value: Any) -> Any:
    """Arrays (also inside a sparse vector's map) as lists of Python numbers."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Mapping):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [plain(v) for v in value]
    return value


def _error(row: Mapping[str, Any]) -> tuple[str | None, str | None]:
    error = row.get("error")
    if not isinstance(error, Mapping):
        return None, None
    return str(error.get("code")), str(error.get("message"))


def write_jsonl(path: Path, shards: Shards, columns: Columns) -> None:
    with open(path, "wb") as out:
        for ids, rows in shards:
            for row_id, row in zip(ids, rows, strict=True):
                code, message = _error(row)
                line = {"id": row_id, **{key: plain(row.get(key)) for key in columns.names()},
                        "error_code": code, "error": message}
                out.write(orjson.dumps(line) + b"\n")


def _arrow_types(columns: Columns, output_dtype: str) -> dict[str, Any]:
    import pyarrow as pa

    number = {"float32": pa.float32(), "float16": pa.float32(), "int8": pa.int8(),
              "uint8": pa.uint8(), "binary": pa.uint8()}[output_dtype]
    kinds = {"dense": pa.list_(number), "muvera": pa.list_(number),
             "multi_vector": pa.list_(pa.list_(number)),
             "sparse": pa.struct([("indices", pa.list_(pa.int32())),
                                  ("values", pa.list_(pa.float32()))])}
    types = {kind: kinds[kind] for kind in columns.row_types}
    if columns.chunk_types is not None:
        chunk = pa.struct([("start", pa.int32()), ("end", pa.int32()),
                           *((kind, kinds[kind]) for kind in columns.chunk_types)])
        types["chunks"] = pa.list_(chunk)
    return types


def write_parquet(path: Path, shards: Shards, columns: Columns, output_dtype: str) -> None:
    """One row group per shard: memory holds one shard at a time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    types = _arrow_types(columns, output_dtype)
    schema = pa.schema([("id", pa.string()), *types.items(), ("error_code", pa.string()),
                        ("error", pa.string())])
    with pq.ParquetWriter(path, schema) as writer:
        for ids, rows in shards:
            errors = [_error(row) for row in rows]
            columns = {"id": ids,
                       **{kind: [plain(row.get(kind)) for row in rows] for kind in types},
                       "error_code": [e[0] for e in errors], "error": [e[1] for e in errors]}
            writer.write_table(pa.Table.from_pydict(columns, schema=schema))


def write_npy(path: Path, shards: Callable[[], Shards], total: int, output_dtype: str) -> None:
    """The dense vectors as one ``(rows, dims)`` array; the ids and errors beside it."""
    dims, dtype = 0, np.dtype(np.float32)
    for _, rows in shards():  # the width and type of the first vector there is
        first = next((np.asarray(r["dense"]) for r in rows if r.get("dense") is not None),
                     None)
        if first is not None:
            dims, dtype = first.shape[-1], first.dtype
            break
    array = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(total, dims))
    with open(path.with_name(path.name + NPY_ROWS_SUFFIX), "wb") as side:
        at = 0
        for ids, rows in shards():
            for row_id, row in zip(ids, rows, strict=True):
                vector = row.get("dense")
                if vector is None:  # a failed row: NaN where NaN exists
                    array[at] = np.nan if dtype.kind == "f" else 0
                else:
                    array[at] = np.asarray(vector)
                code, message = _error(row)
                side.write(orjson.dumps({"id": row_id, "error_code": code,
                                         "error": message}) + b"\n")
                at += 1
    array.flush()
    del array


def write_output(output: Location, fmt: str, parts: PartStore, plan: ShardPlan,
                 done: Mapping[int, int], columns: Columns, output_dtype: str) -> None:
    """Join every shard's part (all must be ``done``) into the output, atomically."""
    names = {index: part_name(index, failed) for index, failed in done.items()}

    def shards() -> Shards:
        for index in range(plan.count):
            yield decode_part(parts.get(names[index]))

    def write(path: Path) -> list[Path]:
        if fmt == "jsonl":
            write_jsonl(path, shards(), columns)
        elif fmt == "parquet":
            write_parquet(path, shards(), columns, output_dtype)
        else:
            write_npy(path, shards, plan.rows, output_dtype)
            return [path, path.with_name(path.name + NPY_ROWS_SUFFIX)]
        return [path]

    if isinstance(output, FileLocation):
        final = output.path
        tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex[:8]}.tmp")
        written = write(tmp)
        for path in written[1:]:  # the npy's side file first: the array marks completion
            os.replace(path, final.with_name(final.name + NPY_ROWS_SUFFIX))
        os.replace(tmp, final)
        return
    client = s3_client()
    with tempfile.TemporaryDirectory(prefix="heron-job-") as folder:
        local = Path(folder) / "output"
        written = write(local)
        for path in written[1:]:
            client.upload_file(str(path), output.bucket, output.key + NPY_ROWS_SUFFIX)
        client.upload_file(str(local), output.bucket, output.key)
