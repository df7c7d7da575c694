"""Images as request items: the limits, the wire forms a server accepts, and what the SDK
sends (the bytes of an image file, or a PIL image encoded as PNG).

JSON carries an image as standard padded base64 or a ``data:image/...;base64,`` URL; msgpack
as raw bytes. Either may instead hold an http(s) URL as a string: the parser keeps it, and
the server's HTTP front fetches it from a host its operator allows, or refuses it
(heron.runtime.image_urls; off by default).

The SDK does not depend on Pillow: a PIL image can only exist where Pillow is installed and
imported, so it is recognized through the ``PIL.Image`` module already loaded, never by
importing it (``pip install 'heron-sdk[images]'`` installs Pillow).
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
# Or an http(s) URL (scheme in any case), of printable ASCII (an IDN host in its xn-- form)
# and at most MAX_IMAGE_URL_CHARS after the scheme: fetched only from the hosts a server's
# operator allows (heron.runtime.image_urls), else refused.
MAX_IMAGE_URL_CHARS = 4096
IMAGE_URL_PATTERN = f"[Hh][Tt][Tt][Pp][Ss]?://[!-~]{{1,{MAX_IMAGE_URL_CHARS}}}"
IMAGE_PATTERN = (f"^(?:(?:{IMAGE_DATA_URL_PREFIX})?{BASE64_PATTERN}|"
                 f"{IMAGE_URL_PATTERN})$")
_IMAGE_RE = re.compile(f"(?:{IMAGE_DATA_URL_PREFIX})?({BASE64_PATTERN})")
_IMAGE_URL_RE = re.compile(IMAGE_URL_PATTERN)


def image_url(value: Any) -> str | None:
    """``value`` when it is an image URL an image field may hold (``IMAGE_URL_PATTERN``);
    None for anything else."""
    if isinstance(value, str) and _IMAGE_URL_RE.fullmatch(value):
        return value
    return None


def check_image_field(value: Any, name: str) -> bytes | str:
    """An image field as the parser keeps it: its bytes (``check_image``), or an http(s)
    URL as given, which the server's front fetches or refuses (heron.runtime.image_urls)."""
    url = image_url(value)
    return url if url is not None else check_image(value, name)


def check_image(value: Any, name: str) -> bytes:
    """An image field's bytes: raw bytes (msgpack), base64 or a ``data:image/...;base64,``
    URL (JSON); at most MAX_IMAGE_BYTES. Whether they are an image is the worker's to find
    out. An http(s) URL is ``check_image_field``'s."""
    if isinstance(value, bytes | bytearray):
        data = bytes(value)
    elif isinstance(value, str):
        text = value
        if text[:8].lower().startswith(("http://", "https://")):
            raise HeronError(ErrorCode.IMAGE_INVALID,
                             f"{name}: an image URL must be http(s):// and at most "
                             f"{MAX_IMAGE_URL_CHARS} printable ASCII characters after it (no "
                             "spaces; an IDN host in its xn-- form)", field=name)
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
        raise invalid_field(name, "must be an image: base64, a data:image URL, an http(s) "
                                  "URL, or bytes")
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
