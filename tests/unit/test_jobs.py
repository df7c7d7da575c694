"""Bulk jobs without a server: where a job may read and write (every escape refused before
anything is opened), reading input rows, shard bookkeeping from part file names, the body's
parser, the job record, and the output joined from part files."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from heron.gateway.job_runner import JobLoop, JobRun
from heron.gateway.job_store import JobRecord
from heron.gateway.settings import GatewaySettings
from heron.runtime.job_files import (
    FileLocation,
    FileParts,
    PathPolicy,
    Rows,
    S3Location,
    ShardPlan,
    decode_part,
    done_shards,
    encode_part,
    parse_rows,
    part_name,
    parts_of,
)
from heron.runtime.job_output import NPY_ROWS_SUFFIX, Columns, write_output
from heron_sdk.errors import ErrorCode, HeronError
from heron_sdk.jobs import JobSpec


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    """root/ (allowed) with a file, a link to a file outside, a link to a folder outside."""
    (tmp_path / "root" / "sub").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    (tmp_path / "outside" / "secret.jsonl").write_text('{"text": "secret"}\n')
    (tmp_path / "root" / "in.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "root" / "out-link").symlink_to(tmp_path / "outside")
    (tmp_path / "root" / "file-link").symlink_to(tmp_path / "outside" / "secret.jsonl")
    (tmp_path / "root" / "inner-link").symlink_to(tmp_path / "root" / "in.jsonl")
    return tmp_path


def refusal(policy: PathPolicy, uri: str) -> HeronError:
    with pytest.raises(HeronError) as info:
        policy.check(uri, "input.uri")
    assert (info.value.status, info.value.code, info.value.field) == (
        403, "JOB_PATH_FORBIDDEN", "input.uri")
    return info.value


def test_paths_under_a_root_are_allowed_as_their_real_path(tree: Path) -> None:
    policy = PathPolicy.of([tree / "root"])
    assert policy.check(f"file://{tree}/root/in.jsonl", "f") == FileLocation(
        (tree / "root" / "in.jsonl").resolve())
    # a link that stays inside a root is fine: it is opened by its target's path
    assert policy.check(f"file://{tree}/root/inner-link", "f") == FileLocation(
        (tree / "root" / "in.jsonl").resolve())
    assert policy.check(f"file://localhost{tree}/root/sub/new.parquet", "f").path.name == \
        "new.parquet"  # an output that does not exist yet


@pytest.mark.parametrize("uri", [
    "file:///etc/passwd", "file://{t}/root/../outside/secret.jsonl",
    "file://{t}/root/%2e%2e/outside/secret.jsonl", "file://{t}/root/./in.jsonl",
    "file://{t}/root/out-link/secret.jsonl", "file://{t}/root/file-link",
    "file://{t}/rootx/in.jsonl", "file://evil.example{t}/root/in.jsonl", "file:root/in.jsonl",
    "/{t}/root/in.jsonl", "http://127.0.0.1/in.jsonl", "ftp://x/y", "s3://other/key",
    "s3://ok/a/../b", "s3://ok/", "file://{t}/root/in.jsonl?x=1",
])
def test_escapes_are_refused(tree: Path, uri: str) -> None:
    policy = PathPolicy.of([tree / "root"], ["ok"])
    refusal(policy, uri.replace("{t}", str(tree)))


def test_nothing_is_allowed_by_default(tree: Path) -> None:
    assert "HERON_JOB_ROOTS" in refusal(PathPolicy(), f"file://{tree}/root/in.jsonl").message
    assert "HERON_JOB_BUCKETS" in refusal(PathPolicy(), "s3://ok/key").message
    policy = PathPolicy.parse(f" {tree}/root , {tree}/outside ", "ok,b2")
    assert policy.check("s3://b2/a/b.parquet", "f") == S3Location("b2", "a/b.parquet")
    assert policy.check(f"file://{tree}/outside/secret.jsonl", "f")


def test_rows_of_each_format_and_bad_rows_fail_alone() -> None:
    rows = parse_rows(b'{"id": 7, "text": "a"}\n\n{"id": 8}\nnot json\n[1]\n{"text": "b"}\n',
                      "jsonl", "text", "id")
    assert rows.ids == ["7", "8", "#2", "#3", "#4"] and rows.texts == ["a", None, None, None,
                                                                        None]
    assert sorted(rows.errors) == [1, 2, 3, 4]
    assert all(e["code"] == "INVALID_FIELD" for e in rows.errors.values())
    numbered = parse_rows(b'{"t": "x"}\n{"t": "y"}\n', "jsonl", "t", None)
    assert numbered.ids == ["0", "1"] and numbered.texts == ["x", "y"]
    csv_rows = parse_rows('id,text\n1,héllo\n2,"a,b"\n'.encode(), "csv", "text", "id")
    assert csv_rows.texts == ["héllo", "a,b"] and csv_rows.ids == ["1", "2"]
    sink = pa.BufferOutputStream()
    pq.write_table(pa.table({"doc": ["p", None], "key": ["k1", "k2"]}), sink)
    parquet = parse_rows(sink.getvalue().to_pybytes(), "parquet", "doc", "key")
    assert parquet.ids == ["k1", "k2"] and parquet.texts == ["p", None]
    with pytest.raises(HeronError, match="input"):
        parse_rows(sink.getvalue().to_pybytes(), "parquet", "nope", None)


def test_shards_and_their_part_names() -> None:
    plan = ShardPlan(1000, 256)
    assert plan.count == 4 and plan.bounds(0) == (0, 256) and plan.bounds(3) == (768, 1000)
    with pytest.raises(IndexError):
        plan.bounds(4)
    done = done_shards([part_name(3, 2), part_name(0, 0), "x.msgpack",
                        ".part-000001-0.msgpack.ab12.tmp"])  # a rename never done: not done
    assert done == {3: 2, 0: 0}
    assert plan.missing(done) == [1, 2] and plan.rows_of(done) == 256 + 232
    assert ShardPlan(0, 256).count == 0 and ShardPlan(256, 256).count == 1


def test_the_body_parser() -> None:
    body = {"model": "m", "input": {"uri": "file:///d/in.jsonl", "format": "jsonl"},
            "output": {"uri": "file:///d/out.parquet", "format": "parquet"}, "dims": 8}
    spec = JobSpec.from_wire(body)
    assert spec.input.text_field == "text" and spec.input.id_field is None
    assert spec.options == {"dims": 8} and JobSpec.from_wire(spec.to_wire()) == spec
    for bad, field in [({**body, "priority": 1}, "priority"), ({**body, "dims": 0}, "dims"),
                       ({**body, "task": "score"}, "task"),
                       ({**body, "input": {**body["input"], "format": "xml"}}, "input.format"),
                       ({**body, "output": {"uri": "x"}}, "output.format"),
                       ({**body, "input": {**body["input"], "sep": ","}}, "input.sep")]:
        with pytest.raises(HeronError) as info:
            JobSpec.from_wire(bad)
        assert info.value.field == field and info.value.status == 422


def test_a_record_round_trips_and_leases_lapse() -> None:
    record = JobRecord("job_1", {"model": "m"}, shard_rows=10, owner="g", lease_until=100.0)
    assert JobRecord.from_kv(record.to_kv()) == record
    assert record.leased(99.0) and not record.leased(100.0)
    assert record.view()["state"] == "queued"


def _parts(folder: Path) -> FileParts:
    parts = FileParts(folder)
    vec = np.arange(3, dtype=np.float32)
    parts.put(part_name(0, 1), encode_part(["a", "b"], [{"dense": vec},
                                                        {"error": {"code": "INPUT_TOO_LONG",
                                                                   "message": "long"}}]))
    parts.put(part_name(1, 0), encode_part(["c"], [{"dense": vec + 1}]))
    return parts


@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "npy"])
def test_the_output_joins_the_parts_in_order(tmp_path: Path, fmt: str) -> None:
    out = FileLocation(tmp_path / f"out.{fmt}")
    parts = parts_of(out, "job_x")
    assert isinstance(parts, FileParts) and parts.folder.name == f"out.{fmt}.job_x.parts"
    _parts(parts.folder)
    done = done_shards(parts.names())
    write_output(out, fmt, parts, ShardPlan(3, 2), done, Columns(("dense",)), "float32")
    if fmt == "parquet":
        table = pq.read_table(out.path).to_pylist()
        assert [r["id"] for r in table] == ["a", "b", "c"]
        assert table[0]["dense"] == [0, 1, 2] and table[1]["dense"] is None
        assert table[1]["error_code"] == "INPUT_TOO_LONG" and table[2]["error"] is None
    elif fmt == "jsonl":
        lines = [json.loads(line) for line in out.path.read_text().splitlines()]
        assert [r["id"] for r in lines] == ["a", "b", "c"] and lines[2]["dense"] == [1, 2, 3]
    else:
        array = np.load(out.path)
        assert array.shape == (3, 3) and np.isnan(array[1]).all() and array[2][0] == 1
        side = (tmp_path / f"out.npy{NPY_ROWS_SUFFIX}").read_text().splitlines()
        assert [json.loads(line)["id"] for line in side] == ["a", "b", "c"]
    assert not [p for p in tmp_path.iterdir() if p.name.endswith(".tmp")]


# ---- a shard against a stand-in gateway -------------------------------------------------------
class StandIn:
    """The gateway as a shard sees it: ``encode_rows`` answers from a script, in turn
    (a HeronError is raised; ``"echo"`` answers every item with its text's length)."""

    gateway_id = "g1"

    def __init__(self, script: list[Any]) -> None:
        self.settings = GatewaySettings(job_shard_attempts=2)
        self.script = script
        self.calls: list[list[str]] = []

    async def encode_rows(self, model: str, req: Any) -> dict[str, Any]:
        texts = [item.text for item in req.items]
        self.calls.append(texts)
        assert req.options.priority == self.settings.job_priority
        step = self.script.pop(0)
        if isinstance(step, HeronError):
            raise step
        if step == "server-error":
            return {"items": [{"error": {"code": "INTERNAL", "message": "lost"}}
                              for _ in texts]}
        return {"items": [{"dense": np.array([len(t)], np.float32), "tokens": 1}
                          for t in texts]}


async def run_shard(tmp_path: Path, script: list[Any], texts: list[str | None]
                    ) -> tuple[StandIn, list[dict[str, Any]], int]:
    gateway = StandIn(script)
    loop = JobLoop(gateway, PathPolicy.of([tmp_path]))  # type: ignore[arg-type]
    loop._shards = asyncio.Semaphore(1)
    spec = {"model": "m", "input": {"uri": "file:///x", "format": "jsonl"},
            "output": {"uri": f"file://{tmp_path}/o.parquet", "format": "parquet"}}
    run = JobRun(loop, JobRecord("job_1", spec, shard_rows=len(texts)), 1)
    run.plan = ShardPlan(len(texts), len(texts))
    rows = Rows()
    for i, text in enumerate(texts):
        rows.add({"id": f"r{i}", "text": text}, "text", "id")
    tmp_path.mkdir(exist_ok=True)
    parts = FileParts(tmp_path / "parts")
    await run._shard(0, rows, parts)
    [name] = parts.names()
    ids, out = decode_part(parts.get(name))
    assert ids == [f"r{i}" for i in range(len(texts))]
    return gateway, out, done_shards([name])[0]


async def test_a_row_the_model_refuses_fails_alone(tmp_path: Path) -> None:
    too_long = HeronError(ErrorCode.INPUT_TOO_LONG, "items[1]: too long", field="items[1]")
    gateway, out, failed = await run_shard(tmp_path, [too_long, "ok"], ["a", "bb", None, "d"])
    assert gateway.calls == [["a", "bb", "d"], ["a", "d"]]  # the unreadable row never went
    assert failed == 2 and out[1]["error"]["code"] == "INPUT_TOO_LONG"
    assert out[2]["error"]["code"] == "INVALID_FIELD"
    assert np.asarray(out[3]["dense"]).tolist() == [1.0]
    assert "tokens" not in out[0]  # only the vectors are kept


async def test_backpressure_is_waited_out_and_server_failures_retried(tmp_path: Path) -> None:
    full = HeronError(ErrorCode.QUEUE_FULL, "busy", retry_after_s=0.01)
    gateway, out, failed = await run_shard(tmp_path, [full, "server-error", "ok"], ["a", "b"])
    assert len(gateway.calls) == 3 and failed == 0
    # past job_shard_attempts, rows failed server-side are recorded as failed
    gateway, out, failed = await run_shard(tmp_path / "2", ["server-error"] * 2, ["a"])
    assert failed == 1 and out[0]["error"]["code"] == "INTERNAL"


async def test_an_error_of_the_job_itself_fails_it(tmp_path: Path) -> None:
    with pytest.raises(HeronError, match="nope"):
        await run_shard(tmp_path, [HeronError(ErrorCode.MODEL_NOT_FOUND, "nope")], ["a"])
