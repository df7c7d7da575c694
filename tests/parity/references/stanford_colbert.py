"""Stanford ColBERT checkpoints (colbert-ai's HF_ColBERT), computed by PyLate loading them.
# reference venv: parity
The files are laid out as colbert-ir/colbertv2.0's hub repository has them: config.json with
architectures ["HF_ColBERT"], one model.safetensors holding the ``bert.*`` backbone and the
bias-free ``linear.weight`` projection, the WordPiece tokenizer, and ``artifact.metadata``
(colbert-ai's training config: marker tokens, query/document max lengths, [MASK] attention).
Usage: python stanford_colbert.py OUT
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from pylate import models
from pylate.models.Dense import Dense
from pylate.scores import colbert_scores
from safetensors.torch import save_file
from transformers import AutoTokenizer, BertConfig, BertModel

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.parity.texts import QUERY, parity_texts
from tests.support.tiny_models import minilm_dir

TEXTS = parity_texts()
QUERIES = TEXTS[:8]
HIDDEN = 32

# name -> (projection dim, artifact.metadata fields that differ between cases)
CASES: dict[str, tuple[int, dict[str, object]]] = {
    # colbertv2.0's settings (its dim is 128).
    "stanford-colbert": (16, {"query_maxlen": 32, "doc_maxlen": 180,
                              "attend_to_mask_tokens": False, "mask_punctuation": True}),
    # [MASK] expansion attended to (as answerai-colbert-small-v1's training does), shorter
    # lengths, punctuation kept in documents.
    "stanford-colbert-attend": (24, {"query_maxlen": 24, "doc_maxlen": 100,
                                     "attend_to_mask_tokens": True,
                                     "mask_punctuation": False}),
}


def metadata(dim: int, extra: dict[str, object]) -> dict[str, object]:
    """colbert-ai's ColBERTConfig as its checkpoints save it (artifact.metadata)."""
    return {
        "query_token_id": "[unused0]", "doc_token_id": "[unused1]",
        "query_token": "[Q]", "doc_token": "[D]",
        "ncells": None, "centroid_score_threshold": None, "ndocs": None, "load_index_with_mmap":
        False, "index_path": None, "index_bsize": 64, "nbits": 2, "kmeans_niters": 20,
        "resume": False, "similarity": "cosine", "bsize": 32, "accumsteps": 1, "lr": 1e-05,
        "maxsteps": 400000, "save_every": None, "warmup": 20000, "warmup_bert": None,
        "relu": False, "nway": 64, "use_ib_negatives": True, "reranker": False,
        "distillation_alpha": 1.0, "ignore_scores": False, "model_name": None,
        "interaction": "colbert", "dim": dim, "checkpoint": "bert-base-uncased",
        "triples": "triples.jsonl", "collection": "collection.tsv", "queries": "queries.tsv",
        "index_name": None, "overwrite": False, "root": "experiments", "experiment": "msmarco",
        "index_root": None, "name": "tiny", "rank": 0, "nranks": 1, "amp": True, "gpus": 1,
        "avoid_fork_if_possible": False,
        "meta": {"hostname": "tiny", "git_branch": "main", "git_hash": "0" * 40,
                 "git_commit_datetime": "2024-01-01 00:00:00+00:00",
                 "current_datetime": "Jan 01, 2024 ; 0:00AM UTC (+0000)", "cmd": "train.py",
                 "version": "colbert-v0.4"},
        **extra}


def build_checkpoint(path: Path, dim: int, meta: dict[str, object]) -> torch.Tensor:
    """What colbert-ai's HF_ColBERT.save_pretrained writes: ``self.bert`` and ``self.linear``
    in one state dict, and config.json naming the HF_ColBERT architecture."""
    config = BertConfig(vocab_size=30522, hidden_size=HIDDEN, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64,
                        max_position_embeddings=512)
    config.architectures = ["HF_ColBERT"]
    bert = BertModel(config, add_pooling_layer=True).eval()
    linear = torch.nn.Linear(HIDDEN, dim, bias=False)
    state = {f"bert.{k}": v.contiguous() for k, v in bert.state_dict().items()}
    state["linear.weight"] = linear.weight.detach().clone().contiguous()
    path.mkdir(parents=True)
    config.save_pretrained(str(path))
    save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
    AutoTokenizer.from_pretrained(str(minilm_dir())).save_pretrained(str(path))
    (path / "artifact.metadata").write_text(json.dumps(meta, indent=4))
    return state["linear.weight"]


def maxsim(query: np.ndarray, docs: list[np.ndarray]) -> np.ndarray:
    """PyLate's colbert_scores, one document at a time (the exact MaxSim: padded, PyLate
    scores a padded token 0 where a real one would score below it)."""
    q = torch.from_numpy(query)[None]
    return np.array([float(colbert_scores(q, torch.from_numpy(d)[None], backend="torch")[0, 0])
                     for d in docs], dtype=np.float64)


def load(path: Path, meta: dict[str, object]) -> models.ColBERT:
    """PyLate's model of the checkpoint, checked to have come by its Stanford path.

    PyLate ignores ``mask_punctuation`` (it always drops punctuation from documents);
    colbert-ai keeps punctuation's vectors when it is false, so that case passes PyLate an
    empty skiplist: the model's answer as it was trained, computed by PyLate."""
    kwargs: dict[str, object] = {}
    if meta["mask_punctuation"] is False:
        kwargs["skiplist_words"] = []
    model = models.ColBERT(model_name_or_path=str(path), device="cpu", **kwargs)
    model.eval()
    assert len(model) == 2 and isinstance(model[1], Dense), list(model)
    assert model.query_prefix == "[unused0]" and model.document_prefix == "[unused1]"
    assert model.query_length == meta["query_maxlen"]
    assert model.document_length == meta["doc_maxlen"]
    assert model.attend_to_expansion_tokens == meta["attend_to_mask_tokens"]
    return model


def save_case(out: Path, name: str, dim: int, extra: dict[str, object]) -> None:
    case = out / name
    meta = metadata(dim, extra)
    linear = build_checkpoint(case / "model", dim, meta)
    model = load(case / "model", meta)
    assert model[1].linear.bias is None and torch.equal(model[1].linear.weight, linear)
    docs = model.encode(TEXTS, is_query=False, batch_size=16, convert_to_numpy=True)
    queries = model.encode(QUERIES, is_query=True, batch_size=16, convert_to_numpy=True)
    query = np.asarray(model.encode([QUERY], is_query=True, convert_to_numpy=True)[0],
                       dtype=np.float32)
    docs = [np.asarray(d, dtype=np.float32) for d in docs]
    arrays = {f"documents_{i}": d for i, d in enumerate(docs)}
    arrays |= {f"queries_{i}": np.asarray(q, dtype=np.float32) for i, q in enumerate(queries)}
    np.savez(case / "expected.npz", **arrays, query=query, scores=maxsim(query, docs))


def main() -> None:
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    for name, (dim, extra) in CASES.items():
        if (out / name).exists():
            shutil.rmtree(out / name)
        save_case(out, name, dim, extra)


if __name__ == "__main__":
    main()
