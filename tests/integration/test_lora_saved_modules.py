"""LoRA adapters that save modules whole (PEFT's ``modules_to_save``), against PEFT: a tiny
random BERT cross-encoder (one label) and two PEFT ``SEQ_CLS`` adapters with LoRA on the
attention and ``modules_to_save=["classifier"]`` (the head trained with the adapter), served
by a real ``heron serve``. Heron's scores with an adapter must equal PEFT's merged model's
(``merge_and_unload``, sigmoid as sentence-transformers' CrossEncoder applies it) within
1e-4, in a burst that mixes the adapters and the base model in the same batches; and in
process, one mixed batch equals PEFT row by row."""

from __future__ import annotations

import asyncio
import random
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
import torch
import yaml

from tests.support import local_http
from tests.support.servers import ServerProcess, start_serve
from tests.support.tiny_models import _config, minilm_dir

ADAPTERS = {"head": (["query", "value"], ["classifier"]),
            "head2": (["key"], ["classifier"]),
            "pooler": (["query"], ["pooler"])}  # BERT's pooler: runs on no row when packed
MODEL = "test/ce-lora"
WORDS = ("heron lora adapter batch token river paris capital model query document rank "
         "fish wing lake mountain bird water wade shallow").split()


def pairs(n: int, seed: int) -> tuple[str, list[str]]:
    rng = random.Random(seed)
    return (" ".join(rng.choices(WORDS, k=rng.randint(2, 6))),
            [" ".join(rng.choices(WORDS, k=rng.randint(1, 25))) for _ in range(n)])


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, BertForSequenceClassification

    root = tmp_path_factory.mktemp("ce-lora")
    torch.manual_seed(0)
    base = root / "base"
    BertForSequenceClassification(_config(num_labels=1)).eval().save_pretrained(str(base))
    AutoTokenizer.from_pretrained(str(minilm_dir())).save_pretrained(str(base))
    out = {"base": base}
    for seed, (name, (targets, to_save)) in enumerate(ADAPTERS.items(), start=1):
        torch.manual_seed(seed)
        model = get_peft_model(BertForSequenceClassification.from_pretrained(str(base)),
                               LoraConfig(task_type="SEQ_CLS", r=4, lora_alpha=8,
                                          target_modules=targets, modules_to_save=to_save,
                                          init_lora_weights=False))
        with torch.no_grad():  # the head and the deltas trained: far from the base's
            for key, weight in model.named_parameters():
                if "lora_B" in key:
                    weight.normal_(0.0, 0.5)
                elif "modules_to_save" in key:
                    weight.normal_(0.0, 1.0)
        model.save_pretrained(str(root / name))
        out[name] = root / name
    # LoRA on a layer inside the module the adapter saves whole: refused, not guessed at
    out["inside"] = root / "inside"
    shutil.copytree(out["pooler"], out["inside"])
    config = (out["inside"] / "adapter_config.json").read_text()
    (out["inside"] / "adapter_config.json").write_text(
        config.replace('"pooler"', '"bert"'))
    return out


class Reference:
    """PEFT's merged models (and the base): sigmoid of the one logit."""

    def __init__(self, models: dict[str, Path]) -> None:
        from peft import PeftModel
        from transformers import AutoTokenizer, BertForSequenceClassification

        base = str(models["base"])
        self.tokenizer = AutoTokenizer.from_pretrained(base)
        self.models = {None: BertForSequenceClassification.from_pretrained(base).eval()}
        for name in ADAPTERS:
            peft = PeftModel.from_pretrained(BertForSequenceClassification.from_pretrained(
                base), str(models[name]))
            self.models[name] = peft.merge_and_unload().eval()

    @torch.inference_mode()
    def score(self, query: str, docs: list[str], adapter: str | None) -> np.ndarray:
        enc = self.tokenizer([query] * len(docs), docs, padding=True, truncation=True,
                             max_length=64, return_tensors="pt")
        return torch.sigmoid(self.models[adapter](**enc).logits[:, 0]).numpy()


@pytest.fixture(scope="module")
def reference(models: dict[str, Path]) -> Reference:
    return Reference(models)


def model_config(models: dict[str, Path]) -> dict:
    return {"id": MODEL, "adapter": "cross_encoder", "source": {"path": str(models["base"])},
            "loras": {n: {"path": str(models[n])} for n in [*ADAPTERS, "inside"]},
            "max_loras": 4,
            "profiles": {"default": {"precision": "fp32", "max_sequence_length": 64}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory,
           models: dict[str, Path]) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("ce-lora-bundle")
    (root / "models").mkdir()
    (root / "models" / "ce.yaml").write_text(yaml.safe_dump(model_config(models)))
    (root / "b.yaml").write_text(yaml.safe_dump({"name": "ce", "models": ["ce.yaml"]}))
    proc = start_serve(root / "b.yaml", root)
    yield proc
    proc.stop()


def scores(body: dict) -> np.ndarray:
    return np.array([r["score"] for r in sorted(body["results"], key=lambda r: r["index"])])


def test_a_burst_mixing_saved_heads_and_the_base_matches_peft_merged(
        server: ServerProcess, reference: Reference) -> None:
    rng = random.Random(5)
    plan = [(rng.choice([None, *ADAPTERS]), pairs(rng.randint(1, 4), seed=200 + i))
            for i in range(60)]

    async def burst() -> list[np.ndarray]:
        async with httpx.AsyncClient(base_url=server.url, timeout=60) as client:
            async def one(adapter: str | None, pair: tuple[str, list[str]]) -> np.ndarray:
                body: dict = {"query": pair[0], "items": pair[1]}
                if adapter is not None:
                    body["adapter"] = adapter
                r = await client.post(f"/v1/score/{MODEL}", json=body)
                assert r.status_code == 200, r.text
                return scores(r.json())
            return await asyncio.gather(*(one(a, p) for a, p in plan))

    answers = asyncio.run(burst())
    for (adapter, (query, docs)), got in zip(plan, answers, strict=True):
        want = reference.score(query, docs, adapter)
        np.testing.assert_allclose(got, want, atol=1e-4, err_msg=str(adapter))
    query, docs = pairs(8, seed=1)
    base = reference.score(query, docs, None)
    for name in ADAPTERS:  # each adapter moves the scores (else the test proves nothing)
        assert np.abs(reference.score(query, docs, name) - base).max() > 0.05, name


def test_lora_inside_a_saved_module_is_refused_with_a_code(server: ServerProcess) -> None:
    r = local_http.post(f"{server.url}/v1/score/{MODEL}@inside",
                        json={"query": "q", "items": ["a"]}, timeout=30)
    assert r.status_code == 502, r.text
    error = r.json()["error"]
    assert error["code"] == "MODEL_LOAD_FAILED" and "modules_to_save" in error["message"]


def test_one_batch_mixing_saved_heads_computes_each_row_with_its_own(
        models: dict[str, Path], reference: Reference) -> None:
    """In process, on the runner's batch path: one batch mixing three adapters and the base
    equals PEFT's merged models row by row, in one pass (the saved classifier runs on
    pooled rows, the saved pooler on padded [B, L, H]: both tell the rows apart)."""
    from heron.runtime.modelconfig import Bundle, parse_model_config
    from heron.worker.memory import MemoryPolicy
    from heron.worker.registry import ModelRegistry

    config = parse_model_config(model_config(models))
    registry = ModelRegistry(Bundle("t", (config,)), memory=MemoryPolicy())
    query, docs = pairs(8, seed=21)

    async def check() -> None:
        await registry.load_all()
        runner = registry.entry(MODEL).runner
        assert runner is not None
        tokens = runner.adapter.tokenize([(query, d) for d in docs])
        async with (runner.loras.use("head") as head, runner.loras.use("head2") as head2,
                    runner.loras.use("pooler") as pooler):
            loras = {None: None, "head": head, "head2": head2, "pooler": pooler}
            names = [None, "head", "head2", "pooler", "head", None, "pooler", "head2"]
            mixed, _, _ = runner._run_batch(tokens, [loras[n] for n in names])
            for i, name in enumerate(names):
                want = reference.score(query, [docs[i]], name)[0]
                assert abs(mixed[i] - want) < 1e-4, (i, name)
            assert head is not None and not head.unmixable
            assert head2 is not None and not head2.unmixable
            assert pooler is not None and not pooler.unmixable
        await registry.close()

    asyncio.run(check())
