"""encode with ``chunking``: each text split into chunks that are computed as items of their
own, then folded back into their item's answer.

InferenceService.encode calls ``plan_chunks`` before computing: it tokenizes every text once
with the model's own tokenizer (on the tokenizer pool: the texts are long), checks the
options against the model, and cuts the texts (heron.worker.chunking). The request it then
computes is ``ChunkPlan.rows``: one plain text item per chunk, ``text[start:end]``, with the
request's prompt and outputs, so a chunk's vector is exactly that of its text sent alone,
and the batcher costs each chunk as the item of its own it is. ``ChunkPlan.fold`` turns the
rows' answers back into one answer per item: its ``chunks``, the pooled ``dense`` with
``pool: "mean"``, ``tokens`` summed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from dataclasses import dataclass
from typing import Any

import numpy as np

from heron.worker.adapters import Adapter
from heron.worker.chunking import Chunk, min_chunks, split_text
from heron.worker.outputs import quantize, truncate_dims
from heron.worker.runner import ItemResult, ModelRunner
from heron_sdk.chunking import ChunkingOptions, check_chunking
from heron_sdk.errors import ErrorCode, HeronError, invalid_field
from heron_sdk.types import MAX_ITEMS_PER_REQUEST, EncodeRequest, Item, wire_array

# A request's chunks, over all its items: each is a row the model computes, so the bound on
# a request's rows (its items) bounds them too. Through a gateway, it applies to each work
# item (the gateway cannot count tokens, and slices long texts apart).
MAX_CHUNKS_PER_REQUEST = MAX_ITEMS_PER_REQUEST


@dataclass(slots=True)
class ChunkPlan:
    request: EncodeRequest  # as the client sent it
    rows: EncodeRequest  # what is computed: one text item per chunk
    chunks: list[list[Chunk]]  # each item's chunks, in order
    split_s: float  # tokenizing and cutting the texts (counted in the tokenize phase)

    def fold(self, rows: list[dict[str, Any]], results: list[ItemResult],
             normalize: bool) -> list[dict[str, Any]]:
        """Each item's answer from its chunks' rows (wire-ready dicts) and results (the
        float vectors that ``pool: "mean"`` averages)."""
        req, pool = self.request, self.request.chunking.pool  # type: ignore[union-attr]
        out: list[dict[str, Any]] = []
        first = 0
        for n, (item, chunks) in enumerate(zip(req.items, self.chunks, strict=True)):
            mine = rows[first:first + len(chunks)]
            values = results[first:first + len(chunks)]
            first += len(chunks)
            truncated = any(row.get("truncated") for row in mine)
            if truncated and not req.options.truncate:  # tokenized unlike its own text
                raise HeronError(ErrorCode.INPUT_TOO_LONG,
                                 f"items[{n}]: a chunk came out longer than the model's limit"
                                 " and truncate is false; ask for a smaller max_tokens",
                                 field=f"items[{n}]")
            answer: dict[str, Any] = {} if item.id is None else {"id": item.id}
            answer["chunks"] = [{"start": c.start, "end": c.end,
                                 **{k: v for k, v in row.items() if k != "truncated"}}
                                for c, row in zip(chunks, mine, strict=True)]
            if pool == "mean":
                answer["dense"] = wire_array(quantize(self._mean(values, normalize),
                                                      req.output_dtype),
                                             req.options.encoding)
            answer["tokens"] = sum(row["tokens"] for row in mine)
            answer["truncated"] = truncated
            out.append(answer)
        return out

    def _mean(self, values: list[ItemResult], normalize: bool) -> np.ndarray:
        """The mean of the chunks' dense vectors as answered (after ``dims``, before the
        output dtype), unit length when the model normalizes its vectors."""
        vectors = np.stack([truncate_dims(v.value["dense"], self.request.dims, normalize)
                            for v in values]).astype(np.float32)
        mean = vectors.mean(axis=0)
        if normalize:
            mean /= max(float(np.linalg.norm(mean)), 1e-12)
        return mean


async def plan_chunks(runner: ModelRunner, req: EncodeRequest, prompt: str) -> ChunkPlan:
    """The chunks of every text of ``req`` (which has ``chunking``), and the request of
    chunk texts to compute. 422 for options the model cannot meet, 413 TOO_MANY_ITEMS for
    more than MAX_CHUNKS_PER_REQUEST chunks."""
    check_chunking(req.chunking, req.items, req.output_types)
    started = time.monotonic()
    # On the tokenizer pool, where runner.tokenize sends long inputs: these texts would
    # hold the event loop (read from the runner, which has no public door to its pool).
    chunks = await asyncio.get_running_loop().run_in_executor(
        runner._tokenize_pool, split_texts, runner.adapter, req, prompt)
    rows = [Item(item.text[c.start:c.end])
            for item, cuts in zip(req.items, chunks, strict=True) for c in cuts]
    # Chunks fit the model by construction: a truncated one is found, and told, in fold.
    options = dataclasses.replace(req.options, truncate=True)
    return ChunkPlan(req, dataclasses.replace(req, items=rows, chunking=None, options=options),
                     chunks, time.monotonic() - started)


def split_texts(adapter: Adapter, req: EncodeRequest, prompt: str) -> list[list[Chunk]]:
    """Tokenize each text of ``req`` with the model's tokenizer and cut it (on a tokenizer
    pool thread)."""
    options: ChunkingOptions = req.chunking  # type: ignore[assignment]
    model = adapter.config.id
    tokenizer = adapter.tokenizer
    if not getattr(tokenizer, "is_fast", False):
        raise invalid_field("chunking", f"model {model}'s tokenizer gives no character "
                                        "offsets (it has no fast tokenizer): its texts cannot "
                                        "be chunked")
    # What a chunk's text is wrapped in when encoded: special tokens, the prompt, markers.
    around = adapter.tokenize([""], req.is_query, prompt)[0].length
    limit = adapter.max_length - around
    if limit < 1:
        raise invalid_field("chunking", f"model {model} has no room for a chunk: its "
                                        f"{adapter.max_length} tokens hold {around} of prompt "
                                        "and special tokens")
    max_tokens = options.max_tokens or limit
    if max_tokens > limit:
        raise invalid_field("chunking.max_tokens",
                            f"{max_tokens} is over model {model}'s {limit} tokens a chunk (its "
                            f"max_sequence_length {adapter.max_length} less {around} of prompt "
                            "and special tokens)")
    if options.overlap >= max_tokens:
        raise invalid_field("chunking.overlap", f"must be less than max_tokens ({max_tokens}),"
                                                f" got {options.overlap}")
    texts = [item.text for item in req.items]
    # The model's own lowercasing, where it keeps every character's place.
    seen = [t.lower() if adapter.lowercase and len(t.lower()) == len(t) else t for t in texts]
    # The adapter's lock: a fast tokenizer's truncation settings are state every call
    # rewrites (Adapter.tokenize), and this call sets none.
    with adapter._tokenize_lock:
        encoded = tokenizer(seen, add_special_tokens=False, truncation=False,
                            return_attention_mask=False, return_token_type_ids=False,
                            return_offsets_mapping=True)
    offsets = encoded["offset_mapping"]
    least = sum(min_chunks(len(o), max_tokens) for o in offsets)
    if least > MAX_CHUNKS_PER_REQUEST:  # refused before cutting
        raise too_many_chunks(least, at_least=True)
    chunks = [split_text(text, spans, max_tokens, options.overlap, options.strategy)
              for text, spans in zip(texts, offsets, strict=True)]
    total = sum(len(c) for c in chunks)
    if total > MAX_CHUNKS_PER_REQUEST:
        raise too_many_chunks(total)
    return chunks


def too_many_chunks(count: int, at_least: bool = False) -> HeronError:
    return HeronError(ErrorCode.TOO_MANY_ITEMS,
                      f"chunking: the texts make {'at least ' if at_least else ''}{count} "
                      f"chunks, over the limit of {MAX_CHUNKS_PER_REQUEST} per request; raise "
                      "max_tokens or send fewer texts a request", field="chunking")
