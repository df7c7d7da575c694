"""The JSON wire shapes of the config service's HTTP bodies: what its OpenAPI document
(config_service/routes.py, CONFIG_OPERATIONS) is generated from.

The POST body is parsed by heron.config_service.body.parse_posted, which reads the model
config with heron.runtime.modelconfig; the limits and enumerations here come from those
modules' constants, and tests/unit/test_openapi.py checks that every body the schema allows
is one the parser accepts (and the rest is refused). Kept apart from api_types.py, which
describes the inference API.
"""

from __future__ import annotations

from typing import Annotated, Literal, NotRequired, TypedDict

from heron.runtime.adapters import AUTO
from heron.runtime.api_types import METRICS_RESPONSES, error_statuses
from heron.runtime.json_schema import closed, schema
from heron.runtime.modelconfig import (
    ACTIVATIONS,
    ADAPTERS,
    DEFAULT_MAX_LORAS,
    DEVICES,
    MUVERA_MAX_K_SIM,
    PACKINGS,
    POOLINGS,
    PRECISIONS,
)
from heron_sdk.types import ADAPTER_NAME_PATTERN, MAX_INTEGER

# The rules of heron.config_service.body.check_name, as JSON Schema: segments of letters,
# digits and ._+- joined by '/', no '..', at most MAX_ID_CHARS characters. The constants are
# repeated (not imported) because the runtime never imports a service; the unit test
# compares them.
MAX_ID_CHARS = 200
_SEGMENT = r"[A-Za-z0-9_][A-Za-z0-9._+-]*"
MODEL_NAME_PATTERN = rf"^{_SEGMENT}(?:/{_SEGMENT})*$"
ModelName = Annotated[str, schema(
    minLength=1, maxLength=MAX_ID_CHARS, pattern=MODEL_NAME_PATTERN,
    **{"not": {"pattern": r"\.\."}},
    description="Segments of letters, digits and ._+- joined by '/'; no '..', spaces or "
                f"leading '/'; at most {MAX_ID_CHARS} characters.")]
AdapterName = Annotated[str, schema(enum=list(ADAPTERS))]
PositiveCount = Annotated[int, schema(minimum=1, maximum=MAX_INTEGER)]
NonEmpty = Annotated[str, schema(minLength=1)]


@closed
class WeightSourceBody(TypedDict):
    """Where the weights come from: exactly one of ``package``, ``path``, ``hub``."""

    package: NotRequired[NonEmpty]
    subdir: NotRequired[str]
    path: NotRequired[NonEmpty]
    hub: NotRequired[NonEmpty]
    revision: NotRequired[NonEmpty]


# "Exactly one of": a oneOf of the three required keys.
WeightSourceField = Annotated[WeightSourceBody, schema(
    oneOf=[{"required": ["package"]}, {"required": ["path"]}, {"required": ["hub"]}])]


@closed
class ProfileBody(TypedDict):
    """A profile's settings; a missing key takes its default (docs/models.md). null in
    pooling, normalize, the instructions and activation means what the checkpoint's own
    files say (heron/runtime/checkpoint.py)."""

    max_batch_tokens: NotRequired[Annotated[PositiveCount, schema(default=16384)]]
    max_batch_items: NotRequired[Annotated[PositiveCount, schema(default=128)]]
    max_wait_ms: NotRequired[Annotated[float, schema(minimum=0, maximum=MAX_INTEGER, default=5.0)]]
    max_sequence_length: NotRequired[PositiveCount | None]
    precision: NotRequired[Annotated[str, schema(enum=list(PRECISIONS), default="auto")]]
    device: NotRequired[Annotated[str, schema(enum=list(DEVICES), default="auto")]]
    # Nullable enums as one enum that holds null: schemathesis cannot negate an anyOf of
    # an enum and null (its negative mode failed 1 run in 3 on it).
    pooling: NotRequired[Annotated[str | None, schema(enum=[*POOLINGS, None], default=None)]]
    normalize: NotRequired[Annotated[bool | None, schema(default=None)]]
    query_instruction: NotRequired[Annotated[str | None, schema(default=None)]]
    document_instruction: NotRequired[Annotated[str | None, schema(default=None)]]
    activation: NotRequired[Annotated[str | None, schema(enum=[*ACTIVATIONS, None],
                                                         default=None)]]
    max_queue_items: NotRequired[Annotated[PositiveCount, schema(default=8192)]]
    packing: NotRequired[Annotated[str, schema(enum=list(PACKINGS), default="auto")]]
    # MUVERA encoding of a multi-vector model's output (the "muvera" output type).
    muvera_k_sim: NotRequired[Annotated[int, schema(minimum=1, maximum=MUVERA_MAX_K_SIM,
                                                    default=5)]]
    muvera_dim_proj: NotRequired[Annotated[PositiveCount, schema(default=16)]]
    muvera_repetitions: NotRequired[Annotated[PositiveCount, schema(default=20)]]
    muvera_seed: NotRequired[Annotated[PositiveCount, schema(default=42)]]


@closed
class ModelConfigBody(TypedDict):
    """POST /v1/configs/models: one model config (JSON, YAML or msgpack), plus the bundles
    to route it to. null in an optional field means its default."""

    id: ModelName
    adapter: NotRequired[Annotated[str | None, schema(
        enum=[*ADAPTERS, None], default=AUTO, description="The model family; absent, null or "
        "'auto': the worker reads the checkpoint's files and picks it.")]]
    source: WeightSourceField
    trust_remote_code: NotRequired[Annotated[bool | None, schema(
        default=False, description="Run the Python code the checkpoint ships (config.json "
        "auto_map) in every worker that serves it. Refused (422) unless the config service "
        "was started with --allow-remote-code.")]]
    profiles: NotRequired[Annotated[
        dict[str, ProfileBody | None] | None,
        schema(required=["default"], description="Profile name -> settings; must contain "
               "'default' (null or absent: one default profile with every default).")]]
    aliases: NotRequired[list[ModelName] | None]
    description: NotRequired[str | None]
    loras: NotRequired[Annotated[dict[str, WeightSourceField] | None, schema(
        propertyNames={"pattern": ADAPTER_NAME_PATTERN},
        description="LoRA adapters (PEFT format) a request may name: adapter name -> its "
        "source, in the shape of `source`.")]]
    max_loras: NotRequired[Annotated[PositiveCount | None, schema(
        default=DEFAULT_MAX_LORAS, description="LoRA adapters a worker keeps loaded at once "
        "for this model (least recently used unloaded first).")]]
    bundles: NotRequired[Annotated[list[NonEmpty] | None, schema(
        minItems=1, description="Bundles to route the model to; absent: every bundle that "
        "serves its adapter (every bundle for adapter 'auto').")]]


class PostAnswer(TypedDict):
    """201: a new epoch was made; 200: the content was already stored (``created`` false,
    ``epoch`` the one the model last changed)."""

    id: str
    epoch: int
    bundles: list[str]
    created: bool


# ---- reads ---------------------------------------------------------------------------------
class ModelConfigView(TypedDict):
    """A stored model config (ModelConfig.to_dict: every profile setting spelled out,
    but those left null, which the checkpoint decides)."""

    id: str
    adapter: AdapterName
    source: WeightSourceField
    profiles: dict[str, ProfileBody]
    aliases: NotRequired[list[str]]
    description: NotRequired[str]
    trust_remote_code: NotRequired[bool]  # present (true) only for a model that opted in
    loras: NotRequired[dict[str, WeightSourceField]]  # present only where there are some
    max_loras: NotRequired[PositiveCount]  # present only where not the default


class ModelConfigSummary(TypedDict):
    id: str
    adapter: AdapterName
    aliases: list[str]
    profiles: list[str]
    bundles: list[str]
    epoch: Annotated[int, schema(description="The epoch the model last changed (0: the "
                                             "bundles dir).")]


class ModelConfigList(TypedDict):
    """GET /v1/configs/models."""

    epoch: int
    models: list[ModelConfigSummary]


class ModelConfigAnswer(TypedDict):
    """GET /v1/configs/models/{model}: ``epoch`` is the one the model last changed."""

    epoch: int
    model: ModelConfigView
    bundles: list[str]


class ExportedBundle(TypedDict):
    adapters: list[AdapterName]
    models: list[str]
    hash: str


class ConfigExport(TypedDict):
    """GET /v1/configs/export: the snapshot followers bootstrap from."""

    epoch: int
    models: dict[str, ModelConfigView]
    bundles: dict[str, ExportedBundle]


class ConfigEpoch(TypedDict):
    """GET /v1/configs/epoch: what followers poll."""

    epoch: int
    bundles_hash: dict[str, str]


class BundleView(TypedDict):
    name: str
    adapters: list[AdapterName]
    models: list[str]
    hash: str
    description: str


class BundleList(TypedDict):
    epoch: int
    bundles: list[BundleView]


class BundleAnswer(BundleView):
    """GET /v1/configs/bundles/{name}: the bundle at the current epoch."""

    epoch: int


class ConfigStatus(TypedDict):
    """/healthz (``ok``) and /readyz (``ready``, or ``not ready`` with 503)."""

    status: Literal["ok", "ready", "not ready"]
    instance_id: str
    leader: bool
    leader_id: str | None
    epoch: int
    store: str
    store_loaded: bool
    nats_connected: bool
    last_error: str | None


# ---- what each route answers (ApiOperation.responses) -----------------------------------------
# 400/413/415/422 (the POST's body), 404 (a path names something) and 401/403 (the admin
# token) are added by the document itself.
POST_MODEL_RESPONSES: dict[int, type | None] = {
    200: PostAnswer, 201: PostAnswer, **error_statuses(409, 503)}
LIST_MODELS_RESPONSES: dict[int, type | None] = {200: ModelConfigList}
GET_MODEL_RESPONSES: dict[int, type | None] = {200: ModelConfigAnswer}
EXPORT_RESPONSES: dict[int, type | None] = {200: ConfigExport}
EPOCH_RESPONSES: dict[int, type | None] = {200: ConfigEpoch}
LIST_BUNDLES_RESPONSES: dict[int, type | None] = {200: BundleList}
GET_BUNDLE_RESPONSES: dict[int, type | None] = {200: BundleAnswer}
CONFIG_HEALTH_RESPONSES: dict[int, type | None] = {200: ConfigStatus}
CONFIG_READY_RESPONSES: dict[int, type | None] = {200: ConfigStatus, 503: ConfigStatus}
CONFIG_METRICS_RESPONSES = METRICS_RESPONSES
