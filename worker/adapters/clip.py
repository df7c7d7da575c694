"""CLIP and SigLIP (transformers' CLIPModel, SiglipModel): texts and images in one space.

A text item goes through the text tower (``get_text_features``), an image item through the
vision tower (``get_image_features``); both are L2-normalized, as the models compare them
(their logits are a scaled cosine), so ``score`` is the cosine of any two. A batch may mix
texts and images: ``forward`` runs each tower on its own rows.

Texts tokenize as the model's processor does: CLIP pads to the longest text with an
attention mask (its pooling reads the EOS position); SigLIP was trained on texts padded to
``max_length`` without a mask and pools the last position, so each text is padded to the
full length here too (a shorter pad gives another vector). Images are decoded and
resized on the tokenizer pool by heron.worker.images (and normalized when the batch is
built); an image costs the batcher its patch count: (image_size / patch_size)^2, plus one
class token for CLIP.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from transformers import AutoModel

from heron.runtime.checkpoint import CheckpointError
from heron.worker.adapters.base import Adapter, RefusedItem, TextInput, Tokenized, to_numpy
from heron.worker.images import ImageInput, ImageSpec, load_pixels, normalize
from heron_sdk.errors import HeronError

# model_type of the checkpoint -> whether it is SigLIP-shaped (no class token, texts padded
# to max_length without a mask, square resize without a crop).
MODEL_TYPES = {"clip": False, "siglip": True}


@dataclass(slots=True)
class ImageTokens(Tokenized):
    """An image item after decoding: its pixels, and its cost in patches."""

    pixels: np.ndarray | None = None  # [H, W, 3] resized and cropped, not yet normalized
    patches: int = 0

    @property
    def length(self) -> int:
        return self.patches


@dataclass(slots=True)
class MixedBatch:
    """A batch's text rows (padded ids) and image rows (stacked pixels), by position."""

    items: list[Tokenized]
    text_rows: list[int]
    image_rows: list[int]
    input_ids: torch.Tensor | None
    attention_mask: torch.Tensor | None
    pixel_values: torch.Tensor | None


class ClipAdapter(Adapter):
    name = "clip"
    accepts_token_ids = False  # texts go through the model's own tokenizer
    accepts_images = True

    def load_model(self, path: Path) -> torch.nn.Module:
        model_type = self.checkpoint.model_type
        if model_type not in MODEL_TYPES:
            raise CheckpointError(f"the clip adapter serves {sorted(MODEL_TYPES)} checkpoints "
                                  f"(config.json model_type), not {model_type!r}")
        self.siglip = MODEL_TYPES[model_type]
        model = self.load_with_head(AutoModel, path)
        vision = model.config.vision_config
        self.image_size = int(vision.image_size)
        grid = self.image_size // int(vision.patch_size)
        self.patches = grid * grid + (0 if self.siglip else 1)
        self.spec = ImageSpec.read(path, image_size=self.image_size, siglip=self.siglip)
        out = self._spec_output()
        if out != (self.image_size, self.image_size):
            raise CheckpointError(
                f"preprocessor_config.json gives {out[0]} x {out[1]} images, the vision "
                f"model takes {self.image_size} x {self.image_size}")
        return model

    def _spec_output(self) -> tuple[int, int]:
        spec = self.spec
        if spec.crop is not None:
            return spec.crop
        if spec.height and spec.width:
            return spec.height, spec.width
        return (0, 0)  # a shortest-edge resize without a crop: the size varies

    def load(self, path: Path, device: torch.device, dtype: torch.dtype) -> None:
        super().load(path, device, dtype)
        config = self.model.config
        text = config.text_config
        limit = int(getattr(text, "max_position_embeddings", 77))
        tokenizer_limit = self.tokenizer.model_max_length
        if tokenizer_limit and tokenizer_limit < 1_000_000:
            limit = min(limit, tokenizer_limit)
        self.max_length = min(self.profile.max_sequence_length or limit, limit)
        self.hidden_size = int(text.hidden_size)
        self.dimensions = int(getattr(config, "projection_dim", 0)
                              or getattr(text, "projection_size", 0) or text.hidden_size)
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.normalize = True
        # The runner's warm-up passes a text; the vision tower runs once here, so a model is
        # ready only after both towers have (and a broken one fails to load, not later).
        with torch.inference_mode():
            dtype = next(self.model.parameters()).dtype
            self.model.get_image_features(pixel_values=torch.zeros(
                1, 3, self.image_size, self.image_size, device=device, dtype=dtype))

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "images": {
            "image_size": self.image_size, "patches": self.patches, **self.spec.describe()}}

    # ---- tokenize: texts as the base class, images decoded here (tokenizer pool) ------
    def tokenize(self, inputs: list[Any], query: bool = False,
                 prompt: str = "") -> list[Tokenized]:
        images = [n for n, x in enumerate(inputs) if isinstance(x, ImageInput)]
        if not images:
            return super().tokenize(inputs, query, prompt)
        out: list[Tokenized | None] = [None] * len(inputs)
        # Decoded before the texts and outside the tokenizer's lock: pool threads decode
        # images of other requests in parallel (Pillow releases the GIL while decoding).
        for n in images:
            item: ImageInput = inputs[n]
            try:
                pixels = load_pixels(item, self.spec)
            except HeronError as exc:  # this item's 4xx; its neighbours are computed
                out[n] = RefusedItem(input_ids=[], token_type_ids=None, truncated=False,
                                     query=query, error=exc)
                continue
            out[n] = ImageTokens(input_ids=[], token_type_ids=None, truncated=False,
                                 query=query, pixels=pixels, patches=self.patches)
        texts = [n for n, x in enumerate(inputs) if not isinstance(x, ImageInput)]
        if texts:
            for n, t in zip(texts, super().tokenize([inputs[n] for n in texts], query, prompt),
                            strict=True):
                out[n] = t
        return out  # type: ignore[return-value]

    def tokenize_now(self, inputs: list[Any], query: bool = False,
                     prompt: str = "") -> list[Tokenized] | None:
        if any(isinstance(x, ImageInput) for x in inputs):
            return None  # decoding is for the pool, never the event loop
        return super().tokenize_now(inputs, query, prompt)

    def _tokenize_locked(self, inputs: list[TextInput], query: bool) -> list[Tokenized]:
        out = super()._tokenize_locked(inputs, query)
        if self.siglip:  # as SigLIP's processor: padding="max_length", no attention mask
            for t in out:
                t.input_ids = t.input_ids + [self.pad_id] * (self.max_length - t.length)
        return out

    # ---- collate, forward, postprocess (inference thread) -----------------------------
    def collate(self, items: list[Tokenized]) -> MixedBatch:  # type: ignore[override]
        image_rows = [n for n, t in enumerate(items) if isinstance(t, ImageTokens)]
        text_rows = [n for n, t in enumerate(items) if not isinstance(t, ImageTokens)]
        input_ids = mask = pixels = None
        if text_rows:
            texts = self._collate_padded([items[n] for n in text_rows])
            input_ids, mask = texts.input_ids, texts.attention_mask
        if image_rows:
            stacked = np.stack([items[n].pixels for n in image_rows])  # type: ignore[attr-defined]
            pixels = torch.from_numpy(normalize(stacked, self.spec)).to(self.device)
        return MixedBatch(items, text_rows, image_rows, input_ids, mask, pixels)

    def forward(self, batch: MixedBatch) -> torch.Tensor:  # type: ignore[override]
        model: Any = self.model
        out = torch.empty(len(batch.items), self.dimensions, device=self.device)
        if batch.text_rows:
            # SigLIP's texts are padded to max_length and read without a mask, as trained.
            feats = _pooled(model.get_text_features(
                input_ids=batch.input_ids,
                attention_mask=None if self.siglip else batch.attention_mask))
            out[batch.text_rows] = feats.float()
        if batch.image_rows:
            dtype = next(model.parameters()).dtype
            feats = _pooled(model.get_image_features(
                pixel_values=batch.pixel_values.to(dtype)))  # type: ignore[union-attr]
            out[batch.image_rows] = feats.float()
        return F.normalize(out, p=2, dim=-1)

    def postprocess(self, batch: MixedBatch,  # type: ignore[override]
                    output: torch.Tensor) -> list[dict[str, np.ndarray]]:
        return [{"dense": row} for row in to_numpy(output)]


def _pooled(output: Any) -> torch.Tensor:
    """get_*_features' vectors: a tensor, or (transformers 5) the output's pooler_output."""
    return output if isinstance(output, torch.Tensor) else output.pooler_output
