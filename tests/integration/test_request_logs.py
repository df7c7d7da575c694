"""Structured logs as an operator greps them: a real `heron gateway` and `heron worker`
(child processes, JSON logs at debug level) both log the request a client sent with
`X-Request-Id`, under that id, on lines that are each one JSON object."""

from __future__ import annotations

import contextlib
import contextvars
import http.server
import io
import json
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from heron.runtime.logs import (
    QUIET_BELOW_DEBUG,
    JsonFormatter,
    TextFormatter,
    bind_request,
    configure_logging,
)
from tests.support import local_http
from tests.support.cluster_procs import ChildProcess, GatewayProcess
from tests.support.gateway_harness import unique
from tests.support.nats_server import NatsServer
from tests.support.servers import REPO, free_port
from tests.support.tiny_models import one_model_bundle

MODEL = "tiny-logs"
# Empty means unset: each command's default format (json for gateway and worker).
DEFAULT_FORMAT = {"HERON_LOG_FORMAT": ""}


def json_lines(path: Path) -> list[dict[str, Any]]:
    """Every line of a log, each parsed as JSON (a line that is not fails the test)."""
    lines = []
    for number, line in enumerate(path.read_text().splitlines(), start=1):
        if line.strip():
            try:
                lines.append(json.loads(line))
            except json.JSONDecodeError:
                pytest.fail(f"{path.name}:{number} is not JSON: {line!r}")
    return lines


def lines_of(path: Path, request_id: str) -> list[dict[str, Any]]:
    return [line for line in json_lines(path) if line.get("request_id") == request_id]


def wait_for_lines(path: Path, request_id: str, timeout_s: float = 10) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = lines_of(path, request_id)
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"{request_id} never logged in {path.name}:\n{path.read_text()[-3000:]}")


def test_one_request_id_in_gateway_and_worker_logs(nats_server: NatsServer,
                                                   tiny_models: dict[str, Path],
                                                   tmp_path: Path) -> None:
    bundle = one_model_bundle(tmp_path / "bundle", MODEL, tiny_models["tiny-dense-cls"])
    pool, worker_id = unique("logs"), unique("w-logs")
    worker = ChildProcess("worker", ["--nats", nats_server.url, "--pool", pool, "--bundle",
                                     str(bundle), "--worker-id", worker_id,
                                     "--log-level", "debug"],
                          tmp_path, {**DEFAULT_FORMAT, "HF_HUB_OFFLINE": "1"})
    gateway = GatewayProcess(nats_server.url, {str(bundle): pool}, tmp_path,
                             extra_env=DEFAULT_FORMAT, extra_args=["--log-level", "debug"])
    try:
        worker.wait_ready(60)
        gateway.wait_ready(30)
        deadline = time.monotonic() + 15
        while local_http.get(gateway.url + "/readyz").json()["pools"][pool]["healthy_workers"] < 1:
            assert time.monotonic() < deadline, "the gateway never saw the worker beat"
            time.sleep(0.1)

        request_id = unique("req")
        r = local_http.post(f"{gateway.url}/v1/encode/{MODEL}", json={"items": ["a heron", "b"]},
                            headers={"X-Request-Id": request_id}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.headers["x-request-id"] == request_id
        rejected_id = unique("bad")
        bad = local_http.post(f"{gateway.url}/v1/encode/{MODEL}", json={"items": []},
                              headers={"X-Request-Id": rejected_id}, timeout=30)
        assert bad.status_code == 422 and bad.headers["x-request-id"] == rejected_id

        gateway_lines = wait_for_lines(gateway.log_path, request_id)
        worker_lines = wait_for_lines(worker.log_path, request_id)
        summary = next(line for line in gateway_lines if line.get("status") == 200)
        assert summary["level"] == "debug" and summary["logger"] == "heron.gateway"
        assert (summary["model"], summary["pool"]) == (f"test/{MODEL}", pool)
        assert f"/v1/encode/{MODEL} 200" in summary["message"] and summary["duration_ms"] > 0
        item = worker_lines[-1]
        assert item["logger"] == "heron.worker.consumer" and item["level"] == "debug"
        assert (item["model"], item["pool"], item["worker_id"]) == (f"test/{MODEL}", pool,
                                                                    worker_id)
        assert "answered" in item["message"] and item["status"] == 200
        for line in (summary, item):
            assert {"timestamp", "level", "logger", "message"} <= set(line)
            assert line["timestamp"].endswith("Z")
        # the rejected request never reached NATS: only the gateway logged it
        rejected = wait_for_lines(gateway.log_path, rejected_id)
        assert rejected[-1]["status"] == 422
        assert not lines_of(worker.log_path, rejected_id)
    finally:
        gateway.stop()
        worker.stop()
    # each line of both logs, from start to shutdown, is one JSON object
    assert json_lines(gateway.log_path) and json_lines(worker.log_path)


@pytest.mark.parametrize(("env", "args", "message"), [
    ({"HERON_LOG_FORMAT": "xml"}, [], "HERON_LOG_FORMAT: xml: must be one of json, text"),
    ({}, ["--log-level", "loud"], "--log-level: loud: must be one of critical, error"),
])
def test_bad_log_settings_stop_the_process_with_a_clear_error(
        env: dict[str, str], args: list[str], message: str) -> None:
    done = subprocess.run([sys.executable, "-m", "heron.cli", "gateway", "--port",
                           str(free_port()), *args], cwd=REPO, capture_output=True,
                          text=True, timeout=60, env={**os.environ, **env})
    assert done.returncode == 2 and message in done.stderr, done.stderr


def _record(message: str, **extra: Any) -> logging.LogRecord:
    record = logging.LogRecord("heron.test", logging.WARNING, __file__, 1, message, (), None)
    record.__dict__.update(extra)
    return record


def test_formats_carry_the_bound_request() -> None:
    def inside_a_request() -> tuple[str, str]:
        context = bind_request("req-42", model="test/m")
        context.pool = "p1"  # routed later: lines logged afterwards name it too
        return (JsonFormatter().format(_record("slow batch", duration_ms=1.5)),
                TextFormatter().format(_record("slow batch")))

    as_json, as_text = contextvars.copy_context().run(inside_a_request)
    line = json.loads(as_json)
    assert line["message"] == "slow batch" and line["level"] == "warning"
    assert (line["request_id"], line["model"], line["pool"]) == ("req-42", "test/m", "p1")
    assert line["duration_ms"] == 1.5
    assert as_text.endswith("WARNING heron.test slow batch [request_id=req-42 model=test/m "
                            "pool=p1]")
    # outside any request: no request fields
    assert "request_id" not in json.loads(JsonFormatter().format(_record("idle")))


@contextlib.contextmanager
def logging_configured(monkeypatch: pytest.MonkeyPatch, level: str,
                       **fields: str) -> Iterator[io.StringIO]:
    """configure_logging(level, "json") onto a string, undone afterwards."""
    stream = io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    root = logging.getLogger()
    saved = (list(root.handlers), root.level)
    quieted = {name: logging.getLogger(name).level for name in QUIET_BELOW_DEBUG}
    try:
        configure_logging(level, "json", **fields)
        yield stream
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
        logging.captureWarnings(False)
        for name, previous in quieted.items():
            logging.getLogger(name).setLevel(previous)


def test_configure_logging_writes_json_to_stderr(monkeypatch: pytest.MonkeyPatch) -> None:
    with logging_configured(monkeypatch, "info", worker_id="w-1") as stream:
        logging.getLogger("heron.worker").debug("hidden at info")
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger("heron.worker").exception("it failed")
    lines = [json.loads(x) for x in stream.getvalue().splitlines()]
    assert len(lines) == 1
    assert lines[0]["level"] == "error" and lines[0]["worker_id"] == "w-1"
    assert "ValueError: boom" in lines[0]["exception"]


def test_outgoing_http_calls_are_logged_at_debug_only(monkeypatch: pytest.MonkeyPatch) -> None:
    """An httpx call (a config resync, an image URL fetch) writes no line at info: its URL
    may carry a signed query string. At debug it does."""

    class Quiet(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            self.send_response(200)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}/image.png?X-Amz-Signature=secret"
    try:
        lines = {}
        for level in ("info", "debug"):
            with logging_configured(monkeypatch, level) as stream:
                assert local_http.get(url, timeout=5).status_code == 200
            lines[level] = [json.loads(x) for x in stream.getvalue().splitlines()]
    finally:
        server.shutdown()
        server.server_close()
    assert not [x for x in lines["info"] if "secret" in x["message"]], lines["info"]
    assert [x for x in lines["debug"] if x["logger"] == "httpx" and "secret" in x["message"]]
