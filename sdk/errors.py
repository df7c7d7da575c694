"""One error type and one table of error codes, shared by every Heron server and the SDK.

Every error on the wire is ``{"error": {"code": "...", "message": "..."}}`` with the HTTP
status this table gives for its code.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import Any


class ErrorCode(StrEnum):
    MALFORMED_BODY = "MALFORMED_BODY"
    UNSUPPORTED_MEDIA_TYPE = "UNSUPPORTED_MEDIA_TYPE"
    INVALID_FIELD = "INVALID_FIELD"
    UNSUPPORTED_OUTPUT = "UNSUPPORTED_OUTPUT"
    UNSUPPORTED_TASK = "UNSUPPORTED_TASK"
    INPUT_TOO_LONG = "INPUT_TOO_LONG"
    PAYLOAD_TOO_LARGE = "PAYLOAD_TOO_LARGE"
    TOO_MANY_ITEMS = "TOO_MANY_ITEMS"
    MODEL_NOT_FOUND = "MODEL_NOT_FOUND"
    ADAPTER_NOT_FOUND = "ADAPTER_NOT_FOUND"
    NOT_FOUND = "NOT_FOUND"
    METHOD_NOT_ALLOWED = "METHOD_NOT_ALLOWED"
    QUEUE_FULL = "QUEUE_FULL"
    MODEL_LOADING = "MODEL_LOADING"
    INSUFFICIENT_MEMORY = "INSUFFICIENT_MEMORY"
    NOT_READY = "NOT_READY"
    NATS_UNAVAILABLE = "NATS_UNAVAILABLE"
    MODEL_LOAD_FAILED = "MODEL_LOAD_FAILED"
    DEADLINE_EXCEEDED = "DEADLINE_EXCEEDED"
    INTERNAL = "INTERNAL"
    NOT_LEADER = "NOT_LEADER"
    CONTENT_CONFLICT = "CONTENT_CONFLICT"
    UNAUTHORIZED = "UNAUTHORIZED"
    FORBIDDEN = "FORBIDDEN"
    POOL_NOT_FOUND = "POOL_NOT_FOUND"
    POOL_CONFLICT = "POOL_CONFLICT"
    IMAGE_INVALID = "IMAGE_INVALID"
    IMAGE_TOO_LARGE = "IMAGE_TOO_LARGE"
    TOO_MANY_IMAGES = "TOO_MANY_IMAGES"
    IMAGE_URL_REFUSED = "IMAGE_URL_REFUSED"
    IMAGE_FETCH_FAILED = "IMAGE_FETCH_FAILED"
    JOB_NOT_FOUND = "JOB_NOT_FOUND"
    JOB_PATH_FORBIDDEN = "JOB_PATH_FORBIDDEN"


STATUS_BY_CODE: dict[ErrorCode, int] = {
    ErrorCode.MALFORMED_BODY: 400,
    ErrorCode.UNSUPPORTED_MEDIA_TYPE: 415,
    ErrorCode.INVALID_FIELD: 422,
    ErrorCode.UNSUPPORTED_OUTPUT: 422,
    ErrorCode.UNSUPPORTED_TASK: 422,
    ErrorCode.INPUT_TOO_LONG: 422,
    ErrorCode.PAYLOAD_TOO_LARGE: 413,
    ErrorCode.TOO_MANY_ITEMS: 413,
    ErrorCode.MODEL_NOT_FOUND: 404,
    ErrorCode.ADAPTER_NOT_FOUND: 404,
    ErrorCode.NOT_FOUND: 404,
    ErrorCode.METHOD_NOT_ALLOWED: 405,
    ErrorCode.QUEUE_FULL: 429,
    ErrorCode.MODEL_LOADING: 503,
    ErrorCode.INSUFFICIENT_MEMORY: 503,
    ErrorCode.NOT_READY: 503,
    ErrorCode.NATS_UNAVAILABLE: 503,
    ErrorCode.MODEL_LOAD_FAILED: 502,
    ErrorCode.DEADLINE_EXCEEDED: 504,
    ErrorCode.INTERNAL: 500,
    ErrorCode.NOT_LEADER: 503,
    ErrorCode.CONTENT_CONFLICT: 409,
    ErrorCode.UNAUTHORIZED: 401,
    ErrorCode.FORBIDDEN: 403,
    ErrorCode.POOL_NOT_FOUND: 404,
    ErrorCode.POOL_CONFLICT: 409,
    ErrorCode.IMAGE_INVALID: 422,
    ErrorCode.IMAGE_TOO_LARGE: 413,
    ErrorCode.TOO_MANY_IMAGES: 413,
    ErrorCode.IMAGE_URL_REFUSED: 422,
    ErrorCode.IMAGE_FETCH_FAILED: 422,
    ErrorCode.JOB_NOT_FOUND: 404,
    ErrorCode.JOB_PATH_FORBIDDEN: 403,
}


class HeronError(Exception):
    """An error with a machine-readable code; servers map it to its HTTP status.

    The SDK raises the subclasses below. There ``code`` is the server's code (a plain
    string when this SDK does not know it yet) and ``status`` the HTTP status received.
    """

    def __init__(
        self,
        code: ErrorCode | str,
        message: str,
        *,
        field: str | None = None,
        retry_after_s: float | None = None,
        status: int | None = None,
    ) -> None:
        super().__init__(message)
        try:
            self.code: ErrorCode | str = ErrorCode(code)
        except ValueError:
            if type(self) is HeronError:  # servers only ever raise known codes
                raise
            self.code = str(code)
        self.message = message
        self.field = field
        self.retry_after_s = retry_after_s
        self._status = status

    @property
    def status(self) -> int:
        if self._status is not None:
            return self._status
        return STATUS_BY_CODE.get(self.code, 500)  # type: ignore[call-overload]

    def to_body(self) -> dict[str, Any]:
        error: dict[str, Any] = {"code": str(self.code), "message": self.message}
        if self.field is not None:
            error["field"] = self.field
        return {"error": error}

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.code!s}, {self.message!r})"


def invalid_field(field: str, reason: str) -> HeronError:
    """422 naming the offending field, e.g. ``items[3].text: must be a string``."""
    return HeronError(ErrorCode.INVALID_FIELD, f"{field}: {reason}", field=field)


# ---- what the SDK raises -------------------------------------------------------------------
# Client-side codes: no server sends these; they name what the SDK itself gave up on.
CONNECTION_FAILED = "CONNECTION_FAILED"
PROVISIONING_TIMEOUT = "PROVISIONING_TIMEOUT"


class RequestError(HeronError):
    """A 4xx: the request itself is wrong (or not allowed); sending it again will not help."""


class ModelNotFound(RequestError):
    """404 MODEL_NOT_FOUND: no model by that name (or not in the named pool's bundle)."""


class PoolError(RequestError):
    """A pool could not be used: POOL_NOT_FOUND (absent or expired) or POOL_CONFLICT."""


class ServerError(HeronError):
    """A 5xx (or a 429) that was still there when the call's retries ran out."""


class ProvisioningTimeout(HeronError):
    """No capacity came (202 or 503 with Retry-After) within ``provision_timeout_s``."""


class ConnectionError(HeronError):  # shadows the builtin inside heron_sdk.errors only
    """The server could not be reached (refused, reset, timed out) within the deadline."""


_POOL_CODES = {ErrorCode.POOL_NOT_FOUND, ErrorCode.POOL_CONFLICT}


def error_for_status(status: int, code: str, message: str, *, field: str | None = None,
                     retry_after_s: float | None = None) -> HeronError:
    """The typed SDK error for an HTTP error answer."""
    cls: type[HeronError]
    if code in _POOL_CODES:
        cls = PoolError
    elif code == ErrorCode.MODEL_NOT_FOUND:
        cls = ModelNotFound
    elif 400 <= status < 500 and status != 429:
        cls = RequestError
    else:
        cls = ServerError
    return cls(code or ErrorCode.INTERNAL, message, field=field, retry_after_s=retry_after_s,
               status=status)


def error_from_wire(error: Mapping[str, Any]) -> HeronError:
    """The typed SDK error of an ``error`` object (``{code, message, field?}``) found in a
    body: an item's own error in an encode or extract answer. Its status is its code's."""
    code = str(error.get("code") or ErrorCode.INTERNAL)
    field = error.get("field")
    return error_for_status(STATUS_BY_CODE.get(code, 500),  # type: ignore[call-overload]
                            code, str(error.get("message") or code),
                            field=field if isinstance(field, str) else None)


class ProtocolError(ValueError):
    """A message between Heron's processes (a work item's headers, a result, a heartbeat,
    a pool lease, ...) that does not have its documented shape. Internal: never sent to a
    client; the reader drops the message and logs why (heron.runtime.protocol)."""
