"""Logs of every Heron process: one line per event, JSON or text, carrying the id of the
request being served (and its model, pool and worker) wherever it is known.

``configure_logging`` is called once per process by the ``heron`` command. A request's
handler calls ``bind_request``; every line logged while it runs (in its task, and in tasks
it starts) then carries ``request_id`` and whatever ``RequestContext`` fields are set. The
gateway and the worker bind the same id (the worker reads it from the work item's
``Heron-Request-Id`` header), so one grep finds a request in every component's log.

JSON line: ``{"timestamp", "level", "logger", "message", "request_id", "model", "pool",
"worker_id", "trace_id", "span_id", ...extra fields, "exception"}``, the optional ones only
when known. See docs/observability.md.
"""

from __future__ import annotations

import datetime
import logging
import os
import sys
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import orjson

from heron.runtime import telemetry
from heron.runtime.modelconfig import ConfigError

LOG_FORMAT_ENV = "HERON_LOG_FORMAT"
LOG_LEVEL_ENV = "HERON_LOG_LEVEL"
FORMATS = ("json", "text")
TRACE = 5  # uvicorn's "trace" level, below debug
# Libraries whose info lines are one per outgoing request: shown at debug and below only.
QUIET_BELOW_DEBUG = ("httpx",)
LEVELS = {"critical": logging.CRITICAL, "error": logging.ERROR, "warning": logging.WARNING,
          "info": logging.INFO, "debug": logging.DEBUG, "trace": TRACE}


@dataclass(slots=True)
class RequestContext:
    """The request a task is serving. Mutable on purpose: a handler fills in ``model`` and
    ``pool`` once it has routed the request, and the lines its parent task logs later
    (the request's summary) see them too."""

    request_id: str
    model: str | None = None
    pool: str | None = None


_current: ContextVar[RequestContext | None] = ContextVar("heron_request", default=None)
# Fields of the whole process (worker_id and pool of a worker): on every line.
_process_fields: dict[str, str] = {}
_json = False  # configure_logging chose JSON: libraries must not print lines of their own


def bind_request(request_id: str, *, model: str | None = None,
                 pool: str | None = None) -> RequestContext:
    """Attach a request to the running task's context (and the tasks it starts later).
    Not reset on purpose: every request runs in a task of its own (uvicorn's per-request
    task, the consumer's per-item task), so nothing leaks, and the error handlers that run
    after the handler returned still log the id."""
    context = RequestContext(request_id, model, pool)
    _current.set(context)
    return context


def current_request() -> RequestContext | None:
    return _current.get()


# Attributes every LogRecord has; anything else on a record came from ``extra=``
# (uvicorn's color_message is its message again, with terminal colour codes).
_RECORD_ATTRS = frozenset(logging.LogRecord("", 0, "", 0, "", (), None).__dict__) | {
    "message", "asctime", "taskName", "color_message"}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "timestamp": datetime.datetime.fromtimestamp(record.created, datetime.UTC)
            .isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        out.update(_process_fields)
        context = _current.get()
        if context is not None:
            out["request_id"] = context.request_id
            if context.model is not None:
                out["model"] = context.model
            if context.pool is not None:
                out["pool"] = context.pool
        ids = telemetry.current_trace_ids()
        if ids is not None:
            out["trace_id"], out["span_id"] = ids
        for key, value in record.__dict__.items():
            if key not in _RECORD_ATTRS and not key.startswith("_"):
                out[key] = value
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        if record.stack_info:
            out["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(out, default=str).decode()


class TextFormatter(logging.Formatter):
    """``2026-01-01 12:00:00,000 INFO heron.gateway message [request_id=... model=...]``"""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        context = _current.get()
        if context is None:
            return line
        tags = [f"request_id={context.request_id}"]
        if context.model is not None:
            tags.append(f"model={context.model}")
        if context.pool is not None:
            tags.append(f"pool={context.pool}")
        first, newline, rest = line.partition("\n")  # keep a traceback below the tags
        return f"{first} [{' '.join(tags)}]{newline}{rest}"


def parse_level(level: str) -> int:
    try:
        return LEVELS[level.strip().lower()]
    except KeyError:
        raise ConfigError("--log-level", level, f"must be one of {', '.join(LEVELS)}"
                          ) from None


def log_format(default: str) -> str:
    """``HERON_LOG_FORMAT``, or ``default`` when unset."""
    fmt = (os.environ.get(LOG_FORMAT_ENV) or default).strip().lower()
    if fmt not in FORMATS:
        raise ConfigError(LOG_FORMAT_ENV, fmt, f"must be one of {', '.join(FORMATS)}")
    return fmt


def configure_logging(level: str = "info", fmt: str = "text",
                      **process_fields: str) -> None:
    """Send every logger's records (uvicorn's too, see ``uvicorn_log_config``) to stderr
    in ``fmt``, at ``level`` and above. ``process_fields`` go on every line. Raises
    ConfigError on an unknown level or format."""
    global _json
    numeric = parse_level(level)
    if fmt not in FORMATS:
        raise ConfigError(LOG_FORMAT_ENV, fmt, f"must be one of {', '.join(FORMATS)}")
    logging.addLevelName(TRACE, "TRACE")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(numeric)
    # httpx logs each request it sends at info, whole URL included: a config resync every
    # 30 s in every gateway and worker, and each image URL fetched with its query string (a
    # signed URL's credentials). Those lines show at debug only.
    for chatty in QUIET_BELOW_DEBUG:
        logging.getLogger(chatty).setLevel(logging.WARNING if numeric > logging.DEBUG
                                           else logging.NOTSET)
    # Python's warnings would otherwise print raw lines to stderr, between the JSON ones;
    # so would the Hugging Face libraries' progress bars (this variable is read when
    # huggingface_hub is imported, later; adopt_library_logs covers the imported ones).
    _json = fmt == "json"
    logging.captureWarnings(_json)
    if _json:
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        adopt_library_logs()
    _process_fields.clear()
    _process_fields.update({k: v for k, v in process_fields.items() if v})


def adopt_library_logs() -> None:
    """In JSON mode, make the libraries that print on their own go through our handler:
    transformers has its own stderr handler (``[transformers] ...`` lines) and tqdm bars
    ("Loading weights"). Call it after they are imported (the worker does, at start);
    libraries not imported yet are left alone (importing transformers costs seconds)."""
    if not _json:
        return
    transformers_logging = sys.modules.get("transformers.utils.logging")
    if transformers_logging is not None:
        transformers_logging.disable_default_handler()
        transformers_logging.enable_propagation()
        transformers_logging.disable_progress_bar()
    hub_utils = sys.modules.get("huggingface_hub.utils")
    if hub_utils is not None:
        hub_utils.disable_progress_bars()


def uvicorn_log_config() -> dict[str, Any] | None:
    """What to give uvicorn as ``log_config``: None (configure nothing: its records go to
    the root handler, in our format) once ``configure_logging`` ran; else uvicorn's own
    default, so an embedded server still prints its messages."""
    if logging.getLogger().handlers:
        return None
    from uvicorn.config import LOGGING_CONFIG

    return LOGGING_CONFIG
