"""Partial failures: a slice that fails server-side becomes per-item errors (encode,
extract); a client error, or every slice failing, fails the request."""

from __future__ import annotations

import pytest

from heron.gateway.reassembly import Added, Reassembly, merge_items
from heron.gateway.slicing import Slice
from heron.runtime.backend import InferenceCall, settle_item_errors
from heron.runtime.protocol import WorkResult
from heron_sdk.errors import RequestError


def slices(*counts: int) -> list[Slice]:
    out, start = [], 0
    for n in counts:
        out.append(Slice(start=start, count=n))
        start += n
    return out


def ok(start: int, count: int) -> WorkResult:
    return WorkResult("r", start, count,
                      body={"items": [{"dense": [float(start + i)]} for i in range(count)],
                            "usage": {"tokens": count}})


def failed(start: int, count: int, code: str = "INTERNAL") -> WorkResult:
    return WorkResult("r", start, count, error={"code": code, "message": "x"})


def test_server_side_slice_failure_becomes_item_errors() -> None:
    r = Reassembly("r", slices(2, 3, 1), partial=True)
    assert r.add(ok(0, 2)) is Added.ACCEPTED
    assert r.add(failed(2, 3)) is Added.ACCEPTED
    assert r.add(failed(2, 3)) is Added.DUPLICATE
    assert r.add(ok(5, 1)) is Added.COMPLETE
    assert r.error is None
    merged = merge_items("m", r.parts(), r.expected, r.failures())
    assert merged["errors"] == 3 and merged["usage"]["tokens"] == 3
    assert [i.get("dense") for i in merged["items"]] == [[0.0], [1.0], None, None, None, [5.0]]
    assert merged["items"][2] == {"error": {"code": "INTERNAL", "message": "x"}}


def test_client_errors_and_total_failure_fail_the_request() -> None:
    r = Reassembly("r", slices(2, 2), partial=True)
    assert r.add(failed(2, 2, "INPUT_TOO_LONG")) is Added.FAILED
    assert r.error is not None and r.error.status == 422
    r = Reassembly("r", slices(2, 2), partial=True)
    r.add(failed(0, 2))
    assert r.add(failed(2, 2, "DEADLINE_EXCEEDED")) is Added.FAILED
    assert r.error is not None and r.error.status == 500
    r = Reassembly("r", slices(2, 2))  # not partial (score, OpenAI): one failure fails all
    assert r.add(failed(0, 2)) is Added.FAILED


def test_an_items_own_error_moves_to_the_requests_index() -> None:
    r = Reassembly("r", slices(2, 2), partial=True)
    r.add(ok(0, 2))
    own = {"error": {"code": "IMAGE_INVALID", "field": "items[0].image",
                     "message": "items[0].image: not an image"}}
    assert r.add(WorkResult("r", 2, 2, body={"items": [own, {"dense": [3.0]}],
                                             "usage": {"tokens": 1}})) is Added.COMPLETE
    merged = merge_items("m", r.parts(), r.expected, r.failures())
    assert merged["errors"] == 1
    assert merged["items"][2]["error"]["field"] == "items[2].image"
    assert merged["items"][2]["error"]["message"].startswith("items[2].image:")
    assert [i.get("dense") for i in merged["items"]] == [[0.0], [1.0], None, [3.0]]


def test_a_request_stands_only_with_an_item_answered_and_partial_allowed() -> None:
    bad = {"error": {"code": "IMAGE_INVALID", "field": "items[1].image", "message": "no"}}
    body = {"items": [{"dense": [1.0]}, bad], "errors": 1}
    settle_item_errors(body, InferenceCall({}))  # stands: item 0 was answered
    with pytest.raises(RequestError) as raised:  # OpenAI's body has no place for an error
        settle_item_errors(body, InferenceCall({}, all_or_nothing=True))
    assert (raised.value.status, raised.value.field) == (422, "items[1].image")
    with pytest.raises(RequestError, match="no"):  # no item answered
        settle_item_errors({"items": [bad], "errors": 1}, InferenceCall({}))
