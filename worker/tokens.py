"""The tokenizer calls (heron.runtime.token_calls): a model's tokens for texts, and text for
token ids, from the model's own tokenizer. Both the worker's HTTP API (heron.worker.app) and
its queue consumer (work items of task ``tokenize`` or ``decode``) answer through here.

Tokenizing runs on a thread (a long text takes milliseconds) under the adapter's tokenizer
lock: a fast tokenizer keeps truncation settings as state that a concurrent encode would
rewrite. Nothing here is batched or queued behind forward passes.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from heron.runtime.token_calls import DecodeRequest, TokenizeRequest
from heron.worker.adapters import Adapter
from heron.worker.registry import ModelRegistry
from heron.worker.service import Outcome, Timings
from heron_sdk.errors import ErrorCode, HeronError
from heron_sdk.types import INPUT_TYPES

TOKEN_TASKS = frozenset({"tokenize", "decode"})


def _byte_offsets(text: str) -> list[int]:
    """Byte offset (UTF-8) of each character position of ``text``, and of its end."""
    out = [0]
    for char in text:
        out.append(out[-1] + len(char.encode()))
    return out


def tokens_of(adapter: Adapter, text: str, add_special_tokens: bool) -> list[dict[str, Any]]:
    """TEI's SimpleTokens of ``text``: id, text (the input's own characters for a regular
    token, the token for a special one), special, start and stop as byte offsets into
    ``text`` (None for special tokens, and where the tokenizer gives no offsets)."""
    tokenizer = adapter.tokenizer
    fast = bool(getattr(tokenizer, "is_fast", False))
    seen = text.lower() if adapter.lowercase else text  # what the model tokenizes
    with adapter._tokenize_lock:  # the adapter's: see the module's docstring
        enc = tokenizer(seen, add_special_tokens=add_special_tokens, truncation=False,
                        return_attention_mask=False, return_special_tokens_mask=True,
                        return_offsets_mapping=fast)
    ids: list[int] = enc["input_ids"]
    special: list[int] = enc["special_tokens_mask"]
    offsets = enc.get("offset_mapping") if fast else None
    pieces = tokenizer.convert_ids_to_tokens(ids)
    to_bytes = None if seen.isascii() else _byte_offsets(seen)
    out: list[dict[str, Any]] = []
    for i, token_id in enumerate(ids):
        if special[i] or offsets is None:
            out.append({"id": int(token_id), "text": str(pieces[i]),
                        "special": bool(special[i]), "start": None, "stop": None})
            continue
        start, stop = offsets[i]
        out.append({"id": int(token_id), "text": seen[start:stop], "special": False,
                    "start": start if to_bytes is None else to_bytes[start],
                    "stop": stop if to_bytes is None else to_bytes[stop]})
    return out


class TokenService:
    """tokenize and decode over the registry's loaded models."""

    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry

    async def _adapter(self, model: str) -> tuple[str, Adapter]:
        entry, runner = await self.registry.acquire(model)  # 503 MODEL_LOADING: loading now
        adapter = runner.adapter
        if getattr(adapter, "tokenizer", None) is None:
            raise HeronError(ErrorCode.UNSUPPORTED_TASK,
                             f"model {entry.config.id} has no tokenizer")
        return entry.config.id, adapter

    async def tokenize(self, model: str, req: TokenizeRequest) -> Outcome:
        timings = Timings()
        model_id, adapter = await self._adapter(model)
        side = INPUT_TYPES.get(req.input_type or "document", "document")
        prompt = adapter.prompt(side == "query", None, req.input_type)
        started = time.monotonic()
        texts = [prompt + item.text for item in req.items]
        rows = await asyncio.to_thread(
            lambda: [tokens_of(adapter, t, req.add_special_tokens) for t in texts])
        timings.tokenize = time.monotonic() - started
        timings.total = time.monotonic() - timings.started
        body = {"model": model_id, "items": [{"tokens": row} for row in rows],
                "usage": {"tokens": sum(len(row) for row in rows)}}
        return Outcome(body, timings, model_id)

    async def decode(self, model: str, req: DecodeRequest) -> Outcome:
        timings = Timings()
        model_id, adapter = await self._adapter(model)
        vocab = len(adapter.tokenizer)  # added tokens included
        for n, ids in enumerate(req.sequences):
            bad = next((t for t in ids if t >= vocab), None)
            if bad is not None:
                raise HeronError(ErrorCode.INVALID_FIELD,
                                 f"items[{n}]: token id {bad} is outside model {model_id}'s "
                                 f"vocabulary of {vocab}", field=f"items[{n}]")
        started = time.monotonic()
        skip = req.skip_special_tokens

        def decode_all() -> list[str]:
            with adapter._tokenize_lock:  # a concurrent encode may rewrite its settings
                return [adapter.tokenizer.decode(list(ids), skip_special_tokens=skip)
                        for ids in req.sequences]

        texts = await asyncio.to_thread(decode_all)
        timings.tokenize = time.monotonic() - started
        timings.total = time.monotonic() - timings.started
        body = {"model": model_id, "items": [{"text": text} for text in texts],
                "usage": {"tokens": sum(len(ids) for ids in req.sequences)}}
        return Outcome(body, timings, model_id)
