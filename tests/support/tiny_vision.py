"""Tiny random-weight CLIP and SigLIP checkpoints, built offline with transformers.

Each is what a hub checkpoint holds: config.json and weights (save_pretrained), the real
tokenizer class of its family (CLIPTokenizer over a byte-level vocabulary with no merges;
SiglipTokenizer over a sentencepiece model trained here on a few lines) and the family's
image processor config (preprocessor_config.json). 32 x 32 images in 8 x 8 patches.
"""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

IMAGE_SIZE = 32
PATCH_SIZE = 8


def _bytes_to_unicode() -> list[str]:
    """GPT-2's byte -> printable character table, which CLIP's BPE vocabulary is built on."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for c in cs]


def _vision(image_size: int = IMAGE_SIZE, patch_size: int = PATCH_SIZE) -> dict[str, object]:
    return {"hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 2,
            "intermediate_size": 64, "image_size": image_size, "patch_size": patch_size}


def build_tiny_clip(path: Path, seed: int = 0, image_size: int = IMAGE_SIZE,
                    patch_size: int = PATCH_SIZE) -> Path:
    """``image_size``/``patch_size``: 224/32 is ViT-B/32's geometry (50 patches) at tiny
    widths, for bench/image_bench.py."""
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel, CLIPTokenizer

    path.mkdir(parents=True, exist_ok=True)
    chars = _bytes_to_unicode()
    vocab = {c: i for i, c in enumerate(chars + [c + "</w>" for c in chars])}
    vocab["<|startoftext|>"], vocab["<|endoftext|>"] = len(vocab), len(vocab) + 1
    (path / "vocab.json").write_text(json.dumps(vocab))
    (path / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = CLIPTokenizer(str(path / "vocab.json"), str(path / "merges.txt"),
                              model_max_length=32)
    torch.manual_seed(seed)
    config = CLIPConfig(
        text_config={"vocab_size": len(vocab), "hidden_size": 32, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "intermediate_size": 64,
                     "max_position_embeddings": 32, "bos_token_id": vocab["<|startoftext|>"],
                     "eos_token_id": vocab["<|endoftext|>"], "pad_token_id": 1},
        vision_config=_vision(image_size, patch_size), projection_dim=16)
    CLIPModel(config).eval().save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    CLIPImageProcessor(size={"shortest_edge": image_size},
                       crop_size={"height": image_size, "width": image_size}
                       ).save_pretrained(str(path))
    return path


def build_tiny_siglip(path: Path, seed: int = 0) -> Path:
    import sentencepiece as spm
    from transformers import SiglipConfig, SiglipImageProcessor, SiglipModel, SiglipTokenizer

    path.mkdir(parents=True, exist_ok=True)
    corpus = path / "corpus.txt"
    words = ("a photo of a cat a dog on the grass red green blue square circle heron "
             "serves images and texts in one space").split()
    corpus.write_text("\n".join(" ".join(words[i:] + words[:i]) for i in range(len(words))))
    spm.SentencePieceTrainer.train(
        input=str(corpus), model_prefix=str(path / "spiece"), vocab_size=60,
        hard_vocab_limit=False, model_type="unigram", character_coverage=1.0, pad_id=0,
        eos_id=1, unk_id=2, bos_id=-1, minloglevel=2)
    corpus.unlink()
    tokenizer = SiglipTokenizer(str(path / "spiece.model"), model_max_length=16)
    torch.manual_seed(seed)
    config = SiglipConfig(
        text_config={"vocab_size": len(tokenizer), "hidden_size": 32, "num_hidden_layers": 2,
                     "num_attention_heads": 2, "intermediate_size": 64,
                     "max_position_embeddings": 16},
        vision_config=_vision())
    SiglipModel(config).eval().save_pretrained(str(path))
    tokenizer.save_pretrained(str(path))
    SiglipImageProcessor(size={"height": IMAGE_SIZE, "width": IMAGE_SIZE}
                         ).save_pretrained(str(path))
    return path


def image_bytes(width: int, height: int, fmt: str = "PNG", seed: int = 0,
                mode: str = "RGB") -> bytes:
    """A random-noise image (so resizing and cropping show in the pixels) as a file."""
    rng = np.random.default_rng(seed)
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    array = rng.integers(0, 256, (height, width, channels), dtype=np.uint8)
    image = Image.fromarray(array[:, :, 0] if channels == 1 else array, mode)
    out = io.BytesIO()
    image.save(out, format=fmt, **({"quality": 90} if fmt in ("JPEG", "WEBP") else {}))
    return out.getvalue()
