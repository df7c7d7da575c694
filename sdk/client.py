"""A minimal synchronous client (msgpack by default, JSON on request).

Issue #5 grows this into the full SDK (typed results, AsyncClient, capacity waits, pools);
the call shapes here are the ones it keeps.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx

from sdk import wire
from sdk.errors import ErrorCode, HeronError
from sdk.types import EncodeRequest, ExtractRequest, Item, RequestOptions, ScoreRequest

ItemLike = str | Item


def _items(items: Sequence[ItemLike] | str) -> list[Item]:
    if isinstance(items, str):
        items = [items]
    return [i if isinstance(i, Item) else Item(i) for i in items]


class Client:
    def __init__(self, base_url: str = "http://127.0.0.1:8080", *, wire_format: str = "msgpack",
                 timeout: float = 60.0) -> None:
        self._fmt = wire.MSGPACK if wire_format == "msgpack" else wire.JSON
        self._http = httpx.Client(base_url=base_url, timeout=timeout)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        response = self._http.post(path, content=wire.encode(body, self._fmt),
                                   headers={"content-type": self._fmt, "accept": self._fmt})
        return self._decode(response)

    def _get(self, path: str) -> dict[str, Any]:
        return self._decode(self._http.get(path, headers={"accept": self._fmt}))

    @staticmethod
    def _decode(response: httpx.Response) -> dict[str, Any]:
        fmt = wire.media_type(response.headers.get("content-type")) or wire.JSON
        body = wire.decode(response.content, fmt) if response.content else {}
        if response.status_code >= 400 or "error" in body:
            error = body.get("error", {}) if isinstance(body, dict) else {}
            try:
                code = ErrorCode(error.get("code"))
            except ValueError:
                code = ErrorCode.INTERNAL
            retry = response.headers.get("retry-after")
            raise HeronError(code, error.get("message", response.text),
                             field=error.get("field"),
                             retry_after_s=float(retry) if retry else None)
        return body

    def encode(self, model: str, items: Sequence[ItemLike] | str, *,
               output_types: Sequence[str] = ("dense",), output_dtype: str = "float32",
               dims: int | None = None, is_query: bool = False, instruction: str | None = None,
               truncate: bool = True, priority: int = 0,
               timeout_s: float | None = None) -> dict[str, Any]:
        req = EncodeRequest(items=_items(items), output_types=tuple(output_types),
                            output_dtype=output_dtype, dims=dims, is_query=is_query,
                            instruction=instruction,
                            options=RequestOptions(truncate=truncate, priority=priority,
                                                   timeout_s=timeout_s))
        return self._post(f"/v1/encode/{model}", req.to_wire())

    def score(self, model: str, query: str, items: Sequence[ItemLike], *,
              top_k: int | None = None, truncate: bool = True) -> dict[str, Any]:
        req = ScoreRequest(query=query, items=_items(items), top_k=top_k,
                           options=RequestOptions(truncate=truncate))
        return self._post(f"/v1/score/{model}", req.to_wire())

    def extract(self, model: str, items: Sequence[ItemLike] | str, *,
                labels: Sequence[str] | None = None, threshold: float = 0.0) -> dict[str, Any]:
        req = ExtractRequest(items=_items(items), labels=None if labels is None else
                             list(labels), threshold=threshold)
        return self._post(f"/v1/extract/{model}", req.to_wire())

    def list_models(self) -> list[dict[str, Any]]:
        return self._get("/v1/models")["data"]

    def get_model(self, model: str) -> dict[str, Any]:
        return self._get(f"/v1/models/{model}")
