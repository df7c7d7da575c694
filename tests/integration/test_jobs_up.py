"""A bulk job through `heron up` survives its faults: 20,000 rows on the null bundle (real
tokenization, no model compute), a worker killed, then the gateway that runs the job, then
nats-server, each mid-job (`heron up` restarts them); the Parquet output holds every row
once, in input order, with the vectors a direct encode call gives."""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import psutil
import pyarrow.parquet as pq
import pytest

from heron_sdk import Client
from tests.integration.test_up import UpProcess
from tests.support import local_http

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

ROWS = 20_000
POOL = "null"


def child(up: UpProcess, mark: str) -> psutil.Process:
    found = up.children_with(mark)
    assert found, f"no child with {mark!r}"
    return found[0]


def job_info(up: UpProcess, job_id: str) -> dict[str, Any] | None:
    """The job as any gateway answers (None while the gateway or NATS is away)."""
    try:
        answer = local_http.get(f"{up.url}/v1/jobs/{job_id}", timeout=3)
    except httpx.HTTPError:
        return None
    return answer.json() if answer.status_code == 200 else None


def wait_for(up: UpProcess, what: str, check: Any, timeout_s: float) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert up.proc.poll() is None, up.log.read_text()[-3000:]
        value = check()
        if value:
            return value
        time.sleep(0.1)
    raise TimeoutError(f"{what} not within {timeout_s} s:\n{up.log.read_text()[-3000:]}")


def ready_workers(up: UpProcess) -> int:
    try:
        ready = local_http.get(up.url + "/readyz", timeout=2)
    except httpx.HTTPError:
        return 0
    if ready.status_code != 200:
        return 0
    return int(ready.json()["pools"].get(POOL, {}).get("healthy_workers", 0))


def kill_at(up: UpProcess, job_id: str, rows: int, mark: str) -> int:
    """SIGKILL the child named by ``mark`` once the job has done ``rows`` rows; the rows
    done then (fewer than all: the fault is mid-job)."""
    info = wait_for(up, f"{rows} rows done", lambda: (
        (i := job_info(up, job_id)) is not None and i["rows_done"] >= rows and i), 90)
    assert info["state"] == "running" and info["rows_done"] < ROWS, info
    child(up, mark).send_signal(signal.SIGKILL)
    return int(info["rows_done"])


def test_a_job_survives_a_worker_its_gateway_and_nats(tmp_path: Path) -> None:
    data = tmp_path / "data"
    (data / "jobs").mkdir(parents=True)
    texts = [f"row {i}: " + " ".join(["word"] * (i % 13)) for i in range(ROWS)]
    source, out = data / "jobs" / "in.jsonl", data / "jobs" / "out.parquet"
    source.write_text("".join(json.dumps({"id": f"id-{i}", "text": t}) + "\n"
                              for i, t in enumerate(texts)))
    # One shard in flight and small shards: slow enough to strike mid-job. A short lease:
    # the restarted gateway (a new id) takes the job over 2 s after the old one died.
    up = UpProcess(tmp_path, "--bundle", "null", "--workers", "2", env={
        "HERON_GATEWAY_JOB_SHARD_ROWS": "50", "HERON_GATEWAY_JOB_SHARDS_IN_FLIGHT": "1",
        "HERON_GATEWAY_JOB_LEASE_S": "2", "HERON_STREAM_ACK_WAIT_S": "2"})
    try:
        t0 = time.monotonic()
        wait_for(up, "two ready workers", lambda: ready_workers(up) == 2, 120)
        t_ready = time.monotonic()
        with Client(up.url, timeout=30) as client:
            job = client.jobs.create("null-model",
                                     input={"uri": f"file://{source}", "format": "jsonl",
                                            "id_field": "id"},
                                     output={"uri": f"file://{out}", "format": "parquet"})
        struck = [kill_at(up, job.id, ROWS // 10, " worker "),
                  kill_at(up, job.id, ROWS * 3 // 10, " gateway "),
                  kill_at(up, job.id, ROWS * 5 // 10, "nats-server")]
        t_struck = time.monotonic()
        info = wait_for(up, "the job's end", lambda: (
            (i := job_info(up, job.id)) is not None and i["state"] in
            ("succeeded", "failed", "cancelled") and i), 120)
        assert info["state"] == "succeeded", info
        t_done = time.monotonic()
        assert (info["rows_total"], info["rows_done"], info["rows_failed"]) == (ROWS, ROWS, 0)
        assert info["runs"] >= 2, info  # the restarted gateway took it over
        log = up.log.read_text()
        assert "gateway restarted" in log and "nats restarted" in log, log[-3000:]

        table = pq.read_table(out)
        ids = table.column("id").to_pylist()
        assert ids == [f"id-{i}" for i in range(ROWS)]  # every row once, in input order
        assert table.column("error").null_count == ROWS
        dense = table.column("dense").combine_chunks()
        vectors = dense.flatten().to_numpy().reshape(ROWS, -1)
        with Client(up.url, timeout=60) as client:  # every row, by direct encode calls
            direct = client.encode("null-model", texts).dense
        np.testing.assert_array_equal(vectors, direct)
        print(f"faults struck at rows {struck}; seconds: start {t_ready - t0:.1f}, to the "
              f"last fault {t_struck - t_ready:.1f}, to the end {t_done - t_struck:.1f}")
    finally:
        code = up.stop()
    assert code == 0
