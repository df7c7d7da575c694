"""Stanford ColBERT checkpoints (colbert-ai's HF_ColBERT, as colbert-ir/colbertv2.0 ships them)
served from their own files match PyLate loading them: document and query token vectors
(marker tokens from ``artifact.metadata``, its lengths and [MASK] attention, the
``linear.weight`` projection kept in the backbone's weights) and MaxSim ``score``.
Checkpoints: references/stanford_colbert.py (.venv-parity); their token vectors and scores
are checked with PyLate's cases in test_colbert.py. Here: what the models route shows, how
the files are read (defaults without metadata), and the checkpoints that are refused rather
than served wrong."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from heron.runtime.checkpoint import (
    Checkpoint,
    CheckpointError,
    detect_family,
    read_checkpoint,
)
from heron_sdk import Client


def test_models_route_shows_stanford_settings(parity_servers: dict[str, str]) -> None:
    with Client(parity_servers["serve"]) as client:
        model = client.get_model("parity/stanford-colbert")
        attend = client.get_model("parity/stanford-colbert-attend")
    assert model["adapter"] == "multi_vector" and model["similarity"] == "maxsim"
    assert model["dimensions"] == 16 and attend["dimensions"] == 24
    assert model["detected"]["format"] == "ColBERT"
    colbert = model["colbert"]
    assert colbert["format"] == "stanford"
    assert colbert["query_length"] == 32 and colbert["document_length"] == 180
    assert colbert["query_prefix"] == "[unused0]" and colbert["document_prefix"] == "[unused1]"
    assert colbert["attend_to_expansion_tokens"] is False and colbert["skiplist_tokens"] > 0
    assert attend["colbert"]["attend_to_expansion_tokens"] is True
    assert attend["colbert"]["skiplist_tokens"] == 0  # mask_punctuation: false
    assert "prompts" not in model


# ---- reading the files (no server) --------------------------------------------------------
def _stanford_dir(root: Path, metadata: dict[str, object] | None,
                  architectures: tuple[str, ...] = ("HF_ColBERT",)) -> Path:
    root.mkdir()
    (root / "config.json").write_text(json.dumps(
        {"architectures": list(architectures), "model_type": "bert", "hidden_size": 32}))
    if metadata is not None:
        (root / "artifact.metadata").write_text(json.dumps(metadata))
    return root


def test_metadata_becomes_pylate_settings(tmp_path: Path) -> None:
    ckpt = read_checkpoint(_stanford_dir(tmp_path / "m", {
        "query_token_id": "[unused0]", "doc_token_id": "[unused1]", "query_maxlen": 32,
        "doc_maxlen": 300, "attend_to_mask_tokens": True, "mask_punctuation": True,
        "dim": 96, "similarity": "cosine", "interaction": "colbert"}))
    assert detect_family(ckpt) == "multi_vector" and ckpt.st_kind == "ColBERT"
    assert ckpt.colbert == {"query_prefix": "[unused0]", "document_prefix": "[unused1]",
                            "query_length": 32, "document_length": 300, "dim": 96,
                            "attend_to_expansion_tokens": True,
                            "projection": "linear.weight"}


def test_no_metadata_takes_pylate_defaults(tmp_path: Path) -> None:
    # As PyLate: Stanford's marker tokens, its own lengths and expansion settings.
    ckpt = read_checkpoint(_stanford_dir(tmp_path / "m", None))
    assert detect_family(ckpt) == "multi_vector"
    assert ckpt.colbert == {"query_prefix": "[unused0]", "document_prefix": "[unused1]",
                            "projection": "linear.weight"}


@pytest.mark.parametrize("metadata", [{"similarity": "l2"}, {"interaction": "flipr"},
                                      {"query_maxlen": "long"}])
def test_metadata_that_cannot_be_served_is_refused(tmp_path: Path,
                                                   metadata: dict[str, object]) -> None:
    with pytest.raises(CheckpointError, match=r"artifact\.metadata"):
        read_checkpoint(_stanford_dir(tmp_path / "m", metadata))


def test_a_plain_bert_is_not_stanford(tmp_path: Path) -> None:
    # Neither PyLate's config nor HF_ColBERT: served (as multi_vector when asked) the plain way.
    ckpt = read_checkpoint(_stanford_dir(tmp_path / "m", {"query_maxlen": 32},
                                         architectures=("BertModel",)))
    assert ckpt.colbert is None and detect_family(ckpt) == "dense"


def _adapter(ckpt: Checkpoint) -> Any:
    # The worker side imports torch: kept out of the module's imports.
    from heron.runtime.modelconfig import ModelConfig, Profile, WeightSource
    from heron.worker.adapters.multi_vector import MultiVectorAdapter
    config = ModelConfig(id="t/stanford", adapter="multi_vector",
                         source=WeightSource(path=str(ckpt.path)),
                         profiles={"default": Profile()})
    return MultiVectorAdapter(config, config.profile, ckpt)


def _tiny_stanford(root: Path, linear: bool, dim: int = 16) -> Path:
    import torch
    from safetensors.torch import save_file
    from transformers import BertConfig, BertModel
    config = BertConfig(vocab_size=64, hidden_size=32, num_hidden_layers=1,
                        num_attention_heads=2, intermediate_size=32)
    config.architectures = ["HF_ColBERT"]
    root.mkdir()
    config.save_pretrained(str(root))
    state = {f"bert.{k}": v.contiguous() for k, v in BertModel(config).state_dict().items()}
    if linear:
        state["linear.weight"] = torch.randn(dim, 32)
    save_file(state, str(root / "model.safetensors"))
    (root / "artifact.metadata").write_text(json.dumps({"dim": 16}))
    return root


@pytest.mark.parametrize(("linear", "dim", "message"), [
    (False, 16, "linear.weight"), (True, 8, "dim 16")])
def test_projection_that_is_missing_or_wrong_is_refused(tmp_path: Path, linear: bool,
                                                        dim: int, message: str) -> None:
    ckpt = read_checkpoint(_tiny_stanford(tmp_path / "m", linear, dim))
    with pytest.raises(CheckpointError, match=message):
        _adapter(ckpt).load_model(ckpt.path)
