"""Images as request items: the limits, the wire forms a server accepts, and what the SDK
sends (the bytes of an image file, or a PIL image encoded as PNG).

JSON carries an image as standard padded base64 or a ``data:image/...;base64,`` URL; msgpack
as raw bytes. The SDK does not depend on Pillow: a PIL image can only exist where Pillow is
installed and imported, so it is recognized through the ``PIL.Image`` module already
loaded, never by importing it (``pip install 'heron-sdk[images]'`` installs Pillow).
"""

from __future__ import annotations

import base64
import binascii
import io
import re
import sys
from typing import Any

from heron_sdk.errors import ErrorCode, HeronError, invalid_field

# Images (encode and score items of CLIP-style models): bytes of one image after base64, and
# images per request. Pixels are checked by the worker from the image's header, before
# decoding (heron.worker.images): a 20000 x 20000 PNG of one colour is a few KB.
MAX_IMAGE_BYTES = 8 * 1024 * 1024
MAX_IMAGES_PER_REQUEST = 64
MAX_IMAGE_PIXELS = 40_000_000
# An image in JSON: standard padded base64, optionally as a data URL. The OpenAPI document
# (heron/runtime/api_types.py) states the same pattern.
IMAGE_DATA_URL_PREFIX = r"data:image/[A-Za-z0-9.+-]+;base64,"
BASE64_PATTERN = (r"(?:[A-Za-z0-9+/]{4})*(?:[A-Za-z0-9+/]{4}|[A-Za-z0-9+/]{2}==|"
                  r"[A-Za-z0-9+/]{3}=)")
IMAGE_PATTERN = f"^(?:{IMAGE_DATA_URL_PREFIX})?{BASE64_PATTERN}$"
_IMAGE_RE = re.compile(f"(?:{IMAGE_DATA_URL_PREFIX})?({BASE64_PATTERN})")


def check_image(value: Any, name: str) -> bytes:
    """An image field's bytes: raw bytes (msgpack), base64 or a ``data:image/...;base64,``
    URL (JSON). http(s) URLs are refused (the server does not fetch: SSRF); the bytes are
    at most MAX_IMAGE_BYTES. Whether they are an image is the worker's to find out."""
    if isinstance(value, bytes | bytearray):
        data = bytes(value)
    elif isinstance(value, str):
        text = value
        if text[:8].lower().startswith(("http://", "https://")):
            raise HeronError(ErrorCode.IMAGE_URL_REFUSED,
                             f"{name}: this server does not fetch image URLs (a server that "
                             "fetches what a request names can be pointed at internal "
                             "addresses); send the image's bytes as base64", field=name)
        if len(text) > 4 * (MAX_IMAGE_BYTES // 3 + 1) + 128:
            raise _image_too_large(name, len(text) * 3 // 4)
        match = _IMAGE_RE.fullmatch(text)
        if match is None:
            raise HeronError(ErrorCode.IMAGE_INVALID,
                             f"{name}: must be standard padded base64, or a data URL "
                             "data:image/<type>;base64,<data>", field=name)
        try:
            data = base64.b64decode(match.group(1), validate=True)
        except (binascii.Error, ValueError):  # the pattern leaves nothing for this to find
            raise HeronError(ErrorCode.IMAGE_INVALID, f"{name}: is not valid base64",
                             field=name) from None
    else:
        raise invalid_field(name, "must be an image: base64, a data:image URL, or bytes")
    if not data:
        raise HeronError(ErrorCode.IMAGE_INVALID, f"{name}: the image is empty", field=name)
    if len(data) > MAX_IMAGE_BYTES:
        raise _image_too_large(name, len(data))
    return data


def _image_too_large(name: str, size: int) -> HeronError:
    return HeronError(ErrorCode.IMAGE_TOO_LARGE,
                      f"{name}: an image of {size} bytes is over the limit of "
                      f"{MAX_IMAGE_BYTES} bytes", field=name)


# ---- what the SDK sends --------------------------------------------------------------------
# PNG at zlib level 1: lossless, and several times faster to write than the default level 6
# for a photo, for somewhat more bytes.
PNG_COMPRESS_LEVEL = 1


def is_pil_image(value: Any) -> bool:
    module = sys.modules.get("PIL.Image")
    return module is not None and isinstance(value, module.Image)


def pil_to_bytes(image: Any) -> bytes:
    """A PIL image as PNG bytes (modes PNG cannot hold become RGB or RGBA first)."""
    if image.mode not in ("1", "L", "LA", "I", "I;16", "P", "RGB", "RGBA"):
        image = image.convert("RGBA" if "A" in image.getbands() else "RGB")
    out = io.BytesIO()
    image.save(out, format="PNG", compress_level=PNG_COMPRESS_LEVEL)
    return out.getvalue()


def image_bytes(value: Any) -> bytes | None:
    """``value`` as an image file's bytes when it is an image (bytes or a PIL image); None
    for anything else (a text, an Item)."""
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value)
    if is_pil_image(value):
        return pil_to_bytes(value)
    return None
