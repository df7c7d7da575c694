"""Cohere's rerank routes (``POST /v2/rerank``, ``POST /v1/rerank``) and Jina's shape of
``/v1/rerank``, in their own request, response and error shapes, over the backend's
``score``: a cross-encoder scores each pair, a bi-encoder ranks by cosine, a multi-vector
model by MaxSim (the model's own task decides, as on ``/v1/score``).

Cohere and Jina both post to ``/v1/rerank`` with nearly the same body; the answer carries
what each client reads (Cohere's ``id``, ``results`` and ``meta``; Jina's ``model`` and
``usage``). Where they differ, Cohere's default wins: ``return_documents`` is false unless
asked for (Jina's default is true)."""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from heron.runtime import api_types as api
from heron.runtime.backend import Answer
from heron.runtime.http import request_id_of
from heron.runtime.modelconfig import split_adapter
from heron.runtime.openapi import ApiOperation
from heron_sdk.errors import ErrorCode, HeronError, invalid_field
from heron_sdk.types import (
    MAX_ITEMS_PER_REQUEST,
    Item,
    RequestOptions,
    ScoreRequest,
    check_fields,
    check_text,
    optional_field,
    require_object,
)

if TYPE_CHECKING:
    from heron.runtime.front import InferenceFront

# Documents past api.MAX_RERANK_DOCUMENTS (Cohere's limit) are refused; each call to the
# backend takes MAX_ITEMS_PER_REQUEST of them.
MAX_DOCUMENTS = api.MAX_RERANK_DOCUMENTS
# Cohere bills one search unit per query and up to 100 documents.
DOCUMENTS_PER_SEARCH_UNIT = 100
V1_FIELDS = frozenset({"model", "query", "documents", "top_n", "return_documents",
                       "rank_fields", "max_chunks_per_doc", "max_tokens_per_doc", "priority"})
V2_FIELDS = frozenset({"model", "query", "documents", "top_n", "return_documents",
                       "max_tokens_per_doc", "priority"})


@dataclass(slots=True)
class RerankCall:
    """A rerank body, parsed: what to score, and what the answer shows."""

    model: str
    query: str
    documents: list[Any]  # as sent (strings or objects): return_documents echoes them
    texts: list[str]
    top_n: int | None
    return_documents: bool
    max_tokens_per_doc: int | None
    priority: int
    adapter: str | None = None  # a LoRA adapter of the model ("model@adapter")


def parse_rerank(body: Any, version: int) -> RerankCall:
    """A Cohere (v1 or v2) or Jina rerank body; HeronError naming the field otherwise."""
    body = require_object(body)
    check_fields(body, V1_FIELDS if version == 1 else V2_FIELDS)
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_field("model", "is required and must be a string")
    query = body.get("query")
    if not isinstance(query, str):
        raise invalid_field("query", "is required and must be a string")
    documents = body.get("documents")
    if not isinstance(documents, list) or not documents:
        raise invalid_field("documents", "must be a non-empty list of strings"
                            + (" or {text} objects" if version == 1 else ""))
    if len(documents) > MAX_DOCUMENTS:
        raise HeronError(ErrorCode.TOO_MANY_ITEMS, f"documents: {len(documents)} is over the "
                         f"limit of {MAX_DOCUMENTS}", field="documents")
    rank_fields = body.get("rank_fields")
    if rank_fields is not None and rank_fields != ["text"]:
        raise invalid_field("rank_fields", "only ['text'] is supported: put what to rank on "
                            "in each document's text")
    texts = [_document_text(d, i, version) for i, d in enumerate(documents)]
    named = RequestOptions()
    model = split_adapter(model, named)  # "model@adapter": a LoRA adapter of the model
    return RerankCall(model=model, query=check_text(query, "query"), documents=documents,
                      texts=texts, top_n=_positive(body, "top_n"),
                      return_documents=optional_field(body, "return_documents", bool, False),
                      max_tokens_per_doc=_positive(body, "max_tokens_per_doc"),
                      # Heron's own rule for priority (0 is the highest, never negative)
                      priority=RequestOptions.from_wire(body).priority,
                      adapter=named.adapter)


def _document_text(document: Any, index: int, version: int) -> str:
    where = f"documents[{index}]"
    if isinstance(document, str):
        return check_text(document, where)
    if version == 1 and isinstance(document, Mapping):
        text = document.get("text")
        if not isinstance(text, str):
            raise invalid_field(f"{where}.text", "is required and must be a string")
        return check_text(text, f"{where}.text")
    raise invalid_field(where, "must be a string" + (" or a {text} object" if version == 1
                                                      else ""))


def _positive(body: Mapping[str, Any], name: str) -> int | None:
    value = optional_field(body, name, int, None)
    if value is not None and value <= 0:
        raise invalid_field(name, "must be a positive integer")
    return value


def rerank_answer(call: RerankCall, ranked: list[tuple[int, float]], model: str, tokens: int,
                  request_id: str, version: int) -> dict[str, Any]:
    """Cohere's answer (with Jina's fields on v1): results best first."""
    results = []
    for index, score in ranked:
        row: dict[str, Any] = {"index": index, "relevance_score": score}
        if call.return_documents:
            document = call.documents[index]
            row["document"] = document if isinstance(document, Mapping) else {"text": document}
        results.append(row)
    units = math.ceil(len(call.texts) / DOCUMENTS_PER_SEARCH_UNIT)
    out: dict[str, Any] = {"id": request_id, "results": results,
                           "meta": {"api_version": {"version": str(version)},
                                    "billed_units": {"search_units": units}}}
    if version == 1:  # Jina's
        out["model"] = model
        out["usage"] = {"total_tokens": tokens, "prompt_tokens": tokens}
    return out


# Cohere's statuses: a request it cannot take is a 400 (its client raises BadRequestError);
# 404 NotFoundError, 429 TooManyRequestsError and 503 keep theirs.
_COHERE_STATUS = {413: 400, 415: 400, 422: 400}


def rerank_error(exc: HeronError) -> tuple[int, dict[str, Any]]:
    """Cohere's error body (``message``), with Jina's (``detail``) and Heron's code."""
    return _COHERE_STATUS.get(exc.status, exc.status), {
        "message": exc.message, "detail": exc.message, "code": str(exc.code).lower(),
        "param": exc.field}


class RerankRoutes:
    """The handlers of the rerank routes over the front's backend."""

    def __init__(self, front: InferenceFront) -> None:
        self.front = front

    async def v1(self, request: Request) -> Response:
        return await self._rerank(request, 1)

    async def v2(self, request: Request) -> Response:
        return await self._rerank(request, 2)

    async def _rerank(self, request: Request, version: int) -> Response:
        front = self.front
        call_info = front.call_of(request)

        async def handle(body: Any) -> Answer:
            call = parse_rerank(body, version)
            scored: list[tuple[int, float]] = []
            tokens, model_id, phases, total = 0, call.model, {}, None
            # One backend call per MAX_ITEMS_PER_REQUEST documents; each ranks its share
            # (a document's score does not depend on the others), then they are merged.
            for start in range(0, len(call.texts), MAX_ITEMS_PER_REQUEST):
                part = call.texts[start:start + MAX_ITEMS_PER_REQUEST]
                req = ScoreRequest(query=call.query, items=[Item(t) for t in part],
                                   top_k=call.top_n if len(call.texts) == len(part) else None,
                                   options=RequestOptions(priority=call.priority,
                                                          adapter=call.adapter),
                                   max_tokens_per_doc=call.max_tokens_per_doc)
                out = await front.backend.score(call.model, req, call_info)
                scored += [(start + r["index"], float(r["score"]))
                           for r in out.body["results"]]
                tokens += out.body["usage"]["tokens"]
                model_id, phases, total = out.model_id, out.phases, out.total_s
            scored.sort(key=lambda pair: (-pair[1], pair[0]))
            if call.top_n is not None:
                scored = scored[:call.top_n]
            request_id = request_id_of(request)
            assert request_id is not None  # RequestScope named it before the handler ran
            return Answer(rerank_answer(call, scored, model_id, tokens, request_id, version),
                          model_id, phases, total if len(call.texts) <= MAX_ITEMS_PER_REQUEST
                          else None)

        return await front.serve_json(request, f"rerank_v{version}", handle, rerank_error)

    def routes(self) -> list[BaseRoute]:
        return [Route("/v1/rerank", self.v1, methods=["POST"]),
                Route("/v2/rerank", self.v2, methods=["POST"])]


def rerank_routes(front: InferenceFront) -> list[BaseRoute]:
    return RerankRoutes(front).routes()


_RERANK_RESPONSES: dict[int, type | None] = {200: api.RerankResponse,
                                             **api.error_statuses(404, 429, 500, 502, 503, 504)}
RERANK_OPERATIONS: tuple[ApiOperation, ...] = (
    ApiOperation("POST", "/v2/rerank", "rerankV2", "Rerank documents (Cohere's v2 API)",
                 "rerank", request=api.RerankV2Body, responses=_RERANK_RESPONSES, auth=True,
                 dialect_error=api.RerankErrorBody),
    ApiOperation("POST", "/v1/rerank", "rerankV1",
                 "Rerank documents (Cohere's v1 API; Jina's rerank API)", "rerank",
                 request=api.RerankV1Body, responses=_RERANK_RESPONSES, auth=True,
                 dialect_error=api.RerankErrorBody),
)
