"""Tracing as an operator sees it: one request through gateway -> NATS -> worker is ONE
trace, its spans named per phase and linked parent to child, a client's traceparent is
continued (a malformed one ignored), `heron serve` traces too, and the exporters that
HERON_TRACING names really export.

The gateway and the worker run in this process (uvicorn in threads, a real nats-server),
so one InMemorySpanExporter sees both sides."""

from __future__ import annotations

import contextlib
import http.server
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
)
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.trace import SpanKind
from starlette.applications import Starlette

from heron.runtime import telemetry
from heron.runtime.modelconfig import ConfigError, load_bundle
from heron.runtime.protocol import WorkItemHeaders
from heron.worker.app import QueueMode, create_app
from tests.support import local_http
from tests.support.gateway_harness import GatewayThread, unique
from tests.support.nats_server import NatsServer
from tests.support.servers import REPO, free_port
from tests.support.tiny_models import one_model_bundle

MODEL = "tiny-dense"
GATEWAY_PHASES = ["request", "publish", "wait"]
WORKER_PHASES = ["queue_wait", "process", "tokenize", "batch_wait", "inference", "postprocess",
                 "respond"]
TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"


class AppThread:
    """A Starlette app on uvicorn, on a loopback port, in a thread of this process."""

    def __init__(self, app: Starlette) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port,
                                                    log_level="warning", loop="asyncio"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self, timeout_s: float = 60) -> AppThread:
        self.thread.start()
        wait_for(lambda: _ok(self.url + "/readyz"), timeout_s, f"{self.url} never ready")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(30)


def _ok(url: str) -> bool:
    with contextlib.suppress(httpx.HTTPError):
        return local_http.get(url, timeout=2).status_code == 200
    return False


def wait_for(condition: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    raise AssertionError(what)


@pytest.fixture(scope="module")
def bundle(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, Path]) -> Path:
    return one_model_bundle(tmp_path_factory.mktemp("trace-bundle"), MODEL,
                            tiny_models["tiny-dense-cls"])


@pytest.fixture(scope="module")
def cluster(nats_server: NatsServer, bundle: Path) -> Iterator[tuple[str, str]]:
    """(gateway URL, pool): an in-process worker of the one-model bundle behind an
    in-process gateway."""
    pool = unique("trace")
    worker = AppThread(create_app(load_bundle(bundle), queue=QueueMode(
        nats_url=nats_server.url, pool=pool, worker_id=unique("w")))).start()
    gateway = GatewayThread(nats_server.url, {str(bundle): pool}).start()
    try:
        wait_for(lambda: gateway.gateway.health.has_capacity(pool), 30, "no healthy worker")
        yield gateway.url, pool
    finally:
        gateway.stop()
        worker.stop()


@pytest.fixture()
def spans() -> Iterator[Any]:
    with telemetry.in_memory_tracing() as exporter:
        yield exporter


def trace_of(exporter: Any, request_id: str, names: list[str], *,
             count: dict[str, int] | None = None) -> dict[str, list[ReadableSpan]]:
    """The spans of the trace whose gateway/worker request span carries ``request_id``,
    by name, once every name in ``names`` has arrived (worker spans end after the HTTP
    answer: the result is acknowledged first)."""
    def collect() -> dict[str, list[ReadableSpan]] | None:
        finished = exporter.get_finished_spans()
        roots = [s for s in finished if s.name.endswith(".request")
                 and s.attributes.get("heron.request_id") == request_id]
        if not roots:
            return None
        trace_id = roots[0].context.trace_id
        by_name: dict[str, list[ReadableSpan]] = {}
        for s in finished:
            if s.context.trace_id == trace_id:
                by_name.setdefault(s.name, []).append(s)
        wanted = {n: (count or {}).get(n, 1) for n in names}
        return by_name if all(len(by_name.get(n, [])) >= k for n, k in wanted.items()) \
            else None

    return wait_for(collect, 15, f"spans {names} of request {request_id} never all ended: "
                                 f"{[s.name for s in exporter.get_finished_spans()]}")


def names(scope: str, phases: list[str]) -> list[str]:
    return [f"{scope}.{p}" for p in phases]


def one(by_name: dict[str, list[ReadableSpan]], name: str) -> ReadableSpan:
    assert len(by_name[name]) == 1, (name, by_name[name])
    return by_name[name][0]


def parent_of(span: ReadableSpan) -> int | None:
    return span.parent.span_id if span.parent is not None else None


# ---- through the cluster -----------------------------------------------------------------
def test_one_request_is_one_trace_across_gateway_and_worker(
        cluster: tuple[str, str], spans: Any) -> None:
    url, pool = cluster
    r = local_http.post(f"{url}/v1/encode/{MODEL}", json={"items": ["where does the heron wait?"]},
                        headers={"x-request-id": "trace-one"}, timeout=30)
    assert r.status_code == 200, r.text
    expected = names(telemetry.GATEWAY, GATEWAY_PHASES) + names(telemetry.WORKER,
                                                                WORKER_PHASES)
    by_name = trace_of(spans, "trace-one", expected)
    # one trace: every span of the request, on both sides, and nothing else in it
    assert sorted(by_name) == sorted(expected)
    assert len({s.context.trace_id for ss in by_name.values() for s in ss}) == 1

    g = {p: one(by_name, f"heron.gateway.{p}") for p in GATEWAY_PHASES}
    w = {p: one(by_name, f"heron.worker.{p}") for p in WORKER_PHASES}
    assert g["request"].parent is None and g["request"].kind is SpanKind.SERVER
    assert parent_of(g["publish"]) == parent_of(g["wait"]) == g["request"].context.span_id
    assert g["publish"].kind is SpanKind.PRODUCER
    # the worker's spans hang off the gateway's publish span: the context crossed NATS
    assert parent_of(w["process"]) == parent_of(w["queue_wait"]) == g["publish"].context.span_id
    assert w["process"].kind is SpanKind.CONSUMER
    for phase in ("tokenize", "batch_wait", "inference", "postprocess", "respond"):
        assert parent_of(w[phase]) == w["process"].context.span_id, phase
    assert {s.instrumentation_scope.name for s in g.values()} == {"heron.gateway"}
    assert {s.instrumentation_scope.name for s in w.values()} == {"heron.worker"}

    attrs = g["request"].attributes
    assert attrs["heron.request_id"] == "trace-one"
    assert attrs["http.route"] == "/v1/encode/{model}"
    assert (attrs["heron.model"], attrs["heron.pool"]) == (f"test/{MODEL}", pool)
    assert attrs["http.response.status_code"] == 200
    attrs = w["process"].attributes
    assert (attrs["heron.request_id"], attrs["heron.task"], attrs["heron.item_count"]) == \
        ("trace-one", "encode", 1)
    # the phases happen in order, inside the request
    assert w["tokenize"].end_time <= w["batch_wait"].start_time + 1_000_000
    assert w["batch_wait"].end_time <= w["inference"].start_time + 1_000_000
    assert g["request"].start_time <= g["publish"].start_time
    assert g["wait"].end_time <= g["request"].end_time


def test_client_traceparent_is_continued_across_slices(cluster: tuple[str, str],
                                                       spans: Any) -> None:
    url, _ = cluster
    items = [f"item {i}" for i in range(100)]  # at most 64 items a work item: two
    r = local_http.post(f"{url}/v1/encode/{MODEL}", json={"items": items}, timeout=30,
                        headers={"x-request-id": "trace-two",
                            "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"})
    assert r.status_code == 200, r.text
    by_name = trace_of(spans, "trace-two", ["heron.gateway.request", "heron.worker.respond"],
                       count={"heron.worker.respond": 2})
    request = one(by_name, "heron.gateway.request")
    assert format(request.context.trace_id, "032x") == TRACE_ID
    assert format(parent_of(request) or 0, "016x") == PARENT_ID
    publish = one(by_name, "heron.gateway.publish")
    assert publish.attributes["heron.work_items"] == 2
    processes = by_name["heron.worker.process"]
    assert len(processes) == 2
    assert {parent_of(p) for p in processes} == {publish.context.span_id}
    slices = sorted((p.attributes["heron.item_start"], p.attributes["heron.item_count"])
                    for p in processes)
    assert slices[0][0] == 0 and slices[1][0] == slices[0][1]
    assert sum(count for _, count in slices) == 100


@pytest.mark.parametrize("traceparent", [
    "garbage", f"00-{TRACE_ID}-{PARENT_ID}", f"00-{'0' * 32}-{PARENT_ID}-01",
    f"ff-{TRACE_ID}-{PARENT_ID}-01", f"00-{TRACE_ID.upper()}-zzzzzzzzzzzzzzzz-01", "",
])
def test_malformed_traceparent_starts_a_new_trace(cluster: tuple[str, str], spans: Any,
                                                  traceparent: str) -> None:
    url, _ = cluster
    request_id = unique("bad-tp")
    r = local_http.post(f"{url}/v1/encode/{MODEL}", json={"items": ["x"]}, timeout=30,
                        headers={"x-request-id": request_id, "traceparent": traceparent})
    assert r.status_code == 200, r.text
    request = one(trace_of(spans, request_id, ["heron.gateway.request"]),
                  "heron.gateway.request")
    assert request.parent is None and request.context.is_valid
    assert format(request.context.trace_id, "032x") != TRACE_ID


# ---- heron serve: the worker's own HTTP API ----------------------------------------------
def test_single_node_continues_the_http_traceparent(bundle: Path, spans: Any) -> None:
    server = AppThread(create_app(load_bundle(bundle))).start()
    try:
        r = local_http.post(f"{server.url}/v1/encode/{MODEL}", json={"items": ["hello"]},
                            headers={"x-request-id": "serve-one",
                                "traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"}, timeout=30)
        assert r.status_code == 200, r.text
        phases = ["request", "tokenize", "batch_wait", "inference", "postprocess"]
        by_name = trace_of(spans, "serve-one", names(telemetry.WORKER, phases))
        request = one(by_name, "heron.worker.request")
        assert format(request.context.trace_id, "032x") == TRACE_ID
        assert format(parent_of(request) or 0, "016x") == PARENT_ID
        assert request.kind is SpanKind.SERVER
        for phase in phases[1:]:
            assert parent_of(one(by_name, f"heron.worker.{phase}")) == \
                request.context.span_id, phase

        bad = local_http.post(f"{server.url}/v1/encode/{MODEL}", json={"items": ["hello"]},
                              headers={"x-request-id": "serve-bad", "traceparent": "00-nope"},
                              timeout=30)
        assert bad.status_code == 200
        fresh = one(trace_of(spans, "serve-bad", ["heron.worker.request"]),
                    "heron.worker.request")
        assert fresh.parent is None and format(fresh.context.trace_id, "032x") != TRACE_ID
    finally:
        server.stop()


# ---- off by default, and the exporters HERON_TRACING names ---------------------------------
def test_tracing_off_adds_nothing() -> None:
    assert not telemetry.enabled()
    headers = WorkItemHeaders("r", "encode", "m", "_INBOX.x", 0, 1, None, 0).to_wire()
    before = dict(headers)
    telemetry.inject(headers)
    assert headers == before  # no traceparent crosses NATS
    with telemetry.span(telemetry.GATEWAY, "publish") as span:
        assert span is None
    assert telemetry.current_trace_ids() is None


def test_unknown_tracing_mode_is_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HERON_TRACING", "jaeger")
    with pytest.raises(ConfigError, match="HERON_TRACING"):
        telemetry.setup_tracing("heron-test")
    assert not telemetry.enabled()
    done = subprocess.run([sys.executable, "-m", "heron.cli", "gateway", "--port",
                           str(free_port())], cwd=REPO, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "HERON_TRACING": "jaeger"})
    assert done.returncode == 2
    assert "HERON_TRACING: jaeger: must be one of off, console, otlp" in done.stderr


def test_console_exporter_prints_spans(monkeypatch: pytest.MonkeyPatch,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("HERON_TRACING", "console")
    monkeypatch.setenv("OTEL_SERVICE_NAME", "heron-console-test")
    assert telemetry.setup_tracing("heron-gateway")
    try:
        with telemetry.span(telemetry.GATEWAY, "publish"):
            pass
    finally:
        telemetry.shutdown_tracing()  # flushes the batch
    out = capsys.readouterr().out
    assert '"name": "heron.gateway.publish"' in out
    assert '"service.name": "heron-console-test"' in out


class _OtlpReceiver(http.server.BaseHTTPRequestHandler):
    received: list[tuple[str, str, bytes]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["content-length"]))
        self.received.append((self.path, self.headers["content-type"], body))
        self.send_response(200)
        self.send_header("content-type", "application/x-protobuf")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


def test_otlp_exporter_posts_spans_to_the_endpoint(monkeypatch: pytest.MonkeyPatch) -> None:
    receiver = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _OtlpReceiver)
    threading.Thread(target=receiver.serve_forever, daemon=True).start()
    try:
        monkeypatch.setenv("HERON_TRACING", "otlp")
        monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT",
                           f"http://127.0.0.1:{receiver.server_address[1]}")
        monkeypatch.delenv("OTEL_SERVICE_NAME", raising=False)
        assert telemetry.setup_tracing("heron-worker")
        with telemetry.span(telemetry.WORKER, "tokenize", attributes={"heron.items": 3}):
            pass
        telemetry.shutdown_tracing()
        path, content_type, body = wait_for(lambda: _OtlpReceiver.received and
                                            _OtlpReceiver.received[-1], 10, "nothing posted")
    finally:
        receiver.shutdown()
    assert (path, content_type) == ("/v1/traces", "application/x-protobuf")
    export = ExportTraceServiceRequest.FromString(body)
    resource = export.resource_spans[0]
    service = {a.key: a.value.string_value for a in resource.resource.attributes}
    assert service["service.name"] == "heron-worker"
    span = resource.scope_spans[0].spans[0]
    assert span.name == "heron.worker.tokenize"
    assert resource.scope_spans[0].scope.name == "heron.worker"
