"""OpenTelemetry tracing, set up the same way in the gateway and the worker. Off by default.

``HERON_TRACING``: ``off`` (default), ``console`` (spans printed as JSON to stdout) or
``otlp`` (OTLP over HTTP/protobuf to ``OTEL_EXPORTER_OTLP_ENDPOINT``, default
``http://localhost:4318``; the other standard ``OTEL_EXPORTER_OTLP_*`` variables apply).
``OTEL_SERVICE_NAME`` names the service (default ``heron-gateway`` / ``heron-worker``).

Off costs next to nothing: every helper here checks one module flag and returns a shared
no-op (no span objects, no context switches, no headers). On, the trace context crosses
NATS in each work item's headers (W3C ``traceparent``, through OTel's propagator) and HTTP
in the request's ``traceparent``; a malformed one is ignored (a new trace starts).

Span names are ``<scope>.<phase>``: ``heron.gateway.request``, ``heron.worker.tokenize``...
(docs/observability.md lists them with their attributes).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any

from opentelemetry import context as otel_context
from opentelemetry import propagate, trace
from opentelemetry.trace import Span, SpanKind, Status, StatusCode

from heron.runtime.modelconfig import ConfigError

if TYPE_CHECKING:  # the SDK is imported only when tracing is turned on
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SpanExporter

TRACING_ENV = "HERON_TRACING"
MODES = ("off", "console", "otlp")
GATEWAY = "heron.gateway"  # instrumentation scopes, and the prefix of their span names
WORKER = "heron.worker"

_provider: TracerProvider | None = None
_tracers: dict[str, trace.Tracer] = {}
_enabled = False
_NO_SPAN: contextlib.nullcontext[None] = contextlib.nullcontext()


def tracing_mode() -> str:
    mode = (os.environ.get(TRACING_ENV) or "off").strip().lower()
    if mode not in MODES:
        raise ConfigError(TRACING_ENV, mode, f"must be one of {', '.join(MODES)}")
    return mode


def setup_tracing(service_name: str, *, exporter: SpanExporter | None = None) -> bool:
    """Turn tracing on for this process, as ``HERON_TRACING`` says, or with ``exporter``
    (tests: an InMemorySpanExporter, spans exported as they end). True when on. Raises
    ConfigError on an unknown mode."""
    global _provider, _enabled
    from opentelemetry.sdk.resources import SERVICE_NAME, Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor

    if exporter is None:
        mode = tracing_mode()
        if mode == "off":
            return False
        if mode == "console":
            from opentelemetry.sdk.trace.export import ConsoleSpanExporter

            exporter = ConsoleSpanExporter(out=sys.stdout)  # today's stdout, not import's
        else:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                OTLPSpanExporter,
            )

            exporter = OTLPSpanExporter()
        # Spans leave in batches, on the processor's thread: never I/O on the event loop.
        processor: Any = BatchSpanProcessor(exporter)
    else:
        processor = SimpleSpanProcessor(exporter)
    shutdown_tracing()
    # OTEL_SERVICE_NAME and OTEL_RESOURCE_ATTRIBUTES are read by Resource.create; an
    # explicit service.name would override them, so it is given only as the fallback.
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {SERVICE_NAME: service_name}
    _provider = TracerProvider(resource=Resource.create(attributes))
    _provider.add_span_processor(processor)
    _enabled = True
    return True


def shutdown_tracing() -> None:
    """Export what is buffered and go back to no-op (process exit, end of a test)."""
    global _provider, _enabled
    _enabled = False
    _tracers.clear()
    if _provider is not None:
        _provider.shutdown()
        _provider = None


def enabled() -> bool:
    return _enabled


def _tracer(scope: str) -> trace.Tracer:
    tracer = _tracers.get(scope)
    if tracer is None:
        assert _provider is not None
        tracer = _tracers[scope] = _provider.get_tracer(scope)
    return tracer


# ---- spans --------------------------------------------------------------------------------
def span(scope: str, phase: str, *, kind: SpanKind = SpanKind.INTERNAL,
         attributes: Mapping[str, Any] | None = None,
         parent: otel_context.Context | None = None
         ) -> contextlib.AbstractContextManager[Span | None]:
    """``with span(WORKER, "tokenize") as s:``: a span named ``heron.worker.tokenize``,
    current inside the block (child of the current one, or of ``parent``); ``s`` is None
    when tracing is off."""
    if not _enabled:
        return _NO_SPAN
    return _tracer(scope).start_as_current_span(f"{scope}.{phase}", context=parent,
                                                kind=kind, attributes=attributes)


def start_span(scope: str, phase: str, *, kind: SpanKind = SpanKind.INTERNAL,
               attributes: Mapping[str, Any] | None = None,
               parent: otel_context.Context | None = None) -> Span | None:
    """A span made current in the running task until it ends (``end_span``); for a span
    whose end is in a ``finally`` far from its start. None when tracing is off."""
    if not _enabled:
        return None
    started = _tracer(scope).start_span(f"{scope}.{phase}", context=parent, kind=kind,
                                        attributes=attributes)
    # Never detached: each request runs in a task of its own, whose context dies with it.
    otel_context.attach(trace.set_span_in_context(started))
    return started


def end_span(span_: Span | None, *, error: str | None = None,
             attributes: Mapping[str, Any] | None = None) -> None:
    if span_ is None:
        return
    if attributes:
        span_.set_attributes(attributes)
    if error is not None:
        span_.set_status(Status(StatusCode.ERROR, error))
    span_.end()


def record_span(scope: str, phase: str, start_ns: int, end_ns: int, *,
                attributes: Mapping[str, Any] | None = None,
                parent: otel_context.Context | None = None) -> None:
    """A span for a phase measured elsewhere (a wait in the batcher, the forward pass on
    the inference thread): wall-clock nanoseconds, see ``wall_ns``."""
    if not _enabled:
        return
    recorded = _tracer(scope).start_span(f"{scope}.{phase}", context=parent,
                                         attributes=attributes, start_time=start_ns)
    recorded.end(end_time=max(start_ns, end_ns))


def wall_ns(monotonic_s: float) -> int:
    """A ``time.monotonic()`` reading as wall-clock nanoseconds (span timestamps)."""
    return time.time_ns() - int((time.monotonic() - monotonic_s) * 1e9)


def set_attributes(attributes: Mapping[str, Any]) -> None:
    """On the current span, if tracing is on and there is one."""
    if _enabled:
        trace.get_current_span().set_attributes(attributes)


def current_trace_ids() -> tuple[str, str] | None:
    """(trace id, span id) in hex of the current span, for log lines; None when off."""
    if not _enabled:
        return None
    ctx = trace.get_current_span().get_span_context()
    if not ctx.is_valid:
        return None
    return format(ctx.trace_id, "032x"), format(ctx.span_id, "016x")


# ---- propagation -----------------------------------------------------------------------------
def inject(headers: MutableMapping[str, str]) -> None:
    """Add the current trace context (``traceparent``) to outgoing message headers."""
    if _enabled:
        propagate.inject(headers)


def extract(headers: Mapping[str, str] | None) -> otel_context.Context | None:
    """The trace context an incoming message or request carries; a missing or malformed
    ``traceparent`` gives an empty context (the span becomes a new trace's root)."""
    if not _enabled or not headers:
        return None
    return propagate.extract(headers)


@contextlib.contextmanager
def in_memory_tracing(service_name: str = "heron-test") -> Iterator[Any]:
    """Tracing into an InMemorySpanExporter for the duration of a ``with`` block (tests);
    yields the exporter (``get_finished_spans()``)."""
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exporter = InMemorySpanExporter()
    setup_tracing(service_name, exporter=exporter)
    try:
        yield exporter
    finally:
        shutdown_tracing()
