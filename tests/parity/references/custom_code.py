"""A checkpoint that ships its own modelling code (config.json auto_map): a BERT encoder
with a gated residual "twist" on its output, under a model_type transformers does not know,
so nothing loads it without running its code. Mean pooling and Normalize on top, written
by sentence-transformers, which is the reference (``trust_remote_code=True``).
# reference venv: main
Usage: python custom_code.py OUT
"""

from __future__ import annotations

import importlib
import json
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
from sentence_transformers import SentenceTransformer, models
from transformers import AutoTokenizer

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.parity.texts import QUERY, parity_texts
from tests.support.tiny_models import minilm_dir

TEXTS = parity_texts()
QUERIES = TEXTS[:8]
CASE = "custom-code"
MODEL_TYPE = "heron_twist"  # unknown to transformers: only the shipped code defines it

# The files the checkpoint ships. Written to a package folder first so that the classes
# come from real modules: save_pretrained copies a registered class's source file (and the
# files it imports relatively) next to the weights and writes auto_map.
CONFIGURATION = f'''"""Configuration of the twisted BERT encoder (Heron's parity suite)."""

from transformers import BertConfig


class HeronTwistConfig(BertConfig):
    model_type = "{MODEL_TYPE}"

    def __init__(self, twist_scale: float = 0.5, **kwargs):
        super().__init__(**kwargs)
        self.twist_scale = twist_scale
'''

MODELING = '''"""A BERT encoder whose token states go through a gated residual: h + s tanh(W h)."""

import torch
from transformers import BertModel
from transformers.modeling_outputs import BaseModelOutputWithPoolingAndCrossAttentions

from .configuration_heron_twist import HeronTwistConfig


class HeronTwistModel(BertModel):
    config_class = HeronTwistConfig

    def __init__(self, config, add_pooling_layer=True):
        super().__init__(config, add_pooling_layer=add_pooling_layer)
        self.twist = torch.nn.Linear(config.hidden_size, config.hidden_size)
        self.post_init()

    def forward(self, *args, **kwargs):
        out = super().forward(*args, **kwargs)
        hidden = out.last_hidden_state
        hidden = hidden + self.config.twist_scale * torch.tanh(self.twist(hidden))
        return BaseModelOutputWithPoolingAndCrossAttentions(
            last_hidden_state=hidden, pooler_output=out.pooler_output,
            hidden_states=out.hidden_states, attentions=out.attentions)
'''


def twisted_backbone(root: Path) -> Path:
    """The custom model with random weights, saved by transformers with its code."""
    package = root / "_code" / "heron_twist_code"
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "configuration_heron_twist.py").write_text(CONFIGURATION)
    (package / "modeling_heron_twist.py").write_text(MODELING)
    sys.path.insert(0, str(package.parent))
    config_mod = importlib.import_module("heron_twist_code.configuration_heron_twist")
    model_mod = importlib.import_module("heron_twist_code.modeling_heron_twist")
    config_cls, model_cls = config_mod.HeronTwistConfig, model_mod.HeronTwistModel
    config_cls.register_for_auto_class()
    model_cls.register_for_auto_class("AutoModel")
    torch.manual_seed(11)
    config = config_cls(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=512, twist_scale=0.75)
    path = root / "_backbones" / "twist"
    model_cls(config).eval().save_pretrained(str(path))
    AutoTokenizer.from_pretrained(str(minilm_dir())).save_pretrained(str(path))
    written = json.loads((path / "config.json").read_text())
    assert written["model_type"] == MODEL_TYPE and "AutoModel" in written["auto_map"], written
    assert (path / "modeling_heron_twist.py").exists(), sorted(p.name for p in path.iterdir())
    return path


def main() -> None:
    out = Path(sys.argv[1])
    case = out / CASE
    remote = {"trust_remote_code": True}
    # Only case folders go in OUT: the backbone and its code are built in a scratch dir.
    with tempfile.TemporaryDirectory() as scratch:
        base = twisted_backbone(Path(scratch))
        transformer = models.Transformer(str(base), max_seq_length=128, model_kwargs=remote,
                                         config_kwargs=remote, processor_kwargs=remote)
        built = SentenceTransformer(modules=[transformer, models.Pooling(32, pooling_mode="mean"),
                                             models.Normalize()])
        built.save(str(case / "model"))
    # The reference: the checkpoint as a user would load it, from its own folder.
    model = SentenceTransformer(str(case / "model"), trust_remote_code=True, device="cpu")
    model.eval()
    saved = case / "model"
    assert json.loads((saved / "config.json").read_text())["model_type"] == MODEL_TYPE
    assert (saved / "modeling_heron_twist.py").exists(), sorted(p.name for p in saved.iterdir())
    docs = model.encode_document(TEXTS, convert_to_numpy=True, batch_size=16)
    queries = model.encode_query(QUERIES, convert_to_numpy=True, batch_size=16)
    query = model.encode_query([QUERY], convert_to_numpy=True)
    scores = model.similarity(query, docs).numpy()[0]
    # Reloaded from its own folder (its shipped code), it computes what was built.
    assert np.abs(docs - built.encode_document(TEXTS, convert_to_numpy=True)).max() < 1e-5
    np.savez(case / "expected.npz", documents=docs, queries=queries, scores=scores)
    (case / "heron.json").write_text(json.dumps({"trust_remote_code": True}))


if __name__ == "__main__":
    main()
