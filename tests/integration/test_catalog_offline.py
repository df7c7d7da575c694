"""A catalogue model with no network and an empty weight cache: ``heron serve`` starts, and a
request for the model answers 502 MODEL_LOAD_FAILED naming the model and why, not a hang or
a crash."""

from __future__ import annotations

import shutil
import time
from pathlib import Path

import httpx
import yaml

from tests.support.servers import REPO, start_serve, wait_until

CATALOG = REPO / "bundles" / "models" / "catalog"


def _offline_env(tmp_path: Path) -> dict[str, str]:
    """No Hub, no S3 tier, and caches that hold nothing."""
    for name in ("heron-cache", "hf-home"):
        (tmp_path / name).mkdir()
    return {"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf-home"),
            "HERON_CACHE_DIR": str(tmp_path / "heron-cache"), "HERON_WEIGHTS_S3": ""}


def _until_not_loading(http: httpx.Client, path: str, body: dict) -> httpx.Response:
    deadline = time.monotonic() + 60
    while (response := http.post(path, json=body)).status_code == 503 \
            and time.monotonic() < deadline:
        time.sleep(0.2)
    return response


def _assert_names_the_model(response: httpx.Response, model_id: str) -> None:
    assert response.status_code == 502, response.text
    error = response.json()["error"]
    assert error["code"] == "MODEL_LOAD_FAILED"
    assert model_id in error["message"]
    assert "HF_HUB_OFFLINE" in error["message"]  # says why: the Hub was not asked


def test_a_one_model_bundle_from_the_catalogue_fails_clearly_offline(tmp_path: Path) -> None:
    config = yaml.safe_load((CATALOG / "bge-small-en-v1.5.yaml").read_text())
    (tmp_path / "models").mkdir()
    shutil.copy(CATALOG / "bge-small-en-v1.5.yaml", tmp_path / "models")
    bundle = tmp_path / "one.yaml"
    bundle.write_text(yaml.safe_dump({"name": "one", "models": ["bge-small-en-v1.5.yaml"],
                                      "preload": []}))
    server = start_serve(bundle, tmp_path, env=_offline_env(tmp_path))
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            first = http.post(f"/v1/encode/{config['id']}", json={"items": ["offline"]})
            assert first.status_code == 503  # the load starts on the first request
            response = _until_not_loading(http, f"/v1/encode/{config['id']}",
                                          {"items": ["offline"]})
            _assert_names_the_model(response, config["source"]["hub"])
            model = http.get(f"/v1/models/{config['id']}").json()
            assert model["state"] == "failed" and config["id"] in model["error"]
    finally:
        server.stop()
    assert not any((tmp_path / "heron-cache").glob("*/*/config.json"))  # nothing was fetched


def test_serving_a_catalogue_model_by_id_loads_it_at_start(tmp_path: Path) -> None:
    """``--models`` picks from the catalogue and loads the pick at start: offline, the
    server is up, readiness says the load failed, and a score call gets the 502."""
    model_id = "cross-encoder/ms-marco-MiniLM-L6-v2"
    server = start_serve("catalog", tmp_path, extra_args=["--models", model_id],
                         env=_offline_env(tmp_path), wait_ready=False)
    try:
        wait_until(server, "/healthz", 120)
        with httpx.Client(base_url=server.url, timeout=30) as http:
            deadline = time.monotonic() + 60
            while (ready := http.get("/readyz").json())["status"] != "failed":
                assert time.monotonic() < deadline, ready
                time.sleep(0.2)
            response = _until_not_loading(http, f"/v1/score/{model_id}",
                                          {"query": "q", "items": ["a document"]})
            _assert_names_the_model(response, model_id)
    finally:
        server.stop()

