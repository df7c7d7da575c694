"""LRU eviction in a real `heron serve`: three models rotating under a memory budget that
fits two, a busy model never evicted, a load that cannot fit answered 503 (not 502), and
idle eviction. Three ids share one tiny model's weights, so each has the same size."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import yaml

from heron_sdk import Client
from tests.support import local_http
from tests.support.servers import REPO, ServerProcess, start_serve

ROTATING = ["t/a", "t/b", "t/c"]


def write_bundle(root: Path, tiny: Path) -> Path:
    (root / "models").mkdir(parents=True)
    names = []
    for model_id in ROTATING:
        name = model_id.replace("/", "-") + ".yaml"
        (root / "models" / name).write_text(yaml.safe_dump({
            "id": model_id, "adapter": "dense", "source": {"path": str(tiny)},
            "profiles": {"default": {"pooling": "mean"}}}))
        names.append(name)
    big = (REPO / "bundles/models/all-minilm-l6-v2.yaml").read_text()
    (root / "models" / "minilm.yaml").write_text(big)
    names.append("minilm.yaml")
    (root / "t.yaml").write_text(yaml.safe_dump({"name": "t", "models": names,
                                                 "preload": []}))
    return root / "t.yaml"


def metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


@pytest.fixture(scope="module")
def tiny_size(tiny_models: dict[str, Path]) -> int:
    return (tiny_models["tiny-dense-cls"] / "model.safetensors").stat().st_size


@pytest.fixture(scope="module")
def budget_server(tmp_path_factory: pytest.TempPathFactory, tiny_models: dict[str, Path],
                  tiny_size: int) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("evict")
    bundle = write_bundle(root, tiny_models["tiny-dense-cls"])
    server = start_serve(bundle, root, env={
        "HERON_MODEL_MEMORY_BUDGET": str(int(tiny_size * 2.5))})
    yield server
    server.stop()


def test_three_models_rotate_under_a_budget_for_two(budget_server: ServerProcess,
                                                    tiny_size: int) -> None:
    first: dict[str, np.ndarray] = {}
    with Client(budget_server.url, timeout=30) as client:
        for round_ in range(4):
            for model in ROTATING:
                vec = client.encode(model, ["rotate the models"]).dense[0]
                if round_ == 0:
                    first[model] = vec
                else:  # a reloaded model answers exactly as before
                    np.testing.assert_allclose(vec, first[model], atol=1e-6)
                text = local_http.get(budget_server.url + "/metrics").text
                assert metric(text, "heron_worker_model_memory_bytes") <= tiny_size * 2.5
    text = local_http.get(budget_server.url + "/metrics").text
    # Each call after the first two needed an eviction: 10 of the 12.
    assert metric(text, "heron_worker_model_evictions_total", reason="budget") >= 10
    errors = sum(metric(text, "heron_worker_requests_total", status=s) for s in ("500", "502"))
    assert errors == 0
    states = {m["id"]: m["state"] for m in local_http.get(budget_server.url + "/v1/models").json()
              ["data"]}
    assert sorted(s for m, s in states.items() if m in ROTATING) == \
        ["not_loaded", "ready", "ready"]


def test_a_busy_model_is_never_evicted(budget_server: ServerProcess) -> None:
    with Client(budget_server.url, timeout=60) as client:
        client.encode("t/a", ["warm"])
        client.encode("t/b", ["warm"])  # a and b resident; a is the older
        results: list[int] = []

        def busy() -> None:  # keeps t/a working while t/c needs room
            for _ in range(3):
                results.append(len(client.encode("t/a", ["x " * 60] * 300)))

        thread = threading.Thread(target=busy)
        thread.start()
        time.sleep(0.3)
        client.encode("t/c", ["needs room"])
        thread.join(60)
        assert results == [300, 300, 300]
        evicted = local_http.get(budget_server.url + "/v1/models/t/b").json()["state"]
        assert evicted == "not_loaded"  # b went, though a was older: a was busy


def test_a_model_that_cannot_fit_is_a_transient_503(budget_server: ServerProcess) -> None:
    r = local_http.post(budget_server.url + "/v1/encode/minilm", json={"items": ["too big"]},
                        timeout=30)
    deadline = time.monotonic() + 30
    while r.status_code == 503 and r.json()["error"]["code"] == "MODEL_LOADING":
        assert time.monotonic() < deadline
        time.sleep(0.2)
        r = local_http.post(budget_server.url + "/v1/encode/minilm", json={"items": ["too big"]})
    assert r.status_code == 503, r.text
    assert r.json()["error"]["code"] == "INSUFFICIENT_MEMORY"
    assert "budget" in r.json()["error"]["message"] and int(r.headers["retry-after"]) >= 1
    model = local_http.get(budget_server.url + "/v1/models/minilm").json()
    assert model["state"] == "not_loaded"  # not "failed": it is tried again later


def test_idle_models_are_evicted_and_come_back(tmp_path: Path,
                                               tiny_models: dict[str, Path]) -> None:
    bundle = write_bundle(tmp_path, tiny_models["tiny-dense-cls"])
    server = start_serve(bundle, tmp_path, env={"HERON_IDLE_EVICT_S": "1"})
    try:
        with Client(server.url, timeout=30) as client:
            before = client.encode("t/a", ["idle soon"]).dense
            evicted = metric(local_http.get(server.url + "/metrics").text,
                             "heron_worker_model_evictions_total", model="t/a", reason="idle")
            deadline = time.monotonic() + 15
            while client.get_model("t/a")["state"] == "ready":
                assert time.monotonic() < deadline, "never evicted"
                time.sleep(0.3)
            text = local_http.get(server.url + "/metrics").text
            assert metric(text, "heron_worker_model_evictions_total", model="t/a",
                          reason="idle") == evicted + 1
            # The next request waits for the reload: no 503 for an evicted model.
            r = local_http.post(server.url + "/v1/encode/t/a", json={"items": ["idle soon"]})
            assert r.status_code == 200, r.text
            np.testing.assert_allclose(client.encode("t/a", ["idle soon"]).dense, before,
                                       atol=1e-6)
    finally:
        server.stop()


def test_memory_units_parse() -> None:
    from heron.worker.memory import parse_bytes

    assert parse_bytes("1.5GiB") == int(1.5 * 1024**3) and parse_bytes("800MB") == 800_000_000
    assert parse_bytes("123") == 123
    with pytest.raises(ValueError, match="not a size"):
        parse_bytes("lots")
