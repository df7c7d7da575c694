"""PyLate ColBERT checkpoints, written and computed by PyLate itself.
# reference venv: parity
Prefix tokens, query expansion with [MASK] (attended to or not), document truncation,
skiplist words, the Dense projection with and without bias.
Usage: python pylate_colbert.py OUT
"""

from __future__ import annotations

import shutil
import string
import sys
from pathlib import Path

import numpy as np
import torch
from pylate import models
from pylate.scores import colbert_scores
from transformers import AutoTokenizer, BertConfig, BertModel

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.parity.texts import QUERY, parity_texts
from tests.support.tiny_models import minilm_dir

TEXTS = parity_texts()
QUERIES = TEXTS[:8]

# name -> PyLate's ColBERT arguments. The first is PyLate's defaults ("[Q] "/"[D] " prefix
# tokens added to the vocabulary, [MASK] expansion not attended to, punctuation skiplist).
CASES: dict[str, dict[str, object]] = {
    "pylate-colbert": {"embedding_size": 16, "query_length": 32, "document_length": 180},
    # Stanford-style prefixes already in the vocabulary, expansion tokens attended to, a
    # word skiplist, a biased projection.
    "pylate-colbert-attend": {
        "embedding_size": 24, "query_length": 24, "document_length": 100, "bias": True,
        "query_prefix": "[unused0]", "document_prefix": "[unused1]",
        "attend_to_expansion_tokens": True,
        "skiplist_words": ["the", "of", *string.punctuation]},
    # No query expansion (queries keep their own length), no document prefix.
    "pylate-colbert-noexp": {
        "embedding_size": 16, "query_length": 20, "document_length": 64,
        "do_query_expansion": False, "document_prefix": ""},
}


def backbone(root: Path) -> Path:
    path = root / "_backbones" / "bert"
    config = BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=512)
    BertModel(config).eval().save_pretrained(str(path))
    AutoTokenizer.from_pretrained(str(minilm_dir())).save_pretrained(str(path))
    return path


def maxsim(query: np.ndarray, docs: list[np.ndarray]) -> np.ndarray:
    """PyLate's colbert_scores, one document at a time: the exact MaxSim. (Padded into one
    tensor, PyLate multiplies padded similarities by 0, so a document whose best match for a
    query token is negative would score that token 0 instead.)"""
    q = torch.from_numpy(query)[None]
    return np.array([float(colbert_scores(q, torch.from_numpy(d)[None], backend="torch")[0, 0])
                     for d in docs], dtype=np.float64)


def save_case(out: Path, name: str, base: Path, kwargs: dict[str, object]) -> None:
    case = out / name
    model = models.ColBERT(model_name_or_path=str(base), device="cpu", **kwargs)
    model.save(str(case / "model"))
    # What a user gets from the checkpoint: PyLate's model loaded back from its own files.
    model = models.ColBERT(model_name_or_path=str(case / "model"), device="cpu")
    model.eval()
    docs = model.encode(TEXTS, is_query=False, batch_size=16, convert_to_numpy=True)
    queries = model.encode(QUERIES, is_query=True, batch_size=16, convert_to_numpy=True)
    query = model.encode([QUERY], is_query=True, convert_to_numpy=True)[0]
    arrays = {f"documents_{i}": np.asarray(d, dtype=np.float32) for i, d in enumerate(docs)}
    arrays |= {f"queries_{i}": np.asarray(q, dtype=np.float32) for i, q in enumerate(queries)}
    np.savez(case / "expected.npz", **arrays, query=np.asarray(query, dtype=np.float32),
             scores=maxsim(np.asarray(query, dtype=np.float32),
                           [np.asarray(d, dtype=np.float32) for d in docs]))


def main() -> None:
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    base = backbone(out)
    for name, kwargs in CASES.items():
        save_case(out, name, base, kwargs)
    shutil.rmtree(out / "_backbones")


if __name__ == "__main__":
    main()
