"""Bulk jobs through a real gateway (in a thread) on a real nats-server, with a fake worker
(tests/support/gateway_harness.py) whose vectors are known from the texts: the API, the
SDK, every input and output format, bad rows failing alone, cancel, and paths outside the
allowed root refused with 403 before anything is opened. (The kill test, through
`heron up` with a real worker, is tests/integration/test_jobs_up.py.)"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from heron.gateway.settings import GatewaySettings
from heron_sdk import AsyncClient, Client
from heron_sdk.errors import HeronError
from tests.integration.test_cli_client import heron
from tests.support.config_procs import MotoS3
from tests.support.gateway_harness import (
    FakeWorker,
    GatewayThread,
    fake_vector,
    unique,
    write_bundles,
)
from tests.support.nats_server import NatsServer


@dataclass
class Rig:
    url: str
    root: Path  # the jobs root
    outside: Path  # a folder next to it that jobs may not touch
    worker: FakeWorker
    nats_url: str
    pools: dict[str, str]
    bundles: Path


@pytest.fixture(scope="module")
def rig(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Rig]:
    """Its own nats-server (no other test's gateway runs these jobs); bundle ``jb`` has a
    fake worker, ``jcold`` none (its jobs wait for capacity)."""
    tmp = tmp_path_factory.mktemp("jobs")
    server = NatsServer(tmp / "nats").start()
    bundles = write_bundles(tmp / "bundles", {"jb": ["dense", "sparse"], "jcold": ["dense"]})
    pools = {"jb": unique("jb"), "jcold": unique("jcold")}
    worker = FakeWorker(server.url, pools["jb"], "jb").start()
    root, outside = tmp / "root", tmp / "outside"
    root.mkdir()
    outside.mkdir()
    settings = GatewaySettings(job_roots=str(root), job_buckets="jobs-s3", job_shard_rows=40,
                               job_lease_s=1.5, startup_grace_s=1.0)
    gateway = GatewayThread(server.url, pools, bundles, settings).start()
    try:
        gateway.wait_for_capacity(pools["jb"], 10)  # its first beat may outlast the grace
        yield Rig(gateway.url, root, outside, worker, server.url, pools, bundles)
    finally:
        gateway.stop()
        worker.stop()
        server.stop()


def body(source: str, out: str, fmt: str = "jsonl", out_fmt: str = "parquet",
         **extra: object) -> dict[str, object]:
    return {"model": "jb-dense", "input": {"uri": source, "format": fmt, "id_field": "id"},
            "output": {"uri": out, "format": out_fmt}, **extra}


def texts_of(n: int) -> list[str]:
    return [f"row {i} " + "w" * (i % 9) for i in range(n)]


def test_a_jsonl_job_writes_every_row_once_with_bad_rows_failed(rig: Rig) -> None:
    texts = texts_of(500)
    lines = [json.dumps({"id": f"r{i}", "text": t}) for i, t in enumerate(texts)]
    lines[7] = json.dumps({"id": "r7"})  # no text
    lines[99] = "{not json"
    lines[250] = json.dumps({"id": "r250", "text": "boom"})  # the worker refuses it (422)
    source = rig.root / "in.jsonl"
    source.write_text("\n".join(lines) + "\n")
    out = rig.root / "out.parquet"
    with Client(rig.url, timeout=30) as client:
        job = client.jobs.create("jb-dense", input={"uri": f"file://{source}",
                                                    "format": "jsonl", "id_field": "id"},
                                 output={"uri": f"file://{out}", "format": "parquet"})
        assert job.state in ("queued", "running") and job.id.startswith("job_")
        job.wait(timeout_s=60, poll_s=0.2)
        assert [j.id for j in client.jobs.list()].count(job.id) == 1
    info = job.info
    assert info["state"] == "succeeded" and info["rows_total"] == 500
    assert (info["rows_done"], info["rows_failed"]) == (500, 3)
    assert info["shards_total"] == info["shards_done"] == 13
    assert info["output_uri"] == f"file://{out}" and info["eta_s"] == 0
    rows = pq.read_table(out).to_pylist()
    assert [r["id"] for r in rows] == [f"r{i}" if i != 99 else "#99" for i in range(500)]
    failed = {r["id"]: r["error_code"] for r in rows if r["error_code"]}
    assert failed == {"r7": "INVALID_FIELD", "#99": "INVALID_FIELD",
                      "r250": "INPUT_TOO_LONG"}
    for i, row in enumerate(rows):
        if row["id"] not in failed:
            assert row["dense"] == fake_vector(texts[i]).tolist(), i
    deadline = time.monotonic() + 10  # deleted once the success is recorded
    while list(rig.root.glob("*.parts")):
        assert time.monotonic() < deadline, "the part files are deleted at the end"
        time.sleep(0.05)


def test_csv_to_npy_and_parquet_to_jsonl(rig: Rig) -> None:
    texts = texts_of(90)
    (rig.root / "in.csv").write_text("id,text\n" + "".join(
        f'{i},"{t}"\n' for i, t in enumerate(texts)))
    pq.write_table(pa.table({"id": [f"p{i}" for i in range(90)], "text": texts}),
                   rig.root / "in.parquet")
    with httpx.Client(base_url=rig.url, timeout=30) as http:
        ids = []
        for request in (body(f"file://{rig.root}/in.csv", f"file://{rig.root}/out.npy",
                             "csv", "npy"),
                        body(f"file://{rig.root}/in.parquet", f"file://{rig.root}/o.jsonl",
                             "parquet", "jsonl", output_types=["dense"], dims=2)):
            answer = http.post("/v1/jobs", json=request)
            assert answer.status_code == 202, answer.text
            ids.append(answer.json()["id"])
        for job_id in ids:
            deadline = time.monotonic() + 60
            while (info := http.get(f"/v1/jobs/{job_id}").json())["state"] != "succeeded":
                assert time.monotonic() < deadline, f"job {job_id} not done in 60 s: {info}"
                time.sleep(0.2)
    array = np.load(rig.root / "out.npy")
    np.testing.assert_array_equal(array, np.stack([fake_vector(t) for t in texts]))
    side = (rig.root / "out.npy.rows.jsonl").read_text().splitlines()
    assert [json.loads(line)["id"] for line in side] == [str(i) for i in range(90)]
    lines = [json.loads(line) for line in (rig.root / "o.jsonl").read_text().splitlines()]
    assert [line["id"] for line in lines] == [f"p{i}" for i in range(90)]
    assert lines[3]["dense"] == fake_vector(texts[3]).tolist() and lines[3]["error"] is None


def test_cancel_stops_a_job_and_removes_its_parts(rig: Rig) -> None:
    (rig.root / "cold.jsonl").write_text("".join(
        json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts_of(100))))
    with httpx.Client(base_url=rig.url, timeout=30) as http:
        request = body(f"file://{rig.root}/cold.jsonl", f"file://{rig.root}/cold.parquet")
        answer = http.post("/v1/jobs", json={**request, "model": "jcold-dense"})
        assert answer.status_code == 202, answer.text
        job_id = answer.json()["id"]
        deadline = time.monotonic() + 20
        while http.get(f"/v1/jobs/{job_id}").json()["state"] != "running":
            assert time.monotonic() < deadline
            time.sleep(0.1)
        parts = rig.root / f"cold.parquet.{job_id}.parts"  # as if a shard had finished
        parts.mkdir()
        (parts / "part-000000-0.msgpack").write_bytes(b"")
        cancelled = http.delete(f"/v1/jobs/{job_id}")
        assert cancelled.status_code == 200 and cancelled.json()["state"] == "cancelled"
        again = http.delete(f"/v1/jobs/{job_id}")
        assert again.status_code == 200 and again.json()["state"] == "cancelled"
        deadline = time.monotonic() + 10  # the run sees it at its next lease renewal
        while parts.exists():
            assert time.monotonic() < deadline, "the cancelled job's parts are still there"
            time.sleep(0.1)
        assert http.get(f"/v1/jobs/{job_id}").json()["state"] == "cancelled"
        missing = http.get("/v1/jobs/job_nope")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == \
            "JOB_NOT_FOUND"
    assert not (rig.root / "cold.parquet").exists()


@pytest.mark.parametrize(("source", "out", "field"), [
    ("file:///etc/passwd", "{root}/o.parquet", "input.uri"),
    ("file://{root}/../outside/fifo", "{root}/o.parquet", "input.uri"),
    ("file://{root}/link/fifo", "{root}/o.parquet", "input.uri"),
    ("file://{root}/fifo-link", "{root}/o.parquet", "input.uri"),
    ("s3://unlisted-bucket/in.jsonl", "{root}/o.parquet", "input.uri"),
    ("http://127.0.0.1:1/in.jsonl", "{root}/o.parquet", "input.uri"),
    ("file://{root}/in.jsonl", "{root}/link/o.parquet", "output.uri"),
    ("file://{root}/in.jsonl", "/tmp/o.parquet", "output.uri"),
])
def test_paths_outside_the_roots_are_403_and_read_nothing(rig: Rig, source: str, out: str,
                                                          field: str) -> None:
    """The escapes lead to a FIFO: opening it to read would block the request (and the
    test would time out), so a quick 403 shows nothing was opened."""
    fifo = rig.outside / "fifo"
    if not fifo.exists():
        os.mkfifo(fifo)
        (rig.root / "link").symlink_to(rig.outside)
        (rig.root / "fifo-link").symlink_to(fifo)
        (rig.root / "in.jsonl").write_text('{"id": 1, "text": "a"}\n')
    request = body(source.replace("{root}", str(rig.root)),
                   "file://" + out.replace("{root}", str(rig.root)))
    with httpx.Client(base_url=rig.url, timeout=10) as http:
        answer = http.post("/v1/jobs", json=request)
        assert answer.status_code == 403, answer.text
        error = answer.json()["error"]
        assert (error["code"], error["field"]) == ("JOB_PATH_FORBIDDEN", field)
        # No job was made for it (the list is the gateway's watched copy: other tests'
        # jobs may show up in it late, so the count alone would not tell).
        time.sleep(0.3)
        assert not [job for job in http.get("/v1/jobs").json()["data"]
                    if (job["input"], job["output"]) == (request["input"], request["output"])]


def test_bad_jobs_are_refused_before_they_start(rig: Rig) -> None:
    (rig.root / "ok.jsonl").write_text('{"id": 1, "text": "a"}\n')
    source, out = f"file://{rig.root}/ok.jsonl", f"file://{rig.root}/x.parquet"
    cases = [
        ({**body(source, out), "model": "nope"}, 404, "MODEL_NOT_FOUND"),
        (body(f"file://{rig.root}/absent.jsonl", out), 422, "INVALID_FIELD"),
        (body(source, f"file://{rig.root}/no/such/dir/x.parquet"), 422, "INVALID_FIELD"),
        (body(source, f"file://{rig.root}/x.npy", out_fmt="npy",
              output_types=["sparse"]), 422, "UNSUPPORTED_OUTPUT"),
        (body(source, f"file://{rig.root}/x.npy", out_fmt="npy",
              chunking={"max_tokens": 8}), 422, "INVALID_FIELD"),  # one vector a row
        ({**body(source, out), "chunking": {"pool": "max"}}, 422, "INVALID_FIELD"),
        ({**body(source, out), "priority": 0}, 422, "INVALID_FIELD"),
    ]
    with httpx.Client(base_url=rig.url, timeout=10) as http:
        for request, status, code in cases:
            answer = http.post("/v1/jobs", json=request)
            assert (answer.status_code, answer.json()["error"]["code"]) == (status, code), \
                answer.text
    with Client(rig.url) as client, pytest.raises(HeronError) as info:
        client.jobs.create("jb-dense", input={"uri": source, "format": "xml"},
                           output={"uri": out, "format": "parquet"})
    assert info.value.field == "input.format"  # refused by the SDK before it is sent


def test_s3_input_and_output(rig: Rig, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A real S3 API (moto's server on loopback): the gateway (in this process) reads and
    writes with the environment's endpoint and credentials."""
    moto = MotoS3(tmp_path)
    try:
        env = moto.weights_env("jobs-s3")
        for key in ("AWS_ENDPOINT_URL", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
                    "AWS_DEFAULT_REGION"):
            monkeypatch.setenv(key, env[key])
        from heron.runtime.job_files import s3_client

        s3 = s3_client()
        texts = texts_of(120)
        s3.put_object(Bucket="jobs-s3", Key="in/rows.jsonl", Body="".join(
            json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts)).encode())
        with Client(rig.url, timeout=30) as client:
            job = client.jobs.create(
                "jb-dense", input={"uri": "s3://jobs-s3/in/rows.jsonl", "format": "jsonl",
                                   "id_field": "id"},
                output={"uri": "s3://jobs-s3/out/rows.jsonl", "format": "jsonl"})
            job.wait(timeout_s=60, poll_s=0.2)
            with pytest.raises(HeronError) as info:  # a bucket not on the list
                client.jobs.create("jb-dense", input={"uri": "s3://other/in.jsonl",
                                                      "format": "jsonl"},
                                   output={"uri": "s3://jobs-s3/o.jsonl", "format": "jsonl"})
            assert (info.value.status, info.value.code) == (403, "JOB_PATH_FORBIDDEN")
        body = s3.get_object(Bucket="jobs-s3", Key="out/rows.jsonl")["Body"].read()
        lines = [json.loads(line) for line in body.decode().splitlines()]
        assert [line["id"] for line in lines] == [str(i) for i in range(120)]
        assert lines[5]["dense"] == fake_vector(texts[5]).tolist()
        deadline = time.monotonic() + 10  # the parts go just after success is recorded
        while [o["Key"] for o in s3.list_objects_v2(
                Bucket="jobs-s3", Prefix="out/")["Contents"]] != ["out/rows.jsonl"]:
            assert time.monotonic() < deadline, "the job's parts are still there"
            time.sleep(0.05)
    finally:
        moto.stop()


def test_heron_jobs_from_a_terminal(rig: Rig) -> None:
    (rig.root / "cli.jsonl").write_text("".join(
        json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts_of(30))))
    with Client(rig.url) as client:
        job = client.jobs.create("jb-dense", input={"uri": f"file://{rig.root}/cli.jsonl",
                                                    "format": "jsonl"},
                                 output={"uri": f"file://{rig.root}/cli.jsonl.out",
                                         "format": "jsonl"})
    shown = heron("jobs", "--url", rig.url, "show", job.id, "--wait", "--poll", "0.2")
    assert shown.returncode == 0, shown.stderr
    info = json.loads(shown.stdout)
    assert (info["state"], info["rows_done"]) == ("succeeded", 30)
    listed = heron("jobs", "--url", rig.url, "list")
    assert listed.returncode == 0 and job.id in listed.stdout and "succeeded" in listed.stdout
    cancelled = heron("jobs", "--url", rig.url, "cancel", job.id)  # finished: as it is
    assert cancelled.returncode == 0 and json.loads(cancelled.stdout)["state"] == "succeeded"
    missing = heron("jobs", "--url", rig.url, "show", "job_nope")
    assert missing.returncode == 1 and "JOB_NOT_FOUND [404]" in missing.stderr


async def test_the_async_client(rig: Rig) -> None:
    (rig.root / "async.jsonl").write_text("".join(
        json.dumps({"id": i, "text": t}) + "\n" for i, t in enumerate(texts_of(45))))
    async with AsyncClient(rig.url, timeout=30) as client:
        job = await client.jobs.create(
            "jb-dense", input={"uri": f"file://{rig.root}/async.jsonl", "format": "jsonl"},
            output={"uri": f"file://{rig.root}/async.parquet", "format": "parquet"})
        await job.wait(timeout_s=60, poll_s=0.2)
        assert job.state == "succeeded" and job.info["rows_done"] == 45
        assert job.id in [j.id for j in await client.jobs.list()]
    assert pq.read_table(rig.root / "async.parquet").num_rows == 45


def test_a_stopping_gateway_gives_its_jobs_up(rig: Rig) -> None:
    """A gateway stopped (SIGTERM, a rolling upgrade) hands its jobs over at once: another
    gateway runs them long before the first one's lease (30 s here) would have lapsed.
    The job's folder is a root of these two gateways only, so the rig's never claims it."""
    folder = rig.outside / "handover"
    folder.mkdir(exist_ok=True)
    (folder / "in.jsonl").write_text('{"id": 1, "text": "a"}\n')

    def gateway() -> GatewayThread:
        return GatewayThread(rig.nats_url, rig.pools, rig.bundles, GatewaySettings(
            job_roots=str(folder), job_lease_s=30, startup_grace_s=0.5)).start()

    leaving = gateway()
    successor: GatewayThread | None = None
    request = {**body(f"file://{folder}/in.jsonl", f"file://{folder}/h.parquet"),
               "model": "jcold-dense"}  # no worker: it runs until cancelled
    try:
        with httpx.Client(timeout=10) as http:
            def info(job_id: str) -> dict[str, Any]:
                return http.get(f"{rig.url}/v1/jobs/{job_id}").json()

            def running_on(gateway: GatewayThread, runs: int) -> bool:
                # The record is written before the claiming gateway's thread files the run
                # as its own, so a loaded machine can show the one without the other.
                return (info(job_id)["runs"] == runs
                        and job_id in gateway.gateway.jobs.loop.runs)

            job_id = http.post(f"{leaving.url}/v1/jobs", json=request).json()["id"]
            deadline = time.monotonic() + 10
            while not running_on(leaving, 1):
                assert time.monotonic() < deadline, info(job_id)
                time.sleep(0.05)
            successor = gateway()
            leaving.stop()
            stopped = time.monotonic()
            while not running_on(successor, 2):
                assert time.monotonic() - stopped < 5, info(job_id)
                time.sleep(0.05)
            assert info(job_id)["state"] == "running"
            assert http.delete(f"{rig.url}/v1/jobs/{job_id}").json()["state"] == "cancelled"
    finally:
        leaving.stop()
        if successor is not None:
            successor.stop()
