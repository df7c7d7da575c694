"""The JSON wire shapes of Heron's HTTP bodies, as typed dicts: what the OpenAPI document
(heron/runtime/openapi.py) is generated from.

The servers parse requests with heron_sdk.types (``EncodeRequest.from_wire`` ...) and
heron/runtime/openai_compat.py; these types describe the same bodies for the document, with
the limits taken from the same constants. Every request body is ``@closed``: its parser
refuses a field it does not know (422), so the schema says ``additionalProperties: false``.
tests/unit/test_openapi.py checks that every body these schemas allow is one the parsers
accept. Under msgpack the shapes are the same, with numpy arrays where JSON has lists of
numbers.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired, TypedDict

from heron.runtime.json_schema import closed, schema
from heron_sdk.errors import STATUS_BY_CODE, ErrorCode
from heron_sdk.images import IMAGE_PATTERN, MAX_IMAGE_BYTES, MAX_IMAGES_PER_REQUEST
from heron_sdk.pools import MAX_POOL_WORKERS, MAX_TTL_S, MIN_TTL_S, POOL_NAME_RE
from heron_sdk.types import (
    ADAPTER_NAME_PATTERN,
    MAX_INTEGER,
    MAX_ITEMS_PER_REQUEST,
    MAX_LABEL_CHARS,
    MAX_LABELS,
    MAX_TEXT_CHARS,
    MIN_TIMEOUT_S,
    MODEL_ADAPTER_PATTERN,
)

# ---- requests ------------------------------------------------------------------------------
Text = Annotated[str, schema(maxLength=MAX_TEXT_CHARS,
                             description=f"At most {MAX_TEXT_CHARS:,} characters (413 past it).")]


@closed
class ItemObject(TypedDict):
    """An item with an id the result echoes (as a string)."""

    text: Text
    id: NotRequired[str | int | None]


Items = Annotated[list[Text | ItemObject], schema(
    minItems=1, maxItems=MAX_ITEMS_PER_REQUEST,
    description=f"1 to {MAX_ITEMS_PER_REQUEST} texts: strings or {{text, id}} objects "
                "(413 TOO_MANY_ITEMS past the limit).")]


@closed
class TokensObject(TypedDict):
    """An item given as the model's own token ids (no special tokens: the server adds the
    model's), in place of a text; encode only."""

    tokens: TokenIds
    id: NotRequired[str | int | None]


TokenIds = Annotated[list[Annotated[int, schema(minimum=0, maximum=MAX_INTEGER)]], schema(
    minItems=1, maxItems=MAX_TEXT_CHARS,
    description="The model's own token ids for one text, without special tokens.")]
ImageData = Annotated[str, schema(pattern=IMAGE_PATTERN, description=(
    f"An image file's bytes (PNG, JPEG, WebP, GIF, BMP) as standard padded base64, or a "
    f"data:image/<type>;base64, URL; under msgpack, the raw bytes. At most {MAX_IMAGE_BYTES:,} "
    f"bytes (413 IMAGE_TOO_LARGE). Or an http(s) URL of the image: refused (422 "
    f"IMAGE_URL_REFUSED) unless the server's operator allows its host (--image-url-hosts), "
    f"then fetched by the server (422 IMAGE_FETCH_FAILED when that fails)."))]


@closed
class ImageObject(TypedDict):
    """An image item (models with adapter clip: CLIP, SigLIP); encode and score."""

    image: ImageData
    id: NotRequired[str | int | None]


@closed
class ImageQuery(TypedDict):
    """An image as score's query (models with adapter clip)."""

    image: ImageData


_IMAGES = (f"; images at most {MAX_IMAGES_PER_REQUEST} per request (413 TOO_MANY_IMAGES), "
           "for image models only")
EncodeItems = Annotated[list[Text | ItemObject | TokensObject | ImageObject], schema(
    minItems=1, maxItems=MAX_ITEMS_PER_REQUEST,
    description=f"1 to {MAX_ITEMS_PER_REQUEST} texts: strings, {{text, id}} objects or "
                "{tokens, id} objects (413 TOO_MANY_ITEMS past the limit), or {image, id} "
                f"objects{_IMAGES}.")]
ScoreItems = Annotated[list[Text | ItemObject | ImageObject], schema(
    minItems=1, maxItems=MAX_ITEMS_PER_REQUEST,
    description=f"1 to {MAX_ITEMS_PER_REQUEST} texts: strings or {{text, id}} objects "
                f"(413 TOO_MANY_ITEMS past the limit), or {{image, id}} objects{_IMAGES}.")]
Encoding = Literal["float", "base64"]
OutputType = Literal["dense", "sparse", "multi_vector", "muvera"]
InputType = Literal["query", "document", "search_query", "search_document", "classification",
                    "clustering"]  # heron_sdk.types.INPUT_TYPES
OutputDtype = Literal["float32", "float16", "int8", "uint8", "binary"]
PositiveInt = Annotated[int, schema(minimum=1, maximum=MAX_INTEGER)]
ModelField = Annotated[str, schema(minLength=1, pattern=MODEL_ADAPTER_PATTERN, description=(
    "A model id or alias; model@adapter names a LoRA adapter of the model."))]


class RequestOptionsBody(TypedDict):
    """Options every inference request takes; null means the default."""

    truncate: NotRequired[Annotated[bool | None, schema(default=True)]]
    priority: NotRequired[Annotated[int | None, schema(minimum=0, maximum=MAX_INTEGER,
                                                          default=0)]]
    timeout_s: NotRequired[Annotated[float | None, schema(minimum=MIN_TIMEOUT_S)]]
    encoding: NotRequired[Annotated[Encoding | None, schema(default="float")]]
    adapter: NotRequired[Annotated[str | None, schema(
        pattern=ADAPTER_NAME_PATTERN, description="A LoRA adapter the model's config lists "
        "(404 ADAPTER_NOT_FOUND otherwise); null: the base model. model@adapter in the "
        "route says the same.")]]
    cache: NotRequired[Annotated[bool | None, schema(default=True, description=(
        "false: the worker's result cache is neither read nor written, and the items are "
        "computed for this request alone"))]]


@closed
class ChunkingBody(TypedDict):
    """encode's chunking: each text split into chunks with the model's own tokenizer, every
    chunk embedded as if sent alone (heron_sdk.chunking). Texts only: an item given as
    token ids or an image is 422."""

    max_tokens: NotRequired[Annotated[PositiveInt | None, schema(description=(
        "The model's tokens a chunk holds at most, without its special tokens and prompt; "
        "default (null): all the model takes. Over that: 422 INVALID_FIELD."))]]
    overlap: NotRequired[Annotated[int | None, schema(
        minimum=0, maximum=MAX_INTEGER, default=0, description=(
            "Tokens a chunk repeats of the one before it; less than max_tokens (else 422)."))]]
    strategy: NotRequired[Annotated[Literal["tokens", "sentences"] | None, schema(
        default="tokens", description=(
            "tokens: windows of max_tokens tokens, cut at word boundaries; sentences: whole "
            "sentences packed up to max_tokens (a longer sentence is cut by tokens)."))]]
    pool: NotRequired[Annotated[Literal["mean"] | None, schema(description=(
        "mean: the item's dense is also answered, the mean of its chunks' dense vectors "
        "(unit length when the model normalizes); needs dense in output_types."))]]


class EncodeOptionsBody(TypedDict):
    """What encode computes for each item: on POST /v1/encode and on a job."""

    output_types: NotRequired[Annotated[list[OutputType] | None, schema(
        minItems=1, default=["dense"])]]
    output_dtype: NotRequired[Annotated[OutputDtype | None, schema(default="float32")]]
    dims: NotRequired[PositiveInt | None]
    is_query: NotRequired[Annotated[bool | None, schema(default=False)]]
    instruction: NotRequired[str | None]
    input_type: NotRequired[Annotated[InputType | None, schema(description=(
        "The side of a search the texts are on, mapped to the model's own prompts: "
        "query and search_query encode as queries; document and search_document as "
        "documents; classification and clustering take the checkpoint's prompt of that "
        "name, else the document side. Given, it decides the side (is_query is not read)."))]]
    chunking: NotRequired[ChunkingBody | None]


@closed
class EncodeBody(RequestOptionsBody, EncodeOptionsBody):
    """POST /v1/encode/{model}."""

    items: EncodeItems


@closed
class ScoreBody(RequestOptionsBody):
    """POST /v1/score/{model}."""

    query: Text | ImageQuery
    items: ScoreItems
    top_k: NotRequired[PositiveInt | None]
    max_tokens_per_doc: NotRequired[Annotated[PositiveInt | None, schema(
        description="Each item is cut to this many tokens first; the model's own limit "
                    "applies on top.")]]


@closed
class ExtractBody(RequestOptionsBody):
    """POST /v1/extract/{model}."""

    items: Items
    labels: NotRequired[Annotated[list[Annotated[str, schema(
        minLength=1, maxLength=MAX_LABEL_CHARS)]] | None, schema(
        minItems=1, maxItems=MAX_LABELS,
        description="Entity types: kept ones for a token classifier; the prompt of a "
                    "zero-shot (gliner) model, which needs them.")]]
    threshold: NotRequired[Annotated[float | None, schema(minimum=0, maximum=1, default=0)]]


@closed
class EmbeddingsBody(TypedDict):
    """POST /v1/embeddings (OpenAI-compatible): OpenAI's fields; ``user`` is not used."""

    model: ModelField
    input: (Text | Annotated[list[Text], schema(minItems=1, maxItems=MAX_ITEMS_PER_REQUEST)]
            | TokenIds | Annotated[list[TokenIds], schema(
                minItems=1, maxItems=MAX_ITEMS_PER_REQUEST)])
    encoding_format: NotRequired[Annotated[Encoding | None, schema(default="float")]]
    dimensions: NotRequired[PositiveInt | None]
    user: NotRequired[Annotated[str | None, schema(
        description="OpenAI's end-user id: accepted, not used.")]]
    input_type: NotRequired[Annotated[InputType | None, schema(
        description="Heron's: the side of a search the texts are on (as on encode); the "
                    "openai client sends it in extra_body.")]]


class RerankDocumentObject(TypedDict):
    """A document as an object (Cohere v1, Jina): ``text`` is ranked; the other fields come
    back with it when ``return_documents`` is true."""

    text: Text


# Cohere's own limit of documents a rerank request (heron.runtime.rerank_api splits them).
MAX_RERANK_DOCUMENTS = 10_000
Documents = Annotated[list[Text], schema(minItems=1, maxItems=MAX_RERANK_DOCUMENTS)]


@closed
class RerankV2Body(TypedDict):
    """POST /v2/rerank (Cohere's v2)."""

    model: ModelField
    query: Text
    documents: Documents
    top_n: NotRequired[PositiveInt | None]
    return_documents: NotRequired[Annotated[bool | None, schema(default=False)]]
    max_tokens_per_doc: NotRequired[PositiveInt | None]
    priority: NotRequired[Annotated[int | None, schema(minimum=0, maximum=MAX_INTEGER,
                                                          default=0)]]


@closed
class RerankV1Body(TypedDict):
    """POST /v1/rerank (Cohere's v1, Jina's): documents may be objects with ``text``."""

    model: ModelField
    query: Text
    documents: Annotated[list[Text | RerankDocumentObject], schema(
        minItems=1, maxItems=MAX_RERANK_DOCUMENTS)]
    top_n: NotRequired[PositiveInt | None]
    return_documents: NotRequired[Annotated[bool | None, schema(default=False)]]
    rank_fields: NotRequired[Annotated[list[Literal["text"]] | None, schema(
        minItems=1, maxItems=1, description="Only ['text'].")]]
    max_chunks_per_doc: NotRequired[Annotated[Any, schema(
        description="Accepted; a document is never split (it is cut at the model's "
                    "limit, or at max_tokens_per_doc).")]]
    max_tokens_per_doc: NotRequired[PositiveInt | None]
    priority: NotRequired[Annotated[int | None, schema(minimum=0, maximum=MAX_INTEGER,
                                                          default=0)]]


# ---- inference responses ---------------------------------------------------------------------
class Base64Array(TypedDict):
    """An array under ``encoding: "base64"``: its raw little-endian bytes in base64."""

    b64: str
    dtype: Literal["float32", "float16", "int8", "uint8", "int32"]
    shape: list[int]


Vector = list[float] | Base64Array
Matrix = list[list[float]] | Base64Array


class SparseEmbedding(TypedDict):
    """Vocabulary ids (ascending) and their weights."""

    indices: list[int] | Base64Array
    values: Vector


class Usage(TypedDict):
    tokens: int


class TextChunk(TypedDict):
    """One chunk of a chunked item: ``text[start:end]`` (character offsets, end exclusive),
    its outputs (a key per requested output type) and its tokens (special ones and the
    prompt's included)."""

    start: int
    end: int
    dense: NotRequired[Vector]
    sparse: NotRequired[SparseEmbedding]
    multi_vector: NotRequired[Matrix]
    muvera: NotRequired[Vector]
    tokens: int
    cached: NotRequired[Annotated[bool, schema(description="As on an item.")]]


class EncodedItem(TypedDict):
    """One item's outputs: a key per requested output type. With chunking, ``chunks``
    holds them per chunk, and ``dense`` only with ``pool: "mean"``; ``tokens`` is then the
    chunks' sum."""

    dense: NotRequired[Vector]
    sparse: NotRequired[SparseEmbedding]
    multi_vector: NotRequired[Matrix]
    muvera: NotRequired[Vector]
    chunks: NotRequired[list[TextChunk]]
    tokens: int
    truncated: bool
    id: NotRequired[str]
    cached: NotRequired[Annotated[bool, schema(description=(
        "Present (true) when the item was not computed for this request: served from the "
        "worker's result cache, or shared with an identical item computed at the same time"))]]


class ErrorDetail(TypedDict):
    code: ErrorCode
    message: str
    field: NotRequired[str]


class ErrorBody(TypedDict):
    """Every error answer."""

    error: ErrorDetail


class ItemError(TypedDict):
    """An item that failed on its own, in its place: an image its model could not decode
    (its 4xx: IMAGE_INVALID, IMAGE_TOO_LARGE), or, from a gateway, an item of a slice that
    failed server-side (5xx). The request fails instead when no item succeeded."""

    error: ErrorDetail
    id: NotRequired[str]


class EncodeResponse(TypedDict):
    model: str
    items: list[EncodedItem | ItemError]
    usage: Usage
    errors: NotRequired[Annotated[int, schema(description="Items that failed on their own.")]]


class ScoredDocument(TypedDict):
    index: int
    score: float
    rank: int
    id: NotRequired[str]
    truncated: NotRequired[bool]


class ScoreResponse(TypedDict):
    """Results best first; top_k keeps the best."""

    model: str
    results: list[ScoredDocument]
    usage: Usage


class EntitySpan(TypedDict):
    label: str
    text: str
    start: int
    end: int
    score: float


class ExtractedItem(TypedDict):
    entities: list[EntitySpan]
    tokens: int
    truncated: bool
    id: NotRequired[str]


class ExtractResponse(TypedDict):
    model: str
    items: list[ExtractedItem | ItemError]
    usage: Usage
    errors: NotRequired[int]


class EmbeddingData(TypedDict):
    object: Literal["embedding"]
    index: int
    embedding: Annotated[list[float] | str, schema(
        description="float: a list; base64: the little-endian float32 bytes.")]


class EmbeddingsUsage(TypedDict):
    prompt_tokens: int
    total_tokens: int


class EmbeddingsResponse(TypedDict):
    object: Literal["list"]
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingsUsage


class ProvisioningBody(TypedDict):
    """202 from a gateway: the pool has no healthy worker yet; retry after Retry-After."""

    status: Literal["provisioning"]
    pool: str
    bundle: str
    estimated_wait_s: float


# ---- models, health ------------------------------------------------------------------------
ModelState = Literal["not_loaded", "loading", "ready", "failed", "no_workers"]


class ModelInfo(TypedDict):
    """A model as /v1/models shows it; the load-time fields appear once it is loaded."""

    id: str
    object: Literal["model"]
    owned_by: str
    adapter: str
    aliases: list[str]
    state: ModelState
    task: NotRequired[str]
    tasks: NotRequired[list[str]]
    output_types: NotRequired[list[OutputType]]
    max_sequence_length: NotRequired[int]
    device: NotRequired[str]
    dtype: NotRequired[str]
    dimensions: NotRequired[int]
    # What the worker read from the checkpoint's files (heron/runtime/checkpoint.py) and
    # made of it with the profile: pooling, normalization, prompts, packing.
    detected: NotRequired[dict[str, Any]]
    pooling: NotRequired[str]
    normalize: NotRequired[bool]
    prompts: NotRequired[dict[str, str]]
    packed: NotRequired[bool]
    packing_refused: NotRequired[str]
    error: NotRequired[str]
    bundle: NotRequired[str]
    pool: NotRequired[str]
    description: NotRequired[str]
    loras: NotRequired[Annotated[list[str], schema(
        description="The LoRA adapters a request may name (adapter, model@adapter).")]]


class ModelList(TypedDict):
    object: Literal["list"]
    data: list[ModelInfo]


class ProvisionAnswer(TypedDict):
    """200 of /v1/models/{model}/provision: the model is loaded and warm."""

    model: str
    state: Literal["ready"]
    pool: NotRequired[str]
    healthy_workers: NotRequired[int]


class HealthBody(TypedDict):
    status: Literal["ok"]


class GatewayPoolStatus(TypedDict):
    bundle: str
    kind: Literal["lease", "static"]
    healthy_workers: int
    outstanding_items: int


class ReadinessBody(TypedDict):
    """/readyz: 200 once the server takes inference requests, else 503 with Retry-After.
    ``status`` is loading while models warm up, failed when a preloaded model failed, and
    disconnected while NATS is away (cluster processes)."""

    status: Literal["ready", "loading", "failed", "disconnected"]
    models: dict[str, ModelState]
    nats_connected: NotRequired[bool]
    # gateway only
    registry_loaded: NotRequired[bool]
    gateway_id: NotRequired[str]
    pools: NotRequired[dict[str, GatewayPoolStatus]]
    error: NotRequired[str]


# ---- pools (gateway) -----------------------------------------------------------------------
PoolName = Annotated[str, schema(pattern=POOL_NAME_RE.pattern)]
TtlSeconds = Annotated[float, schema(minimum=MIN_TTL_S, maximum=MAX_TTL_S)]


@closed
class PoolCreateBody(TypedDict):
    """POST /v1/pools: lease a pool of workers serving ``bundle``."""

    name: PoolName
    bundle: Annotated[str, schema(minLength=1)]
    workers: NotRequired[Annotated[int, schema(minimum=0, maximum=MAX_POOL_WORKERS)]]
    ttl_s: NotRequired[TtlSeconds]


@closed
class PoolRenewBody(TypedDict):
    """POST /v1/pools/{name}/renew; an empty body keeps the lease's TTL."""

    ttl_s: NotRequired[TtlSeconds]


class PoolView(TypedDict):
    name: str
    bundle: str
    kind: Literal["lease", "static"]
    state: Literal["ready", "provisioning"]
    healthy_workers: int
    workers: NotRequired[int]
    ttl_s: NotRequired[float]
    created_at: NotRequired[float]
    renewed_at: NotRequired[float]
    expires_at: NotRequired[float]
    expires_in_s: NotRequired[float]


class PoolList(TypedDict):
    object: Literal["list"]
    data: list[PoolView]


class PoolDeleted(TypedDict):
    name: str
    deleted: Literal[True]


# ---- bulk jobs (gateway) ---------------------------------------------------------------------
# heron_sdk.jobs.JobSpec.from_wire is the parser; the options are encode's (EncodeBody),
# less priority, timeout_s and encoding, which are the job's own.
NonEmpty = Annotated[str, schema(minLength=1)]


@closed
class JobInputBody(TypedDict):
    """Where the rows come from: file:///path under HERON_JOB_ROOTS, or s3://bucket/key
    of a bucket on HERON_JOB_BUCKETS (403 JOB_PATH_FORBIDDEN otherwise)."""

    uri: NonEmpty
    format: Literal["jsonl", "parquet", "csv"]
    text_field: NotRequired[Annotated[NonEmpty, schema(default="text")]]
    id_field: NotRequired[Annotated[NonEmpty, schema(
        description="The column of each row's id; absent: a row's id is its number.")]]


@closed
class JobOutputBody(TypedDict):
    uri: NonEmpty
    format: Literal["parquet", "jsonl", "npy"]


@closed
class JobCreateBody(EncodeOptionsBody):
    """POST /v1/jobs: encode every row of ``input`` into ``output``."""

    model: NonEmpty
    task: NotRequired[Annotated[Literal["encode"], schema(default="encode")]]
    input: JobInputBody
    output: JobOutputBody
    truncate: NotRequired[Annotated[bool | None, schema(default=True)]]
    adapter: NotRequired[Annotated[str | None, schema(pattern=ADAPTER_NAME_PATTERN)]]
    cache: NotRequired[Annotated[bool | None, schema(default=True)]]


class JobView(TypedDict):
    id: str
    object: Literal["job"]
    model: str
    task: str
    state: Literal["queued", "running", "succeeded", "failed", "cancelled"]
    rows_total: int | None
    rows_done: int
    rows_failed: int
    shards_total: int | None
    shards_done: int
    rows_per_s: float | None
    eta_s: float | None
    input: dict[str, Any]
    output: dict[str, Any]
    output_uri: str
    created_at: float
    started_at: float | None
    finished_at: float | None
    updated_at: float
    runs: int  # how many times a gateway has taken it (more than 1: taken over)
    error: ErrorDetail | None


class JobList(TypedDict):
    object: Literal["list"]
    data: list[JobView]


def error_statuses(*statuses: int) -> dict[int, type]:
    """``{status: ErrorBody}`` for ``responses`` of an ApiOperation; every status must be
    one heron_sdk.errors gives some code."""
    known = set(STATUS_BY_CODE.values())
    unknown = [s for s in statuses if s not in known]
    if unknown:
        raise ValueError(f"no error code answers {unknown}")
    return dict.fromkeys(statuses, ErrorBody)


class RerankResult(TypedDict):
    index: int
    relevance_score: float
    document: NotRequired[dict[str, Any]]


class RerankMeta(TypedDict):
    api_version: dict[str, str]
    billed_units: dict[str, int]


class RerankUsage(TypedDict):
    total_tokens: int
    prompt_tokens: int


class RerankResponse(TypedDict):
    """Cohere's rerank answer (on /v1/rerank also Jina's ``model`` and ``usage``)."""

    id: str
    results: list[RerankResult]
    meta: RerankMeta
    model: NotRequired[str]
    usage: NotRequired[RerankUsage]


class RerankErrorBody(TypedDict):
    """An error on the rerank routes: Cohere's ``message`` and Jina's ``detail`` (the same
    text), Heron's code lowercased, and the field at fault."""

    message: str
    detail: str
    code: str
    param: str | None


class OpenAIErrorDetail(TypedDict):
    message: str
    type: str  # invalid_request_error, authentication_error, rate_limit_error, server_error...
    param: str | None  # the field at fault
    code: str  # Heron's error code, lowercased


class OpenAIErrorBody(TypedDict):
    """An error on the OpenAI-compatible route, in OpenAI's shape."""

    error: OpenAIErrorDetail


# ---- what each inference route answers (ApiOperation.responses) -----------------------------
# 400/413/415/422 (a body is read), 404 (a path names a model) and 401/403 (API keys) are
# added by the document itself; 202 comes from a gateway only.
_INFERENCE_ERRORS = error_statuses(404, 429, 500, 502, 503, 504)
ENCODE_RESPONSES: dict[int, type | None] = {200: EncodeResponse, 202: ProvisioningBody,
                                            **_INFERENCE_ERRORS}
SCORE_RESPONSES: dict[int, type | None] = {200: ScoreResponse, 202: ProvisioningBody,
                                           **_INFERENCE_ERRORS}
EXTRACT_RESPONSES: dict[int, type | None] = {200: ExtractResponse, 202: ProvisioningBody,
                                             **_INFERENCE_ERRORS}
EMBEDDINGS_RESPONSES: dict[int, type | None] = {200: EmbeddingsResponse,
                                                202: ProvisioningBody, **_INFERENCE_ERRORS}
PROVISION_RESPONSES: dict[int, type | None] = {
    200: ProvisionAnswer, 202: ProvisioningBody, **error_statuses(404, 500, 502, 503)}
MODEL_LIST_RESPONSES: dict[int, type | None] = {200: ModelList}
MODEL_RESPONSES: dict[int, type | None] = {200: ModelInfo}
HEALTH_RESPONSES: dict[int, type | None] = {200: HealthBody}
READY_RESPONSES: dict[int, type | None] = {200: ReadinessBody, 503: ReadinessBody}
METRICS_RESPONSES: dict[int, type | None] = {200: str}  # Prometheus text exposition
