"""The live cluster page on a real cluster: nats-server, a gateway (uvicorn on loopback)
and a `heron worker` serving the null bundle, read by headless Chromium and by a plain
WebSocket client, as a person and a script would read them; bulk jobs run on that worker
(a file under the gateway's job root) show there with their progress.

Set HERON_CLUSTER_PAGE_SCREENSHOT=docs/img/cluster-page.png to refresh the docs' screenshot
(otherwise it goes to the test's temp dir)."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import shutil
import signal
import socket
import struct
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from heron.gateway.settings import GatewaySettings
from heron.gateway.status_page import MAX_CLIENTS
from tests.support import local_http
from tests.support.gateway_harness import GatewayThread, start_worker, unique
from tests.support.nats_server import NatsServer
from tests.support.servers import ServerProcess

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
NULL_MODEL = "heron/null"


@pytest.fixture(scope="module")
def pool() -> str:
    return unique("page")


@pytest.fixture(scope="module")
def job_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder this module's gateway lets bulk jobs read and write (only its own)."""
    return tmp_path_factory.mktemp("page-jobs")


@pytest.fixture(scope="module")
def gateway(nats_server: NatsServer, pool: str, job_root: Path) -> Iterator[GatewayThread]:
    gateway = GatewayThread(nats_server.url, {"null": pool},
                            settings=GatewaySettings(job_roots=str(job_root))).start()
    yield gateway
    gateway.stop()


@pytest.fixture()
def worker(nats_server: NatsServer, pool: str, tmp_path: Path) -> Iterator[ServerProcess]:
    """A `heron worker` of the null bundle (a real tokenizer, no forward pass: starts in
    seconds), stopped by its PID."""
    worker = start_worker(nats_server.url, pool, "null", tmp_path, timeout_s=90)
    yield worker
    worker.stop()


def worker_id(worker: ServerProcess) -> str:
    return f"w-{worker.url.rsplit(':', 1)[1]}"  # start_worker names it after its port


def ws_url(gateway: GatewayThread) -> str:
    return gateway.url.replace("http://", "ws://") + "/ws/cluster-status"


def wait_for(check: Callable[[], Any], timeout_s: float, what: str) -> Any:
    """Poll ``check`` until it returns something truthy (bounded, never a bare sleep)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout_s}s: {what}")
        time.sleep(0.1)


def snapshot_where(ws: ClientConnection, check: Callable[[dict[str, Any]], bool],
                   timeout_s: float) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        remaining = deadline - time.monotonic()
        assert remaining > 0, f"no snapshot matched within {timeout_s}s"
        snapshot = json.loads(ws.recv(timeout=remaining))
        assert snapshot["type"] == "cluster_status"
        if check(snapshot):
            return snapshot


def workers_of(snapshot: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {w["worker_id"]: w for w in snapshot["workers"]}


def job_of(snapshot: dict[str, Any], job_id: str) -> dict[str, Any] | None:
    return next((j for j in snapshot.get("jobs", []) if j["id"] == job_id), None)


JOB_ROWS = 41  # one of them not JSON: it fails alone
JOB_MODEL = "null-model"  # the null model's alias: shown as the job names it, like GET /v1/jobs


def start_job(gateway: GatewayThread, root: Path, name: str) -> tuple[str, str]:
    """A small bulk job on the null model (one shard): its id and its output's URI."""
    lines = [json.dumps({"id": i, "text": f"row {i}"}) for i in range(JOB_ROWS)]
    lines[5] = "{not json"
    (root / f"{name}.jsonl").write_text("\n".join(lines) + "\n")
    output = f"file://{root}/{name}.parquet"
    r = local_http.post(gateway.url + "/v1/jobs", timeout=10, json={
        "model": JOB_MODEL,
        "input": {"uri": f"file://{root}/{name}.jsonl", "format": "jsonl", "id_field": "id"},
        "output": {"uri": output, "format": "parquet"}})
    assert r.status_code == 202, r.text
    return r.json()["id"], output


# ---- the feed, read by a script ---------------------------------------------------------
def test_feed_shows_the_worker_its_throughput_and_a_job(gateway: GatewayThread,
                                                        worker: ServerProcess, pool: str,
                                                        job_root: Path) -> None:
    me = worker_id(worker)
    with connect(ws_url(gateway), open_timeout=10) as ws:
        snapshot = snapshot_where(ws, lambda s: workers_of(s).get(me, {}).get("state")
                                  == "ready", 20)
        shown = workers_of(snapshot)[me]
        assert shown["pool"] == pool and shown["bundle"] == "null"
        assert shown["models"] == {NULL_MODEL: "ready"}
        assert shown["bundle_hash_matches"] is True and shown["memory_rss"] > 10 << 20
        assert shown["address"] == worker.url
        pools = {p["name"]: p for p in snapshot["pools"]}
        assert pools[pool]["healthy_workers"] >= 1 and pools[pool]["kind"] == "static"
        models = {m["id"]: m for m in snapshot["models"]}
        assert models[NULL_MODEL]["state"] == "ready"

        r = local_http.post(gateway.url + "/v1/encode/null-model",
                            json={"items": [f"text {i}" for i in range(300)]}, timeout=30)
        assert r.status_code == 200, r.text
        snapshot = snapshot_where(
            ws, lambda s: workers_of(s)[me]["throughput_items_per_s"] > 0, 10)
        assert workers_of(snapshot)[me]["model_throughput_items_per_s"][NULL_MODEL] > 0
        pools = {p["name"]: p for p in snapshot["pools"]}
        assert pools[pool]["throughput_items_per_s"] > 0
        models = {m["id"]: m for m in snapshot["models"]}
        assert models[NULL_MODEL]["throughput_items_per_s"] > 0

        # A bulk job: shown from the snapshot after its creation until it is done, its rows
        # done never going back and reaching its rows total.
        job_id, output = start_job(gateway, job_root, "feed")
        seen: list[dict[str, Any]] = []

        def job_done(s: dict[str, Any]) -> bool:
            shown = job_of(s, job_id)
            assert shown is not None, f"job {job_id} missing from {s.get('jobs')}"
            seen.append(shown)
            return shown["state"] == "succeeded"

        snapshot_where(ws, job_done, 15)
        done = seen[-1]
        assert done["model"] == JOB_MODEL and done["output_uri"] == output
        # Its gateway while it runs (the only one with this root), none once it has ended.
        assert done["owner"] is None
        assert {j["owner"] for j in seen if j["state"] == "running"} <= \
            {gateway.gateway.gateway_id}
        assert (done["rows_done"], done["rows_total"], done["rows_failed"]) == \
            (JOB_ROWS, JOB_ROWS, 1)
        assert done["percent"] == 100.0 and done["error_code"] is None
        assert done["finished_at"] >= done["created_at"]
        progress = [j["rows_done"] for j in seen]
        assert progress == sorted(progress), progress
        assert all(j["percent"] is None or 0 <= j["percent"] <= 100 for j in seen), seen
        assert snapshot_where(ws, lambda s: True, 5)["job_counts"]["succeeded"] >= 1


def handshake(port: int) -> socket.socket:
    """A WebSocket opening handshake by hand, so the test can then misbehave freely."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=5)
    key = base64.b64encode(os.urandom(16)).decode()
    sock.sendall((f"GET /ws/cluster-status HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                  "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                  f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n").encode())
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        assert chunk, "the gateway closed during the handshake"
        head += chunk
    assert head.startswith(b"HTTP/1.1 101"), head[:200]
    return sock


def vanish(sock: socket.socket) -> None:
    """Go away without a close frame: a reset, as a crashed browser tab would."""
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def test_bad_clients_do_not_break_the_feed(gateway: GatewayThread) -> None:
    port = gateway.port
    with connect(ws_url(gateway), open_timeout=10) as ws:
        ws.recv(timeout=10)
        ws.send("{this is not json")
        ws.send(os.urandom(256 << 10))  # a quarter MiB of binary noise
        ws.send(json.dumps({"type": "subscribe", "pool": "*"}))
        assert json.loads(ws.recv(timeout=10))["type"] == "cluster_status"

    # Invalid frames after the handshake: the connection is closed, nothing else happens.
    sock = handshake(port)
    sock.sendall(b"\xff\xff" + os.urandom(64))
    with contextlib.suppress(OSError):
        while sock.recv(65536):
            pass
    sock.close()
    # Not a WebSocket at all, and a handshake cut off in the middle.
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        raw.sendall(b"GET /ws/cluster-status HTTP/1.1\r\nHost: x\r\n\r\n")
        assert raw.recv(4096).split(b" ")[1] in (b"400", b"403", b"404", b"426")
    with socket.create_connection(("127.0.0.1", port), timeout=5) as raw:
        raw.sendall(b"GET /ws/cluster-status HTTP/1.1\r\nUpgrade: webs")

    # More clients than the gateway serves at once, each vanishing: every slot comes back.
    for _ in range(MAX_CLIENTS + 6):
        vanish(handshake(port))

    def a_fresh_client_is_served() -> bool:
        try:
            with connect(ws_url(gateway), open_timeout=5) as fresh:
                return json.loads(fresh.recv(timeout=5))["type"] == "cluster_status"
        except (ConnectionClosed, InvalidStatus, TimeoutError):
            return False  # closed 1013 (full) until the vanished clients are noticed

    wait_for(a_fresh_client_is_served, 15, "a new client gets snapshots")
    assert local_http.get(gateway.url + "/readyz", timeout=5).status_code == 200


# ---- the page, read by a person (headless Chromium) --------------------------------------
@pytest.fixture()
def browser(tmp_path: Path) -> Iterator[Any]:
    if not (shutil.which(CHROMIUM) and shutil.which(CHROMEDRIVER)):
        pytest.skip("chromium and chromium-driver are not installed (`make test` installs "
                    "them)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    # Without the background-networking flags Chromium keeps dialling Google services,
    # which a closed network refuses (slowly).
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1500,900",
                 f"--user-data-dir={tmp_path / 'chromium-profile'}"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})  # console errors
    driver = webdriver.Chrome(options=options, service=Service(CHROMEDRIVER))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()


def row_cells(driver: Any, table: str, key: str) -> list[str] | None:
    """The visible texts of one row of a table on the page (None: no such row now)."""
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    try:
        for row in driver.find_elements(By.CSS_SELECTOR, f"#{table} tbody tr"):
            cells = [td.text for td in row.find_elements(By.TAG_NAME, "td")]
            if cells and cells[0] == key:
                return cells
    except StaleElementReferenceException:  # the row was redrawn while being read
        return None
    return None


# Columns of the page's tables (cluster.html)
W_STATE, W_MODELS, W_RATE = 2, 5, 9
P_HEALTHY, P_RATE = 5, 8
J_MODEL, J_STATE, J_PROGRESS, J_ROWS, J_FAILED, J_GATEWAY = 1, 2, 3, 4, 5, 8


def test_page_shows_the_worker_then_shows_it_gone(gateway: GatewayThread,
                                                  worker: ServerProcess, browser: Any,
                                                  pool: str, tmp_path: Path,
                                                  job_root: Path) -> None:
    from selenium.webdriver.common.by import By

    me = worker_id(worker)
    browser.get(gateway.url + "/")
    assert browser.title == "Heron cluster"

    cells = wait_for(lambda: (c := row_cells(browser, "workers", me)) and
                     c[W_STATE] == "ready" and c, 20, f"worker {me} shown ready")
    assert cells[1] == pool and "heron/null ready" in cells[W_MODELS]
    assert browser.find_element(By.ID, "connection").text == "live"
    assert browser.find_element(By.ID, "gateway-id").text == gateway.gateway.gateway_id
    assert browser.find_element(By.ID, "nats").text == "connected"
    wait_for(lambda: (c := row_cells(browser, "models", NULL_MODEL)) and "ready" in c, 10,
             "the null model shown ready")

    r = local_http.post(gateway.url + "/v1/encode/null-model",
                        json={"items": [f"text {i}" for i in range(500)]}, timeout=30)
    assert r.status_code == 200, r.text
    wait_for(lambda: (c := row_cells(browser, "pools", pool)) and float(c[P_RATE]) > 0, 10,
             "the pool's throughput shown")
    assert float(row_cells(browser, "workers", me)[W_RATE]) > 0  # type: ignore[index]

    # The Jobs table: "No bulk jobs." exactly while it has no rows (other tests' jobs on
    # this nats-server may be there), then this job, run to its end, with a full bar.
    no_jobs = browser.find_element(By.ID, "no-jobs")
    rows = browser.find_elements(By.CSS_SELECTOR, "#jobs tbody tr")
    assert no_jobs.is_displayed() == (not rows)
    job_id, _ = start_job(gateway, job_root, "page")
    cells = wait_for(lambda: (c := row_cells(browser, "jobs", job_id)) and
                     c[J_STATE] == "succeeded" and c, 15, f"job {job_id} shown succeeded")
    assert cells[J_MODEL] == JOB_MODEL and cells[J_GATEWAY] == "-"  # ended: no gateway
    assert cells[J_PROGRESS] == "100.0%" and cells[J_ROWS] == f"{JOB_ROWS} / {JOB_ROWS}"
    assert cells[J_FAILED] == "1"
    assert not no_jobs.is_displayed()
    # Both widths in one step in the page: the live table redraws its rows, and an element
    # found before a redraw is stale after it (one CI run failed so).
    widths = browser.execute_script(
        "const row = document.querySelector(`#jobs tbody tr[data-key='${arguments[0]}']`);"
        "return row && [row.querySelector('.progress-bar').getBoundingClientRect().width,"
        " row.querySelector('.progress').getBoundingClientRect().width];", job_id)
    assert widths and widths[0] == widths[1] > 0, widths
    shot = Path(os.environ.get("HERON_CLUSTER_PAGE_SCREENSHOT") or tmp_path / "page.png")
    shot.parent.mkdir(parents=True, exist_ok=True)
    assert browser.save_screenshot(str(shot)) and shot.stat().st_size > 10_000

    os.kill(worker.proc.pid, signal.SIGKILL)  # no goodbye beat: only silence tells
    worker.proc.wait(10)
    wait_for(lambda: (c := row_cells(browser, "workers", me)) is None or
             c[W_STATE] == "gone", 15, f"worker {me} shown gone")
    wait_for(lambda: (c := row_cells(browser, "pools", pool)) and c[P_HEALTHY] == "0", 5,
             "the pool shown with no healthy worker")
    # The page ran clean: no script error, no blocked resource (its CSP), nothing fetched
    # from elsewhere.
    problems = [e for e in browser.get_log("browser") if e["level"] in ("SEVERE", "WARNING")]
    assert not problems, problems
