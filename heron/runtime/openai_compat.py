"""OpenAI-compatible `POST /v1/embeddings` bodies: parsing and answers (worker and gateway).

The body takes OpenAI's own fields (``EMBEDDINGS_FIELDS``); ``user`` is read and not used.
Any other field is refused naming it, as on Heron's own routes. Errors take OpenAI's shape
and statuses (``openai_error``), so the official clients raise their own exception classes."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from heron.runtime.modelconfig import split_adapter
from heron_sdk.errors import ErrorCode, HeronError, invalid_field
from heron_sdk.types import (
    INPUT_TYPES,
    MAX_INTEGER,
    MAX_ITEMS_PER_REQUEST,
    EncodeRequest,
    Item,
    check_fields,
    check_finite,
    check_text,
    check_token_ids,
    integral,
)
from heron_sdk.wire import array_to_base64

# Every field of OpenAI's embeddings request (platform.openai.com/docs/api-reference/embeddings),
# and input_type (sent by the openai client as extra_body): the side of a search the texts are
# on, as on /v1/encode.
EMBEDDINGS_FIELDS = frozenset({"input", "model", "encoding_format", "dimensions", "user",
                               "input_type"})


def parse_embeddings_request(body: Any) -> tuple[str, EncodeRequest, str]:
    """(model, the encode request, encoding_format) from an OpenAI embeddings body."""
    if not isinstance(body, Mapping):
        raise HeronError(ErrorCode.MALFORMED_BODY, "body must be an object")
    check_fields(body, EMBEDDINGS_FIELDS)
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid_field("user", "must be a string")
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_field("model", "is required and must be a string")
    items = _input_items(body.get("input"))
    if len(items) > MAX_ITEMS_PER_REQUEST:
        raise HeronError(ErrorCode.TOO_MANY_ITEMS,
                         f"input: {len(items)} items is over the limit of "
                         f"{MAX_ITEMS_PER_REQUEST}", field="input")
    encoding = body.get("encoding_format")
    encoding = "float" if encoding is None else encoding  # "" and false are errors, too
    if encoding not in ("float", "base64"):
        raise invalid_field("encoding_format", "must be 'float' or 'base64'")
    check_finite(body.get("dimensions"), "dimensions")
    dims = integral(body.get("dimensions"))
    if dims is not None and (isinstance(dims, bool) or not isinstance(dims, int)
                             or not 0 < dims <= MAX_INTEGER):
        raise invalid_field("dimensions", f"must be an integer from 1 to {MAX_INTEGER}")
    input_type = body.get("input_type")
    if input_type is not None and (not isinstance(input_type, str)
                                   or input_type not in INPUT_TYPES):
        raise invalid_field("input_type", f"must be one of {list(INPUT_TYPES)}")
    req = EncodeRequest(items=items, dims=dims, input_type=input_type,
                        is_query=INPUT_TYPES.get(input_type or "") == "query")
    # "model@adapter" names a LoRA adapter of the model (docs/api.md)
    return split_adapter(model, req.options), req, encoding


def _input_items(raw: Any) -> list[Item]:
    """OpenAI's four input forms: a string, a list of strings, a list of token ids (one
    input), a list of lists of token ids. Token ids are the model's own tokenizer's."""
    if raw is None:
        raise invalid_field("input", "is required")
    if isinstance(raw, str):
        return [Item(check_text(raw, "input"))]
    if not isinstance(raw, list) or not raw:
        raise invalid_field("input", "must be a string, a non-empty list of strings, a list "
                            "of token ids or a list of lists of token ids")
    if all(isinstance(t, str) for t in raw):
        return [Item(check_text(t, f"input[{i}]")) for i, t in enumerate(raw)]
    if all(isinstance(t, list) for t in raw):
        return [Item.of_tokens(check_token_ids(t, f"input[{i}]")) for i, t in enumerate(raw)]
    if all(isinstance(integral(t), int) for t in raw):
        return [Item.of_tokens(check_token_ids(raw, "input"))]
    raise invalid_field("input", "must be all strings, all token ids, or all lists of "
                        "token ids")


def embeddings_response(model: str, vectors: list, tokens: int, encoding: str) -> dict:
    data = [{"object": "embedding", "index": i,
             "embedding": array_to_base64(v) if encoding == "base64" else v.tolist()}
            for i, v in enumerate(vectors)]
    return {"object": "list", "data": data, "model": model,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


# OpenAI's statuses: a request it cannot take is a 400 (its clients raise BadRequestError);
# the rest keep Heron's (404 NotFoundError, 429 RateLimitError, 503 with Retry-After, which
# the official clients wait out when they retry).
_OPENAI_STATUS = {413: 400, 415: 400, 422: 400}
_OPENAI_TYPE = {400: "invalid_request_error", 401: "authentication_error",
                403: "permission_error", 404: "invalid_request_error",
                409: "invalid_request_error", 429: "rate_limit_error"}


def openai_error(exc: HeronError) -> tuple[int, dict[str, Any]]:
    """A HeronError in OpenAI's error shape: ``{"error": {message, type, param, code}}``."""
    status = _OPENAI_STATUS.get(exc.status, exc.status)
    kind = _OPENAI_TYPE.get(status, "server_error")
    return status, {"error": {"message": exc.message, "type": kind, "param": exc.field,
                              "code": str(exc.code).lower()}}
