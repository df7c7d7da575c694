"""What an operator checks: timing headers, request ids, Prometheus metrics, health."""

from __future__ import annotations

import httpx

from tests.support import local_http


def test_timing_headers_and_request_id(http: httpx.Client) -> None:
    r = http.post("/v1/encode/minilm", json={"items": ["time me"]},
                  headers={"x-request-id": "req-123"})
    assert r.headers["x-request-id"] == "req-123"
    phases = dict(part.strip().split(";dur=") for part in r.headers["server-timing"].split(","))
    assert list(phases) == ["tokenize", "batch_wait", "inference", "postprocess", "total"]
    assert float(phases["inference"]) > 0
    assert float(phases["total"]) >= float(phases["inference"])
    # many items of varied lengths run in several batches: the phases are the last item's,
    # one after another, never more than the total
    batches = _phases(http.post("/v1/encode/minilm", json={
        "items": ["word " * (1 + (i * 37) % 200) for i in range(96)]}))
    assert batches["total"] >= sum(v for k, v in batches.items() if k != "total") - 0.1
    fresh = http.post("/v1/encode/minilm", json={"items": ["x"]}).headers["x-request-id"]
    assert len(fresh) == 32
    oai = http.post("/v1/embeddings", json={"model": "minilm", "input": "x"})
    assert "server-timing" in oai.headers and oai.headers["x-request-id"]


def _phases(response: httpx.Response) -> dict[str, float]:
    return {name.strip(): float(ms) for name, ms in (
        part.split(";dur=") for part in response.headers["server-timing"].split(","))}


def test_gateway_timing_headers_cover_every_phase(cluster_url: str) -> None:
    """Through gateway -> JetStream -> worker: the gateway's phases, then the worker's (as
    the result message reported them), then the gateway's total, in order. A small request
    goes in a shared work item (coalesce: its wait for company); a split one does not."""
    r = local_http.post(cluster_url + "/v1/encode/minilm", json={"items": ["time me", "twice"]},
                        headers={"x-request-id": "gw-timing-1"}, timeout=60)
    assert r.status_code == 200 and r.headers["x-request-id"] == "gw-timing-1"
    phases = _phases(r)
    assert list(phases) == ["coalesce", "publish", "queue_wait", "tokenize", "batch_wait",
                            "inference", "postprocess", "total"]
    assert min(phases.values()) >= 0 and phases["inference"] > 0
    # the phases follow one another inside the gateway's total (each rounded to 0.01 ms)
    assert phases["total"] >= sum(v for k, v in phases.items() if k != "total") - 0.1
    # split into three work items (64 items each at most): the phases are the slice's that
    # answered last, still inside the total
    many = local_http.post(cluster_url + "/v1/encode/minilm",
                           json={"items": [f"item {i}" for i in range(150)]}, timeout=60)
    assert many.status_code == 200 and len(many.json()["items"]) == 150
    split = _phases(many)
    assert "coalesce" not in split
    assert split["total"] >= sum(v for k, v in split.items() if k != "total") - 0.1
    metrics = local_http.get(cluster_url + "/metrics").text
    for phase in list(phases)[:-1]:
        assert _value(metrics, "heron_gateway_phase_duration_seconds_count", phase=phase,
                      model="sentence-transformers/all-MiniLM-L6-v2") >= 1, phase


def test_errors_and_replaced_ids_carry_x_request_id(http: httpx.Client,
                                                    cluster_url: str) -> None:
    for base in (str(http.base_url), cluster_url):
        missing = local_http.post(base + "/v1/encode/no-such-model", json={"items": ["x"]},
                                  headers={"x-request-id": "err-1"})
        assert missing.status_code == 404 and missing.headers["x-request-id"] == "err-1"
        # an id that could not travel in a NATS header or forge a log line is replaced
        for bad in ("two words", "x" * 201):
            r = local_http.post(base + "/v1/encode/minilm", json={"items": ["x"]},
                                headers={"x-request-id": bad}, timeout=60)
            assert r.status_code == 200
            assert r.headers["x-request-id"] != bad and len(r.headers["x-request-id"]) == 32


def _value(metrics: str, name: str, **labels: str) -> float:
    for line in metrics.splitlines():
        if line.startswith((name + "{", name + " ")) and all(
                f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_count_requests_by_route_model_and_status(http: httpx.Client) -> None:
    model = "sentence-transformers/all-MiniLM-L6-v2"
    before = http.get("/metrics").text
    http.post("/v1/encode/minilm", json={"items": ["a", "b"], "cache": False})  # computed
    http.post("/v1/encode/minilm", json={"items": []})
    http.post("/v1/encode/not-a-model", json={"items": ["a"]})
    after = http.get("/metrics").text
    for status, route_model in (("200", model), ("422", model), ("404", "_unknown")):
        delta = (_value(after, "heron_worker_requests_total", route="encode",
                        model=route_model, status=status)
                 - _value(before, "heron_worker_requests_total", route="encode",
                          model=route_model, status=status))
        assert delta == 1, (status, route_model)
    items = (_value(after, "heron_worker_items_total", model=model)
             - _value(before, "heron_worker_items_total", model=model))
    assert items == 2
    assert _value(after, "heron_worker_models_loaded") >= 1
    assert "heron_worker_phase_duration_seconds_bucket" in after
    for phase in ("tokenize", "batch_wait", "inference", "postprocess"):
        assert _value(after, "heron_worker_phase_duration_seconds_count", phase=phase,
                      model=model) >= 1, phase
    assert "heron_worker_batch_padded_tokens_bucket" in after


def test_health_and_readiness(http: httpx.Client) -> None:
    assert http.get("/healthz").json() == {"status": "ok"}
    ready = http.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    assert set(ready.json()["models"].values()) == {"ready"}


def test_worker_reports_loads_and_memory(http: httpx.Client) -> None:
    metrics = http.get("/metrics").text
    minilm = "sentence-transformers/all-MiniLM-L6-v2"
    assert _value(metrics, "heron_worker_model_loads_total", model=minilm,
                  result="loaded") >= 1
    assert _value(metrics, "heron_worker_model_load_duration_seconds_count",
                  model=minilm) >= 1
    assert _value(metrics, "heron_worker_resident_memory_bytes") > 100e6  # MiniLM alone is 90
