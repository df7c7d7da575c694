"""LoRA adapters per request, against PEFT: a tiny random sentence-transformers model and
PEFT adapters on it (random, non-zero B so they change the output), served by a real
`heron serve` and, for adding an adapter at run time, by a cluster (config service, worker,
gateway). Heron's embedding with an adapter must match PEFT's merged model under the same
mean pooling (cosine >= 0.9999), alone and in a burst that mixes adapters and the base
model in the same batches."""

from __future__ import annotations

import asyncio
import json
import os
import random
import shutil
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import yaml

from tests.support import local_http
from tests.support.cluster_procs import ChildProcess, ConfigProcess, GatewayProcess
from tests.support.nats_server import NatsServer
from tests.support.servers import ServerProcess, start_serve
from tests.support.tiny_models import _config, minilm_dir

ADAPTERS = {"alpha": ["query", "value"],
            # "dense" takes BERT's pooler too: a layer that, packed, runs on no row
            "beta": ["key", "dense"],
            "gamma": ["value"]}
WORDS = ("heron lora adapter batch token river paris capital model query document rank "
         "embedding fish wing lake mountain sparse dense vector cluster").split()


def texts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(2, 30))) for _ in range(n)]


def cosine(a: np.ndarray, b: np.ndarray) -> float:
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


class Reference:
    """PEFT's merged models (and the base), mean-pooled as the checkpoint's Pooling says."""

    def __init__(self, base: Path, adapters: dict[str, Path]) -> None:
        from peft import PeftModel
        from transformers import AutoTokenizer, BertModel

        self.tokenizer = AutoTokenizer.from_pretrained(str(base))
        self.models = {None: BertModel.from_pretrained(str(base)).eval()}
        for name, path in adapters.items():
            peft = PeftModel.from_pretrained(BertModel.from_pretrained(str(base)), str(path))
            self.models[name] = peft.merge_and_unload().eval()

    @torch.inference_mode()
    def encode(self, items: list[str], adapter: str | None) -> np.ndarray:
        enc = self.tokenizer(items, padding=True, truncation=True, max_length=64,
                             return_tensors="pt")
        hidden = self.models[adapter](**enc).last_hidden_state
        mask = enc["attention_mask"].unsqueeze(-1).float()
        return ((hidden * mask).sum(1) / mask.sum(1)).numpy()


@pytest.fixture(scope="module")
def lora_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A tiny sentence-transformers model (mean pooling) and three PEFT adapters on it."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, BertModel

    root = tmp_path_factory.mktemp("lora")
    torch.manual_seed(0)
    base = root / "base"
    BertModel(_config()).eval().save_pretrained(str(base))
    AutoTokenizer.from_pretrained(str(minilm_dir())).save_pretrained(str(base))
    # sentence-transformers' files, as its save writes them (importing it costs 3 s here)
    (base / "modules.json").write_text(json.dumps([
        {"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"},
        {"idx": 1, "name": "1", "path": "1_Pooling",
         "type": "sentence_transformers.models.Pooling"}]))
    (base / "sentence_bert_config.json").write_text(json.dumps({"max_seq_length": 64}))
    (base / "1_Pooling").mkdir()
    (base / "1_Pooling" / "config.json").write_text(json.dumps(
        {"word_embedding_dimension": 32, "pooling_mode_mean_tokens": True}))
    out = {"base": base}
    for seed, (name, targets) in enumerate(ADAPTERS.items(), start=1):
        torch.manual_seed(seed)
        model = get_peft_model(BertModel.from_pretrained(str(base)), LoraConfig(
            r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
        with torch.no_grad():  # big enough to move the embedding well away from the base's
            for key, weight in model.named_parameters():
                if "lora_B" in key:
                    weight.normal_(0.0, 0.5)
        model.save_pretrained(str(root / name))
        out[name] = root / name
    # alpha's files with DoRA asked for: what Heron does not compute, so refuses
    out["dora"] = root / "dora"
    shutil.copytree(out["alpha"], out["dora"])
    config = json.loads((out["dora"] / "adapter_config.json").read_text())
    (out["dora"] / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    return out


@pytest.fixture(scope="module")
def reference(lora_models: dict[str, Path]) -> Reference:
    return Reference(lora_models["base"], {n: lora_models[n] for n in ADAPTERS})


def model_config(model_id: str, lora_models: dict[str, Path], loras: list[str],
                 **extra: object) -> dict:
    return {"id": model_id, "adapter": "dense", "source": {"path": str(lora_models["base"])},
            "loras": {n: {"path": str(lora_models[n])} for n in loras},
            "profiles": {"default": {"precision": "fp32", "max_sequence_length": 64}},
            **extra}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory,
           lora_models: dict[str, Path]) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("lora-bundle")
    (root / "models").mkdir()
    with_loras = model_config("test/lora-base", lora_models, [*ADAPTERS, "dora"],
                              max_loras=2, aliases=["lora-base"])
    plain = model_config("test/plain", lora_models, [], aliases=["plain"])
    del plain["loras"]
    for name, config in (("lora.yaml", with_loras), ("plain.yaml", plain)):
        (root / "models" / name).write_text(yaml.safe_dump(config))
    (root / "b.yaml").write_text(yaml.safe_dump({"name": "lora",
                                                 "models": ["lora.yaml", "plain.yaml"]}))
    proc = start_serve(root / "b.yaml", root)
    yield proc
    proc.stop()


def encode(url: str, model: str, items: list[str], **body: object) -> np.ndarray:
    r = local_http.post(f"{url}/v1/encode/{model}", json={"items": items, **body}, timeout=30)
    assert r.status_code == 200, r.text
    return np.array([row["dense"] for row in r.json()["items"]], dtype=np.float32)


async def encode_with(client: httpx.AsyncClient, adapter: str | None,
                      items: list[str]) -> np.ndarray:
    """``items`` encoded by lora-base with ``adapter`` (None: the base model)."""
    body: dict = {"items": items}
    if adapter is not None:
        body["adapter"] = adapter
    r = await client.post("/v1/encode/lora-base", json=body)
    assert r.status_code == 200, r.text
    return np.array([row["dense"] for row in r.json()["items"]], np.float32)


def assert_matches(got: np.ndarray, want: np.ndarray) -> None:
    for g, w in zip(got, want, strict=True):
        assert cosine(g, w) >= 0.9999, cosine(g, w)
        assert np.linalg.norm(g) == pytest.approx(np.linalg.norm(w), rel=1e-3)


def test_each_adapter_matches_peft_merged(server: ServerProcess, reference: Reference) -> None:
    items = texts(8, seed=1)
    base = encode(server.url, "lora-base", items)
    assert_matches(base, reference.encode(items, None))
    for name in ADAPTERS:
        got = encode(server.url, "lora-base", items, adapter=name)
        assert_matches(got, reference.encode(items, name))
        # the adapter changes the answer (else the test proves nothing)
        assert min(cosine(g, b) for g, b in zip(got, base, strict=True)) < 0.999
    # model@adapter: in the route, and in OpenAI's model field
    assert_matches(encode(server.url, "test/lora-base@beta", items),
                   reference.encode(items, "beta"))
    r = local_http.post(server.url + "/v1/embeddings",
                        json={"model": "lora-base@alpha", "input": items}, timeout=30)
    assert r.status_code == 200, r.text
    assert_matches(np.array([d["embedding"] for d in r.json()["data"]], dtype=np.float32),
                   reference.encode(items, "alpha"))


def test_a_burst_mixing_adapters_answers_each_with_its_own(server: ServerProcess,
                                                           reference: Reference) -> None:
    rng = random.Random(7)
    plan = [(rng.choice([None, "alpha", "beta"]), texts(rng.randint(1, 3), seed=100 + i))
            for i in range(48)]

    async def burst() -> list[np.ndarray]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            return await asyncio.gather(*(encode_with(client, a, t) for a, t in plan))

    answers = asyncio.run(burst())
    for (adapter, items), got in zip(plan, answers, strict=True):
        assert_matches(got, reference.encode(items, adapter))


def test_adapters_beyond_max_loras_rotate_and_count_in_memory(
        server: ServerProcess, reference: Reference, lora_models: dict[str, Path]) -> None:
    from safetensors.numpy import load_file

    def lora_bytes(name: str) -> int:
        return sum(a.nbytes for a in load_file(
            str(lora_models[name] / "adapter_model.safetensors")).values())

    def memory() -> float:
        text = local_http.get(server.url + "/metrics").text
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("heron_worker_model_memory_bytes"))

    items = texts(3, seed=3)
    encode(server.url, "lora-base", items)  # base loaded; adapters maybe from other tests
    for name in ("alpha", "beta"):
        encode(server.url, "lora-base", items, adapter=name)
    two = memory()
    assert_matches(encode(server.url, "lora-base", items, adapter="gamma"),
                   reference.encode(items, "gamma"))  # max_loras 2: alpha (LRU) unloaded
    assert memory() - two == lora_bytes("gamma") - lora_bytes("alpha")
    assert_matches(encode(server.url, "lora-base", items, adapter="alpha"),
                   reference.encode(items, "alpha"))  # loaded again, beta unloaded
    assert memory() - two == lora_bytes("gamma") - lora_bytes("beta")


@pytest.mark.parametrize(("path", "body", "status", "code"), [
    ("/v1/encode/lora-base", {"adapter": "nope"}, 404, "ADAPTER_NOT_FOUND"),
    ("/v1/encode/lora-base@nope", {}, 404, "ADAPTER_NOT_FOUND"),
    ("/v1/encode/lora-base@", {}, 422, "INVALID_FIELD"),
    ("/v1/encode/@alpha", {}, 422, "INVALID_FIELD"),
    ("/v1/encode/plain@alpha", {}, 404, "ADAPTER_NOT_FOUND"),
    ("/v1/encode/plain", {"adapter": "alpha"}, 404, "ADAPTER_NOT_FOUND"),
    ("/v1/encode/lora-base@alpha", {"adapter": "beta"}, 422, "INVALID_FIELD"),
    ("/v1/encode/lora-base", {"adapter": "a b"}, 422, "INVALID_FIELD"),
    ("/v1/encode/lora-base", {"adapter": 3}, 422, "INVALID_FIELD"),
    ("/v1/score/lora-base@nope", {"query": "q"}, 404, "ADAPTER_NOT_FOUND"),
    ("/v1/encode/lora-base@dora", {}, 502, "MODEL_LOAD_FAILED"),
])
def test_bad_adapters_are_refused_with_a_code_and_neighbours_unharmed(
        server: ServerProcess, reference: Reference, path: str, body: dict, status: int,
        code: str) -> None:
    items = texts(2, seed=5)

    async def together() -> tuple[httpx.Response, httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
            return await asyncio.gather(
                client.post(path, json={"items": items, **body}),
                client.post("/v1/encode/lora-base", json={"items": items, "adapter": "beta"}))

    bad, good = asyncio.run(together())
    assert bad.status_code == status, bad.text
    assert bad.json()["error"]["code"] == code
    assert good.status_code == 200
    assert_matches(np.array([r["dense"] for r in good.json()["items"]], np.float32),
                   reference.encode(items, "beta"))


def test_rerank_and_sdk_take_the_adapter(server: ServerProcess) -> None:
    from heron_sdk import Client

    r = local_http.post(server.url + "/v1/rerank", json={"model": "lora-base@nope", "query": "q",
                                                    "documents": ["a"]})
    assert r.status_code == 404 and r.json()["code"] == "adapter_not_found"
    r = local_http.post(server.url + "/v1/rerank", json={"model": "lora-base@alpha", "query": "q",
                                                    "documents": ["a", "b"]})
    assert r.status_code == 200, r.text
    described = local_http.get(server.url + "/v1/models/lora-base").json()
    assert described["loras"] == sorted([*ADAPTERS, "dora"])
    assert "loras" not in local_http.get(server.url + "/v1/models/plain").json()
    with Client(server.url) as client:
        got = client.encode("lora-base", ["one text"], adapter="gamma").dense
        want = encode(server.url, "lora-base@gamma", ["one text"])
        assert cosine(np.asarray(got[0]), want[0]) >= 0.9999


def test_an_adapter_added_through_the_config_service_serves_without_restart(
        nats_server: NatsServer, tmp_path: Path, lora_models: dict[str, Path],
        reference: Reference) -> None:
    # A bundle of the tiny base alone: the worker is ready in seconds (MiniLM's default
    # bundle took 17 s to come up on the 2-core CI machine).
    bundles = tmp_path / "bundles"
    (bundles / "models").mkdir(parents=True)
    plain = model_config("test/plain", lora_models, [])
    del plain["loras"]
    (bundles / "models" / "plain.yaml").write_text(yaml.safe_dump(plain))
    (bundles / "lora.yaml").write_text(yaml.safe_dump({"name": "lora", "adapters": ["dense"],
                                                       "models": ["plain.yaml"]}))
    env = {"HERON_BUNDLES_DIR": str(bundles), "HF_HUB_OFFLINE": "1"}
    config_service = ConfigProcess(nats_server.url, str(tmp_path / "store"), tmp_path, env)
    pool = f"l{uuid.uuid4().hex[:8]}"
    worker = ChildProcess("worker", ["--nats", nats_server.url, "--pool", pool, "--bundle",
                                     "lora", "--config", config_service.url], tmp_path, env)
    gateway = GatewayProcess(nats_server.url, {"lora": pool}, tmp_path,
                             extra_args=["--config", config_service.url],
                             extra_env={**env, "HERON_CONFIG_RESYNC_S": "1"})
    model_id = f"live/lora-{uuid.uuid4().hex[:6]}"
    items = texts(4, seed=9)
    try:
        config_service.wait_ready()
        worker.wait_ready()
        gateway.wait_ready()
        config = model_config(model_id, lora_models, ["alpha"], bundles=["lora"])
        r = local_http.post(config_service.url + "/v1/configs/models", json=config)
        assert r.status_code == 201, r.text

        def answer(name: str) -> httpx.Response:
            deadline = time.monotonic() + 60
            while True:
                resp = local_http.post(f"{gateway.url}/v1/encode/{model_id}@{name}",
                                       json={"items": items}, timeout=30)
                if resp.status_code not in (202, 503) and not (
                        resp.status_code == 404
                        and resp.json()["error"]["code"] == "MODEL_NOT_FOUND"):
                    return resp
                assert time.monotonic() < deadline, resp.text
                time.sleep(0.2)

        ok = answer("alpha")
        assert ok.status_code == 200, ok.text
        assert_matches(np.array([row["dense"] for row in ok.json()["items"]], np.float32),
                       reference.encode(items, "alpha"))
        missing = answer("beta")  # refused by the gateway: the config has no beta yet
        assert missing.status_code == 404
        assert missing.json()["error"]["code"] == "ADAPTER_NOT_FOUND"

        config["loras"]["beta"] = {"path": str(lora_models["beta"])}
        r = local_http.post(config_service.url + "/v1/configs/models", json=config)
        assert r.status_code == 201, r.text
        deadline = time.monotonic() + 30
        while (resp := answer("beta")).status_code == 404:
            assert time.monotonic() < deadline, resp.text
            time.sleep(0.2)
        assert resp.status_code == 200, resp.text
        assert_matches(np.array([row["dense"] for row in resp.json()["items"]], np.float32),
                       reference.encode(items, "beta"))
        stored = local_http.get(f"{config_service.url}/v1/configs/models/{model_id}").json()
        assert sorted(stored["model"]["loras"]) == ["alpha", "beta"]
        assert json.dumps(stored)  # the stored view is plain JSON
    finally:
        worker.stop()
        gateway.stop()
        config_service.stop()


@pytest.mark.parametrize("packing", ["auto", "off"])
def test_one_batch_mixing_adapters_computes_each_row_with_its_own(
        lora_models: dict[str, Path], packing: str) -> None:
    """In-process, on the runner's own batch path: one mixed batch (padded, or packed on
    CPU) equals the rows computed alone. Under packing BERT's pooler (adapted by beta's
    "dense") runs on no row: beta's batches are then computed apart, never wrongly."""
    from heron.runtime.modelconfig import Bundle, parse_model_config
    from heron.worker.memory import MemoryPolicy
    from heron.worker.registry import ModelRegistry

    config = model_config("test/mixed", lora_models, list(ADAPTERS))
    config["profiles"]["default"]["packing"] = packing
    registry = ModelRegistry(Bundle("t", (parse_model_config(config),)), memory=MemoryPolicy())

    async def check() -> None:
        await registry.load_all()
        entry = registry.entry("test/mixed")
        runner = entry.runner
        assert runner is not None and runner.adapter.packed is (packing == "auto")
        items = texts(6, seed=11)
        tokens = runner.adapter.tokenize(items)
        async with runner.loras.use("alpha") as alpha, runner.loras.use("beta") as beta:
            rows = [alpha, None, beta, alpha, beta, None]
            mixed, _, _ = runner._run_batch(tokens, rows)
            for i, lora in enumerate(rows):
                alone, _, _ = runner._run_batch([tokens[i]], [lora])
                assert cosine(mixed[i]["dense"], alone[0]["dense"]) >= 0.99999
            assert alpha is not None and not alpha.unmixable
            assert beta is not None and beta.unmixable is runner.adapter.packed
            mixed_ab, _, _ = runner._run_batch(tokens[:2], [alpha, None])
            assert cosine(mixed_ab[0]["dense"], mixed[0]["dense"]) >= 0.99999
        await registry.close()

    asyncio.run(check())


RESOLVE = """
import json, sys
from heron.runtime.modelconfig import WeightSource
from heron.worker.lora_files import read_lora, resolve_lora
from heron.worker.weights import wait_for_uploads
path = resolve_lora("org/base", "alpha", WeightSource(hub="org/alpha-lora"))
wait_for_uploads(30)
print(json.dumps({"path": str(path), "layers": len(read_lora(path, "alpha").modules)}))
"""


def test_a_hub_adapter_comes_through_the_models_weight_tiers(
        tmp_path: Path, lora_models: dict[str, Path]) -> None:
    """Hub -> local cache -> S3 (read-through), then a worker with an empty cache and no
    Hub reads it from S3: moto's S3 server and a loopback Hub (nothing leaves the host)."""
    import subprocess
    import sys

    from tests.support.config_procs import MotoS3
    from tests.support.fake_hub import FakeHub
    from tests.support.servers import REPO

    moto = MotoS3(tmp_path)
    hub = FakeHub({"org/alpha-lora": lora_models["alpha"]}).start()
    try:
        env = moto.weights_env("lora-cache")

        def resolve(cache: Path, **extra: str) -> dict:
            clean = {k: v for k, v in os.environ.items() if k not in ("HF_HUB_OFFLINE",)}
            done = subprocess.run([sys.executable, "-c", RESOLVE], cwd=REPO, text=True,
                                  capture_output=True, timeout=120, env={
                                      **clean, **env, "HERON_CACHE_DIR": str(cache), **extra})
            assert done.returncode == 0, done.stderr
            return json.loads(done.stdout.splitlines()[-1])

        first = resolve(tmp_path / "c1", HF_ENDPOINT=hub.url)
        assert first["path"].startswith(str(tmp_path / "c1")) and first["layers"] == 4
        assert any("adapter_model.safetensors" in r for r in hub.requests)
        hub.stop()
        second = resolve(tmp_path / "c2", HF_HUB_OFFLINE="1")  # from S3 alone
        assert second["path"].startswith(str(tmp_path / "c2")) and second["layers"] == 4
    finally:
        moto.stop()


# ---- the config schema and the config service's append-only rule (no server) --------------
def test_model_config_loras_parse_round_trip_and_leave_other_hashes_alone() -> None:
    from heron.runtime.modelconfig import ConfigError, parse_model_config

    plain = {"id": "org/m", "adapter": "dense", "source": {"hub": "org/m"}}
    with_loras = {**plain, "loras": {"a": {"path": "/x"}, "b.2": {"hub": "org/l",
                                                                  "revision": "v1"}},
                  "max_loras": 2.0}
    config = parse_model_config(with_loras)
    assert config.max_loras == 2 and config.loras["b.2"].revision == "v1"
    assert parse_model_config(config.to_dict()) == config
    base = parse_model_config(plain)
    assert "loras" not in base.canonical() and "loras" not in base.to_dict()
    assert parse_model_config({**plain, "loras": None, "max_loras": None}) == base
    assert config.canonical()["loras"]["a"]["path"] == "/x"
    for bad in ({"loras": []}, {"loras": {"": {"path": "/x"}}}, {"loras": {"a b": {}}},
                {"loras": {"a": {"path": "/x", "hub": "y"}}}, {"loras": {"a": None}},
                {"loras": {"a@b": {"path": "/x"}}}, {"max_loras": 0}, {"max_loras": True},
                {"max_loras": 1.5}, {"max_loras": "2"}):
        with pytest.raises(ConfigError):
            parse_model_config({**plain, **bad})


def test_the_config_service_merges_new_adapters_and_refuses_changed_ones(
        tmp_path: Path) -> None:
    from heron.config_service.state import ContentConflict, Registry
    from heron.runtime.modelconfig import parse_model_config
    from tests.support.config_procs import model_body, write_bundles

    registry = Registry.from_bundles_dir(write_bundles(tmp_path / "bundles"))
    body = model_body(loras={"a": {"path": "/a"}})
    registry.apply(registry.plan(parse_model_config(body), None))  # type: ignore[arg-type]
    grown = registry.plan(parse_model_config(
        {**body, "loras": {"b": {"path": "/b"}}}), None)  # "a" left out: kept
    assert grown is not None and sorted(grown.model.loras) == ["a", "b"]
    assert grown.delta().model["loras"] == {"a": {"path": "/a"}, "b": {"path": "/b"}}
    registry.apply(grown)
    assert registry.plan(parse_model_config(body), None) is None
    for changed, field_name in (({"loras": {"a": {"path": "/other"}}}, "loras.a"),
                                ({"max_loras": 9}, "max_loras")):
        with pytest.raises(ContentConflict) as refused:
            registry.plan(parse_model_config({**body, **changed}), None)
        assert refused.value.fields == [field_name]
