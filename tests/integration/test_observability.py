"""What an operator checks: timing headers, request ids, Prometheus metrics, health."""

from __future__ import annotations

import httpx


def test_timing_headers_and_request_id(http: httpx.Client) -> None:
    r = http.post("/v1/encode/minilm", json={"items": ["time me"]},
                  headers={"x-request-id": "req-123"})
    assert r.headers["x-request-id"] == "req-123"
    phases = dict(part.strip().split(";dur=") for part in r.headers["server-timing"].split(","))
    assert set(phases) == {"tokenize", "queue", "inference", "total"}
    assert float(phases["inference"]) > 0
    assert float(phases["total"]) >= float(phases["inference"])
    fresh = http.post("/v1/encode/minilm", json={"items": ["x"]}).headers["x-request-id"]
    assert len(fresh) == 32
    oai = http.post("/v1/embeddings", json={"model": "minilm", "input": "x"})
    assert "server-timing" in oai.headers and oai.headers["x-request-id"]


def _value(metrics: str, name: str, **labels: str) -> float:
    for line in metrics.splitlines():
        if line.startswith((name + "{", name + " ")) and all(
                f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_metrics_count_requests_by_route_model_and_status(http: httpx.Client) -> None:
    model = "sentence-transformers/all-MiniLM-L6-v2"
    before = http.get("/metrics").text
    http.post("/v1/encode/minilm", json={"items": ["a", "b"]})
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
    assert "heron_worker_batch_padded_tokens_bucket" in after


def test_health_and_readiness(http: httpx.Client) -> None:
    assert http.get("/healthz").json() == {"status": "ok"}
    ready = http.get("/readyz")
    assert ready.status_code == 200 and ready.json()["status"] == "ready"
    assert set(ready.json()["models"].values()) == {"ready"}
