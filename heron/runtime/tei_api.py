"""Text Embeddings Inference's routes (``/embed``, ``/rerank``, ``/info``, ...) in TEI's own
request, response and error shapes, over the same backend as Heron's routes, for the tools
that speak TEI (huggingface_hub's InferenceClient, LangChain, LlamaIndex, Haystack).

Each route parses its body (heron.runtime.tei_types), picks its model (``TeiModels``), calls
the backend (encode, score, tokenize, decode) and writes TEI's answer; the front serves it
(metrics, logs, request ids, timing headers) with TEI's error body and statuses
(``tei_error``). ``POST /`` is TEI's root route: an embed body embeds (sparse when the model
makes only sparse vectors), a rerank body reranks.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import BaseRoute, Route

from heron import __version__
from heron.runtime import tei_types as tei
from heron.runtime.backend import Answer, InferenceBackend, InferenceCall
from heron.runtime.openapi import ApiOperation
from heron.runtime.token_calls import DecodeRequest, TokenizeRequest
from heron_sdk.errors import ErrorCode, HeronError
from heron_sdk.types import (
    INPUT_TYPES,
    MAX_ITEMS_PER_REQUEST,
    EncodeRequest,
    Item,
    RequestOptions,
    ScoreRequest,
)

if TYPE_CHECKING:
    from heron.runtime.front import InferenceFront

# ---- the API's description ------------------------------------------------------------------
# What TEI answers with each status (router/src/http/server.rs); 401/403 come from API keys,
# in Heron's shape, and the document adds them.
_ERRORS: dict[int, type | None] = dict.fromkeys((400, 404, 413, 415, 422, 424, 429, 500, 503,
                                                 504), tei.TeiError)
_DESCRIPTION = ("Text Embeddings Inference's route, in its request, answer and error shapes "
                "(docs/api.md#text-embeddings-inference-tei). ")


def _op(method: str, path: str, operation_id: str, summary: str, request: Any,
        answer: Any) -> ApiOperation:
    return ApiOperation(method, path, operation_id, summary, "tei", request=request,
                        responses={200: answer, **_ERRORS}, auth=True,
                        description=_DESCRIPTION + "Its model: the body's `model`, else "
                        "the server's --default-model, else the one model that can answer.")


_EMBED_ANSWER = list[list[float]]
_SPARSE_ANSWER = list[list[tei.TeiSparseValue]]
TEI_OPERATIONS: tuple[ApiOperation, ...] = (
    _op("POST", "/embed", "teiEmbed", "TEI: dense embeddings", tei.TeiEmbedBody,
        _EMBED_ANSWER),
    _op("POST", "/embed_sparse", "teiEmbedSparse", "TEI: sparse embeddings",
        tei.TeiEmbedSparseBody, _SPARSE_ANSWER),
    _op("POST", "/rerank", "teiRerank", "TEI: rank texts against a query", tei.TeiRerankBody,
        list[tei.TeiRank]),
    _op("POST", "/predict", "teiPredict", "TEI: score [text, text] pairs with a cross-encoder",
        tei.TeiPredictBody, list[tei.TeiPrediction] | list[list[tei.TeiPrediction]]),
    _op("POST", "/tokenize", "teiTokenize", "TEI: the model's tokens of texts",
        tei.TeiTokenizeBody, list[list[tei.TeiToken]]),
    _op("POST", "/decode", "teiDecode", "TEI: the text of token ids", tei.TeiDecodeBody,
        list[str]),
    _op("GET", "/info", "teiInfo", "TEI: the served model and the server's version", None,
        tei.TeiInfo),
    _op("POST", "/", "teiRoot", "TEI's root route: /embed (or /embed_sparse) or /rerank by "
        "the body", tei.TeiEmbedBody | tei.TeiRerankBody,
        _EMBED_ANSWER | _SPARSE_ANSWER | list[tei.TeiRank]),
)
# (method, path) of every TEI route: API keys guard them as they guard /v1/.
TEI_PATHS = frozenset((op.method, op.path) for op in TEI_OPERATIONS)


# ---- errors -----------------------------------------------------------------------------------
_BACKEND_CODES = frozenset({ErrorCode.UNSUPPORTED_TASK, ErrorCode.UNSUPPORTED_OUTPUT,
                            ErrorCode.MODEL_LOAD_FAILED})


def tei_error(exc: HeronError) -> tuple[int, dict[str, Any]]:
    """TEI's status and body for a HeronError: ``Empty`` 400, ``Validation`` 422 (and Heron's
    400/404/413/415 as they are), ``Backend`` 424 for a model that cannot do the route's
    work (or failed to load), ``Overloaded`` 429, ``Unhealthy`` 503 (loading, starting,
    NATS away; with Retry-After), ``Backend`` for the other 5xx."""
    status, code = exc.status, exc.code
    if code is ErrorCode.INVALID_FIELD and status == 400:
        kind = "Empty"
    elif code in _BACKEND_CODES:
        status, kind = 424, "Backend"
    elif code is ErrorCode.TOO_MANY_ITEMS:  # TEI's batch size error
        status, kind = 422, "Validation"
    elif code is ErrorCode.QUEUE_FULL:
        kind = "Overloaded"
    elif status == 503:
        kind = "Unhealthy"
    elif status >= 500:
        kind = "Backend"
    else:
        kind = "Validation"
    return status, {"error": exc.message, "error_type": kind}


_ITEM = re.compile(r"items\[(\d+)\]")


async def _named(answer: Awaitable[Answer], rename: Callable[[int], str]) -> Answer:
    """``answer``, with an error's ``items[i]`` (Heron's name for the i-th text) written as
    the TEI body names it (``rename(i)``: ``inputs[i]``, ``texts[i]``, ...)."""
    try:
        return await answer
    except HeronError as exc:
        if "items[" not in exc.message and not (exc.field or "").startswith("items"):
            raise

        def sub(text: str) -> str:
            return _ITEM.sub(lambda m: rename(int(m.group(1))), text)

        raise HeronError(exc.code, sub(exc.message),
                         field=None if exc.field is None else sub(exc.field),
                         retry_after_s=exc.retry_after_s, status=exc.status) from exc


def _as(name: str) -> Callable[[int], str]:
    return lambda i: f"{name}[{i}]"


# ---- which model ------------------------------------------------------------------------------
Fits = Callable[[dict[str, Any]], bool]


def _outputs(m: dict[str, Any]) -> Sequence[str]:
    return m.get("output_types") or ()


# route -> (can answer it, is made for it): a dense model can score, but /rerank's own
# models are cross-encoders.
ROUTE_MODELS: dict[str, tuple[Fits, Fits]] = {
    "embed": (lambda m: "dense" in _outputs(m), lambda m: m.get("task") == "encode"),
    "embed_sparse": (lambda m: "sparse" in _outputs(m), lambda m: m.get("task") == "encode"),
    "embed_any": (lambda m: bool({"dense", "sparse"} & set(_outputs(m))),
                  lambda m: "dense" in _outputs(m)),
    "rerank": (lambda m: "score" in (m.get("tasks") or ()), lambda m: m.get("task") == "score"),
    "predict": (lambda m: m.get("task") == "score", lambda m: True),
    "tokenize": (lambda m: True, lambda m: True),
}
ROUTE_PATHS = {"embed": "/embed", "embed_sparse": "/embed_sparse", "embed_any": "POST /",
               "rerank": "/rerank", "predict": "/predict", "tokenize": "/tokenize and /decode"}
CHOICE_TTL_S = 1.0  # the served models change rarely; a choice is reused this long


class TeiModels:
    """The model of a TEI call: the body's ``model``; else the first of ``defaults``
    (--default-model) made for the route, else the first that can answer it; else the one
    model served that is made for it, else the one that can answer it."""

    def __init__(self, backend: InferenceBackend, defaults: Sequence[str]) -> None:
        self.backend = backend
        self.defaults = tuple(defaults)
        # route -> (when, model id or None, why not, the error's code)
        self._chosen: dict[str, tuple[float, str | None, str, ErrorCode]] = {}
        self._outputs: dict[str, tuple[float, tuple[str, ...]]] = {}  # model -> (at, outputs)

    def pick(self, route: str, named: str | None) -> str:
        if named is not None:
            return named
        if len(self.defaults) == 1:  # the backend says if it cannot answer (424)
            self._check_defaults()
            return self.defaults[0]
        now = time.monotonic()
        cached = self._chosen.get(route)
        if cached is None or now - cached[0] > CHOICE_TTL_S:
            cached = (now, *self._choose(route))
            self._chosen[route] = cached
        _, model, why, code = cached
        if model is None:
            raise HeronError(code, why, field="model" if code is ErrorCode.INVALID_FIELD
                             else None, retry_after_s=1.0 if code is ErrorCode.NOT_READY
                             else None)
        return model

    def _check_defaults(self) -> None:
        """404 naming the setting for a --default-model name not served here (503 while a
        gateway's registry is still loading)."""
        unknown = [n for n in self.defaults if self.backend.canonical_id(n) is None]
        if not unknown:
            return
        if not self.backend.models():
            raise HeronError(ErrorCode.NOT_READY, "no model is known yet (the registry is "
                             "loading); retry shortly", retry_after_s=1.0)
        raise HeronError(ErrorCode.MODEL_NOT_FOUND, f"--default-model / HERON_DEFAULT_MODEL "
                         f"names {unknown[0]!r}, which is not served here; GET /v1/models "
                         "lists what is")

    def outputs(self, model: str) -> tuple[str, ...]:
        """What ``model`` encodes to (its output_types), remembered a while."""
        now = time.monotonic()
        cached = self._outputs.get(model)
        if cached is None or now - cached[0] > CHOICE_TTL_S:
            cached = (now, tuple(self.backend.model(model).get("output_types") or ()))
            self._outputs[model] = cached
        return cached[1]

    def _choose(self, route: str) -> tuple[str | None, str, ErrorCode]:
        """(model id, "", _) or (None, why not, the error's code): 503 NOT_READY while no
        model is known, 422 when several could answer (the body or the setting must name
        one), TEI's 424 (UNSUPPORTED_TASK) when none can."""
        ok, cannot = ErrorCode.INTERNAL, ErrorCode.UNSUPPORTED_TASK  # ok: not raised
        models = self.backend.models()
        if not models:
            return (None, "no model is known yet (the registry is loading); retry shortly",
                    ErrorCode.NOT_READY)
        can, made = ROUTE_MODELS[route]
        where = ROUTE_PATHS[route]
        if self.defaults:
            self._check_defaults()
            names = {n: m for m in models for n in (m["id"], *m.get("aliases", ()))}
            listed = [names[n] for n in self.defaults if n in names]
            able = [m for m in listed if can(m)]
            if not able:
                return None, (f"none of --default-model / HERON_DEFAULT_MODEL "
                              f"({', '.join(self.defaults)}) can answer {where} here"), cannot
            return next((m for m in able if made(m)), able[0])["id"], "", ok
        able = [m for m in models if can(m)]
        own = [m for m in able if made(m)]
        for group in (own, able):
            if len(group) == 1:
                return group[0]["id"], "", ok
        if not able:
            return None, f"no model served here can answer {where}", cannot
        shown = ", ".join(m["id"] for m in (own or able))
        return None, (f"{len(own or able)} models here can answer {where} ({shown}): set "
                      "--default-model (HERON_DEFAULT_MODEL) on the server, or name one "
                      "with \"model\" in the body"), ErrorCode.INVALID_FIELD

    def info_model(self) -> str | None:
        """The model /info describes: the one POST / embeds with; else the first default,
        else the only model served; else None."""
        try:
            return self.pick("embed_any", None)
        except HeronError:
            pass
        if self.defaults:
            return self.defaults[0]
        models = self.backend.models()
        return models[0]["id"] if len(models) == 1 else None


# ---- the routes -------------------------------------------------------------------------------
def _unit(vector: np.ndarray) -> np.ndarray:
    """``vector`` at unit length (TEI's normalize); left as is when it already is."""
    norm = float(np.linalg.norm(vector))
    if norm == 0.0 or abs(norm - 1.0) <= 1e-6:
        return vector
    return (vector / norm).astype(np.float32, copy=False)


def _options(call: tei.TeiCall) -> RequestOptions:
    return RequestOptions(truncate=call.truncate)


def _encode_request(call: tei.TeiCall, output: str) -> EncodeRequest:
    query = call.input_type is not None and INPUT_TYPES[call.input_type] == "query"
    return EncodeRequest(items=call.items or [], output_types=(output,),
                         dims=call.dims if output == "dense" else None, is_query=query,
                         input_type=call.input_type, options=_options(call))


class TeiRoutes:
    """The TEI routes' handlers over one front."""

    def __init__(self, front: InferenceFront, defaults: Sequence[str]) -> None:
        self.front = front
        self.backend = front.backend
        self.models = TeiModels(front.backend, defaults)

    def _serve(self, request: Request, route: str,
               handle: Callable[[Any, InferenceCall], Awaitable[Answer]], *,
               read: bool = True) -> Awaitable[Response]:
        call = self.front._call(request, all_or_nothing=True)  # no per-item errors in TEI
        return self.front._serve(request, route, lambda body: handle(body, call),
                                 json_only=True, read=read, errors=tei_error)

    # ---- embed ----------------------------------------------------------------------------
    async def _embed(self, parsed: tei.TeiCall, call: InferenceCall, model: str) -> Answer:
        out = await _named(self.backend.encode(model, _encode_request(parsed, "dense"), call),
                           _as("inputs"))
        rows = out.body["items"]
        vectors = [_unit(r["dense"]) if parsed.normalize else r["dense"] for r in rows]
        return Answer(vectors, out.model_id, out.phases, out.total_s)  # type: ignore[arg-type]

    async def _embed_sparse(self, parsed: tei.TeiCall, call: InferenceCall,
                            model: str) -> Answer:
        out = await _named(self.backend.encode(model, _encode_request(parsed, "sparse"),
                                               call), _as("inputs"))
        body = [[{"index": i, "value": v} for i, v in zip(
            np.asarray(r["sparse"]["indices"]).tolist(),
            np.asarray(r["sparse"]["values"]).tolist(), strict=True)]
            for r in out.body["items"]]
        return Answer(body, out.model_id, out.phases, out.total_s)  # type: ignore[arg-type]

    async def embed(self, request: Request) -> Response:
        async def handle(body: Any, call: InferenceCall) -> Answer:
            parsed = tei.parse_embed(body)
            return await self._embed(parsed, call, self.models.pick("embed", parsed.model))
        return await self._serve(request, "tei_embed", handle)

    async def embed_sparse(self, request: Request) -> Response:
        async def handle(body: Any, call: InferenceCall) -> Answer:
            parsed = tei.parse_embed_sparse(body)
            return await self._embed_sparse(parsed, call,
                                            self.models.pick("embed_sparse", parsed.model))
        return await self._serve(request, "tei_embed_sparse", handle)

    # ---- rerank, predict ------------------------------------------------------------------
    async def _rerank(self, parsed: tei.TeiCall, call: InferenceCall, model: str) -> Answer:
        items = parsed.items or []
        req = ScoreRequest(query=parsed.query, items=items, options=_options(parsed))
        out = await _named(self.backend.score(model, req, call), _as("texts"))
        ranks = []
        for row in out.body["results"]:
            rank: dict[str, Any] = {"index": row["index"], "score": row["score"]}
            if parsed.return_text:
                rank["text"] = items[row["index"]].text
            ranks.append(rank)
        return Answer(ranks, out.model_id, out.phases, out.total_s)  # type: ignore[arg-type]

    async def rerank(self, request: Request) -> Response:
        async def handle(body: Any, call: InferenceCall) -> Answer:
            parsed = tei.parse_rerank(body)
            return await self._rerank(parsed, call, self.models.pick("rerank", parsed.model))
        return await self._serve(request, "tei_rerank", handle)

    async def predict(self, request: Request) -> Response:
        async def handle(body: Any, call: InferenceCall) -> Answer:
            parsed = tei.parse_predict(body)
            model = self.models.pick("predict", parsed.model)
            described = self.backend.model(model)
            if described.get("task") != "score":
                raise HeronError(ErrorCode.UNSUPPORTED_TASK,
                                 f"model {described['id']} is not a cross-encoder: /predict "
                                 "scores [text, text] pairs with one (Heron serves no "
                                 "sequence classifiers)")
            # One score call per distinct first text, run together.
            groups: dict[str, list[int]] = {}
            for i, (query, _) in enumerate(parsed.pairs or []):
                groups.setdefault(query, []).append(i)
            pairs = parsed.pairs or []

            async def group(query: str, where: list[int]) -> tuple[list[int], Answer]:
                req = ScoreRequest(query=query, items=[Item(pairs[i][1]) for i in where],
                                   options=_options(parsed))
                return where, await _named(self.backend.score(model, req, call),
                                           lambda k: f"inputs[{where[k]}]")

            answers = await _all([group(q, w) for q, w in groups.items()])
            scores = [0.0] * len(pairs)
            for where, out in answers:
                for row in out.body["results"]:
                    scores[where[row["index"]]] = row["score"]
            rows = [[{"score": s, "label": "LABEL_0"}] for s in scores]
            last = answers[-1][1]
            return Answer(rows[0] if parsed.single else rows,  # type: ignore[arg-type]
                          last.model_id, last.phases)
        return await self._serve(request, "tei_predict", handle)

    # ---- tokenize, decode ------------------------------------------------------------------
    async def tokenize(self, request: Request) -> Response:
        async def handle(body: Any, call: InferenceCall) -> Answer:
            parsed = tei.parse_tokenize(body)
            model = self.models.pick("tokenize", parsed.model)
            req = TokenizeRequest(parsed.items or [], parsed.add_special_tokens,
                                  parsed.input_type)
            out = await _named(self.backend.tokenize(model, req, call), _as("inputs"))
            return Answer([r["tokens"] for r in out.body["items"]],  # type: ignore[arg-type]
                          out.model_id, out.phases, out.total_s)
        return await self._serve(request, "tei_tokenize", handle)

    async def decode(self, request: Request) -> Response:
        async def handle(body: Any, call: InferenceCall) -> Answer:
            parsed = tei.parse_decode(body)
            model = self.models.pick("tokenize", parsed.model)
            req = DecodeRequest(parsed.sequences or [], parsed.skip_special_tokens)
            out = await _named(self.backend.decode(model, req, call), _as("ids"))
            return Answer([r["text"] for r in out.body["items"]],  # type: ignore[arg-type]
                          out.model_id, out.phases, out.total_s)
        return await self._serve(request, "tei_decode", handle)

    # ---- the root route and /info -----------------------------------------------------------
    async def root(self, request: Request) -> Response:
        async def handle(body: Any, call: InferenceCall) -> Answer:
            kind, parsed = tei.parse_root(body)
            if kind == "rerank":
                return await self._rerank(parsed, call,
                                          self.models.pick("rerank", parsed.model))
            model = self.models.pick("embed_any", parsed.model)
            outputs = self.models.outputs(model)
            if "dense" in outputs or "sparse" not in outputs:
                return await self._embed(parsed, call, model)
            if parsed.dims is not None:
                raise HeronError(ErrorCode.INVALID_FIELD, "dimensions: model makes sparse "
                                 "vectors only", field="dimensions")
            return await self._embed_sparse(parsed, call, model)
        return await self._serve(request, "tei_root", handle)

    async def info(self, request: Request) -> Response:
        async def handle(_: Any, call: InferenceCall) -> Answer:
            model = self.models.info_model()
            described = self.backend.model(model) if model is not None else {}
            return Answer(self._info(described), described.get("id", "_unknown"), {})
        return await self._serve(request, "tei_info", handle, read=False)

    def _info(self, m: dict[str, Any]) -> dict[str, Any]:
        task, outputs = m.get("task"), m.get("output_types") or ()
        if task == "score":
            kind: dict[str, Any] | None = {"reranker": {"id2label": {"0": "LABEL_0"},
                                                        "label2id": {"LABEL_0": 0}}}
        elif task == "encode":
            pooling = m.get("pooling") or ("splade" if "dense" not in outputs else None)
            kind = {"embedding": {"pooling": pooling}}
        elif task == "extract":
            kind = {"token_classifier": {}}
        else:
            kind = None
        return {"model_id": m.get("id"), "model_sha": None, "model_dtype": m.get("dtype"),
                "served_model_name": m.get("id"), "model_type": kind,
                "max_concurrent_requests": self.front.max_in_flight,
                "max_input_length": m.get("max_sequence_length"), "max_batch_tokens": None,
                "max_batch_requests": None, "max_client_batch_size": MAX_ITEMS_PER_REQUEST,
                "auto_truncate": True, "tokenization_workers": None, "version": __version__,
                "sha": None, "docker_label": None}

    def routes(self) -> list[BaseRoute]:
        return [Route("/embed", self.embed, methods=["POST"]),
                Route("/embed_sparse", self.embed_sparse, methods=["POST"]),
                Route("/rerank", self.rerank, methods=["POST"]),
                Route("/predict", self.predict, methods=["POST"]),
                Route("/tokenize", self.tokenize, methods=["POST"]),
                Route("/decode", self.decode, methods=["POST"]),
                Route("/info", self.info, methods=["GET"]),
                Route("/", self.root, methods=["POST"])]


async def _all(calls: list[Awaitable[Any]]) -> list[Any]:
    """Every call's result, run together; the first failure cancels the rest and is
    raised (a HeronError as itself, not in an ExceptionGroup)."""
    if len(calls) == 1:
        return [await calls[0]]
    tasks = [asyncio.ensure_future(c) for c in calls]
    try:
        return list(await asyncio.gather(*tasks))
    finally:
        for task in tasks:
            task.cancel()


def tei_routes(front: InferenceFront, default_models: Sequence[str] = ()) -> list[BaseRoute]:
    """The TEI routes over ``front``; ``default_models``: --default-model's names."""
    return TeiRoutes(front, default_models).routes()
