"""Put a request back together from its work items' results (pure: no NATS, no HTTP).

Results arrive in any order, maybe twice (a worker died between publishing a result and
acking its item, so another worker computed it again): they are keyed by ``start``, the
first one wins. A slice's client error (4xx: the input) fails the whole request, as on a
single node. A server-side failure (5xx, e.g. a slice given up after its deliveries) fails
the whole request for score and OpenAI bodies; for encode and extract (``partial``) it
becomes per-item errors and the other items are answered, unless every slice failed.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any

from heron.gateway.slicing import Slice
from heron.runtime.protocol import WorkResult
from heron_sdk.errors import ErrorCode, HeronError


class Added(StrEnum):
    ACCEPTED = "accepted"  # a new slice; more to come
    COMPLETE = "complete"  # the last missing slice
    FAILED = "failed"  # a slice error: the request has failed
    DUPLICATE = "duplicate"  # this slice was already answered
    UNEXPECTED = "unexpected"  # no such slice in this request (ignored)


class Reassembly:
    """The results of one request's slices."""

    def __init__(self, request_id: str, slices: Sequence[Slice], *,
                 partial: bool = False) -> None:
        self.request_id = request_id
        self.expected = {s.start: s.count for s in slices}
        self.partial = partial
        self.bodies: dict[int, dict[str, Any]] = {}
        self.failed: dict[int, HeronError] = {}  # partial: slices that failed server-side
        self.gateway_timings: dict[str, float] = {}  # publish, queue_wait: the dispatcher's
        self.worker_timings: dict[str, float] = {}  # the slice that answered last
        self.error: HeronError | None = None

    @property
    def timings(self) -> dict[str, float]:
        """The gateway's phases and those of the slice that answered last: the request's
        critical path, so the phases follow one another inside the gateway's total."""
        return {**self.gateway_timings, **self.worker_timings}

    @property
    def missing(self) -> int:
        """Slices not answered yet."""
        return len(self.expected) - len(self.bodies) - len(self.failed)

    def failures(self) -> list[tuple[int, int, HeronError]]:
        """(start, count, error) of every slice that failed server-side, in item order."""
        return [(start, self.expected[start], err) for start, err in sorted(self.failed.items())]

    @property
    def done(self) -> bool:
        return self.error is not None or not self.missing

    def add(self, result: WorkResult) -> Added:
        start, count = result.start, result.count
        if self.expected.get(start) != count:
            return Added.UNEXPECTED
        if start in self.bodies or start in self.failed or self.done:
            return Added.DUPLICATE
        error = result.error
        if error is not None:
            failure = slice_error(error, start)
            if not (self.partial and failure.status >= 500):
                self.error = failure
                return Added.FAILED
            self.failed[start] = failure
            if not self.missing and not self.bodies:  # every slice failed: the request did
                self.error = next(iter(self.failed.values()))
                return Added.FAILED
            return Added.COMPLETE if not self.missing else Added.ACCEPTED
        body = result.body
        if body is None:
            self.error = HeronError(ErrorCode.INTERNAL,
                                    f"a worker answered items {start}..{start + count - 1} "
                                    "with neither a body nor an error")
            return Added.FAILED
        self.bodies[start] = body  # the decoded result's own dict: nothing else holds it
        # Slices run in parallel: the request waited for the one that answered last. Its
        # phases are kept whole (per-phase maxima of different slices overlap in time).
        self.worker_timings = {phase: float(seconds) for phase, seconds
                               in (result.timings or {}).items()
                               if isinstance(seconds, int | float)}
        return Added.COMPLETE if not self.missing else Added.ACCEPTED

    def parts(self) -> list[tuple[int, dict[str, Any]]]:
        """(start, body) of every slice, in item order."""
        return sorted(self.bodies.items())


# An error field naming an item: ``items[i]`` (and what follows it, for a nested field).
ITEM_INDEX = re.compile(r"^items\[(\d+)\]")


def slice_error(error: Mapping[str, Any], start: int) -> HeronError:
    """A worker's error for a slice as the request's error: item indexes in ``field`` and
    the message are the slice's own, so they move by the slice's ``start``."""
    try:
        code = ErrorCode(error.get("code"))
    except ValueError:
        code = ErrorCode.INTERNAL
    message = str(error.get("message") or code.value)
    field = error.get("field")

    def shift(text: str) -> str:
        return ITEM_INDEX.sub(lambda m: f"items[{int(m.group(1)) + start}]", text, count=1)

    if isinstance(field, str):
        field = shift(field)
        message = shift(message)
    retry = error.get("retry_after_s")
    return HeronError(code, message, field=field if isinstance(field, str) else None,
                      retry_after_s=float(retry) if isinstance(retry, int | float) else None)


def shift_item_errors(rows: Sequence[Any], delta: int) -> tuple[list[Any], int]:
    """``rows`` (a body's items) with the item indexes of their own errors (``{"error":
    ...}`` rows: an image its model could not decode) moved by ``delta``, and how many
    such rows there are."""
    out, errors = [], 0
    for row in rows:
        if isinstance(row, Mapping) and isinstance(row.get("error"), Mapping):
            errors += 1
            if delta:
                row = {**row, "error": slice_error(row["error"], delta).to_body()["error"]}
        out.append(row)
    return out, errors


# ---- merging the slices' bodies into one answer ----------------------------------------
def _checked_rows(parts: Sequence[tuple[int, Mapping[str, Any]]], expected: Mapping[int, int],
                  key: str) -> list[Any]:
    rows: list[Any] = []
    for start, body in parts:
        part_rows = body.get(key)
        if not isinstance(part_rows, list) or len(part_rows) != expected[start]:
            raise HeronError(ErrorCode.INTERNAL,
                             f"a worker answered items {start}.. with "
                             f"{len(part_rows) if isinstance(part_rows, list) else 'no'} "
                             f"{key} for {expected[start]} items")
        rows.extend(part_rows)
    return rows


def _tokens(parts: Sequence[tuple[int, Mapping[str, Any]]]) -> int:
    return sum(int((body.get("usage") or {}).get("tokens", 0)) for _, body in parts)


def merge_items(model: str, parts: Sequence[tuple[int, Mapping[str, Any]]],
                expected: Mapping[int, int],
                failures: Sequence[tuple[int, int, HeronError]] = ()) -> dict[str, Any]:
    """encode and extract: the slices' items, concatenated in order; tokens summed. Items
    of failed slices are ``{"error": {code, message}}``, as are items that failed on their
    own (their indexes moved to the request's), and ``errors`` counts them all."""
    rows: dict[int, list[Any]] = {}
    errors = 0
    for part in parts:
        rows[part[0]], own_errors = shift_item_errors(
            _checked_rows([part], expected, "items"), part[0])
        errors += own_errors
    for start, count, error in failures:
        rows[start] = [error.to_body() for _ in range(count)]
        errors += count
    items = [row for start in sorted(rows) for row in rows[start]]
    merged: dict[str, Any] = {"model": model, "items": items,
                              "usage": {"tokens": _tokens(parts)}}
    if errors:
        merged["errors"] = errors
    return merged


def merge_scores(model: str, parts: Sequence[tuple[int, Mapping[str, Any]]],
                 expected: Mapping[int, int], top_k: int | None) -> dict[str, Any]:
    """score: every slice ranked its own items (index relative to the slice); rank them all
    together as one worker would: score descending, ties by index, then top_k, ranks 1..n."""
    rows: list[dict[str, Any]] = []
    for start, body in parts:
        results = body.get("results")
        if not isinstance(results, list) or len(results) != expected[start]:
            raise HeronError(ErrorCode.INTERNAL,
                             f"a worker scored items {start}.. with "
                             f"{len(results) if isinstance(results, list) else 'no'} results "
                             f"for {expected[start]} items")
        for row in results:
            rows.append({**row, "index": int(row["index"]) + start})
    rows.sort(key=lambda r: (-float(r["score"]), r["index"]))
    if top_k is not None:
        rows = rows[:top_k]
    for rank, row in enumerate(rows, start=1):
        row["rank"] = rank
    return {"model": model, "results": rows, "usage": {"tokens": _tokens(parts)}}
