"""Wire codec: msgpack (numpy arrays in msgpack-numpy's form) and JSON.

The request's Content-Type picks the decoder; Accept picks the encoder (falling back to
the request's format). Imported by the worker, the gateway and the SDK alike.

Servers read request bodies with ``decode_request``: no arrays (no request carries one) and
at most ``MAX_BODY_DEPTH`` levels of nesting. Answers and messages between Heron's
processes are read with ``decode``, whose arrays are numeric only: msgpack-numpy's own
decoder unpickles an object array, which would run whatever code the sender chose.
"""

from __future__ import annotations

import base64
from typing import Any

import msgpack
import msgpack_numpy
import numpy as np
import orjson

from heron_sdk.errors import ErrorCode, HeronError

MSGPACK = "application/msgpack"
JSON = "application/json"
_MSGPACK_ALIASES = ("application/msgpack", "application/x-msgpack", "application/vnd.msgpack")
# No request body nests deeper than 4 levels (a config's profiles.<name>.<setting>); the
# bound leaves room and keeps anything that walks a body far from Python's recursion limit.
MAX_BODY_DEPTH = 32
# numpy dtype kinds an array on the wire may have: booleans and numbers. Never "O" (object
# arrays travel as pickles), "V" (structured), strings or dates.
_ARRAY_KINDS = frozenset("biuf")
_CONTAINERS = (dict, list)  # what the decoders build maps and arrays as


def media_type(header: str | None) -> str | None:
    """Normalise a Content-Type/Accept value to MSGPACK, JSON, or None (unknown/absent)."""
    if not header:
        return None
    for part in header.split(","):
        value = part.split(";")[0].strip().lower()
        if value in _MSGPACK_ALIASES:
            return MSGPACK
        if value in (JSON, "*/*", "application/*", "text/json") or value.endswith("+json"):
            return JSON
    return None


def request_format(content_type: str | None) -> str:
    """Decoder for a request body. No Content-Type, or curl's default form type for ``-d``,
    means JSON: that is what a person typing curl meant."""
    if not content_type or content_type.startswith("application/x-www-form-urlencoded"):
        return JSON
    fmt = media_type(content_type)
    if fmt is None:
        raise HeronError(
            ErrorCode.UNSUPPORTED_MEDIA_TYPE,
            f"Content-Type {content_type!r} is not supported; use {JSON} or {MSGPACK}",
        )
    return fmt


def response_format(accept: str | None, request_fmt: str = JSON) -> str:
    """Encoder for a response: msgpack only when asked for (Accept) or spoken (request)."""
    if accept:
        for part in accept.split(","):
            value = part.split(";")[0].strip().lower()
            if value in _MSGPACK_ALIASES:
                return MSGPACK
            if value == JSON or value.endswith("+json"):
                return JSON
    return request_fmt


def decode(body: bytes, fmt: str, *, arrays: bool = True) -> Any:
    """``body`` in ``fmt``; 400 MALFORMED_BODY when it is not. ``arrays``: msgpack maps in
    msgpack-numpy's form become numpy arrays (numeric dtypes only); else they stay maps."""
    if not body:
        raise HeronError(ErrorCode.MALFORMED_BODY, "request body is empty")
    try:
        if fmt == MSGPACK:
            return msgpack.unpackb(body, object_hook=_numpy_hook if arrays else None,
                                   raw=False, strict_map_key=False)
        return orjson.loads(body)
    except (ValueError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError,
            TypeError, UnicodeDecodeError) as exc:
        kind = "msgpack" if fmt == MSGPACK else "JSON"
        raise HeronError(ErrorCode.MALFORMED_BODY, f"body is not valid {kind}: {exc}") from exc


def decode_request(body: bytes, fmt: str) -> Any:
    """A request body as a server reads it: ``decode`` without arrays, nested at most
    ``MAX_BODY_DEPTH`` levels (400 MALFORMED_BODY past it)."""
    value = decode(body, fmt, arrays=False)
    # JSON nests no deeper than it has brackets (those in strings count too, so this only
    # ever walks more): a one-text request has 2, and skips the walk.
    if fmt != JSON or body.count(b"[") + body.count(b"{") > MAX_BODY_DEPTH:
        check_depth(value)
    return value


def check_depth(value: Any, limit: int = MAX_BODY_DEPTH) -> None:
    """400 MALFORMED_BODY when lists and maps in ``value`` nest deeper than ``limit``
    (``{}`` is one level). Level by level, with no recursion: about 0.1 us an element
    (200 us for 2,048 items on the CI machine, against milliseconds to tokenize them)."""
    level = [value] if isinstance(value, dict | list) else []
    depth = 0
    while level:
        depth += 1
        if depth > limit:
            raise HeronError(ErrorCode.MALFORMED_BODY,
                             f"body nests lists and maps deeper than {limit} levels")
        below: list[Any] = []
        for node in level:
            below += [c for c in (node.values() if type(node) is dict else node)
                      if type(c) in _CONTAINERS]
        level = below


def _numpy_hook(obj: dict[Any, Any]) -> Any:
    """msgpack-numpy's map for an array or a scalar, as numpy; any other map unchanged.
    ValueError (a malformed body) for an array that is not numeric or does not fit its
    bytes."""
    if b"nd" not in obj:
        return obj
    try:
        kind = obj[b"type"]
        if not isinstance(kind, str):
            raise TypeError(f"dtype {kind!r} is not a string")
        dtype = np.dtype(kind)
        data = obj[b"data"]
        if dtype.kind not in _ARRAY_KINDS or not isinstance(data, bytes):
            raise ValueError(f"dtype {dtype.str} is not a numeric array type")
        if obj[b"nd"] is True:
            return np.ndarray(buffer=data, dtype=dtype, shape=tuple(obj[b"shape"]))
        return np.frombuffer(data, dtype=dtype)[0]
    except (KeyError, IndexError, TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"a msgpack-numpy array is malformed: {exc}") from None


def encode(obj: Any, fmt: str) -> bytes:
    if fmt == MSGPACK:
        return msgpack.packb(obj, default=msgpack_numpy.encode, use_bin_type=True)
    # orjson writes numpy arrays natively: a 384-d float32 vector in ~9 us against ~170 us
    # through lists and json.dumps (float repr dominates), which mattered at 200 requests/s.
    return orjson.dumps(obj, option=orjson.OPT_SERIALIZE_NUMPY, default=_json_default)


def _json_default(obj: Any) -> Any:
    """What orjson cannot write natively (non-contiguous arrays, odd dtypes; bytes, which
    JSON carries as base64: an image item's)."""
    if isinstance(obj, np.ndarray | np.generic):
        return to_jsonable(obj)
    if isinstance(obj, bytes | bytearray):
        return base64.b64encode(obj).decode()
    raise TypeError(f"cannot encode {type(obj).__name__} as JSON")


def to_jsonable(obj: Any) -> Any:
    """numpy arrays become (nested) lists; numpy scalars become Python numbers."""
    if isinstance(obj, np.ndarray):
        return obj.tolist()
    if isinstance(obj, dict):
        return {k: to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, np.generic):
        return obj.item()
    return obj


def array_to_base64(array: np.ndarray) -> str:
    """Little-endian raw bytes, base64: the OpenAI encoding for float32 embeddings."""
    return base64.b64encode(np.ascontiguousarray(array).astype(array.dtype.newbyteorder("<"),
                                                               copy=False).tobytes()).decode()


def base64_to_array(text: str, dtype: str, shape: tuple[int, ...] | None = None) -> np.ndarray:
    array = np.frombuffer(base64.b64decode(text), dtype=np.dtype(dtype).newbyteorder("<"))
    return array.reshape(shape) if shape else array
