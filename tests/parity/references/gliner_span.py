"""A GLiNER span model (gliner 0.2.29's default markerV0 uni-encoder), written by gliner itself.
# reference venv: gliner
Usage: python gliner_span.py OUT

No model hub: the backbone is a tiny random BERT with a WordPiece tokenizer built here from a
vocabulary file, GLiNER's own layers are random too (GLiNER.from_config). The model is saved
with gliner's save_pretrained, loaded back with from_pretrained, and predict_entities' answers
for ``texts()`` under each label set and threshold go to ``<OUT>/gliner_span/expected.json``
(``expected.npz`` holds the entity count, for the parity suite's layout check).

gliner's save_pretrained writes ``pytorch_model.bin`` by default (``model/``, what most GLiNER
repositories on the Hub ship); the same model saved with ``safe_serialization=True`` goes to
``model_safetensors/`` (``model.safetensors``, tied tensors saved once).
"""

from __future__ import annotations

import json
import random
import shutil
import sys
from pathlib import Path

import numpy as np
import torch
from gliner import GLiNER, GLiNERConfig
from transformers import BertConfig, BertModel, BertTokenizerFast

WORDS = ("Ada Lovelace met Charles Babbage in London on 5 June 1833 and later wrote notes "
         "about the Analytical Engine . Heron Labs opened an office in Paris , France for "
         "$ 2.5 million while Marie Curie studied in Warsaw ; the river Seine flows past "
         "Notre-Dame . Zürich naïve café 東京 2024 42.5% don't re-rank ! e-mail user_name "
         "Dr. Smith , CEO of Acme Corp. , flew to New York City on Monday").split()
LABEL_SETS: list[tuple[list[str], float]] = [
    (["person", "organization", "location"], 0.3),
    (["date", "money"], 0.4),
    (["person", "city", "date of birth", "company"], 0.45),
    (["Person", "person", "location", "person"], 0.3),  # case differs; a duplicate
    (["thing"], 0.3),
]


def texts() -> list[str]:
    rng = random.Random(11)
    out = ["Ada Lovelace met Charles Babbage in London.",
           "  Marie   Curie studied in Warsaw,  Poland.\n",
           "Zürich naïve café 東京: 42.5% of e-mails don't re-rank!",
           "x",
           "   ",  # no words: nothing to find
           "Ada \u200b Lovelace \x07 met Babbage in London ."]  # words without tokens
    while len(out) < 30:
        n = rng.choice((3, 8, 15, 30, 60, 90))  # max_len is 64 words: some are cut
        sep = rng.choice((" ", "  ", " \t"))
        out.append(sep.join(rng.choice(WORDS) for _ in range(n)))
    return out


def tokenizer_dir(root: Path) -> Path:
    """A lowercasing WordPiece tokenizer from a vocab.txt: special tokens, characters and
    their continuations, and the texts' frequent words (others split into characters)."""
    path = root / "_tokenizer"
    path.mkdir(parents=True, exist_ok=True)
    chars = sorted({c for t in WORDS for c in t.lower()} | set("abcdefghijklmnopqrstuvwxyz"))
    words = sorted({w.lower() for w in WORDS if w.isalpha()})
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *chars, *(f"##{c}" for c in chars),
             *(w for w in words if w not in chars)]
    (path / "vocab.txt").write_text("\n".join(dict.fromkeys(vocab)) + "\n")
    BertTokenizerFast.from_pretrained(str(path), do_lower_case=True,
                                      model_max_length=512).save_pretrained(str(path))
    return path


def backbone_dir(root: Path, vocab_size: int) -> Path:
    path = root / "_backbone"
    config = BertConfig(vocab_size=vocab_size, hidden_size=32, num_hidden_layers=2,
                        num_attention_heads=2, intermediate_size=64, max_position_embeddings=512)
    BertModel(config).eval().save_pretrained(str(path))
    for name in ("vocab.txt", "tokenizer.json", "tokenizer_config.json",
                 "special_tokens_map.json"):
        source = root / "_tokenizer" / name
        if source.exists():
            (path / name).write_bytes(source.read_bytes())
    return path


def main(out: Path) -> None:
    torch.set_num_threads(1)  # tiny tensors: more threads only contend on a shared machine
    torch.manual_seed(0)
    tok = tokenizer_dir(out)
    vocab_size = len(BertTokenizerFast.from_pretrained(str(tok)))
    backbone = backbone_dir(out, vocab_size)
    # hidden_size differs from the backbone's 32: the encoder's projection is exercised.
    config = GLiNERConfig(model_name=str(backbone), hidden_size=48, max_len=64, dropout=0.0)
    built = GLiNER.from_config(config, backbone_from_pretrained=False,
                               local_files_only=True)
    case = out / "gliner_span"
    with torch.no_grad():  # random label vectors give scores near 0.5: spread them out
        built.model.prompt_rep_layer[3].weight.mul_(40.0)
    built.save_pretrained(str(case / "model"))
    built.save_pretrained(str(case / "model_safetensors"), safe_serialization=True)
    model = GLiNER.from_pretrained(str(case / "model"), local_files_only=True)
    model.eval()
    cases = []
    count = 0
    for labels, threshold in LABEL_SETS:
        for text in texts():
            entities = model.predict_entities(text, labels, threshold=threshold)
            count += len(entities)
            cases.append({"text": text, "labels": labels, "threshold": threshold,
                          "entities": [{k: e[k] for k in ("label", "text", "start", "end", "score")}
                                       for e in entities]})
    (case / "expected.json").write_text(json.dumps({"cases": cases}, ensure_ascii=False))
    np.savez(case / "expected.npz", entities=np.array([count]))
    # Every folder under OUT is a case to the parity suite: the building blocks go.
    shutil.rmtree(out / "_backbone")
    shutil.rmtree(out / "_tokenizer")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
