"""The contract between the HTTP front (heron.runtime.front) and what computes answers behind
it: the worker's local model registry (``heron serve``) or the gateway's pools over NATS. A
backend gets a parsed request and an ``InferenceCall`` and returns an ``Answer``, raises a
HeronError, or raises ``Provisioning`` while capacity is on its way."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Protocol

from heron.runtime.adapters import adapter_family
from heron.runtime.modelconfig import ModelConfig
from heron.runtime.token_calls import DecodeRequest, TokenizeRequest
from heron_sdk.errors import error_from_wire
from heron_sdk.types import EncodeRequest, ExtractRequest, ScoreRequest


@dataclass(frozen=True, slots=True)
class InferenceCall:
    """What a backend may need of the HTTP request beyond its parsed body."""

    headers: Mapping[str, str]  # the request's headers (a gateway routes by X-Heron-Pool)
    # Every item must succeed: an item's failure fails the call, and the answer carries no
    # per-item errors (an OpenAI embeddings body has nowhere to put them).
    all_or_nothing: bool = False
    # time.monotonic() when the server received the request: its deadline counts from here
    # (heron.runtime.received), not from when the handler ran.
    received_at: float = field(default_factory=time.monotonic)

    def remaining_s(self, timeout_s: float) -> float:
        """What is left of ``timeout_s`` counted from the request's arrival."""
        return timeout_s - (time.monotonic() - self.received_at)


@dataclass(slots=True)
class Answer:
    """A backend's answer to one call: the body to send, the model's id (metric label), and
    the phases it took, in order, for Server-Timing."""

    body: dict[str, Any]
    model_id: str
    phases: Mapping[str, float]  # phase -> seconds
    total_s: float | None = None  # the backend's own total; None: measured by the front


def settle_item_errors(body: Mapping[str, Any], call: InferenceCall) -> None:
    """An encode or extract answer with items that failed on their own (``{"error": ...}``
    rows, counted by ``errors``) stands when some items succeeded; otherwise, or when the
    call is all or nothing, the request fails with the first failed item's error."""
    errors = body.get("errors")
    if not errors:
        return
    items = body["items"]
    if call.all_or_nothing or errors >= len(items):
        raise error_from_wire(next(row["error"] for row in items if "error" in row))


class Provisioning(Exception):
    """No capacity for the model yet, and some is coming: answered 202 with Retry-After
    (not an error: the caller retries, and the SDK waits for it)."""

    def __init__(self, pool: str, bundle: str, estimated_wait_s: float,
                 retry_after_s: float) -> None:
        super().__init__(f"pool {pool} is provisioning")
        self.body = {"status": "provisioning", "pool": pool, "bundle": bundle,
                     "estimated_wait_s": estimated_wait_s}
        self.retry_after_s = retry_after_s


@dataclass(slots=True)
class Readiness:
    """A server's /readyz verdict; its body is the same shape on every server."""

    status: str  # "ready", "loading", "failed" (a preloaded model), "disconnected" (NATS)
    models: dict[str, str]  # model id -> state
    nats_connected: bool | None = None  # None: this server uses no NATS (`heron serve`)
    details: dict[str, Any] = field(default_factory=dict)  # what only this server knows

    @property
    def ready(self) -> bool:
        return self.status == "ready"

    def body(self) -> dict[str, Any]:
        out: dict[str, Any] = {"status": self.status, "models": self.models}
        if self.nats_connected is not None:
            out["nats_connected"] = self.nats_connected
        return {**out, **self.details}


class InferenceBackend(Protocol):
    """What serves the inference API behind the front: the worker's local model registry,
    or the gateway's pools over NATS. Errors are HeronErrors (the front maps them)."""

    telemetry_scope: str  # heron.runtime.telemetry.GATEWAY or .WORKER: spans are named so
    log: logging.Logger  # the request's summary line goes here

    async def encode(self, model: str, req: EncodeRequest, call: InferenceCall) -> Answer: ...

    async def score(self, model: str, req: ScoreRequest, call: InferenceCall) -> Answer: ...

    async def extract(self, model: str, req: ExtractRequest, call: InferenceCall
                      ) -> Answer: ...

    async def tokenize(self, model: str, req: TokenizeRequest, call: InferenceCall
                       ) -> Answer:
        """The model's tokens of each text (heron.runtime.token_calls), from the model's own
        tokenizer: the worker's, wherever the model is served (a gateway asks a worker of
        the pool). The model must be loaded (503 MODEL_LOADING starts its load)."""
        ...

    async def decode(self, model: str, req: DecodeRequest, call: InferenceCall) -> Answer:
        """The text of each sequence of token ids (heron.runtime.token_calls); 422 for an id
        outside the model's vocabulary."""
        ...

    async def provision(self, model: str, call: InferenceCall) -> Answer:
        """200 once the model can serve; else start getting it there (load, or workers)."""
        ...

    def models(self) -> list[dict[str, Any]]:
        """Every model, as ``model_description`` builds it."""
        ...

    def model(self, name: str) -> dict[str, Any]:
        """One model by id or alias (404 MODEL_NOT_FOUND)."""
        ...

    def readiness(self) -> Readiness: ...

    def canonical_id(self, name: str) -> str | None:
        """The model id a name or alias stands for; None for a name not served here."""
        ...

    def observe_request(self, route: str, model: str, status: int, seconds: float) -> None:
        """Per-request metrics: ``model`` is an id or ``_unknown``, never a client's name."""
        ...

    def metrics_text(self) -> bytes:
        """The Prometheus exposition for GET /metrics."""
        ...


def model_description(config: ModelConfig, *, state: str, bundle: str, pool: str | None,
                      **known: Any) -> dict[str, Any]:
    """A model as GET /v1/models shows it, on every server: its configuration, where it is
    served, its state, and what only a loaded model knows (``known``: device, dtype,
    dimensions, ...; None values are left out)."""
    family = adapter_family(config.adapter)
    tasks = family.tasks
    out: dict[str, Any] = {"id": config.id, "object": "model", "owned_by": "heron",
                           "adapter": config.adapter, "aliases": list(config.aliases),
                           "task": tasks[0], "tasks": list(tasks), "bundle": bundle,
                           "state": state}
    if pool is not None:
        out["pool"] = pool
    if family.output_types:
        out["output_types"] = sorted(family.output_types)
    if config.profile.max_sequence_length is not None:
        out["max_sequence_length"] = config.profile.max_sequence_length
    if config.description:
        out["description"] = config.description
    if config.loras:  # LoRA adapters a request may name
        out["loras"] = sorted(config.loras)
    out.update((key, value) for key, value in known.items() if value is not None)
    return out


