"""The weight tiers with a real S3 cluster cache: moto's S3 server on loopback, reached by
boto3 over HTTP (nothing patched), and a loopback stand-in for the Hugging Face Hub that the
real huggingface-hub client downloads from.

- A worker with an empty local cache serves MiniLM from S3 (`heron serve`), and its vectors
  equal the package-backed MiniLM's.
- Read-through: a model only the Hub has lands in S3, and the next worker (empty local cache,
  Hub gone) reads it from S3 and loads it.
- A half-uploaded copy (no .complete) is ignored; an unreachable S3 falls through to the Hub;
  a throttling S3 or a full disk is a temporary failure; with every tier empty the error
  names every tier.
"""

from __future__ import annotations

import filecmp
import json
import shutil
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import boto3
import numpy as np
import pytest
import torch
import yaml
from transformers import AutoTokenizer, BertConfig, BertModel

from heron.runtime.modelconfig import ModelConfig, parse_model_config
from heron.worker.adapters.dense import DenseAdapter
from heron.worker.weight_stats import weight_cache_stats
from heron.worker.weights import WeightsTemporarilyUnavailable, WeightsUnavailable, resolve_weights
from tests.support import local_http
from tests.support.config_procs import MotoS3
from tests.support.fake_hub import FakeHub
from tests.support.servers import REPO, free_port, start_serve
from tests.support.tiny_models import minilm_dir

pytestmark = pytest.mark.timeout(180)

PREFIX = "weights"


@pytest.fixture(scope="module")
def moto(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MotoS3]:
    server = MotoS3(tmp_path_factory.mktemp("moto"))
    yield server
    server.stop()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random BERT with MiniLM's tokenizer, as save_pretrained writes it."""
    path = tmp_path_factory.mktemp("tiny") / "tiny-dense"
    torch.manual_seed(0)
    BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         intermediate_size=64, max_position_embeddings=128)
              ).eval().save_pretrained(str(path))
    AutoTokenizer.from_pretrained(str(minilm_dir())).save_pretrained(str(path))
    return path


@pytest.fixture()
def env(moto: MotoS3, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """A fresh bucket as the cluster cache, an empty local cache, the Hub offline."""
    bucket = f"heron-weights-{uuid.uuid4().hex[:8]}"
    for name, value in {"AWS_ENDPOINT_URL": moto.url, "AWS_ACCESS_KEY_ID": "testing",
                        "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1",
                        "AWS_MAX_ATTEMPTS": "1", "HERON_WEIGHTS_S3": f"s3://{bucket}/{PREFIX}",
                        "HERON_CACHE_DIR": str(tmp_path / "cache"), "HF_HUB_OFFLINE": "1",
                        "HF_HUB_DISABLE_PROGRESS_BARS": "1"}.items():
        monkeypatch.setenv(name, value)
    s3 = boto3.client("s3", endpoint_url=moto.url)
    s3.create_bucket(Bucket=bucket)
    return {"s3": s3, "bucket": bucket, "cache": tmp_path / "cache"}


@pytest.fixture()
def hub(tiny_model: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[FakeHub]:
    server = FakeHub({"org/tiny": tiny_model}).start()
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_ENDPOINT", server.url)
    yield server
    server.stop()


WORKER = """
import dataclasses, json, logging, sys
from heron.runtime.modelconfig import parse_model_config
from heron.worker.weight_stats import weight_cache_stats
from heron.worker.weights import resolve_weights, wait_for_uploads
logging.basicConfig(level=logging.INFO, stream=sys.stderr)
config = parse_model_config(json.loads(sys.argv[1]))
try:
    out = {"path": str(resolve_weights(config))}
except Exception as exc:
    out = {"error": type(exc).__name__, "message": str(exc)}
assert wait_for_uploads(60)
out["stats"] = dataclasses.asdict(weight_cache_stats())
print(json.dumps(out))
"""


def resolve_in_worker(model_id: str) -> dict[str, Any]:
    """Resolve in a fresh process, as a worker would: huggingface-hub reads HF_HUB_OFFLINE
    once, at import, and this test process imported it offline."""
    config = {"id": model_id, "adapter": "dense", "source": {"hub": model_id}}
    done = subprocess.run([sys.executable, "-c", WORKER, json.dumps(config)], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return {**json.loads(done.stdout.splitlines()[-1]), "log": done.stderr}


def hub_config(model_id: str = "org/tiny", repo: str | None = None) -> ModelConfig:
    return parse_model_config({"id": model_id, "adapter": "dense",
                               "source": {"hub": repo or model_id}})


def model_files(path: Path) -> dict[str, int]:
    return {p.relative_to(path).as_posix(): p.stat().st_size for p in sorted(path.rglob("*"))
            if p.is_file() and not p.name.startswith(".") and p.name != "README.md"}


def seed(env: dict[str, Any], safe_id: str, src: Path, *, complete: bool = True) -> None:
    """Put a model into the cluster cache by the documented layout, with plain boto3."""
    files = model_files(src)
    base = f"{PREFIX}/{safe_id}/main"
    for name in files:
        env["s3"].upload_file(str(src / name), env["bucket"], f"{base}/{name}")
    if complete:
        env["s3"].put_object(Bucket=env["bucket"], Key=f"{base}/.complete",
                             Body=json.dumps({"files": files}).encode())


def s3_keys(env: dict[str, Any]) -> set[str]:
    listing = env["s3"].list_objects_v2(Bucket=env["bucket"]).get("Contents", [])
    return {o["Key"] for o in listing}


def same_files(a: Path, b: Path) -> bool:
    names = model_files(a)
    return names == model_files(b) and all(
        filecmp.cmp(a / n, b / n, shallow=False) for n in names)


def embed(path: Path, texts: list[str]) -> np.ndarray:
    """A real load through the dense adapter, and one forward pass."""
    config = parse_model_config({"id": "m", "adapter": "dense", "source": {"path": str(path)}})
    adapter = DenseAdapter(config, config.profile)
    adapter.load(path, torch.device("cpu"), torch.float32)
    with torch.inference_mode():
        batch = adapter.collate(adapter.tokenize(texts))
        return np.stack([r["dense"] for r in adapter.postprocess(batch, adapter.forward(batch))])


def test_empty_local_cache_serves_minilm_from_s3(env: dict[str, Any], tmp_path: Path) -> None:
    seed(env, "sentence-transformers--all-MiniLM-L6-v2", minilm_dir())
    shipped = yaml.safe_load((REPO / "bundles/models/all-minilm-l6-v2.yaml").read_text())
    from_s3 = {**shipped, "source": {"hub": "sentence-transformers/all-MiniLM-L6-v2"}}
    from_package = {**shipped, "id": "local/minilm-package", "aliases": []}
    models = tmp_path / "bundle" / "models"
    models.mkdir(parents=True)
    (models / "s3.yaml").write_text(yaml.safe_dump(from_s3))
    (models / "package.yaml").write_text(yaml.safe_dump(from_package))
    (models.parent / "b.yaml").write_text(yaml.safe_dump(
        {"name": "b", "models": ["s3.yaml", "package.yaml"]}))

    server = start_serve(models.parent / "b.yaml", tmp_path)  # HF_HUB_OFFLINE=1: no Hub
    try:
        texts = ["hello world", "Paris is the capital of France."]
        vectors = {}
        for model in ("sentence-transformers/all-MiniLM-L6-v2", "local/minilm-package"):
            r = local_http.post(f"{server.url}/v1/encode/{model}", json={"items": texts},
                                timeout=60)
            assert r.status_code == 200, r.text
            vectors[model] = np.array([item["dense"] for item in r.json()["items"]])
    finally:
        server.stop()
    assert vectors["sentence-transformers/all-MiniLM-L6-v2"].shape == (2, 384)
    np.testing.assert_allclose(vectors["sentence-transformers/all-MiniLM-L6-v2"],
                               vectors["local/minilm-package"], atol=1e-6)
    cached = env["cache"] / "sentence-transformers--all-MiniLM-L6-v2" / "main"
    assert same_files(cached, minilm_dir()) and (cached / ".complete").is_file()


def test_hub_download_fills_s3_and_the_next_worker_reads_s3(
        env: dict[str, Any], hub: FakeHub, tiny_model: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    first = resolve_in_worker("org/tiny")  # the first worker: the Hub has it, nothing else
    path = Path(first["path"])
    assert same_files(path, tiny_model) and path.is_relative_to(env["cache"])
    assert any("/resolve/" in r for r in hub.requests)
    files = model_files(tiny_model)
    stats = first["stats"]
    assert stats["hits"] == {"hub": 1} and stats["misses"] == {"local": 1, "s3": 1}
    assert stats["s3_uploads"] == 1 and stats["s3_uploaded_bytes"] == sum(files.values())

    base = f"{PREFIX}/org--tiny/main"
    assert s3_keys(env) == {f"{base}/{n}" for n in files} | {f"{base}/.complete"}
    marker = env["s3"].get_object(Bucket=env["bucket"], Key=f"{base}/.complete")
    assert json.loads(marker["Body"].read())["files"] == files

    # The next worker: an empty local cache, and no Hub at all.
    hub.stop()
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    shutil.rmtree(env["cache"])
    requests = len(hub.requests)
    before = weight_cache_stats()
    path = resolve_weights(hub_config())
    assert same_files(path, tiny_model) and len(hub.requests) == requests
    assert weight_cache_stats().hits.get("s3", 0) - before.hits.get("s3", 0) == 1
    texts = ["herons stand still in the river", "a second text"]
    np.testing.assert_array_equal(embed(path, texts), embed(tiny_model, texts))


def test_half_uploaded_copy_is_ignored_and_the_error_names_every_tier(
        env: dict[str, Any], tiny_model: Path) -> None:
    seed(env, "org--tiny", tiny_model, complete=False)  # an upload cut short: no marker
    with pytest.raises(WeightsUnavailable) as failure:
        resolve_weights(hub_config())
    message = str(failure.value)
    assert f"local cache: {env['cache']}/org--tiny/main is not there" in message
    assert (f"S3 cluster cache s3://{env['bucket']}/{PREFIX}/org--tiny/main/: has no "
            f"complete copy") in message
    assert "Hugging Face Hub: not downloaded: HF_HUB_OFFLINE is set" in message
    assert not (env["cache"] / "org--tiny").exists()


def test_unreachable_s3_falls_through_to_the_hub(
        env: dict[str, Any], hub: FakeHub, tiny_model: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{free_port()}")  # nobody there
    worker = resolve_in_worker("org/tiny")
    assert same_files(Path(worker["path"]), tiny_model)
    log = worker["log"]
    assert "S3 cluster cache" in log and "unreachable" in log and "trying the next tier" in log
    # The read-through upload fails too: logged, counted, not fatal.
    assert "could not upload to the S3 cluster cache" in log
    assert worker["stats"]["s3_upload_failures"] == 1 and worker["stats"]["errors"] == {"s3": 1}

    # Without the Hub as well, the error says what happened at each tier; it is permanent.
    shutil.rmtree(env["cache"])
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(WeightsUnavailable, match=r"S3 cluster cache .*unreachable.*HF_HUB_OFF"):
        resolve_weights(hub_config())


class _ThrottlingS3:
    """Answers every request as S3 does when it wants the caller to slow down."""

    def __init__(self) -> None:
        class Handler(BaseHTTPRequestHandler):
            def _slow_down(self) -> None:
                body = (b"<?xml version='1.0' encoding='UTF-8'?><Error><Code>SlowDown</Code>"
                        b"<Message>Please reduce your request rate.</Message></Error>")
                self.send_response(503)
                self.send_header("Content-Type", "application/xml")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            do_GET = do_PUT = do_HEAD = do_DELETE = do_POST = _slow_down

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_throttling_s3_is_a_temporary_failure(env: dict[str, Any],
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    throttling = _ThrottlingS3()
    monkeypatch.setenv("AWS_ENDPOINT_URL", throttling.url)
    try:
        with pytest.raises(WeightsTemporarilyUnavailable, match="SlowDown") as failure:
            resolve_weights(hub_config())
    finally:
        throttling.stop()
    assert failure.value.retry_after_s > 0
    assert "HF_HUB_OFFLINE" in str(failure.value)  # every tier is still named


def test_hub_answering_5xx_is_a_temporary_failure(
        env: dict[str, Any], hub: FakeHub, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("HERON_WEIGHTS_S3")  # the Hub is the only tier behind the local cache
    hub.fail_with = 503
    worker = resolve_in_worker("org/tiny")
    assert worker["error"] == "WeightsTemporarilyUnavailable", worker
    assert "could not download org/tiny from the Hugging Face Hub (HTTP 503)" in \
        worker["message"]
    hub.fail_with = 404
    worker = resolve_in_worker("org/tiny")
    assert worker["error"] == "WeightsUnavailable", worker
    assert "(HTTP 404)" in worker["message"]


@pytest.fixture()
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 2 MiB tmpfs: a real full disk. Needs mount rights (root in a container)."""
    mount_point = tmp_path / "small-disk"
    mount_point.mkdir()
    if not shutil.which("mount") or subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(mount_point)],
            capture_output=True).returncode != 0:
        pytest.skip("cannot mount a small tmpfs here (needs root)")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


def test_disk_full_while_filling_is_a_temporary_failure(
        env: dict[str, Any], tiny_model: Path, small_disk: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert sum(model_files(tiny_model).values()) > 2 << 20  # more than the disk holds
    seed(env, "org--tiny", tiny_model)
    monkeypatch.setenv("HERON_CACHE_DIR", str(small_disk / "cache"))
    before = weight_cache_stats()
    with pytest.raises(WeightsTemporarilyUnavailable, match="filled up while fetching from S3"):
        resolve_weights(hub_config())
    assert weight_cache_stats().transient_failures - before.transient_failures == 1
    # Nothing half-written is left, neither at the model's place nor in staging.
    assert not (small_disk / "cache" / "org--tiny" / "main").exists()
    assert list((small_disk / "cache" / ".staging").iterdir()) == []
