"""BGE-M3 checkpoints as FlagEmbedding stores them (a transformers backbone beside
# reference venv: parity
``colbert_linear.pt`` and ``sparse_linear.pt``), and what its BGEM3FlagModel computes: dense,
lexical weights and ColBERT vectors from one encode, plus its dense compute_score.
Usage: python flag_bge_m3.py OUT

Two cases: ``bge-m3-xlmr``, an XLM-R backbone as BGE-M3 itself is (a Unigram tokenizer built
here from a hand-made vocabulary, so no sentencepiece is needed; characters outside it become
<unk>, which FlagEmbedding drops from the lexical weights), and ``bge-m3-bert``, a BERT
backbone with MiniLM's WordPiece tokenizer (no EOS token: FlagEmbedding keeps [SEP] as a term).

Lengths: FlagEmbedding truncates at query/passage_max_length (512 by default); Heron truncates
at the model's own limit, the tokenizer's model_max_length within the position table. The tiny
models' limit is 128 tokens (the XLM-R's tokenizer names none: its 130 positions hold 128
after the padding offset; the BERT's tokenizer says 128), so the reference is told 128 too,
and the longer texts (up to ~300 tokens) are cut.
"""

from __future__ import annotations

import shutil
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from FlagEmbedding import BGEM3FlagModel
from transformers import (
    AutoModel,
    AutoTokenizer,
    BertConfig,
    BertModel,
    XLMRobertaConfig,
    XLMRobertaModel,
    XLMRobertaTokenizer,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[3]))
from tests.parity.texts import _WORDS, QUERY, parity_texts
from tests.support.tiny_models import minilm_dir

TEXTS = parity_texts()
QUERIES = TEXTS[:8]
MAX_LENGTH = 128
HIDDEN = 32
# Random weights at BERT's usual scale (0.02) give every text nearly the same [CLS]
# vector (cosines ~0.99999), which any pooling would match; wider weights make the
# vectors depend on the text.
INIT = 0.2
SPARSE_SPREAD = 0.01


def xlmr_backbone(path: Path) -> None:
    """A tiny XLM-R: 128 positions after the padding offset, as XLM-R lays them out."""
    words = sorted({w for w in _WORDS if w.isascii()})
    vocab = [("<s>", 0.0), ("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0)]
    vocab += [("▁" + w, -5.0 - i * 0.01) for i, w in enumerate(words)]
    vocab += [(c, -10.0) for c in "▁abcdefghijklmnopqrstuvwxyz,.!?'%0123456789-"]
    vocab += [("<mask>", 0.0)]
    # No model_max_length: the limit is the position table's, after XLM-R's padding offset.
    tokenizer = XLMRobertaTokenizer(vocab=vocab)
    config = XLMRobertaConfig(vocab_size=len(tokenizer), hidden_size=HIDDEN,
                              num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                              max_position_embeddings=MAX_LENGTH + 2, pad_token_id=1,
                              initializer_range=INIT)
    XLMRobertaModel(config).eval().save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))


def bert_backbone(path: Path) -> None:
    config = BertConfig(vocab_size=30522, hidden_size=HIDDEN, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=512,
                        initializer_range=INIT)
    BertModel(config).eval().save_pretrained(str(path))
    tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir()), model_max_length=MAX_LENGTH)
    tokenizer.save_pretrained(str(path))


def save_heads(path: Path) -> None:
    """The two heads as FlagEmbedding's M3 model saves them: each Linear's state_dict,
    torch.save'd beside the backbone."""
    colbert = torch.nn.Linear(HIDDEN, HIDDEN)
    sparse = torch.nn.Linear(HIDDEN, 1)
    # Fit the sparse head to these texts' tokens. Centred, about half the tokens get a
    # positive weight (kept) and half a zero one (dropped), rather than all or none. Scaled
    # to a spread of SPARSE_SPREAD: relu cuts at zero, so some kept weights are tiny
    # differences of pre-activation terms, whose fp32 rounding (~1e-7 of their size; the
    # batches' padding differs between Heron and FlagEmbedding) must stay below
    # compare.assert_sparse's absolute floor (1e-7 for weights under 1e-3).
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    backbone = AutoModel.from_pretrained(str(path)).eval()
    with torch.no_grad():
        enc = tokenizer(TEXTS, truncation=True, max_length=MAX_LENGTH, padding=True,
                        return_tensors="pt")
        hidden = backbone(**enc).last_hidden_state
        raw = (hidden @ sparse.weight[0])[enc["attention_mask"].bool()]
        sparse.weight.mul_(SPARSE_SPREAD / float(raw.std()))
        sparse.bias.fill_(-float(raw.median()) * SPARSE_SPREAD / float(raw.std()))
    torch.save({k: v.clone() for k, v in colbert.state_dict().items()},
               path / "colbert_linear.pt")
    torch.save({k: v.clone() for k, v in sparse.state_dict().items()}, path / "sparse_linear.pt")


def encode(model: BGEM3FlagModel, texts: list[str]) -> dict:
    return model.encode(texts, batch_size=16, max_length=MAX_LENGTH, return_dense=True,
                        return_sparse=True, return_colbert_vecs=True)


def write_case(out: Path, name: str, build: Callable[[Path], None]) -> None:
    case = out / name
    path = case / "model"
    path.mkdir(parents=True)
    build(path)
    save_heads(path)
    model = BGEM3FlagModel(str(path), use_fp16=False, devices="cpu",
                           query_max_length=MAX_LENGTH, passage_max_length=MAX_LENGTH)
    docs = encode(model, TEXTS)
    queries = model.encode_queries(QUERIES, batch_size=16, return_dense=True,
                                   return_sparse=True, return_colbert_vecs=True)
    # compute_score's "dense": the inner product of the normalized dense vectors. (Its own
    # compute_score zeroes eos_token_id's weight and fails where a tokenizer has none, as
    # BERT's; the encode path that the rest uses does not.)
    query = model.encode_queries([QUERY], return_dense=True)["dense_vecs"]
    scores = np.asarray(query, dtype=np.float64) @ np.asarray(docs["dense_vecs"],
                                                              dtype=np.float64).T
    arrays: dict[str, np.ndarray] = {
        "documents": np.asarray(docs["dense_vecs"], dtype=np.float32),
        "queries": np.asarray(queries["dense_vecs"], dtype=np.float32),
        "scores": scores[0],
    }
    # lexical_weights: {token id as a string: weight}; colbert_vecs: (tokens - 1) x dim.
    for i, weights in enumerate(docs["lexical_weights"]):
        arrays[f"terms_{i}"] = np.asarray([int(k) for k in weights], dtype=np.int64)
        arrays[f"weights_{i}"] = np.asarray(list(weights.values()), dtype=np.float32)
    for i, vecs in enumerate(docs["colbert_vecs"]):
        arrays[f"colbert_{i}"] = np.asarray(vecs, dtype=np.float32)
    for i, vecs in enumerate(queries["colbert_vecs"]):
        arrays[f"query_colbert_{i}"] = np.asarray(vecs, dtype=np.float32)
    np.savez(case / "expected.npz", **arrays)


def main() -> None:
    out = Path(sys.argv[1])
    torch.manual_seed(0)
    for name in ("bge-m3-xlmr", "bge-m3-bert"):
        if (out / name).exists():
            shutil.rmtree(out / name)
    write_case(out, "bge-m3-xlmr", xlmr_backbone)
    write_case(out, "bge-m3-bert", bert_backbone)


if __name__ == "__main__":
    main()
