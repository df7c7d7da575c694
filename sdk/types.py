"""Request and result types of the inference API, with their wire forms.

Servers parse request bodies with ``*.from_wire`` (every violation is a 422 naming the
field: an unknown field, a wrong type, a number out of range or not finite); the SDK builds
them and calls ``to_wire``, which writes only fields ``from_wire`` knows. Results are plain
dicts on the wire: arrays stay numpy arrays under msgpack, become lists under JSON, or base64
envelopes ``{"b64", "dtype", "shape"}`` when the request asks for ``encoding: "base64"``.
"""

from __future__ import annotations

import math
import re
import reprlib
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from heron_sdk.errors import ErrorCode, HeronError, invalid_field
from heron_sdk.images import MAX_IMAGES_PER_REQUEST, check_image_field
from heron_sdk.wire import array_to_base64

if TYPE_CHECKING:  # heron_sdk.chunking reads fields with this module's readers
    from heron_sdk.chunking import ChunkingOptions

TASKS = ("encode", "score", "extract")
OUTPUT_TYPES = ("dense", "sparse", "multi_vector", "muvera")
OUTPUT_DTYPES = ("float32", "float16", "int8", "uint8", "binary")
ENCODINGS = ("float", "base64")

# Documented limits (docs/api.md). Bigger inputs are split by the SDK.
MAX_ITEMS_PER_REQUEST = 2048
MAX_BODY_BYTES = 16 * 1024 * 1024
MAX_TEXT_CHARS = 1_000_000
# Integer fields (priority, dims, top_k, dimensions) stay within int32: every wire form and
# header carries them, and no real value comes near (a bigger one is a 422, not a 500).
MAX_INTEGER = 2**31 - 1
# The shortest deadline a request may ask for: 1 ms. A smaller one (5e-324 in a fuzzed
# body) has passed before the request is read; it is bad input, not a deadline missed.
MIN_TIMEOUT_S = 0.001
# extract's labels: entity types to keep, or for a zero-shot model (GLiNER) the prompt every
# text is encoded with, so their number and length bound the work of each item.
MAX_LABELS = 50
MAX_LABEL_CHARS = 100

# A LoRA adapter's name (a model config's ``loras`` keys, the ``adapter`` field, the part
# after "@" in ``model@adapter``): subject- and path-safe, so it travels anywhere a model does.
ADAPTER_NAME_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$"
_ADAPTER_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
# A model field that may say ``model@adapter`` (heron.runtime.modelconfig.split_adapter's
# rule): no "@", or a model name, "@" and an adapter name after the last "@".
MODEL_ADAPTER_PATTERN = r"^(?:[^@]+|[\s\S]+@[A-Za-z0-9][A-Za-z0-9._-]{0,63})$"

# The fields each body may hold; any other is a 422 naming it (a misspelt option would
# otherwise be dropped without a word and the request answered as if it were not there).
OPTION_FIELDS = frozenset({"truncate", "priority", "timeout_s", "encoding", "adapter", "cache"})
ENCODE_FIELDS = OPTION_FIELDS | {"items", "output_types", "output_dtype", "dims", "is_query",
                                 "instruction", "input_type", "chunking"}
SCORE_FIELDS = OPTION_FIELDS | {"query", "items", "top_k", "max_tokens_per_doc"}
# Which side of a search a text is on, in the names other APIs use (Cohere's search_query,
# search_document, classification and clustering; Voyage's and Jina's query and document):
# value -> the side it encodes as. classification and clustering take the checkpoint's prompt
# of that name when it has one, else the document side (heron.worker.adapters.base).
INPUT_TYPES: dict[str, str] = {"query": "query", "search_query": "query",
                               "document": "document", "search_document": "document",
                               "classification": "document", "clustering": "document"}
EXTRACT_FIELDS = OPTION_FIELDS | {"items", "labels", "threshold"}
ITEM_FIELDS = frozenset({"text", "id"})
TOKEN_ITEM_FIELDS = ITEM_FIELDS | {"tokens"}  # encode's items may carry token ids instead

# A client's value as error messages show it: bounded in length and depth, whatever it is.
_SHOWN = reprlib.Repr()  # (keyword arguments only from Python 3.12)
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother = 3, 80, 80


def shown(value: Any) -> str:
    """``repr(value)``, cut short: an error message never grows with the body."""
    return _SHOWN.repr(value)


def check_fields(body: Mapping[Any, Any], known: Collection[str], where: str = "") -> None:
    """422 INVALID_FIELD naming the first key of ``body`` that is not in ``known``
    (``where``: the path of ``body`` inside the request, e.g. ``items[2]``)."""
    for key in body:
        if key not in known:
            name = str(key) if len(str(key)) <= 80 else f"{str(key)[:77]}..."
            path = f"{where}.{name}" if where else name
            raise HeronError(ErrorCode.INVALID_FIELD,
                             f"unknown field {shown(path if where else key)}; "
                             f"known: {', '.join(sorted(known))}", field=path)


def check_finite(value: Any, name: str) -> None:
    """422 for NaN and the infinities, which msgpack and YAML carry and no field means."""
    if isinstance(value, float) and not math.isfinite(value):
        raise invalid_field(name, "must be a finite number")


@dataclass(frozen=True, slots=True)
class Item:
    """A text, or (encode only) the model's own token ids in place of a text: OpenAI's
    token-id input. The server adds the model's special tokens around them. Or (encode and
    score, image models) an image's encoded bytes (PNG, JPEG, WebP, ...), or its http(s)
    URL, which the server fetches only from hosts its operator allows (else 422
    IMAGE_URL_REFUSED); the server's front puts the fetched bytes in its place."""

    text: str
    id: str | None = None
    tokens: tuple[int, ...] | None = None  # then ``text`` is ""
    image: bytes | None = None  # then ``text`` is ""
    image_url: str | None = None  # then ``text`` is "" and ``image`` None

    @property
    def is_image(self) -> bool:
        return self.image is not None or self.image_url is not None

    def to_wire(self) -> dict[str, Any] | str:
        if self.tokens is not None:
            out: dict[str, Any] = {"tokens": list(self.tokens)}
            return out if self.id is None else {**out, "id": self.id}
        if self.image is not None:  # raw bytes: msgpack bin; heron_sdk.wire's JSON, base64
            out = {"image": self.image}
            return out if self.id is None else {**out, "id": self.id}
        if self.image_url is not None:
            out = {"image": self.image_url}
            return out if self.id is None else {**out, "id": self.id}
        return self.text if self.id is None else {"text": self.text, "id": self.id}

    @classmethod
    def of_tokens(cls, tokens: Sequence[int], id: str | None = None) -> Item:
        return cls("", id, tuple(tokens))

    @classmethod
    def of_image(cls, data: bytes, id: str | None = None) -> Item:
        """An image given as its file's bytes (PNG, JPEG, WebP, GIF, BMP)."""
        return cls("", id, None, bytes(data))

    @classmethod
    def of_image_url(cls, url: str, id: str | None = None) -> Item:
        """An image given as its http(s) URL, for the server to fetch (a server fetches only
        from the hosts its operator allows: ``--image-url-hosts``)."""
        return cls("", id, None, None, url)


def _parse_items(body: Mapping[str, Any], name: str = "items", *,
                 tokens: bool = False, images: bool = False) -> list[Item]:
    """``tokens``: items may be ``{"tokens": [ids]}`` (encode only); ``images``: items
    may be ``{"image": ...}`` (encode and score)."""
    raw = body.get(name)
    if raw is None:
        raise invalid_field(name, "is required")
    if isinstance(raw, str | Mapping) or not isinstance(raw, list):
        raise invalid_field(name, "must be a list of strings or {text, id} objects")
    if not raw:
        raise invalid_field(name, "must not be empty")
    if len(raw) > MAX_ITEMS_PER_REQUEST:
        raise HeronError(
            ErrorCode.TOO_MANY_ITEMS,
            f"{name}: {len(raw)} items is over the limit of {MAX_ITEMS_PER_REQUEST} per request;"
            " split the request (the SDK does this for you)",
            field=name,
        )
    items: list[Item] = []
    known = ITEM_FIELDS | ({"tokens"} if tokens else set()) | ({"image"} if images else set())
    for i, entry in enumerate(raw):
        if isinstance(entry, str):
            items.append(Item(check_text(entry, f"{name}[{i}]")))
        elif isinstance(entry, Mapping):
            check_fields(entry, known, f"{name}[{i}]")
            item_id = integral(entry.get("id"))
            if item_id is not None and (isinstance(item_id, bool)
                                        or not isinstance(item_id, str | int)):
                raise invalid_field(f"{name}[{i}].id", "must be a string or an integer")
            item_id = None if item_id is None else str(item_id)
            if tokens and "tokens" in entry:
                if "text" in entry:
                    raise invalid_field(f"{name}[{i}]", "takes text or tokens, not both")
                items.append(Item.of_tokens(check_token_ids(entry["tokens"],
                                                            f"{name}[{i}].tokens"), item_id))
                continue
            if images and "image" in entry:
                if "text" in entry or "tokens" in entry:
                    raise invalid_field(f"{name}[{i}]", "takes an image or a text, not both")
                image = check_image_field(entry["image"], f"{name}[{i}].image")
                items.append(Item.of_image_url(image, item_id) if isinstance(image, str)
                             else Item.of_image(image, item_id))
                continue
            text = entry.get("text")
            if not isinstance(text, str):
                raise invalid_field(f"{name}[{i}].text", "is required and must be a string")
            items.append(Item(check_text(text, f"{name}[{i}].text"), item_id))
        else:
            raise invalid_field(f"{name}[{i}]", "must be a string or a {text, id} object")
    if images:
        count = sum(1 for item in items if item.is_image)
        if count > MAX_IMAGES_PER_REQUEST:
            raise HeronError(ErrorCode.TOO_MANY_IMAGES,
                             f"{name}: {count} images is over the limit of "
                             f"{MAX_IMAGES_PER_REQUEST} per request; split the request",
                             field=name)
    return items


def check_token_ids(ids: Any, name: str) -> tuple[int, ...]:
    """A non-empty list of token ids, integers from 0 to MAX_INTEGER (the worker checks them
    against the model's vocabulary), at most MAX_TEXT_CHARS of them; a bad one is named
    ``name[i]``."""
    if not isinstance(ids, list) or not ids:
        raise invalid_field(name, "must be a non-empty list of token ids")
    if len(ids) > MAX_TEXT_CHARS:
        raise HeronError(ErrorCode.PAYLOAD_TOO_LARGE,
                         f"{name}: {len(ids)} token ids is over {MAX_TEXT_CHARS}", field=name)
    out = []
    for i, raw in enumerate(ids):
        token = integral(raw)
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= MAX_INTEGER:
            raise invalid_field(f"{name}[{i}]", f"must be a token id (an integer from 0 to "
                                f"{MAX_INTEGER})")
        out.append(token)
    return tuple(out)


def check_text(text: str, name: str) -> str:
    """413 for one text over MAX_TEXT_CHARS (the body limit bounds the rest)."""
    if len(text) > MAX_TEXT_CHARS:
        raise HeronError(ErrorCode.PAYLOAD_TOO_LARGE,
                         f"{name}: text of {len(text)} characters is over {MAX_TEXT_CHARS}",
                         field=name)
    return text


def optional_field(body: Mapping[str, Any], name: str, kind: type | tuple[type, ...],
                   default: Any) -> Any:
    """Field ``name`` of ``body``, of type ``kind``; absent or null is ``default``. 422
    INVALID_FIELD for another type, a bool where a number is meant, NaN or the
    infinities, or an integer past MAX_INTEGER."""
    value = body.get(name)
    if value is None:  # absent (most fields of most requests): the default, unchecked
        return default
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if int in kinds or float in kinds:
        check_finite(value, name)
    # bool is an int subclass; never accept it where a number is meant.
    if isinstance(value, bool) and kind is not bool:
        raise invalid_field(name, f"must be {_kind_name(kind)}")
    if kind is int:
        value = integral(value)
    if not isinstance(value, kind):
        raise invalid_field(name, f"must be {_kind_name(kind)}")
    if kind is int and value > MAX_INTEGER:
        raise invalid_field(name, f"must be at most {MAX_INTEGER}")
    return value


def integral(value: Any) -> Any:
    """``2.0`` as ``2``: JSON has one number type, and JSON Schema's (so the OpenAPI
    document's) integer is any number without a fraction. Anything else is returned as is."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


def _kind_name(kind: type | tuple[type, ...]) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
             list: "a list"}
    kinds = kind if isinstance(kind, tuple) else (kind,)
    return " or ".join(names.get(k, k.__name__) for k in kinds)


@dataclass(slots=True)
class RequestOptions:
    """Options every inference request carries."""

    truncate: bool = True
    priority: int = 0
    timeout_s: float | None = None
    encoding: str = "float"
    adapter: str | None = None  # a LoRA adapter of the model (None: the base model)
    cache: bool = True  # False: the worker's result cache is neither read nor written

    @classmethod
    def from_wire(cls, body: Mapping[str, Any]) -> RequestOptions:
        priority = optional_field(body, "priority", int, 0)
        if priority < 0:
            raise invalid_field("priority", "must be >= 0 (0 is the highest)")
        timeout_s = optional_field(body, "timeout_s", (int, float), None)
        if timeout_s is not None and timeout_s < MIN_TIMEOUT_S:
            raise invalid_field("timeout_s", f"must be at least {MIN_TIMEOUT_S:g} (a second "
                                "is 1; no model answers within less)")
        encoding = optional_field(body, "encoding", str, "float")
        if encoding not in ENCODINGS:
            raise invalid_field("encoding", f"must be one of {list(ENCODINGS)}")
        adapter = optional_field(body, "adapter", str, None)
        if adapter is not None:
            check_adapter_name(adapter, "adapter")
        return cls(truncate=optional_field(body, "truncate", bool, True), priority=priority,
                   timeout_s=None if timeout_s is None else float(timeout_s), encoding=encoding,
                   adapter=adapter, cache=optional_field(body, "cache", bool, True))

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"truncate": self.truncate, "priority": self.priority,
                               "encoding": self.encoding}
        if self.timeout_s is not None:
            out["timeout_s"] = self.timeout_s
        if self.adapter is not None:
            out["adapter"] = self.adapter
        if not self.cache:
            out["cache"] = False
        return out


def check_adapter_name(name: str, field_name: str) -> str:
    """422 INVALID_FIELD unless ``name`` is a well-formed adapter name."""
    if not _ADAPTER_NAME.fullmatch(name):
        raise invalid_field(field_name, f"{shown(name)} is not an adapter name (1 to 64 "
                            "letters, digits and ._-, starting with a letter or digit)")
    return name


@dataclass(slots=True)
class EncodeRequest:
    items: list[Item]
    output_types: tuple[str, ...] = ("dense",)
    output_dtype: str = "float32"
    dims: int | None = None
    is_query: bool = False
    instruction: str | None = None
    options: RequestOptions = field(default_factory=RequestOptions)
    input_type: str | None = None  # an INPUT_TYPES key; sets is_query
    chunking: ChunkingOptions | None = None  # long texts split (heron_sdk.chunking)

    @classmethod
    def from_wire(cls, body: Any) -> EncodeRequest:
        body = require_object(body)
        check_fields(body, ENCODE_FIELDS)
        output_types = optional_field(body, "output_types", list, ["dense"])
        if not output_types:
            raise invalid_field("output_types", "must not be empty")
        for t in output_types:
            if t not in OUTPUT_TYPES:
                raise HeronError(ErrorCode.UNSUPPORTED_OUTPUT,
                                 f"output_types: unknown output type {shown(t)}; "
                                 f"known: {list(OUTPUT_TYPES)}", field="output_types")
        output_dtype = optional_field(body, "output_dtype", str, "float32")
        if output_dtype not in OUTPUT_DTYPES:
            raise HeronError(ErrorCode.UNSUPPORTED_OUTPUT,
                             f"output_dtype: {shown(output_dtype)} is not one of "
                             f"{list(OUTPUT_DTYPES)}", field="output_dtype")
        dims = optional_field(body, "dims", int, None)
        if dims is not None and dims <= 0:
            raise invalid_field("dims", "must be a positive integer")
        is_query = optional_field(body, "is_query", bool, False)
        input_type = optional_field(body, "input_type", str, None)
        if input_type is not None:  # it decides the side; is_query is then not read
            side = INPUT_TYPES.get(input_type)
            if side is None:
                raise invalid_field("input_type", f"must be one of {list(INPUT_TYPES)}")
            is_query = side == "query"
        chunking = body.get("chunking")
        if chunking is not None:  # imported here: heron_sdk.chunking builds on this module
            from heron_sdk.chunking import parse_chunking  # (about 2 µs: not every request)
            chunking = parse_chunking(chunking)
        return cls(
            items=_parse_items(body, tokens=True, images=True),
            output_types=tuple(dict.fromkeys(output_types)),
            output_dtype=output_dtype,
            dims=dims,
            is_query=is_query,
            instruction=optional_field(body, "instruction", str, None),
            input_type=input_type,
            options=RequestOptions.from_wire(body),
            chunking=chunking,
        )

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"items": [i.to_wire() for i in self.items],
                               "output_types": list(self.output_types),
                               "output_dtype": self.output_dtype, **self.options.to_wire()}
        if self.input_type is None:  # else the side is input_type's
            out["is_query"] = self.is_query
        if self.dims is not None:
            out["dims"] = self.dims
        if self.instruction is not None:
            out["instruction"] = self.instruction
        if self.input_type is not None:
            out["input_type"] = self.input_type
        if self.chunking is not None:
            out["chunking"] = self.chunking.to_wire()
        return out


@dataclass(slots=True)
class ScoreRequest:
    query: str
    items: list[Item]
    top_k: int | None = None
    options: RequestOptions = field(default_factory=RequestOptions)
    # Each item is cut to this many tokens first (Cohere's max_tokens_per_doc); the
    # model's own limit applies on top.
    max_tokens_per_doc: int | None = None
    # An image query (wire: ``"query": {"image": ...}``; image models): then ``query`` is "".
    query_image: bytes | None = None
    query_image_url: str | None = None  # or its URL, until the server's front fetches it

    @classmethod
    def from_wire(cls, body: Any) -> ScoreRequest:
        body = require_object(body)
        check_fields(body, SCORE_FIELDS)
        query = body.get("query")
        query_image: bytes | str | None = None
        if isinstance(query, Mapping):
            check_fields(query, {"image"}, "query")
            if "image" not in query:
                raise invalid_field("query.image", "is required in an image query")
            query_image, query = check_image_field(query["image"], "query.image"), ""
        if not isinstance(query, str):
            raise invalid_field("query", "is required and must be a string or {image}")
        top_k = optional_field(body, "top_k", int, None)
        if top_k is not None and top_k <= 0:
            raise invalid_field("top_k", "must be a positive integer")
        max_tokens = optional_field(body, "max_tokens_per_doc", int, None)
        if max_tokens is not None and max_tokens <= 0:
            raise invalid_field("max_tokens_per_doc", "must be a positive integer")
        items = _parse_items(body, images=True)  # an image query is not counted
        return cls(query=check_text(query, "query"), items=items, top_k=top_k,
                   max_tokens_per_doc=max_tokens, options=RequestOptions.from_wire(body),
                   query_image=query_image if isinstance(query_image, bytes) else None,
                   query_image_url=query_image if isinstance(query_image, str) else None)

    def to_wire(self) -> dict[str, Any]:
        picture = self.query_image if self.query_image is not None else self.query_image_url
        query: Any = self.query if picture is None else {"image": picture}
        out: dict[str, Any] = {"query": query, "items": [i.to_wire() for i in self.items],
                               **self.options.to_wire()}
        if self.top_k is not None:
            out["top_k"] = self.top_k
        if self.max_tokens_per_doc is not None:
            out["max_tokens_per_doc"] = self.max_tokens_per_doc
        return out


@dataclass(slots=True)
class ExtractRequest:
    items: list[Item]
    labels: list[str] | None = None
    threshold: float = 0.0
    options: RequestOptions = field(default_factory=RequestOptions)

    @classmethod
    def from_wire(cls, body: Any) -> ExtractRequest:
        body = require_object(body)
        check_fields(body, EXTRACT_FIELDS)
        labels = check_labels(optional_field(body, "labels", list, None))
        threshold = optional_field(body, "threshold", (int, float), 0.0)
        if not 0.0 <= threshold <= 1.0:
            raise invalid_field("threshold", "must be between 0 and 1")
        return cls(items=_parse_items(body), labels=labels, threshold=float(threshold),
                   options=RequestOptions.from_wire(body))

    def to_wire(self) -> dict[str, Any]:
        out: dict[str, Any] = {"items": [i.to_wire() for i in self.items],
                               "threshold": self.threshold, **self.options.to_wire()}
        if self.labels is not None:
            out["labels"] = self.labels
        return out


def check_labels(labels: list[Any] | None) -> list[str] | None:
    """extract's labels: 1 to MAX_LABELS non-empty strings of at most MAX_LABEL_CHARS
    characters each (422 INVALID_FIELD naming the field otherwise)."""
    if labels is None:
        return None
    if not 1 <= len(labels) <= MAX_LABELS:
        raise invalid_field("labels", f"must hold 1 to {MAX_LABELS} labels, got {len(labels)}")
    for i, label in enumerate(labels):
        if not isinstance(label, str) or not label:
            raise invalid_field(f"labels[{i}]", "must be a non-empty string")
        if len(label) > MAX_LABEL_CHARS:
            raise invalid_field(f"labels[{i}]", f"is {len(label)} characters, over the limit "
                                                f"of {MAX_LABEL_CHARS}")
    return labels


def check_outputs(model_id: str, supported: frozenset[str], req: EncodeRequest) -> None:
    """The output checks that need only the model's adapter (422 UNSUPPORTED_OUTPUT): the
    worker runs them, and the gateway too, so a bad request never reaches a queue."""
    unsupported = [t for t in req.output_types if t not in supported]
    if unsupported:
        raise HeronError(ErrorCode.UNSUPPORTED_OUTPUT,
                         f"output_types: model {model_id} does not produce "
                         f"{unsupported}; it supports {sorted(supported)}",
                         field="output_types")
    if "sparse" in req.output_types and req.output_dtype not in ("float32", "float16"):
        raise HeronError(ErrorCode.UNSUPPORTED_OUTPUT,
                         "output_dtype: sparse outputs are float32 or float16",
                         field="output_dtype")


def require_object(body: Any) -> Mapping[str, Any]:
    """The body as a mapping; 400 MALFORMED_BODY for anything else."""
    if not isinstance(body, Mapping):
        raise HeronError(ErrorCode.MALFORMED_BODY, "body must be an object")
    return body


def wire_array(array: np.ndarray, encoding: str) -> Any:
    """An array as it goes on the wire: itself (msgpack/JSON lists) or a base64 envelope."""
    if encoding == "base64":
        return {"b64": array_to_base64(array), "dtype": array.dtype.name,
                "shape": list(array.shape)}
    return array


@dataclass(frozen=True, slots=True)
class SparseVector:
    """A sparse embedding: what an adapter returns and what the SDK's results hold."""

    indices: np.ndarray  # vocabulary ids, int32, ascending
    values: np.ndarray  # float32 weights, aligned with indices

    def to_wire(self, encoding: str) -> dict[str, Any]:
        return {"indices": wire_array(self.indices, encoding),
                "values": wire_array(self.values, encoding)}

    def to_dict(self) -> dict[int, float]:
        return {int(i): float(v) for i, v in zip(self.indices, self.values, strict=True)}


@dataclass(frozen=True, slots=True)
class Entity:
    """One extracted span: what an adapter returns and what the SDK's results hold."""

    label: str
    text: str
    start: int  # character offsets into the item's text, end exclusive
    end: int
    score: float

    def to_wire(self) -> dict[str, Any]:
        return {"label": self.label, "text": self.text, "start": self.start, "end": self.end,
                "score": self.score}
