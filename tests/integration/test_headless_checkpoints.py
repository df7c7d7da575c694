"""A checkpoint without its task's head never serves: a base encoder (a BertModel saved with
no classifier or MLM head) named by a cross_encoder, token_classifier or sparse model config
fails to load with the weights transformers would have filled with random values, and its
requests get 502 MODEL_LOAD_FAILED; a checkpoint with its head, in the same server, serves."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest
import yaml
from transformers import AutoTokenizer, BertModel

from tests.support.servers import start_serve
from tests.support.tiny_models import _config, minilm_dir

# adapter -> the head weights its AutoModelFor* class would have initialized at random
HEADLESS = {
    "cross_encoder": ["classifier.bias", "classifier.weight"],
    "token_classifier": ["classifier.bias", "classifier.weight"],
    "sparse": ["cls.predictions.bias", "cls.predictions.transform.dense.weight"],
}
TASKS = {"cross_encoder": ("score", {"query": "q", "items": ["a heron"]}),
         "token_classifier": ("extract", {"items": ["Ada lives in Paris"]}),
         "sparse": ("encode", {"items": ["a heron"], "output_types": ["sparse"]})}


def _bundle(root: Path, base: Path, proper: Path) -> Path:
    (root / "models").mkdir(parents=True)
    configs = {f"headless-{a.replace('_', '-')}": (a, base) for a in HEADLESS}
    configs["proper-cross-encoder"] = ("cross_encoder", proper)
    for name, (adapter, path) in configs.items():
        config = {"id": f"test/{name}", "aliases": [name], "adapter": adapter,
                  "source": {"path": str(path)},
                  "profiles": {"default": {"max_sequence_length": 64}}}
        (root / "models" / f"{name}.yaml").write_text(yaml.safe_dump(config))
    bundle = root / "headless.yaml"
    bundle.write_text(yaml.safe_dump({"name": "headless",
                                      "models": [f"{n}.yaml" for n in configs]}))
    return bundle


@pytest.mark.slow
def test_a_checkpoint_without_its_head_fails_to_load_naming_the_weights(
        tmp_path: Path, tiny_models: dict[str, Path]) -> None:
    base = tmp_path / "tiny-base-bert"
    BertModel(_config()).eval().save_pretrained(str(base))  # no classifier, no MLM head
    AutoTokenizer.from_pretrained(str(minilm_dir())).save_pretrained(str(base))
    bundle = _bundle(tmp_path / "bundle", base, tiny_models["tiny-cross-encoder"])
    server = start_serve(bundle, tmp_path, wait_ready=False)
    try:
        with httpx.Client(base_url=server.url, timeout=30) as http:
            deadline = time.monotonic() + 120
            while True:
                assert server.proc.poll() is None, server.log()
                try:
                    models = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
                except httpx.HTTPError:
                    models = {}
                if models and all(m["state"] in ("ready", "failed") for m in models.values()):
                    break
                assert time.monotonic() < deadline, models or server.log()
                time.sleep(0.2)
            assert models["test/proper-cross-encoder"]["state"] == "ready"
            r = http.post("/v1/score/proper-cross-encoder",
                          json={"query": "q", "items": ["a heron"]})
            assert r.status_code == 200, r.text
            for adapter, keys in HEADLESS.items():
                name = f"headless-{adapter.replace('_', '-')}"
                model = models[f"test/{name}"]
                assert model["state"] == "failed", model
                assert "would be newly initialized" in model["error"], model["error"]
                assert all(k in model["error"] for k in keys), model["error"]
                task, body = TASKS[adapter]
                r = http.post(f"/v1/{task}/{name}", json=body)
                assert r.status_code == 502, r.text
                error = r.json()["error"]
                assert error["code"] == "MODEL_LOAD_FAILED"
                assert all(k in error["message"] for k in keys), error
            ready = http.get("/readyz")
            assert ready.status_code == 503 and ready.json()["status"] == "failed"
    finally:
        server.stop()
