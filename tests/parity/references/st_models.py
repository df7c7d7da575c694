"""sentence-transformers checkpoints: every pooling mode, Dense layers, prompts, no Normalize,
a CrossEncoder, a SparseEncoder and a decoder embedder; written by ST itself.
# reference venv: main
Usage: python st_models.py OUT [CASE_PREFIX]   (st5_models.py runs it under ST 5)
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import torch
from sentence_transformers import CrossEncoder, SentenceTransformer, SparseEncoder, models
from sentence_transformers.models import Router
from sentence_transformers.sparse_encoder.models import (
    MLMTransformer,
    SparseStaticEmbedding,
    SpladePooling,
)
from transformers import (
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertModel,
    Qwen3Config,
    Qwen3Model,
)

from tests.parity.texts import QUERY, parity_texts  # the harness sets PYTHONPATH to the repo
from tests.support.tiny_models import minilm_dir

TEXTS = parity_texts()
QUERIES = TEXTS[:8]


def bert_config(**extra: object) -> BertConfig:
    return BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=64, max_position_embeddings=512,
                      **extra)


def backbone(root: Path, name: str, model: torch.nn.Module) -> Path:
    path = root / "_backbones" / name
    model.eval().save_pretrained(str(path))
    AutoTokenizer.from_pretrained(str(minilm_dir())).save_pretrained(str(path))
    return path


def save_encoder(out: Path, name: str, model: SentenceTransformer) -> None:
    case = out / name
    model.save(str(case / "model"))
    model.eval()
    docs = model.encode_document(TEXTS, convert_to_numpy=True, batch_size=16)
    queries = model.encode_query(QUERIES, convert_to_numpy=True, batch_size=16)
    query = model.encode_query([QUERY], convert_to_numpy=True)
    scores = model.similarity(query, docs).numpy()[0]
    np.savez(case / "expected.npz", documents=docs, queries=queries, scores=scores)


def sentence_transformers_cases(out: Path, prefix: str) -> None:
    base = backbone(out, "bert", BertModel(bert_config()))
    for mode in ("mean", "cls", "max", "lasttoken", "weightedmean", "mean_sqrt_len_tokens"):
        transformer = models.Transformer(str(base), max_seq_length=128)
        pooling = models.Pooling(32, pooling_mode=mode)
        normalize = [models.Normalize()] if mode != "mean_sqrt_len_tokens" else []
        model = SentenceTransformer(modules=[transformer, pooling, *normalize])
        save_encoder(out, f"{prefix}pool-{mode}", model)
    # Dense layers, prompts, dot similarity, no Normalize (vectors keep their length).
    transformer = models.Transformer(str(base), max_seq_length=200)
    model = SentenceTransformer(
        modules=[transformer, models.Pooling(32, pooling_mode="cls"),
                 models.Dense(32, 24, activation_function=torch.nn.Tanh()),
                 models.Dense(24, 16, activation_function=torch.nn.Identity())],
        prompts={"query": "query: ", "document": "passage: "},
        similarity_fn_name="dot")
    save_encoder(out, f"{prefix}dense-prompts", model)
    # A Pooling that leaves the prompt's tokens out of the mean (include_prompt false).
    model = SentenceTransformer(
        modules=[models.Transformer(str(base), max_seq_length=128),
                 models.Pooling(32, pooling_mode="mean", include_prompt=False),
                 models.Normalize()],
        prompts={"query": "query: which passage answers ", "document": "passage: "})
    save_encoder(out, f"{prefix}prompt-excluded", model)


def cross_encoder_case(out: Path, prefix: str) -> None:
    base = backbone(out, "bert-ce", BertForSequenceClassification(bert_config(num_labels=1)))
    model = CrossEncoder(str(base), max_length=160)
    case = out / f"{prefix}cross-encoder"
    model.save(str(case / "model"))
    scores = model.predict([(QUERY, t) for t in TEXTS], batch_size=16)
    np.savez(case / "expected.npz", scores=np.asarray(scores, dtype=np.float64))


def sparse_rows(name: str, tensor: torch.Tensor) -> dict[str, np.ndarray]:
    rows = tensor.to_dense().numpy()
    terms = [np.flatnonzero(r) for r in rows]
    return {**{f"{name}_terms_{i}": t for i, t in enumerate(terms)},
            **{f"{name}_weights_{i}": rows[i][t] for i, t in enumerate(terms)}}


def save_sparse(out: Path, name: str, model: SparseEncoder) -> None:
    case = out / name
    model.save(str(case / "model"))
    docs = model.encode_document(TEXTS, convert_to_tensor=True, batch_size=16)
    queries = model.encode_query(QUERIES, convert_to_tensor=True, batch_size=16)
    np.savez(case / "expected.npz", **sparse_rows("documents", docs),
             **sparse_rows("queries", queries))


# The MLM head's bias keeps this many vocabulary terms able to fire and holds the rest far
# below zero. A trained SPLADE head gives a text a few hundred terms; a random one gave each
# of the 50 texts most of the 30,522, answers of 12 MB that took 4-8 s a test to send and
# compare. Heron computes the head as it is, so the parity check is the same.
LIVE_TERMS = 512


def sparse_mlm() -> BertForMaskedLM:
    model = BertForMaskedLM(bert_config())
    live = torch.randperm(model.config.vocab_size)[:LIVE_TERMS]
    with torch.no_grad():
        bias = torch.full_like(model.cls.predictions.bias, -20.0)
        bias[live] = 0.0
        model.cls.predictions.bias.copy_(bias)
    return model


def sparse_cases(out: Path, prefix: str) -> None:
    base = backbone(out, "bert-mlm", sparse_mlm())
    for pooling in ("max", "sum"):
        model = SparseEncoder(modules=[MLMTransformer(str(base), max_seq_length=128),
                                       SpladePooling(pooling)])
        save_sparse(out, f"{prefix}sparse-splade-{pooling}", model)
    # Inference-free SPLADE: the query route is a static weight per vocabulary id.
    document = MLMTransformer(str(base), max_seq_length=128)
    static = SparseStaticEmbedding(tokenizer=document.tokenizer, frozen=False)
    with torch.no_grad():
        static.weight.copy_(torch.rand_like(static.weight) * 3)
    router = Router.for_query_document(query_modules=[static],
                                       document_modules=[document, SpladePooling("max")])
    save_sparse(out, f"{prefix}sparse-inference-free", SparseEncoder(modules=[router]))


def decoder_case(out: Path, prefix: str) -> None:
    """A Qwen3 decoder with last-token pooling; its tokenizer ends every text with EOS (as
    Qwen3-Embedding's does), so the pooled token is EOS's."""
    tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir()))
    tokenizer.eos_token = tokenizer.sep_token  # [SEP] ends every text: the EOS
    config = Qwen3Config(vocab_size=30522, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                         head_dim=16, max_position_embeddings=512,
                         pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    path = out / "_backbones" / "qwen3"
    Qwen3Model(config).eval().save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    transformer = models.Transformer(str(path), max_seq_length=128)
    model = SentenceTransformer(
        modules=[transformer, models.Pooling(32, pooling_mode="lasttoken"), models.Normalize()],
        prompts={"query": "Instruct: find passages about the question\nQuery: "})
    save_encoder(out, f"{prefix}decoder-lasttoken", model)


def main() -> None:
    out = Path(sys.argv[1])
    prefix = sys.argv[2] if len(sys.argv) > 2 else "st-"
    torch.manual_seed(0)
    sentence_transformers_cases(out, prefix)
    cross_encoder_case(out, prefix)
    sparse_cases(out, prefix)
    decoder_case(out, prefix)
    import shutil
    shutil.rmtree(out / "_backbones")


if __name__ == "__main__":
    main()
