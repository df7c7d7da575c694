"""The bodies of the TEI routes (heron.runtime.tei_api): their wire shapes as typed dicts, for
the OpenAPI document, and their parsers, which take exactly what those shapes allow.

The shapes are Text Embeddings Inference's (router/src/http/types.rs), narrowed where Heron
cannot do what TEI would: ``inputs`` are texts (TEI also takes token ids: a whole encoding
it tokenizes again), ``truncation_direction`` is ``right`` only (Heron cuts a text's end),
``raw_scores`` is ``false`` only (scores go through the model's activation),
``prompt_name`` names a side of a search, and /predict takes [text, text] pairs (Heron serves
no sequence classifiers). A body also takes ``model``, which picks the model (TEI's bodies
name none: its server has one). Unknown fields are refused (422), as on Heron's own routes.
A value Heron refuses gets a 4xx that says so, never an answer computed some other way.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Annotated, Any, Literal, NotRequired, TypedDict

from heron.runtime.api_types import PositiveInt, Text, TokenIds
from heron.runtime.json_schema import closed, schema
from heron_sdk.errors import ErrorCode, HeronError, invalid_field
from heron_sdk.types import (
    MAX_INTEGER,
    MAX_ITEMS_PER_REQUEST,
    Item,
    check_fields,
    check_text,
    check_token_ids,
    integral,
    optional_field,
    require_object,
)

# TEI's prompt_name names a prompt of the checkpoint's sentence-transformers config; Heron
# takes the names of a search's sides (heron_sdk.types.INPUT_TYPES, plus the other names
# sentence-transformers uses for documents) and applies the model's prompt for that side.
PROMPT_NAMES: dict[str, str] = {
    "query": "query", "search_query": "search_query", "document": "document",
    "passage": "document", "corpus": "document", "search_document": "search_document",
    "classification": "classification", "clustering": "clustering"}
PromptName = Literal["query", "search_query", "document", "passage", "corpus",
                     "search_document", "classification", "clustering"]
TruncationDirection = Annotated[Literal["right", "Right"], schema(
    description="Only the end of a text is cut (left: 422).")]
ModelName = Annotated[str, schema(minLength=1, description=(
    "Heron's: the model (id or alias) to use; absent, the server's --default-model, or the "
    "one model that can answer."))]
# TEI also takes token ids here, a whole encoding (special tokens included) that it decodes
# and tokenizes again; Heron refuses them (422; /v1/encode takes ids without special tokens).
TeiInput = Annotated[Text | Annotated[list[Text], schema(
    minItems=1, maxItems=MAX_ITEMS_PER_REQUEST)], schema(
    description="A text, or a batch of texts (token ids: 422, see /v1/encode).")]
Pair = Annotated[list[Text], schema(minItems=2, maxItems=2)]
_EMPTY = 400  # TEI's "Empty" error: a batch with nothing in it


# ---- request bodies ---------------------------------------------------------------------------
@closed
class TeiEmbedBody(TypedDict):
    """POST /embed (and POST / with ``inputs``)."""

    inputs: TeiInput
    truncate: NotRequired[Annotated[bool | None, schema(default=True)]]
    truncation_direction: NotRequired[TruncationDirection | None]
    prompt_name: NotRequired[PromptName | None]
    normalize: NotRequired[Annotated[bool | None, schema(default=True)]]
    dimensions: NotRequired[PositiveInt | None]
    encoding_format: NotRequired[Literal["float"] | None]
    model: NotRequired[ModelName | None]


@closed
class TeiEmbedSparseBody(TypedDict):
    """POST /embed_sparse."""

    inputs: TeiInput
    truncate: NotRequired[Annotated[bool | None, schema(default=True)]]
    truncation_direction: NotRequired[TruncationDirection | None]
    prompt_name: NotRequired[PromptName | None]
    model: NotRequired[ModelName | None]


@closed
class TeiRerankBody(TypedDict):
    """POST /rerank (and POST / with ``query``)."""

    query: Text
    texts: Annotated[list[Text], schema(minItems=1, maxItems=MAX_ITEMS_PER_REQUEST)]
    truncate: NotRequired[Annotated[bool | None, schema(default=True)]]
    truncation_direction: NotRequired[TruncationDirection | None]
    raw_scores: NotRequired[Annotated[Literal[False] | None, schema(
        description="Only false: scores go through the model's activation.")]]
    return_text: NotRequired[Annotated[bool | None, schema(default=False)]]
    model: NotRequired[ModelName | None]


@closed
class TeiPredictBody(TypedDict):
    """POST /predict: [text, text] pairs, scored by a cross-encoder."""

    inputs: Pair | Annotated[list[Pair], schema(minItems=1, maxItems=MAX_ITEMS_PER_REQUEST)]
    truncate: NotRequired[Annotated[bool | None, schema(default=True)]]
    truncation_direction: NotRequired[TruncationDirection | None]
    raw_scores: NotRequired[Annotated[Literal[False] | None, schema(
        description="Only false: scores go through the model's activation.")]]
    model: NotRequired[ModelName | None]


@closed
class TeiTokenizeBody(TypedDict):
    """POST /tokenize."""

    inputs: Text | Annotated[list[Text], schema(minItems=1, maxItems=MAX_ITEMS_PER_REQUEST)]
    add_special_tokens: NotRequired[Annotated[bool | None, schema(default=True)]]
    prompt_name: NotRequired[PromptName | None]
    model: NotRequired[ModelName | None]


@closed
class TeiDecodeBody(TypedDict):
    """POST /decode."""

    ids: TokenIds | Annotated[list[TokenIds], schema(minItems=1,
                                                     maxItems=MAX_ITEMS_PER_REQUEST)]
    skip_special_tokens: NotRequired[Annotated[bool | None, schema(default=True)]]
    model: NotRequired[ModelName | None]


# ---- answers ----------------------------------------------------------------------------------
class TeiSparseValue(TypedDict):
    index: int
    value: float


class TeiRank(TypedDict):
    index: int
    score: float
    text: NotRequired[str]


class TeiPrediction(TypedDict):
    score: float
    label: str


class TeiToken(TypedDict):
    """One token: ``text`` is the input's own characters (a special token's own text), and
    ``start``/``stop`` byte offsets into the input as the model saw it (None: special)."""

    id: int
    text: str
    special: bool
    start: int | None
    stop: int | None


class TeiModelType(TypedDict):
    """TEI's model type: one key, ``embedding`` ({pooling}) or ``reranker`` ({id2label,
    label2id}); Heron's extraction models are ``token_classifier``."""

    embedding: NotRequired[dict[str, Any]]
    reranker: NotRequired[dict[str, Any]]
    token_classifier: NotRequired[dict[str, Any]]


class TeiInfo(TypedDict):
    """GET /info: TEI's fields, for the model POST / uses (null where unknown: no model can
    be named, or a gateway's workers have not reported it)."""

    model_id: str | None
    model_sha: None
    model_dtype: str | None
    served_model_name: str | None
    model_type: TeiModelType | None
    max_concurrent_requests: int | None
    max_input_length: int | None
    max_batch_tokens: int | None
    max_batch_requests: int | None
    max_client_batch_size: int
    auto_truncate: bool
    tokenization_workers: int | None
    version: str
    sha: str | None
    docker_label: str | None


ErrorType = Literal["Unhealthy", "Backend", "Overloaded", "Validation", "Tokenizer", "Empty"]


class TeiError(TypedDict):
    """TEI's error body."""

    error: str
    error_type: ErrorType


# ---- parsing ------------------------------------------------------------------------------------
@dataclass(slots=True)
class TeiCall:
    """A parsed TEI body: what every route reads, and each route's own fields."""

    model: str | None = None
    items: list[Item] | None = None  # inputs or texts, as Heron items
    truncate: bool = True
    input_type: str | None = None  # heron_sdk.types.INPUT_TYPES key, from prompt_name
    normalize: bool = True
    dims: int | None = None
    query: str = ""
    return_text: bool = False
    pairs: list[tuple[str, str]] | None = None
    single: bool = False  # predict: one pair, answered unwrapped
    add_special_tokens: bool = True
    sequences: list[tuple[int, ...]] | None = None
    skip_special_tokens: bool = True


def empty(name: str) -> HeronError:
    """TEI's 400 ``Empty``: a list with nothing in it."""
    return HeronError(ErrorCode.INVALID_FIELD, f"`{name}` cannot be empty", field=name,
                      status=_EMPTY)


def _object(body: Any, fields: Any) -> Mapping[str, Any]:
    check_fields(require_object(body), frozenset(fields))
    return body


def _batch(raw: Any, name: str) -> list[Any]:
    if not raw:
        raise empty(name)
    if len(raw) > MAX_ITEMS_PER_REQUEST:
        raise HeronError(ErrorCode.TOO_MANY_ITEMS, f"batch size {len(raw)} > maximum "
                         f"allowed batch size {MAX_ITEMS_PER_REQUEST}", field=name)
    return raw


def _is_id(value: Any) -> bool:
    value = integral(value)
    return isinstance(value, int) and not isinstance(value, bool)


def _common(body: Mapping[str, Any], call: TeiCall) -> None:
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise invalid_field("model", "must be a non-empty string")
    call.model = model
    call.truncate = optional_field(body, "truncate", bool, True)
    direction = body.get("truncation_direction")
    if direction is not None and direction not in ("right", "Right"):
        raise invalid_field("truncation_direction", "only 'right' is supported: Heron cuts "
                            "the end of a text that is too long")
    name = body.get("prompt_name")
    if name is not None:
        if not isinstance(name, str) or name not in PROMPT_NAMES:
            raise invalid_field("prompt_name", f"must be one of {list(PROMPT_NAMES)} (the "
                                "model's prompt for that side of a search is applied)")
        call.input_type = PROMPT_NAMES[name]
    raw_scores = body.get("raw_scores")
    if raw_scores is not None and raw_scores is not False:  # (0 == False: not a boolean)
        raise invalid_field("raw_scores", "only false is supported: scores go through the "
                            "model's activation")


_NO_IDS = ("token-id input is not supported on the TEI routes (TEI takes a whole encoding, "
           "special tokens included); send texts, or ids without special tokens to "
           "/v1/encode as {\"tokens\": [...]}")


def _inputs(body: Mapping[str, Any]) -> list[Item]:
    raw = body.get("inputs")
    if isinstance(raw, str):
        return [Item(check_text(raw, "inputs"))]
    if not isinstance(raw, list):
        raise invalid_field("inputs", "is required: a string or a list of strings")
    if raw and all(_is_id(t) for t in raw):
        raise invalid_field("inputs", _NO_IDS)
    items = []
    for i, entry in enumerate(_batch(raw, "inputs")):
        if isinstance(entry, str):
            items.append(Item(check_text(entry, f"inputs[{i}]")))
        elif isinstance(entry, list) and entry and all(_is_id(t) for t in entry):
            raise invalid_field(f"inputs[{i}]", _NO_IDS)
        else:
            raise invalid_field(f"inputs[{i}]", "must be a string")
    return items


def parse_embed(body: Any) -> TeiCall:
    body = _object(body, TeiEmbedBody.__annotations__)
    call = TeiCall()
    _common(body, call)
    call.items = _inputs(body)
    call.normalize = optional_field(body, "normalize", bool, True)
    dims = integral(body.get("dimensions"))
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int)
                             or not 0 < dims <= MAX_INTEGER):
        raise invalid_field("dimensions", f"must be an integer from 1 to {MAX_INTEGER}")
    call.dims = dims
    if body.get("encoding_format") not in (None, "float"):
        raise invalid_field("encoding_format", "only 'float' is supported here")
    return call


def parse_embed_sparse(body: Any) -> TeiCall:
    body = _object(body, TeiEmbedSparseBody.__annotations__)
    call = TeiCall()
    _common(body, call)
    call.items = _inputs(body)
    return call


def parse_rerank(body: Any) -> TeiCall:
    body = _object(body, TeiRerankBody.__annotations__)
    call = TeiCall()
    _common(body, call)
    query = body.get("query")
    if not isinstance(query, str):
        raise invalid_field("query", "is required and must be a string")
    call.query = check_text(query, "query")
    texts = body.get("texts")
    if not isinstance(texts, list):
        raise invalid_field("texts", "is required and must be a list of strings")
    items = []
    for i, text in enumerate(_batch(texts, "texts")):
        if not isinstance(text, str):
            raise invalid_field(f"texts[{i}]", "must be a string")
        items.append(Item(check_text(text, f"texts[{i}]")))
    call.items = items
    call.return_text = optional_field(body, "return_text", bool, False)
    return call


def _pair(value: Any, name: str) -> tuple[str, str]:
    if (not isinstance(value, list) or len(value) != 2
            or not all(isinstance(t, str) for t in value)):
        raise invalid_field(name, "must be a [text, text] pair (Heron's /predict scores "
                            "pairs with a cross-encoder)")
    return check_text(value[0], f"{name}[0]"), check_text(value[1], f"{name}[1]")


def parse_predict(body: Any) -> TeiCall:
    body = _object(body, TeiPredictBody.__annotations__)
    call = TeiCall()
    _common(body, call)
    raw = body.get("inputs")
    if not isinstance(raw, list):
        raise invalid_field("inputs", "is required: a [text, text] pair or a list of them")
    if raw and all(isinstance(t, str) for t in raw):
        call.pairs, call.single = [_pair(raw, "inputs")], True
    else:
        call.pairs = [_pair(p, f"inputs[{i}]") for i, p in enumerate(_batch(raw, "inputs"))]
    return call


def parse_tokenize(body: Any) -> TeiCall:
    body = _object(body, TeiTokenizeBody.__annotations__)
    call = TeiCall()
    _common(body, call)
    call.items = _inputs(body)
    call.add_special_tokens = optional_field(body, "add_special_tokens", bool, True)
    return call


def parse_decode(body: Any) -> TeiCall:
    body = _object(body, TeiDecodeBody.__annotations__)
    call = TeiCall()
    _common(body, call)
    raw = body.get("ids")
    if not isinstance(raw, list):
        raise invalid_field("ids", "is required: token ids, or a list of them")
    if raw and all(_is_id(t) for t in raw):
        call.sequences = [check_token_ids(raw, "ids")]
    else:
        call.sequences = [check_token_ids(ids, f"ids[{i}]")
                          for i, ids in enumerate(_batch(raw, "ids"))]
    call.skip_special_tokens = optional_field(body, "skip_special_tokens", bool, True)
    return call


def parse_root(body: Any) -> tuple[str, TeiCall]:
    """POST /: a rerank body (it has ``query`` or ``texts``) or an embed body."""
    if isinstance(body, Mapping) and ("query" in body or "texts" in body):
        return "rerank", parse_rerank(body)
    return "embed", parse_embed(body)
