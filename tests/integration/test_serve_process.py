"""`heron serve` as a user runs it: config errors, model subsets, lazy loads, load failures."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from heron_sdk import Client, ServerError
from tests.support.model_stack import without_model_stack
from tests.support.servers import REPO, start_serve


def write_bundle(root: Path, models: dict[str, dict], **extra: object) -> Path:
    (root / "models").mkdir(parents=True, exist_ok=True)
    for name, config in models.items():
        (root / "models" / name).write_text(yaml.safe_dump(config))
    shutil.copy(REPO / "bundles/models/all-minilm-l6-v2.yaml", root / "models")
    bundle = {"name": "t", "models": ["all-minilm-l6-v2.yaml", *models], **extra}
    (root / "t.yaml").write_text(yaml.safe_dump(bundle))
    return root / "t.yaml"


@pytest.mark.parametrize("command", [["serve"], ["worker", "--nats", "nats://127.0.0.1:1"]])
def test_bad_config_fails_at_start_with_file_field_and_reason(tmp_path: Path,
                                                              command: list[str]) -> None:
    bundle = write_bundle(tmp_path, {"bad.yaml": {
        "id": "x/bad", "adapter": "dense", "source": {"path": "/nowhere"},
        "profiles": {"default": {"max_batch_tokens": -5}}}})
    # Refused before the model stack is imported (and, for a worker, before NATS is
    # tried): it runs here without one.
    proc = subprocess.run([sys.executable, "-m", "heron.cli", *command, "--bundle", str(bundle)],
                          capture_output=True, text=True, timeout=60, cwd=REPO,
                          env={**os.environ, **without_model_stack(tmp_path)})
    assert proc.returncode == 2
    assert "bad.yaml: profiles.default.max_batch_tokens: must be a positive integer" in \
        proc.stderr


def test_lazy_load_then_serve_and_load_failure_is_502(tmp_path: Path,
                                                       tiny_models: dict[str, Path]) -> None:
    broken = tmp_path / "broken-weights"
    broken.mkdir()
    (broken / "config.json").write_text('{"model_type": "bert"}')  # no weights, no tokenizer
    bundle = write_bundle(tmp_path, {
        "lazy.yaml": {"id": "t/lazy", "adapter": "dense",
                      "source": {"path": str(tiny_models["tiny-dense-cls"])}},
        "lazy-sdk.yaml": {"id": "t/lazy-sdk", "adapter": "dense",
                          "source": {"path": str(tiny_models["tiny-dense-cls"])}},
        "broken.yaml": {"id": "t/broken", "adapter": "dense", "source": {"path": str(broken)}},
    }, preload=["minilm"])
    server = start_serve(bundle, tmp_path)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            assert http.get("/readyz").json()["models"]["t/lazy"] == "not_loaded"
            first = http.post("/v1/encode/t/lazy", json={"items": ["wake up"]})
            assert first.status_code == 503
            assert first.json()["error"]["code"] == "MODEL_LOADING"
            assert int(first.headers["retry-after"]) >= 1
            deadline = time.monotonic() + 60
            while (r := http.post("/v1/encode/t/lazy", json={"items": ["wake up"]})
                   ).status_code == 503 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert r.status_code == 200 and len(r.json()["items"][0]["dense"]) == 32

            assert http.post("/v1/encode/t/broken", json={"items": ["x"]}).status_code == 503
            deadline = time.monotonic() + 60
            while (r := http.post("/v1/encode/t/broken", json={"items": ["x"]})
                   ).status_code == 503 and time.monotonic() < deadline:
                time.sleep(0.2)
            assert r.status_code == 502
            assert r.json()["error"]["code"] == "MODEL_LOAD_FAILED"
            assert "t/broken" in r.json()["error"]["message"]
            # The failure is contained: the rest of the worker keeps serving.
            assert http.post("/v1/encode/minilm", json={"items": ["fine"]}).status_code == 200
            model = http.get("/v1/models/t/broken").json()
            assert model["state"] == "failed" and model["error"]
            metrics = http.get("/metrics").text
            assert 'heron_worker_model_loads_total{model="t/broken",result="failed"} 1.0' \
                in metrics
            assert 'heron_worker_model_loads_total{model="t/lazy",result="loaded"} 1.0' in metrics
        # The SDK waits out MODEL_LOADING (503 + Retry-After) and returns the vectors...
        with Client(server.url, timeout=30) as client:
            assert client.encode("t/lazy-sdk", ["wake up"]).dense.shape == (1, 32)
            # ...and gives up at once on a permanent failure (502 is not retried).
            started = time.monotonic()
            with pytest.raises(ServerError) as failed:
                client.wait_for_capacity("t/broken")
            assert (failed.value.status, failed.value.code) == (502, "MODEL_LOAD_FAILED")
            assert time.monotonic() - started < 2
    finally:
        server.stop()
    # A graceful shutdown exits 0 (a hang would end in SIGKILL).
    assert server.proc.returncode == 0, server.log()


@pytest.mark.slow
def test_models_flag_serves_a_subset_and_stops_cleanly(tmp_path: Path,
                                                       test_bundle: Path) -> None:
    server = start_serve(test_bundle, tmp_path,
                         extra_args=["--models", "minilm,tiny-cross-encoder,minilm"])
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            ids = sorted(m["id"] for m in http.get("/v1/models").json()["data"])
            assert ids == ["sentence-transformers/all-MiniLM-L6-v2", "test/tiny-cross-encoder"]
            long_query = " ".join(["query"] * 200)  # alone over the 64-token limit
            r = http.post("/v1/score/tiny-cross-encoder",
                          json={"query": long_query, "items": ["a", "b"]})
            assert r.status_code == 200, r.text
            assert all(x["truncated"] for x in r.json()["results"])
    finally:
        server.stop()
    assert server.proc.returncode == 0


def test_null_bundle_returns_fixed_vectors_with_real_token_counts(tmp_path: Path) -> None:
    # Python writes each import of the process to its log (stderr): the null model needs a
    # tokenizer and no model stack (transformers' modeling modules, 2-3 s of CPU a start).
    server = start_serve("null", tmp_path, env={"PYTHONPROFILEIMPORTTIME": "1"})
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            body = http.post("/v1/encode/null-model",
                             json={"items": ["one", "two words here"]}).json()
            a, b = (item["dense"] for item in body["items"])
            assert a == b and len(a) == 384
            assert abs(sum(x * x for x in a) - 1.0) < 1e-5
            assert [i["tokens"] for i in body["items"]] == [3, 5]
        imported = server.log()
        assert " transformers.tokenization_utils_base\n" in imported
        assert "transformers.core_model_loading" not in imported
    finally:
        server.stop()


def test_api_keys_and_readiness_match_the_gateway(tmp_path: Path) -> None:
    """`heron serve` takes the gateway's HERON_API_KEYS and answers /readyz in its shape."""
    server = start_serve("null", tmp_path, env={"HERON_API_KEYS": "key-a, key-b"})
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            # Probes and scrapes need no key.
            assert http.get("/healthz").status_code == 200
            assert http.get("/metrics").status_code == 200
            ready = http.get("/readyz")
            assert ready.status_code == 200
            assert ready.json() == {"status": "ready", "models": {"heron/null": "ready"}}
            body = {"items": ["x"]}
            none = http.post("/v1/encode/null-model", json=body)
            assert none.status_code == 401 and none.json()["error"]["code"] == "UNAUTHORIZED"
            wrong = http.post("/v1/encode/null-model", json=body,
                              headers={"authorization": "Bearer nope"})
            assert wrong.status_code == 403 and wrong.json()["error"]["code"] == "FORBIDDEN"
            assert http.get("/v1/models").status_code == 401
            key = {"authorization": "Bearer key-b"}
            assert http.post("/v1/encode/null-model", json=body, headers=key).status_code == 200
            (model,) = http.get("/v1/models", headers=key).json()["data"]
            # The gateway's fields too: what a client reads works against either server.
            assert model["id"] == "heron/null" and model["state"] == "ready"
            assert model["bundle"] == "null" and model["tasks"] == ["encode"]
            assert model["task"] == "encode" and model["output_types"] == ["dense"]
            assert "pool" not in model  # one process, no pools
    finally:
        server.stop()
