"""InferenceService: encode, score and extract on top of the registry's runners.

HTTP-free: the worker's HTTP API and its queue consumer call these with parsed requests
and get wire-ready dicts plus the request's phase timings. Each phase is also a span
(``heron.worker.tokenize``, ``.batch_wait``, ``.inference``, ``.postprocess``) under the
caller's current span when tracing is on.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from heron.runtime import telemetry
from heron.runtime.http import server_timing
from heron.runtime.modelconfig import lora_source
from heron.worker.adapters import Adapter, RefusedItem, TextInput, TokenIds, Tokenized
from heron.worker.chunked_encode import plan_chunks
from heron.worker.images import ImageInput
from heron.worker.outputs import quantize, truncate_dims
from heron.worker.registry import ModelEntry, ModelRegistry
from heron.worker.runner import ItemResult, ModelRunner
from heron_sdk.errors import ErrorCode, HeronError
from heron_sdk.types import (
    EncodeRequest,
    Entity,
    ExtractRequest,
    RequestOptions,
    ScoreRequest,
    SparseVector,
    check_outputs,
    wire_array,
)

PhaseObserver = Callable[[str, Mapping[str, float]], None]  # (model id, phase -> seconds)


@dataclass(slots=True)
class Timings:
    """Seconds spent per phase; ``batch_wait`` and ``inference`` are those of the item that
    finished last, so the phases follow one another inside ``total``."""

    tokenize: float = 0.0
    batch_wait: float = 0.0  # in the model's batcher queue until its forward pass began
    inference: float = 0.0  # collate, forward and the adapter's postprocess, per batch
    postprocess: float = 0.0  # building the response body from the model's outputs
    total: float = 0.0
    started: float = field(default_factory=time.monotonic)

    def phases(self) -> dict[str, float]:
        return {"tokenize": self.tokenize, "batch_wait": self.batch_wait,
                "inference": self.inference, "postprocess": self.postprocess}

    def server_timing(self) -> str:
        return server_timing({**self.phases(), "total": self.total})


@dataclass(slots=True)
class Outcome:
    body: dict[str, Any]
    timings: Timings
    model: str


def image_input(adapter: Adapter, data: bytes, field: str) -> ImageInput:
    """An image item for ``adapter``; 422 naming it when the model takes texts only."""
    if not adapter.accepts_images:
        raise HeronError(ErrorCode.INVALID_FIELD,
                         f"{field}: model {adapter.config.id} takes texts only (images go "
                         "to image models: adapter clip)", field=field)
    return ImageInput(data, field)


def encode_inputs(adapter: Adapter, req: EncodeRequest) -> list[TextInput | ImageInput]:
    """The texts of ``req``, with items given as token ids checked against the model (422
    naming the item: a coalesced neighbour's items are not this request's fault), and its
    images (decoded later, on the tokenizer pool)."""
    if all(i.tokens is None and i.image is None for i in req.items):
        return [i.text for i in req.items]
    inputs: list[TextInput | ImageInput] = []
    vocab = adapter.vocab_size
    for n, item in enumerate(req.items):
        if item.image is not None:
            inputs.append(image_input(adapter, item.image, f"items[{n}].image"))
            continue
        if item.tokens is None:
            inputs.append(item.text)
            continue
        if not adapter.accepts_token_ids:
            raise HeronError(ErrorCode.INVALID_FIELD,
                             f"items[{n}].tokens: model {adapter.config.id} takes texts only "
                             f"({adapter.name} models tokenize in their own way)",
                             field=f"items[{n}].tokens")
        bad = next((t for t in item.tokens if t >= vocab), None)
        if bad is not None:
            raise HeronError(ErrorCode.INVALID_FIELD,
                             f"items[{n}].tokens: token id {bad} is outside model "
                             f"{adapter.config.id}'s vocabulary of {vocab}",
                             field=f"items[{n}].tokens")
        inputs.append(TokenIds(item.tokens))
    return inputs


class InferenceService:
    def __init__(self, registry: ModelRegistry, *,
                 on_phases: PhaseObserver | None = None) -> None:
        self.registry = registry
        self._on_phases = on_phases  # metrics: every request's phases, HTTP and queue alike

    def items_in_forward(self) -> int:
        """Items in a forward pass right now, over all models."""
        return sum(e.runner.in_forward for e in self.registry.entries() if e.runner)

    def passes_busy(self) -> bool:
        """Whether no forward pass could start now: as many run as the worker has CPU
        inference threads (one, unless ``--inference-threads``; on CUDA: any pass)."""
        running = sum(e.runner.passes_running for e in self.registry.entries() if e.runner)
        return running >= self.registry.inference_threads

    # ---- the shared path: tokenize, check, batch, infer --------------------------------
    async def _run(self, runner: ModelRunner, inputs: list[TextInput], options: RequestOptions,
                   timings: Timings, *, queries: int = 0, prompts: tuple[str, str] = ("", ""),
                   partial: bool = False) -> tuple[list[Tokenized], list[ItemResult]]:
        """Tokenize, batch and compute ``inputs``; the first ``queries`` of them are queries
        (tokenized as the model tokenizes queries, after ``prompts[0]``), the rest documents
        (after ``prompts[1]``). An item the model refuses (a corrupt image: a RefusedItem)
        fails the request, unless ``partial``: then its result is None and the others are
        computed."""
        # Counted from before tokenizing: a model with a request anywhere past picking its
        # runner is busy, and LRU eviction leaves busy models alone.
        runner.in_flight += 1
        try:
            # The request's LoRA adapter stays loaded until its items are computed.
            async with runner.loras.use(options.adapter) as lora:
                return await self._tokenize_and_infer(runner, inputs, options, timings,
                                                      queries, prompts, lora, partial)
        finally:
            runner.in_flight -= 1

    async def _tokenize_and_infer(self, runner: ModelRunner, inputs: list[TextInput],
                                  options: RequestOptions, timings: Timings, queries: int,
                                  prompts: tuple[str, str], lora: Any = None,
                                  partial: bool = False
                                  ) -> tuple[list[Tokenized], list[ItemResult]]:
        started = time.monotonic()
        deadline = started + options.timeout_s if options.timeout_s else None
        with telemetry.span(telemetry.WORKER, "tokenize",
                            attributes={"heron.items": len(inputs)}) as span:
            tokens = (await runner.tokenize(inputs[:queries], query=True, prompt=prompts[0])
                      if queries else [])
            if queries < len(inputs):
                tokens += await runner.tokenize(inputs[queries:], prompt=prompts[1])
            if span is not None:
                span.set_attribute("heron.tokens", sum(t.length for t in tokens))
        timings.tokenize = time.monotonic() - started
        refused = [t for t in tokens if isinstance(t, RefusedItem)]
        if refused and (not partial or refused[0].error is None):
            raise refused[0].error or HeronError(ErrorCode.INTERNAL, "an item was refused")
        computed = [t for t in tokens if not isinstance(t, RefusedItem)] if refused else tokens
        if not options.truncate:
            for i, t in enumerate(tokens):
                if t.truncated:
                    raise HeronError(
                        ErrorCode.INPUT_TOO_LONG,
                        f"items[{i}]: longer than the model's {runner.adapter.max_length} tokens"
                        " and truncate is false", field=f"items[{i}]")
        submitted = time.monotonic()
        if not computed:  # every item refused: nothing to compute
            return tokens, [None] * len(tokens)  # type: ignore[list-item]
        coro = runner.infer(computed, priority=options.priority, deadline=deadline, lora=lora,
                            cache=options.cache)
        try:
            if deadline is None:
                results = await coro
            else:
                results = await asyncio.wait_for(coro, max(0.0, deadline - time.monotonic()))
        except TimeoutError as exc:
            raise HeronError(ErrorCode.DEADLINE_EXCEEDED,
                             "request did not finish before its deadline (timeout_s)"
                             ) from exc
        # The item that finished last tells both phases: maxima taken apart could add up to
        # more than the time that passed (one item queued long, another's batch ran long).
        last = max(results, key=lambda r: r.queue_s + r.inference_s)
        if refused:  # back in the request's order, None where an item was refused
            done = iter(results)
            results = [None if isinstance(t, RefusedItem) else next(done)  # type: ignore[misc]
                       for t in tokens]
        timings.batch_wait, timings.inference = last.queue_s, last.inference_s
        if telemetry.enabled():  # measured by the batcher and the inference thread
            queued = telemetry.wall_ns(submitted)
            forward = queued + int(timings.batch_wait * 1e9)
            telemetry.record_span(telemetry.WORKER, "batch_wait", queued, forward,
                                  attributes={"heron.priority": options.priority})
            telemetry.record_span(telemetry.WORKER, "inference", forward,
                                  forward + int(timings.inference * 1e9))
        return tokens, results

    def _answered(self, model: str, timings: Timings, postprocess_started: float) -> None:
        """The body is built: close the request's timings (and its postprocess span)."""
        now = time.monotonic()
        timings.postprocess = now - postprocess_started
        timings.total = now - timings.started
        if telemetry.enabled():
            telemetry.record_span(telemetry.WORKER, "postprocess",
                                  telemetry.wall_ns(postprocess_started), telemetry.wall_ns(now))
        if self._on_phases is not None:
            self._on_phases(model, timings.phases())

    async def _runner_for(self, model: str, task: str, adapter: str | None = None
                          ) -> tuple[ModelEntry, ModelRunner]:
        # An adapter the model does not list: 404 now, before a load starts for nothing.
        lora_source(self.registry.entry(model).config, adapter)
        entry, runner = await self.registry.acquire(model)
        tasks = runner.adapter.tasks  # the loaded family's, also where the config said auto
        if task not in tasks:
            raise HeronError(ErrorCode.UNSUPPORTED_TASK,
                             f"model {entry.config.id} does not support {task}; "
                             f"it serves {', '.join(tasks)}")
        return entry, runner

    # ---- encode ------------------------------------------------------------------------
    async def encode(self, model: str, req: EncodeRequest) -> Outcome:
        entry, runner = await self._runner_for(model, "encode", req.options.adapter)
        check_outputs(entry.config.id, runner.adapter.output_types, req)
        width = runner.adapter.dimensions or runner.adapter.hidden_size
        if req.dims is not None and "dense" in req.output_types and width and req.dims > width:
            raise HeronError(ErrorCode.INVALID_FIELD,
                             f"dims: {req.dims} is more than the model's {width} dimensions",
                             field="dims")
        prompt = runner.adapter.prompt(req.is_query, req.instruction, req.input_type)
        timings = Timings()
        plan = None
        if req.chunking is not None:  # each chunk is computed as an item of its own
            plan = await plan_chunks(runner, req, prompt)
            req = plan.rows
        tokens, results = await self._run(runner, encode_inputs(runner.adapter, req), req.options,
                                          timings, queries=len(req.items) if req.is_query else 0,
                                          prompts=(prompt, prompt), partial=True)
        postprocess_started = time.monotonic()
        normalize = getattr(runner.adapter, "normalize", True)
        enc = req.options.encoding
        items = []
        errors = 0
        for item, tok, res in zip(req.items, tokens, results, strict=True):
            out: dict[str, Any] = {}
            if item.id is not None:
                out["id"] = item.id
            if isinstance(tok, RefusedItem) and tok.error is not None:
                # The item's own 4xx in its place (heron.runtime.backend.answer_items
                # decides what the request answers when no item succeeded).
                items.append({**tok.error.to_body(), **out})
                errors += 1
                continue
            for kind in req.output_types:
                value = res.value[kind]
                if kind == "dense":
                    vec = truncate_dims(value, req.dims, normalize)
                    out["dense"] = wire_array(quantize(vec, req.output_dtype), enc)
                elif kind in ("multi_vector", "muvera"):
                    out[kind] = wire_array(quantize(value, req.output_dtype), enc)
                else:
                    sparse: SparseVector = value
                    if req.output_dtype == "float16":
                        sparse = SparseVector(sparse.indices, sparse.values.astype(np.float16))
                    out["sparse"] = sparse.to_wire(enc)
            out["tokens"] = tok.length
            out["truncated"] = tok.truncated
            if res.cached:  # not computed for this request (worker/result_cache.py)
                out["cached"] = True
            items.append(out)
        if plan is not None:  # the chunks' rows back into their items
            items = plan.fold(items, results, normalize)
            timings.tokenize += plan.split_s
        body = {"model": entry.config.id, "items": items,
                "usage": {"tokens": sum(t.length for t in tokens)}}
        if errors:
            body["errors"] = errors
        self._answered(entry.config.id, timings, postprocess_started)
        return Outcome(body, timings, entry.config.id)

    # ---- score -------------------------------------------------------------------------
    async def score(self, model: str, req: ScoreRequest) -> Outcome:
        entry, runner = await self._runner_for(model, "score", req.options.adapter)
        timings = Timings()
        images = req.query_image is not None or any(i.image is not None for i in req.items)
        if images and runner.adapter.task == "score":  # a cross-encoder reads text pairs
            field = "query.image" if req.query_image is not None else next(
                f"items[{n}].image" for n, i in enumerate(req.items) if i.image is not None)
            raise HeronError(ErrorCode.INVALID_FIELD, f"{field}: model {entry.config.id} "
                             "scores texts only", field=field)
        docs, clipped = [i.text for i in req.items], set[int]()
        cap = req.max_tokens_per_doc
        if cap is not None and cap < runner.adapter.max_length:  # else the model's cut is it
            docs, clipped = await runner.clip(docs, cap)
        if runner.adapter.task == "score":
            tokens, results = await self._run(
                runner, [(req.query, d) for d in docs], req.options, timings)
            postprocess_started = time.monotonic()
            scores = [float(r.value) for r in results]
            usage_tokens = sum(t.length for t in tokens)
        else:  # bi-encoder: the query's embedding against each item's
            adapter = runner.adapter
            inputs: list[TextInput | ImageInput] = [req.query, *docs]
            if images:  # an image query or image items: decoded on the tokenizer pool
                if req.query_image is not None:
                    inputs[0] = image_input(adapter, req.query_image, "query.image")
                for n, item in enumerate(req.items):
                    if item.image is not None:
                        inputs[n + 1] = image_input(adapter, item.image, f"items[{n}].image")
            tokens, results = await self._run(runner, inputs, req.options, timings, queries=1,
                                              prompts=(adapter.prompt(True),
                                                       adapter.prompt(False)))
            postprocess_started = time.monotonic()
            scores = adapter.similarity([r.value for r in results])
            usage_tokens = sum(t.length for t in tokens)  # the query was computed too
            tokens = tokens[1:]
        order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
        if req.top_k is not None:
            order = order[: req.top_k]
        ranked = []
        for rank, index in enumerate(order, start=1):
            row: dict[str, Any] = {"index": index, "score": scores[index], "rank": rank}
            if req.items[index].id is not None:
                row["id"] = req.items[index].id
            if tokens[index].truncated or index in clipped:
                row["truncated"] = True
            ranked.append(row)
        body = {"model": entry.config.id, "results": ranked, "usage": {"tokens": usage_tokens}}
        self._answered(entry.config.id, timings, postprocess_started)
        return Outcome(body, timings, entry.config.id)

    # ---- extract -----------------------------------------------------------------------
    async def extract(self, model: str, req: ExtractRequest) -> Outcome:
        entry, runner = await self._runner_for(model, "extract", req.options.adapter)
        timings = Timings()
        inputs = runner.adapter.extract_inputs([i.text for i in req.items], req.labels,
                                               req.threshold)
        tokens, results = await self._run(runner, inputs, req.options, timings)
        postprocess_started = time.monotonic()
        wanted = None if req.labels is None else {x.upper() for x in req.labels}
        items = []
        for item, tok, res in zip(req.items, tokens, results, strict=True):
            entities: list[Entity] = [
                e for e in res.value
                if (wanted is None or e.label.upper() in wanted) and e.score >= req.threshold]
            out: dict[str, Any] = {"entities": [e.to_wire() for e in entities],
                                   "tokens": tok.length, "truncated": tok.truncated}
            if item.id is not None:
                out["id"] = item.id
            items.append(out)
        body = {"model": entry.config.id, "items": items,
                "usage": {"tokens": sum(t.length for t in tokens)}}
        self._answered(entry.config.id, timings, postprocess_started)
        return Outcome(body, timings, entry.config.id)
