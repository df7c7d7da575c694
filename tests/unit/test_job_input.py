"""A bulk job's input read shard by shard (heron/runtime/job_input.py): the first pass's
index (one offset a shard) and each shard's rows, in the three formats, against a local
file and an S3 stand-in (tests/integration/test_job_input_s3.py runs the same tests on a
real S3 API). Every shard's rows, joined, are what parsing the whole file at once gave
before (``reference``: that parser, kept here); tiny blocks put block bounds everywhere,
inside lines, between a \\r and its \\n. Also: the job run reads only the shards it
computes, and holds at most ``2 * job_shards_in_flight`` shards' rows at once."""

from __future__ import annotations

import asyncio
import csv
import io
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from heron.gateway.job_runner import JobLoop, JobRun
from heron.gateway.job_store import JobRecord
from heron.runtime import job_sources
from heron.runtime.job_files import (
    FileLocation,
    FileParts,
    Location,
    PathPolicy,
    Rows,
    S3Location,
    done_shards,
    parse_rows,
)
from heron.runtime.job_input import ShardedInput, lines_of, open_input
from heron_sdk.errors import HeronError
from tests.unit.test_jobs import StandIn

Put = Callable[[bytes, str], Location]

JSONL = b"".join([
    b'{"id": "a", "text": "one"}\n',
    b"\n",
    b"   \r\n",
    b'{"id": "b", "text": "two"}\r\n',
    b"not json\n",
    b"[1, 2]\n",
    b'{"id": "c"}\n',
    b'{"id": "d", "text": 5}\n',
    b'{"text": "no id"}\n',
    b'{"id": "e", "text": "caf\xc3\xa9"}\r',  # a bare \r ends a line too
    b'{"id": "f", "text": "six"}\n',
    b"\t\n",
    b'{"id": "g", "text": "last, no newline"}',
])
CSV = b"".join([
    b"\xef\xbb\xbfid,text\r\n",  # a BOM
    b"1,plain\r\n",
    b"\r\n",
    b'2,"quoted\nnewline"\r\n',
    b'3,"crlf\r\ninside, and ""quotes"""\r\n',
    b"4,h\xc3\xa9llo\r\n",
    b"5\r\n",  # no text
    b',"no id"\r\n',
    b'7,"two\n\nnewlines, a blank line inside"\n',
    b"8,last",
])


def reference(data: bytes, fmt: str, text_field: str, id_field: str | None
              ) -> list[tuple[str, str | None, str | None]]:
    """(id, text, error message) of every row, as the whole file parsed at once gave them
    before jobs read shard by shard (that parser, as it was)."""
    rows = Rows()
    if fmt == "jsonl":
        for line in data.splitlines():
            if not line.strip():
                continue
            try:
                record: Any = orjson.loads(line)
            except orjson.JSONDecodeError:
                record = None
            rows.add(record, text_field, id_field)
    elif fmt == "csv":
        for record in csv.DictReader(io.StringIO(data.decode("utf-8-sig"), newline="")):
            rows.add(record, text_field, id_field)
    else:
        table = pq.read_table(pa.BufferReader(data))
        texts = table.column(text_field).to_pylist()
        ids = table.column(id_field).to_pylist() if id_field else range(len(texts))
        for text, row_id in zip(texts, ids, strict=True):
            rows.add({text_field: text, **({id_field: row_id} if id_field else {})},
                     text_field, id_field)
    return flat(rows)


def flat(rows: Rows) -> list[tuple[str, str | None, str | None]]:
    return [(row_id, text, rows.errors[k]["message"] if k in rows.errors else None)
            for k, (row_id, text) in enumerate(zip(rows.ids, rows.texts, strict=True))]


def parquet_bytes(rows: int = 23, group: int = 7) -> bytes:
    sink = pa.BufferOutputStream()
    texts = [None if i % 6 == 4 else f"text {i} " + "é" * (i % 3) for i in range(rows)]
    pq.write_table(pa.table({"key": list(range(100, 100 + rows)), "doc": texts,
                             "other": [1.5] * rows}), sink, row_group_size=group)
    return sink.getvalue().to_pybytes()


# ---- where the input is: a local file, an S3 stand-in ----------------------------------------
class FakeBody:
    def __init__(self, data: bytes) -> None:
        self.stream = io.BytesIO(data)

    def read(self, amount: int | None = None) -> bytes:
        return self.stream.read(amount)

    def close(self) -> None:
        pass


class FakeS3:
    """get_object with Range and IfMatch, as S3 answers them; every GET counted."""

    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}
        self.gets: list[str | None] = []

    def head_object(self, Bucket: str, Key: str) -> dict[str, Any]:
        data = self.objects[Key]
        return {"ContentLength": len(data), "ETag": f'"{hash(data)}"'}

    def get_object(self, Bucket: str, Key: str, IfMatch: str,
                   Range: str | None = None) -> dict[str, Any]:
        data = self.objects[Key]
        if IfMatch != f'"{hash(data)}"':
            error = Exception("precondition")
            error.response = {"Error": {"Code": "PreconditionFailed"}}  # type: ignore[attr-defined]
            raise error
        self.gets.append(Range)
        if Range is not None:
            first, last = Range.removeprefix("bytes=").split("-")
            data = data[int(first):int(last) + 1]
        return {"Body": FakeBody(data)}


@pytest.fixture
def tiny_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """Blocks of 7 bytes (and 64-byte S3 blocks): bounds fall inside every line."""
    monkeypatch.setattr(job_sources, "BLOCK", 7)
    monkeypatch.setattr(job_sources, "S3_BLOCK", 64)


@pytest.fixture(params=["file", "s3-stand-in"])
def put(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
        ) -> Put:
    """Stores bytes (again, over what was there) and gives their location."""
    if request.param == "file":
        def put_file(data: bytes, name: str) -> Location:
            (tmp_path / name).write_bytes(data)
            return FileLocation((tmp_path / name).resolve())
        return put_file
    fake = FakeS3()
    monkeypatch.setattr(job_sources, "s3_client", lambda: fake)

    def put_s3(data: bytes, name: str) -> Location:
        fake.objects[name] = data
        return S3Location("bucket", name)
    return put_s3


def shards_of(sharded: ShardedInput, order: list[int] | None = None) -> list[Rows]:
    order = list(range(sharded.plan.count)) if order is None else order
    by_index = {index: sharded.read(index) for index in order}
    return [by_index[index] for index in sorted(by_index)]


def check_shards(sharded: ShardedInput, expected: list[Any],
                 order: list[int] | None = None) -> None:
    """Each shard holds exactly its rows, numbered over the whole file; joined, they are
    the whole file's rows."""
    plan = sharded.plan
    assert plan.rows == len(expected)
    got = []
    for index, rows in enumerate(shards_of(sharded, order)):
        start, end = plan.bounds(index)
        assert rows.first == start and len(rows.ids) == len(rows.texts) == end - start
        got += flat(rows)
    assert got == expected


# ---- the tests -------------------------------------------------------------------------------
def test_lines_split_as_splitlines_whatever_the_blocks() -> None:
    chance = random.Random(7)
    for _ in range(200):
        data = bytes(chance.choice(b"ab\r\n ") for _ in range(chance.randrange(40)))
        cuts = sorted(chance.sample(range(len(data) + 1), min(len(data) + 1, 5)))
        blocks = [data[a:b] for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)]
        lines = list(lines_of(blocks))
        assert [line for _, line in lines] == data.splitlines(keepends=True), data
        assert all(data[at:at + len(line)] == line for at, line in lines)


@pytest.mark.parametrize("id_field", ["id", None])
@pytest.mark.usefixtures("tiny_blocks")
def test_jsonl_shards_have_their_rows_blank_lines_none_bad_ones_failed(
        put: Put, id_field: str | None) -> None:
    sharded = open_input(put(JSONL, "in.jsonl"), "jsonl", "text", id_field, 3)
    expected = reference(JSONL, "jsonl", "text", id_field)
    assert len(expected) == 10  # the 3 blank lines are no rows
    assert sharded.plan.count == len(sharded.starts) == 4  # the index: one offset a shard
    check_shards(sharded, expected)
    check_shards(sharded, expected, order=[3, 1, 0, 2])
    if id_field is None:  # ids are row numbers over the whole file, not the shard's
        assert [row[0] for row in expected] == [str(i) for i in range(10)]
    assert expected[2] == ("#2" if id_field else "2", None,
                           "row 2: the row is not an object")
    assert expected[4][2] == "row 4: the 'text' field is missing or not a string"
    assert expected[6] == (("#6", None, "row 6: no 'id' field") if id_field else
                           ("6", "no id", None))
    assert expected[7][:2] == ("e" if id_field else "7", "café")


@pytest.mark.usefixtures("tiny_blocks")
def test_csv_shards_keep_quoted_newlines_and_skip_the_bom(put: Put) -> None:
    sharded = open_input(put(CSV, "in.csv"), "csv", "text", "id", 2)
    expected = reference(CSV, "csv", "text", "id")
    assert [row[0] for row in expected] == ["1", "2", "3", "4", "5", "", "7", "8"]
    assert expected[2][1] == 'crlf\r\ninside, and "quotes"' and expected[3][1] == "héllo"
    assert expected[4][1] is None and expected[5][1] == "no id"
    assert sharded.header == ["id", "text"]  # no BOM in the first column's name
    assert sharded.plan.count == len(sharded.starts) == 4
    check_shards(sharded, expected)
    check_shards(sharded, expected, order=[2, 0, 3, 1])


@pytest.mark.parametrize("id_field", ["key", None])
def test_parquet_shards_across_row_groups(put: Put, id_field: str | None) -> None:
    data = parquet_bytes()  # 23 rows in groups of 7: shards of 5 straddle them
    sharded = open_input(put(data, "in.parquet"), "parquet", "doc", id_field, 5)
    expected = reference(data, "parquet", "doc", id_field)
    assert expected[4] == ("104" if id_field else "4", None,
                           "row 4: the 'doc' field is missing or not a string")
    try:
        check_shards(sharded, expected)
        check_shards(sharded, expected, order=[4, 1, 2, 0, 3])  # the cursor goes back
    finally:
        sharded.close()


@pytest.mark.parametrize(("data", "fmt"), [(JSONL, "jsonl"), (CSV, "csv"),
                                           (parquet_bytes(), "parquet")])
def test_parse_rows_is_one_shard_of_the_same_reading(data: bytes, fmt: str) -> None:
    text, row_id = ("doc", "key") if fmt == "parquet" else ("text", "id")
    assert flat(parse_rows(data, fmt, text, row_id)) == reference(data, fmt, text, row_id)


def test_large_inputs_keep_one_offset_a_shard(put: Put) -> None:
    data = b"".join(orjson.dumps({"text": f"row {i}"}) + b"\n" for i in range(10_000))
    sharded = open_input(put(data, "big.jsonl"), "jsonl", "text", None, 256)
    assert sharded.plan.count == len(sharded.starts) == 40
    rows = sharded.read(39)
    assert rows.first == 9984 and rows.ids[0] == "9984" and rows.texts[-1] == "row 9999"


def test_inputs_that_cannot_run_are_422(put: Put) -> None:
    def refused(location: Location, fmt: str, text: str = "text") -> HeronError:
        with pytest.raises(HeronError) as info:
            open_input(location, fmt, text, None, 4).close()
        assert info.value.status == 422
        return info.value

    assert refused(put(b"id,text\n1,\xff\n", "bad.csv"), "csv").field == "input"
    missing = refused(put(parquet_bytes(), "p.parquet"), "parquet", "nope")
    assert missing.field == "input" and "nope" in missing.message
    assert refused(put(b"not parquet", "x.parquet"), "parquet").field == "input"
    assert refused(put(b"", "x.jsonl"), "xml").field == "input.format"
    gone = FileLocation(Path("/nonexistent/in.jsonl"))
    assert refused(gone, "jsonl").field == "input.uri"
    empty = open_input(put(b"\n\n", "blank.jsonl"), "jsonl", "text", None, 4)
    assert empty.plan.rows == empty.plan.count == 0


@pytest.mark.parametrize(("data", "fmt"), [(JSONL, "jsonl"), (CSV, "csv"),
                                           (parquet_bytes(), "parquet")])
def test_an_input_changed_mid_job_fails_it(put: Put, data: bytes, fmt: str) -> None:
    text, row_id = ("doc", "key") if fmt == "parquet" else ("text", "id")
    sharded = open_input(put(data, f"in.{fmt}"), fmt, text, row_id, 2)
    sharded.read(0)
    put(data + b"\n" if fmt != "parquet" else parquet_bytes(30), f"in.{fmt}")
    with pytest.raises(HeronError, match="changed") as info:
        sharded.read(1)
    assert (info.value.status, info.value.field) == (422, "input.uri")
    sharded.close()


def test_s3_parquet_is_read_by_ranged_gets(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through RangedFile: every GET is a range of at most a block (or of a read longer
    than one), and reading in order does not fetch a block twice per column."""
    fake = FakeS3()
    monkeypatch.setattr(job_sources, "s3_client", lambda: fake)
    monkeypatch.setattr(job_sources, "S3_BLOCK", 4096)
    fake.objects["p"] = data = parquet_bytes(2000, 300)
    sharded = open_input(S3Location("b", "p"), "parquet", "doc", None, 128)
    check_shards(sharded, reference(data, "parquet", "doc", None))
    sharded.close()
    assert fake.gets and all(get is not None for get in fake.gets)  # no whole GET
    assert len(fake.gets) < 3 * len(data) / 4096, len(fake.gets)


# ---- the run: only the shards it computes, a bounded number at a time ----------------------------
class SlowStandIn(StandIn):
    """Answers every request, after a little while."""

    async def encode_rows(self, model: str, req: Any) -> dict[str, Any]:
        self.script.append("ok")
        await asyncio.sleep(0.01)
        return await super().encode_rows(model, req)


@pytest.mark.parametrize("ordered", [True, False])
async def test_a_run_reads_only_its_missing_shards_a_few_at_a_time(tmp_path: Path,
                                                                  ordered: bool) -> None:
    data = b"".join(orjson.dumps({"id": f"r{i}", "text": f"t{i}"}) + b"\n"
                    for i in range(100))
    (tmp_path / "in.jsonl").write_bytes(data)
    sharded = open_input(FileLocation(tmp_path / "in.jsonl"), "jsonl", "text", "id", 5)
    gateway = SlowStandIn([])
    loop = JobLoop(gateway, PathPolicy.of([tmp_path]))  # type: ignore[arg-type]
    loop._shards = asyncio.Semaphore(2)
    spec = {"model": "m", "input": {"uri": "file:///x", "format": "jsonl"},
            "output": {"uri": f"file://{tmp_path}/o.parquet", "format": "parquet"}}
    run = JobRun(loop, JobRecord("job_1", spec, shard_rows=5), 1)
    run.plan = sharded.plan
    parts = FileParts(tmp_path / "parts")
    read: list[int] = []
    holding, most = 0, 0
    order_reads = ordered

    class Counted:
        """The input and the parts, counting the shards whose rows are held."""

        ordered = order_reads

        def read(self, index: int) -> Rows:
            nonlocal holding, most
            read.append(index)
            holding += 1
            most = max(most, holding)
            return sharded.read(index)

        def put(self, name: str, data: bytes) -> None:
            nonlocal holding
            holding -= 1
            parts.put(name, data)

    missing = [i for i in range(20) if i % 3]  # the others were done by an earlier run
    await run._compute(missing, Counted(), Counted())  # type: ignore[arg-type]
    assert (read if ordered else sorted(read)) == missing  # each once, none of the done
    assert sorted(done_shards(parts.names())) == missing
    assert 2 <= most <= 4  # 2 * job_shards_in_flight
    # each missing shard's rows went out once, whole; reads not ordered may finish in any order
    sent = [[f"t{i}" for i in range(5 * shard, 5 * shard + 5)] for shard in missing]
    assert (gateway.calls if ordered else sorted(gateway.calls, key=sent.index)) == sent
