"""CLIP and SigLIP: Heron's adapter (decoding, preprocessing, batching mixed texts and
images) against transformers' own processor and get_image_features / get_text_features.

Tiny random-weight checkpoints built here (tests/support/tiny_vision.py); PNG, JPEG and WebP
inputs of several sizes and modes, so resizing, cropping and alpha compositing all show.
The same comparison over HTTP and the cluster is tests/integration/test_images.py.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest
import torch

from heron.runtime.checkpoint import read_checkpoint
from heron.runtime.modelconfig import ModelConfig, Profile, WeightSource
from heron.worker.adapters.clip import ClipAdapter
from heron.worker.images import ImageInput
from tests.support.tiny_vision import build_tiny_clip, build_tiny_siglip, image_bytes

# (width, height, format, mode): square, wide, tall, bigger than the model (downscaled),
# smaller than the model (upscaled), transparency, greyscale.
IMAGES = [(32, 32, "PNG", "RGB"), (64, 20, "JPEG", "RGB"), (17, 90, "WEBP", "RGB"),
          (200, 150, "PNG", "RGBA"), (12, 12, "JPEG", "L"), (96, 96, "WEBP", "RGB")]
TEXTS = ["a photo of a cat", "a dog on the grass", "red", "blue square and a green circle"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("vision")
    return {"clip": build_tiny_clip(root / "clip"), "siglip": build_tiny_siglip(root / "siglip")}


def load_adapter(path: Path) -> ClipAdapter:
    config = ModelConfig(id="parity/vision", adapter="clip", source=WeightSource(path=str(path)),
                         profiles={"default": Profile()})
    adapter = ClipAdapter(config, Profile(), read_checkpoint(path))
    adapter.load(path, torch.device("cpu"), torch.float32)
    return adapter


def reference(path: Path, images: list[bytes], texts: list[str]
              ) -> tuple[np.ndarray, np.ndarray]:
    """transformers' vectors: its processor on PIL images, its model's get_*_features."""
    from PIL import Image
    from transformers import AutoImageProcessor, AutoModel, AutoTokenizer

    model = AutoModel.from_pretrained(str(path)).eval()
    processor = AutoImageProcessor.from_pretrained(str(path))
    tokenizer = AutoTokenizer.from_pretrained(str(path))
    siglip = model.config.model_type == "siglip"
    pil = [Image.open(io.BytesIO(b)) for b in images]
    with torch.inference_mode():
        pixels = processor(images=pil, return_tensors="pt")["pixel_values"]
        image_out = model.get_image_features(pixel_values=pixels)
        enc = tokenizer(texts, padding="max_length" if siglip else True, truncation=True,
                        return_tensors="pt")
        text_out = model.get_text_features(
            input_ids=enc["input_ids"],
            attention_mask=None if siglip else enc["attention_mask"])
    pooled = [o if isinstance(o, torch.Tensor) else o.pooler_output
              for o in (image_out, text_out)]
    return pooled[0].numpy(), pooled[1].numpy()


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(-1) / (np.linalg.norm(a, axis=-1) * np.linalg.norm(b, axis=-1))


@pytest.mark.parametrize("family", ["clip", "siglip"])
def test_vectors_match_transformers(family: str, checkpoints: dict[str, Path]) -> None:
    path = checkpoints[family]
    adapter = load_adapter(path)
    files = [image_bytes(w, h, fmt, seed=n, mode=mode)
             for n, (w, h, fmt, mode) in enumerate(IMAGES)]
    # Texts and images interleaved in one batch: each tower must get its own rows back.
    inputs: list[object] = []
    for n in range(max(len(files), len(TEXTS))):
        if n < len(files):
            inputs.append(ImageInput(files[n], f"items[{len(inputs)}].image"))
        if n < len(TEXTS):
            inputs.append(TEXTS[n])
    tokens = adapter.tokenize(inputs)  # type: ignore[arg-type]
    with torch.inference_mode():
        batch = adapter.collate(tokens)
        rows = [r["dense"] for r in adapter.postprocess(batch, adapter.forward(batch))]
    got_images = np.stack([r for r, x in zip(rows, inputs, strict=True)
                           if isinstance(x, ImageInput)])
    got_texts = np.stack([r for r, x in zip(rows, inputs, strict=True) if isinstance(x, str)])
    want_images, want_texts = reference(path, files, TEXTS)
    assert cosines(got_images, want_images).min() >= 0.9999, cosines(got_images, want_images)
    assert cosines(got_texts, want_texts).min() >= 0.9999, cosines(got_texts, want_texts)
    np.testing.assert_allclose(np.linalg.norm(got_images, axis=-1), 1.0, atol=1e-5)
    # An image costs its patch count: 16 patches of 8 x 8, plus CLIP's class token.
    patches = [t.length for t, x in zip(tokens, inputs, strict=True)
               if isinstance(x, ImageInput)]
    assert set(patches) == {16 if family == "siglip" else 17}
