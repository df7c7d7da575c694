"""Image items: decode a request's image bytes safely and turn them into a model's pixels.

Runs on the worker's tokenizer thread pool (an image model's ``tokenize``), never on the
event loop: decoding a 1024 x 1024 JPEG and resizing it takes milliseconds.

Safety, in the order it is checked: a decoder allowlist (PNG, JPEG, WebP, GIF, BMP; no SVG,
no exotic formats), the pixel count from the header before any pixel is decoded (a
20000 x 20000 PNG of one colour is a few KB: a decompression bomb), and a truncated or
corrupt file is an error, never a half-grey image. Each failure is a 4xx naming the item
(``items[i].image``), so a coalesced neighbour's items are not failed with it.

Pixels follow the checkpoint's ``preprocessor_config.json`` as transformers'
CLIPImageProcessor and SiglipImageProcessor compute them (PIL backend): convert to RGB
(transparency composited on white), resize (shortest edge, or height x width) with the
configured resample filter, center crop (on the pool), then rescale and normalize to
float32, channels first (when the batch is built).
"""

from __future__ import annotations

import io
import json
import math
import struct
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image, ImageFile, ImageOps, UnidentifiedImageError

from heron_sdk.errors import ErrorCode, HeronError
from heron_sdk.images import MAX_IMAGE_PIXELS

# Decoders a request may reach. Pillow tries every registered plugin by default; the rarely
# used ones (PSD, PCX, FLI, ...) are more attack surface than value for embeddings.
ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
OPENAI_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
OPENAI_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)

# A truncated file must fail, not decode as grey (Pillow's default; never changed here).
ImageFile.LOAD_TRUNCATED_IMAGES = False
# Pillow's own bomb check (a warning past MAX_IMAGE_PIXELS, an error at twice it) backs up
# the header check below, at the same bound.
Image.MAX_IMAGE_PIXELS = MAX_IMAGE_PIXELS


@dataclass(frozen=True, slots=True)
class ImageInput:
    """An image item on its way to a model: its file's bytes and the request field that
    carried it (named by the error if it is not a usable image)."""

    data: bytes
    field: str


@dataclass(frozen=True, slots=True)
class ImageSpec:
    """A checkpoint's preprocessing, from its ``preprocessor_config.json``."""

    shortest_edge: int | None = 224  # resize keeping the aspect ratio ...
    height: int | None = None  # ... or to height x width
    width: int | None = None
    resample: int = 3  # PIL's BICUBIC
    crop: tuple[int, int] | None = (224, 224)  # center crop (height, width), or none
    rescale: float | None = 1 / 255
    mean: tuple[float, ...] | None = OPENAI_CLIP_MEAN
    std: tuple[float, ...] | None = OPENAI_CLIP_STD
    convert_rgb: bool = True

    @classmethod
    def read(cls, path: Path, *, image_size: int, siglip: bool) -> ImageSpec:
        """The checkpoint's spec; without a preprocessor_config.json, the defaults of the
        family's processor at the model's own image size."""
        file = path / "preprocessor_config.json"
        raw: dict[str, Any] = json.loads(file.read_text()) if file.exists() else {}
        if siglip:  # SiglipImageProcessor: square resize, no crop, mean and std 0.5
            defaults: dict[str, Any] = {"size": {"height": image_size, "width": image_size},
                                        "do_center_crop": False, "image_mean": [0.5] * 3,
                                        "image_std": [0.5] * 3}
        else:
            defaults = {"size": {"shortest_edge": image_size}, "do_center_crop": True,
                        "crop_size": {"height": image_size, "width": image_size},
                        "image_mean": list(OPENAI_CLIP_MEAN), "image_std": list(OPENAI_CLIP_STD)}
        cfg = {**defaults, **raw}
        size = cfg.get("size")
        if isinstance(size, int | float):  # the oldest configs: one number
            size = {"shortest_edge": int(size)} if not siglip else {"height": int(size),
                                                                    "width": int(size)}
        size = size or {}
        if cfg.get("do_resize", True) is False:
            size = {}
        crop = cfg.get("crop_size") or {}
        if isinstance(crop, int | float):
            crop = {"height": int(crop), "width": int(crop)}
        return cls(
            shortest_edge=size.get("shortest_edge"),
            height=size.get("height"), width=size.get("width"),
            resample=int(cfg.get("resample", 3)),
            crop=(int(crop["height"]), int(crop["width"]))
            if cfg.get("do_center_crop") and crop else None,
            rescale=float(cfg.get("rescale_factor", 1 / 255))
            if cfg.get("do_rescale", True) else None,
            mean=tuple(cfg["image_mean"]) if cfg.get("do_normalize", True) else None,
            std=tuple(cfg["image_std"]) if cfg.get("do_normalize", True) else None,
            convert_rgb=bool(cfg.get("do_convert_rgb", True)),
        )

    def describe(self) -> dict[str, Any]:
        size = ({"shortest_edge": self.shortest_edge} if self.shortest_edge
                else {"height": self.height, "width": self.width})
        return {"size": size, "crop": list(self.crop) if self.crop else None,
                "resample": self.resample}


def invalid(field: str, why: str) -> HeronError:
    return HeronError(ErrorCode.IMAGE_INVALID, f"{field}: {why}", field=field)


def open_image(item: ImageInput, max_pixels: int = MAX_IMAGE_PIXELS) -> Image.Image:
    """The decoded image (first frame), upright as its EXIF orientation says (transformers'
    load_image does the same). 413 IMAGE_TOO_LARGE past ``max_pixels``, read from the header
    before decoding; 422 IMAGE_INVALID for anything that is not a whole image of an
    allowed format."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(item.data), formats=ALLOWED_FORMATS)
            width, height = image.size
            if width <= 0 or height <= 0:
                raise invalid(item.field, f"the image header says {width} x {height} pixels")
            if width * height > max_pixels:
                raise HeronError(ErrorCode.IMAGE_TOO_LARGE,
                                 f"{item.field}: {width} x {height} pixels is over the limit "
                                 f"of {max_pixels} pixels per image", field=item.field)
            image.load()
            image = ImageOps.exif_transpose(image)
    except HeronError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        # Pillow's own check, at open for twice the bound: the same refusal as ours.
        raise HeronError(ErrorCode.IMAGE_TOO_LARGE,
                         f"{item.field}: over the limit of {max_pixels} pixels per image "
                         f"({exc})", field=item.field) from None
    except UnidentifiedImageError:
        raise invalid(item.field, f"not an image in a supported format "
                                  f"({', '.join(ALLOWED_FORMATS)})") from None
    except (OSError, ValueError, SyntaxError, EOFError, struct.error,
            MemoryError) as exc:  # truncated, corrupt, or a decoder's own complaint
        # (some Pillow decoders raise struct.error or SyntaxError on a short file)
        raise invalid(item.field, f"the image could not be decoded: {exc}") from None
    return image


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, transparency composited onto white (transformers' convert_to_rgb)."""
    if "A" in image.getbands() or image.info.get("transparency") is not None:
        rgba = image.convert("RGBA")
        background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
        return Image.alpha_composite(background, rgba).convert("RGB")
    return image.convert("RGB")


def resize_shape(width: int, height: int, spec: ImageSpec) -> tuple[int, int]:
    """(width, height) after resizing, as transformers' get_resize_output_image_size."""
    if spec.shortest_edge:
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = spec.shortest_edge, int(spec.shortest_edge * long / short)
        return (new_short, new_long) if width <= height else (new_long, new_short)
    if spec.height and spec.width:
        return spec.width, spec.height
    return width, height


def center_crop(pixels: np.ndarray, crop: tuple[int, int]) -> np.ndarray:
    """[H, W, C] cut to ``crop`` around the center, zero-padded where it is smaller
    (transformers' center_crop)."""
    crop_h, crop_w = crop
    h, w = pixels.shape[:2]
    top, left = (h - crop_h) // 2, (w - crop_w) // 2
    if top >= 0 and left >= 0:
        return pixels[top:top + crop_h, left:left + crop_w]
    new_h, new_w = max(crop_h, h), max(crop_w, w)
    padded = np.zeros((new_h, new_w, *pixels.shape[2:]), dtype=pixels.dtype)
    top_pad, left_pad = math.ceil((new_h - h) / 2), math.ceil((new_w - w) / 2)
    padded[top_pad:top_pad + h, left_pad:left_pad + w] = pixels
    top, left = top + top_pad, left + left_pad
    return padded[max(0, top):min(new_h, top + crop_h), max(0, left):min(new_w, left + crop_w)]


def resize_and_crop(image: Image.Image, spec: ImageSpec) -> np.ndarray:
    """[H, W, C] pixels as decoded (uint8 for RGB), resized and cropped for the model. Kept
    so while queued (150 KB at 224 x 224, against 600 KB as float32); ``normalize`` runs
    when the batch is built."""
    if spec.convert_rgb:
        image = to_rgb(image)
    size = resize_shape(*image.size, spec)
    if size != image.size:
        image = image.resize(size, resample=Image.Resampling(spec.resample), reducing_gap=None)
    pixels = np.asarray(image)
    if pixels.ndim == 2:
        pixels = pixels[:, :, None]
    if spec.crop is not None:
        pixels = center_crop(pixels, spec.crop)
    return np.ascontiguousarray(pixels)


def normalize(batch: np.ndarray, spec: ImageSpec) -> np.ndarray:
    """[B, H, W, C] pixels as float32 [B, C, H, W]: x * (rescale / std) - mean / std.

    transformers rescales in float64 and normalizes in float32; the two differ by an ulp
    (cosine 1.0 in tests/parity/test_clip.py), and one float32 multiply-add is far cheaper:
    0.15 ms against 2.9 ms an image at 224 x 224 on this project's 2-core machine."""
    channels = batch.shape[-1]
    scale = np.float32(spec.rescale if spec.rescale is not None else 1.0)
    mean = np.asarray(spec.mean if spec.mean is not None else (0.0,) * channels, np.float32)
    std = np.asarray(spec.std if spec.std is not None else (1.0,) * channels, np.float32)
    planes = np.ascontiguousarray(batch.transpose(0, 3, 1, 2)).astype(np.float32)
    planes *= (scale / std)[:, None, None]
    planes -= (mean / std)[:, None, None]
    return planes


def preprocess(image: Image.Image, spec: ImageSpec) -> np.ndarray:
    """float32 [3, H, W] pixels for the model (``resize_and_crop`` then ``normalize``)."""
    return normalize(resize_and_crop(image, spec)[None], spec)[0]


def load_pixels(item: ImageInput, spec: ImageSpec,
                max_pixels: int = MAX_IMAGE_PIXELS) -> np.ndarray:
    """``item``'s pixels for a model with ``spec``, resized and cropped (``normalize``
    finishes them), or the 4xx that says why not."""
    image = open_image(item, max_pixels)
    try:
        return resize_and_crop(image, spec)
    except (OSError, ValueError) as exc:  # a mode RGB conversion cannot handle
        raise invalid(item.field, f"the image could not be converted: {exc}") from None
