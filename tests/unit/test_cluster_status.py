"""The cluster page's data: throughput from heartbeat counters (gateway/health.py) and the
snapshot the gateway pushes on /ws/cluster-status (gateway/status_page.py), read through
Starlette's TestClient against a real gateway app that has no NATS (beats are fed as its
NATS subscription would feed them, job records as its jobs bucket's watcher would)."""

from __future__ import annotations

from typing import Any

import pytest
from starlette.testclient import TestClient

from heron.gateway.app import create_app
from heron.gateway.health import THROUGHPUT_WINDOW_S, WorkerHealth
from heron.gateway.job_store import JobRecord
from heron.gateway.routes import GatewayApp
from heron.gateway.status_page import (
    GONE_SHOWN_S,
    JOB_TEXT_MAX_CHARS,
    JOBS_FINISHED_SHOWN,
    JOBS_UNFINISHED_SHOWN,
)
from tests.support.beats import Clock, beat


def test_throughput_is_the_counters_growth_over_the_window() -> None:
    clock = Clock()
    health = WorkerHealth(3.0, clock=clock)
    for second in range(30):  # 20 items/s of model a, 5 of model b, for 30 s
        health.observe(beat("w", items_done=25 * second,
                            model_items={"a": 20 * second, "b": 5 * second}))
        clock.now += 1.0
    clock.now -= 0.5  # half a second after the last beat
    rate = health.throughput(health.workers()[0])
    assert rate.items_per_s == pytest.approx(25.0)
    assert rate.model_items_per_s == pytest.approx({"a": 20.0, "b": 5.0})
    # only the window counts: a burst long ago does not linger
    assert len(health.workers()[0].counts) <= THROUGHPUT_WINDOW_S + 1


def test_throughput_is_zero_for_idle_gone_new_and_old_workers() -> None:
    clock = Clock()
    health = WorkerHealth(3.0, clock=clock)
    health.observe(beat("old"))  # a worker from before the counters: no items_done
    health.observe(beat("new", items_done=500))  # one beat: no time span yet
    for _ in range(3):
        clock.now += 1.0
        health.observe(beat("idle", items_done=40))
        health.observe(beat("old"))
    by_id = {w.worker_id: w for w in health.workers()}
    for worker_id in ("old", "new", "idle"):
        assert health.throughput(by_id[worker_id]).items_per_s == 0.0, worker_id
    for second in range(5):
        health.observe(beat("busy", items_done=100 * second))
        clock.now += 1.0
    busy = health.workers()[-1]
    assert health.throughput(busy).items_per_s == pytest.approx(100.0)
    clock.now += 3.0  # stopped beating: a dead worker computes nothing
    assert health.throughput(busy).items_per_s == 0.0


def test_a_counter_that_goes_back_starts_the_window_again() -> None:
    clock = Clock()
    health = WorkerHealth(3.0, clock=clock)
    for count in (1000, 2000, 3000, 10, 20):  # restarted with the same id after 3000
        health.observe(beat("w", items_done=count))
        clock.now += 1.0
    assert health.throughput(health.workers()[0]).items_per_s == pytest.approx(10.0)


def test_beats_with_bad_counters_are_dropped() -> None:
    health = WorkerHealth()
    health.observe(beat("w1", items_done="lots"))
    health.observe(beat("w2", model_items=["a"]))
    health.observe(beat("w3", model_memory={"m": "big"}))
    assert not health.workers()


# ---- the snapshot over the WebSocket ------------------------------------------------------
@pytest.fixture()
def gateway() -> tuple[GatewayApp, TestClient]:
    # Port 9 (discard) on loopback: nothing answers; the lifespan (NATS) is never entered.
    app = create_app("nats://127.0.0.1:9", {"null": "nullpool"})
    return app.state.gateway, TestClient(app)


def test_snapshot_shows_pools_workers_and_models(gateway: tuple[GatewayApp, TestClient]
                                                 ) -> None:
    g, client = gateway
    clock = Clock()
    g.health.clock = clock
    bundle_hash = g.registry.bundle_hash("nullpool")
    for second in range(4):
        g.health.observe(beat("w-1", pool="nullpool", bundle="null", bundle_hash=bundle_hash,
                              models={"heron/null": "ready"}, queue_depth=3, in_flight=2,
                              memory_rss=400 << 20, items_done=50 * second,
                              model_items={"heron/null": 50 * second},
                              model_memory={"heron/null": 12 << 20},
                              address="http://127.0.0.1:1"))
        clock.now += 1.0
    g.health.observe(beat("stranger", pool="elsewhere", bundle_hash="other"))
    g.health.observe(beat("w-dead", pool="nullpool", bundle="null", bundle_hash="stale"))
    clock.now += 5.0  # w-dead's last beat is 5 s old: gone
    g.health.observe(beat("w-1", pool="nullpool", bundle="null", bundle_hash=bundle_hash,
                          models={"heron/null": "ready"}, items_done=400,
                          model_items={"heron/null": 400}))

    with client.websocket_connect("/ws/cluster-status") as ws:
        snapshot = ws.receive_json()
    assert snapshot["type"] == "cluster_status" and snapshot["version"] == 1
    assert snapshot["gateway_id"] == g.gateway_id
    assert snapshot["nats_connected"] is False and snapshot["ready"] is False
    assert snapshot["throughput_window_s"] == THROUGHPUT_WINDOW_S
    assert snapshot["jobs"] == []  # no job yet: the page says so
    assert snapshot["job_counts"] == {"queued": 0, "running": 0, "succeeded": 0,
                                      "failed": 0, "cancelled": 0}

    assert snapshot["pools"] == [{
        "name": "nullpool", "bundle": "null", "kind": "static", "bundle_hash": bundle_hash,
        "workers": 1, "healthy_workers": 1, "outstanding_items": 0, "pending_demand": 0,
        "throughput_items_per_s": pytest.approx(400 / 9, abs=0.01)}]

    workers = {w["worker_id"]: w for w in snapshot["workers"]}
    assert set(workers) == {"w-1", "w-dead", "stranger"}
    alive = workers["w-1"]
    assert alive["state"] == "ready" and alive["ready"] is True
    assert alive["bundle_hash_matches"] is True and alive["last_beat_s"] == 0
    assert alive["models"] == {"heron/null": "ready"}
    assert alive["throughput_items_per_s"] == pytest.approx(400 / 9, abs=0.01)
    assert alive["model_throughput_items_per_s"] == {
        "heron/null": pytest.approx(400 / 9, abs=0.01)}
    dead = workers["w-dead"]
    assert dead["state"] == "gone" and dead["bundle_hash_matches"] is False
    assert dead["last_beat_s"] == 5.0 and dead["throughput_items_per_s"] == 0
    assert workers["stranger"]["bundle_hash_matches"] is None  # a pool not routed here

    assert snapshot["models"] == [{
        "id": "heron/null", "aliases": ["null-model"], "adapter": "null", "bundle": "null",
        "pool": "nullpool", "state": "ready", "ready_workers": 1,
        "throughput_items_per_s": pytest.approx(400 / 9, abs=0.01)}]

    clock.now += GONE_SHOWN_S + 1  # long gone workers leave the page
    with client.websocket_connect("/ws/cluster-status") as ws:
        snapshot = ws.receive_json()
    assert snapshot["workers"] == []
    assert snapshot["pools"][0]["healthy_workers"] == 0
    assert snapshot["models"][0]["state"] == "no_workers"


def test_whatever_a_client_sends_is_ignored(gateway: tuple[GatewayApp, TestClient]) -> None:
    g, client = gateway
    with client.websocket_connect("/ws/cluster-status") as ws:
        ws.receive_json()
        ws.send_text("{not json")
        ws.send_bytes(b"\x00\xff" * 1000)
        ws.send_json({"type": "subscribe", "pools": ["x"]})
        assert ws.receive_json()["type"] == "cluster_status"  # the next push still comes
    assert client.get("/healthz").status_code == 200
    assert g.dispatcher.pending_requests() == 0


def test_the_page_and_only_its_files_are_served(gateway: tuple[GatewayApp, TestClient]
                                               ) -> None:
    _, client = gateway
    page = client.get("/")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert "<title>Heron cluster</title>" in page.text
    assert "script-src 'self'" in page.headers["content-security-policy"]
    for name, kind in (("cluster.js", "text/javascript"), ("cluster.css", "text/css")):
        asset = client.get(f"/static/{name}")
        assert asset.status_code == 200 and asset.headers["content-type"].startswith(kind)
        assert f"static/{name}" in page.text
    # nothing else under /static, and no way out of it
    for path in ("/static/cluster.html", "/static/..%2Fstatus_page.py", "/static/x.js"):
        assert client.get(path).status_code == 404, path
    # no page asset comes from elsewhere: the page works offline
    for text in (page.text, client.get("/static/cluster.js").text,
                 client.get("/static/cluster.css").text):
        assert "http://" not in text.replace("http://www.w3.org/2000/svg", "")
        assert "https://" not in text and "//cdn" not in text


# ---- bulk jobs in the snapshot ------------------------------------------------------------
def job(n: int, state: str = "queued", *, created_at: float = 0.0,
        finished_at: float | None = None, rows_total: int | None = None, rows_done: int = 0,
        model: str = "heron/null", output_uri: str | None = None,
        **extra: Any) -> JobRecord:
    return JobRecord(id=f"job_{n:020x}", shard_rows=256, state=state,
                     spec={"model": model, "input": {"uri": "file:///d/in.jsonl"},
                           "output": {"uri": output_uri or f"file:///d/out-{n}.parquet"}},
                     created_at=created_at, finished_at=finished_at, rows_total=rows_total,
                     rows_done=rows_done, **extra)


def show_jobs(g: GatewayApp, client: TestClient, *records: JobRecord) -> dict[str, Any]:
    """The snapshot a page gets once the gateway's job mirror holds ``records``."""
    g.jobs.loop.mirror.records = {r.id: (r, 1) for r in records}
    with client.websocket_connect("/ws/cluster-status") as ws:
        snapshot: dict[str, Any] = ws.receive_json()
    return snapshot


def test_jobs_running_first_then_queued_then_the_last_finished(
        gateway: tuple[GatewayApp, TestClient]) -> None:
    g, client = gateway
    records = [
        job(1, "queued", created_at=50.0),
        job(2, "running", created_at=200.0, rows_total=1000, rows_done=999, rows_failed=4,
            rows_per_s=250.0, eta_s=0.4, owner="gw-b"),
        job(3, "running", created_at=100.0, rows_total=10_000, rows_done=9_999,
            owner="gw-a"),
        job(4, "queued", created_at=300.0),
        # finished 1000 + n seconds in: 20 succeeded, one failed, one cancelled
        *(job(n, "succeeded", created_at=n, finished_at=1000.0 + n, rows_total=n,
              rows_done=n, eta_s=0.0) for n in range(10, 30)),
        job(40, "failed", created_at=40.0, finished_at=1040.0, rows_total=None,
            error={"code": "INVALID_FIELD", "message": "input.uri: row 3 says 'secret'"}),
        job(41, "cancelled", created_at=41.0, finished_at=1026.5, rows_total=80,
            rows_done=20),
    ]
    snapshot = show_jobs(g, client, *reversed(records))  # the mirror's order is no order
    jobs = snapshot["jobs"]
    ids = [j["id"] for j in jobs]
    newest_finished = [job(n).id for n in (40, 29, 28, 27, 41, 26, 25, 24, 23, 22)]
    assert ids == [job(3).id, job(2).id, job(1).id, job(4).id, *newest_finished]
    assert len(newest_finished) == JOBS_FINISHED_SHOWN
    assert snapshot["job_counts"] == {"queued": 2, "running": 2, "succeeded": 20,
                                      "failed": 1, "cancelled": 1}

    by_id = {j["id"]: j for j in jobs}
    assert by_id[job(2).id] == {
        "id": job(2).id, "model": "heron/null", "state": "running", "rows_total": 1000,
        "rows_done": 999, "rows_failed": 4, "percent": 99.9, "rows_per_s": 250.0,
        "eta_s": 0.4, "owner": "gw-b", "output_uri": "file:///d/out-2.parquet",
        "error_code": None, "created_at": 200.0, "finished_at": None}
    # floored: 9,999 of 10,000 rows is not shown as done
    assert by_id[job(3).id]["percent"] == 99.9
    assert by_id[job(1).id]["percent"] is None  # queued: its size is not known yet
    assert by_id[job(29).id]["percent"] == 100.0
    assert by_id[job(41).id]["percent"] == 25.0
    failed = by_id[job(40).id]
    assert failed["state"] == "failed" and failed["error_code"] == "INVALID_FIELD"
    assert "secret" not in str(snapshot)  # the message may quote the input: not shown


def test_the_jobs_shown_are_bounded_however_many_there_are(
        gateway: tuple[GatewayApp, TestClient]) -> None:
    g, client = gateway
    records = [job(n, "queued", created_at=float(n), model="m" * 100_000,
                   output_uri="file:///" + "u" * 100_000) for n in range(500)]
    records += [job(n, "succeeded", created_at=float(n), finished_at=float(n),
                    rows_total=1, rows_done=1) for n in range(500, 3500)]
    snapshot = show_jobs(g, client, *records)
    jobs = snapshot["jobs"]
    assert len(jobs) == JOBS_UNFINISHED_SHOWN + JOBS_FINISHED_SHOWN
    # the oldest queued (the next to run) and the newest finished
    assert jobs[0]["id"] == job(0).id and jobs[JOBS_UNFINISHED_SHOWN]["id"] == job(3499).id
    assert len(jobs[0]["model"]) == len(jobs[0]["output_uri"]) == JOB_TEXT_MAX_CHARS
    assert snapshot["job_counts"]["queued"] == 500
    assert snapshot["job_counts"]["succeeded"] == 3000
    assert g.status_page is not None
    assert len(g.status_page.encoded_snapshot()) < 64 << 10
