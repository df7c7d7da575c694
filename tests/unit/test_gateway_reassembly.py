"""Reassembly by start, duplicates ignored, slice errors, and the merge of ranked scores.
Results go through WorkResult.from_wire, as the dispatcher reads them off NATS."""

from __future__ import annotations

import random

import pytest

from heron.gateway.dispatcher import split_unaccounted
from heron.gateway.reassembly import Added, Reassembly, merge_items, merge_scores, slice_error
from heron.gateway.slicing import Slice
from heron.runtime.protocol import ProtocolError, WorkResult
from heron_sdk.errors import ErrorCode, HeronError


def encode_wire(start: int, count: int, tag: str = "") -> dict:
    """A worker's result for an encode slice as it arrives (decoded msgpack)."""
    items = [{"dense": [float(start + i)], "tokens": 2, "truncated": False, "tag": tag}
             for i in range(count)]
    return {"request_id": "r", "start": start, "count": count,
            "body": {"model": "m", "items": items, "usage": {"tokens": 2 * count}}}


def encode_result(start: int, count: int, tag: str = "") -> WorkResult:
    return WorkResult.from_wire(encode_wire(start, count, tag))


SLICES = [Slice(0, 3), Slice(3, 3), Slice(6, 2)]


def test_results_in_any_order_reassemble_in_item_order() -> None:
    r = Reassembly("r", SLICES)
    messages = [encode_result(s.start, s.count) for s in SLICES]
    random.Random(7).shuffle(messages)
    outcomes = [r.add(m) for m in messages]
    assert outcomes == [Added.ACCEPTED, Added.ACCEPTED, Added.COMPLETE] and r.done
    merged = merge_items("m", r.parts(), r.expected)
    assert [row["dense"][0] for row in merged["items"]] == [float(i) for i in range(8)]
    assert merged["usage"]["tokens"] == 16 and merged["model"] == "m"


def test_duplicate_result_is_ignored_and_first_wins() -> None:
    r = Reassembly("r", SLICES)
    assert r.add(encode_result(0, 3, "first")) is Added.ACCEPTED
    assert r.add(encode_result(0, 3, "again")) is Added.DUPLICATE
    assert r.missing == 2
    r.add(encode_result(3, 3))
    r.add(encode_result(6, 2))
    assert r.add(encode_result(6, 2, "late")) is Added.DUPLICATE
    rows = merge_items("m", r.parts(), r.expected)["items"]
    assert rows[0]["tag"] == "first" and len(rows) == 8


def test_unexpected_slices_are_ignored() -> None:
    r = Reassembly("r", SLICES)
    assert r.add(encode_result(1, 3)) is Added.UNEXPECTED  # no slice starts at 1
    assert r.add(encode_result(0, 2)) is Added.UNEXPECTED  # wrong count
    assert r.missing == 3
    with pytest.raises(ProtocolError):  # the dispatcher drops it as malformed
        WorkResult.from_wire({"request_id": "r", "start": "0", "count": 3})


def test_a_slice_error_fails_the_request_with_shifted_item_index() -> None:
    r = Reassembly("r", SLICES)
    r.add(encode_result(0, 3))
    error = {"code": "INPUT_TOO_LONG", "field": "items[1]",
             "message": "items[1]: longer than the model's 256 tokens and truncate is false"}
    failure = WorkResult.from_wire({"request_id": "r", "start": 3, "count": 3, "error": error})
    assert r.add(failure) is Added.FAILED
    assert r.done and r.error is not None
    assert r.error.status == 422 and r.error.field == "items[4]"
    assert r.error.message.startswith("items[4]: longer")
    assert r.add(encode_result(6, 2)) is Added.DUPLICATE  # finished: nothing more counts


@pytest.mark.parametrize(("code", "status"), [("DEADLINE_EXCEEDED", 504),
                                              ("MODEL_LOAD_FAILED", 502),
                                              ("NO_SUCH_CODE", 500)])
def test_slice_error_codes_keep_their_status(code: str, status: int) -> None:
    error = slice_error({"code": code, "message": "m"}, 10)
    assert error.status == status and error.field is None


def test_a_short_body_is_an_internal_error() -> None:
    r = Reassembly("r", [Slice(0, 2)])
    r.add(WorkResult.from_wire(encode_wire(0, 2) | {"body": {"items": [{}],
                                                              "usage": {"tokens": 1}}}))
    with pytest.raises(HeronError) as err:
        merge_items("m", r.parts(), r.expected)
    assert err.value.code is ErrorCode.INTERNAL


def score_part(start: int, scores: list[float], ids: bool = False) -> tuple[int, dict]:
    """A worker's ranked answer for one slice: indexes relative to the slice."""
    order = sorted(range(len(scores)), key=lambda i: (-scores[i], i))
    results = []
    for rank, i in enumerate(order, start=1):
        row = {"index": i, "score": scores[i], "rank": rank}
        if ids:
            row["id"] = f"doc{start + i}"
        results.append(row)
    return start, {"model": "m", "results": results, "usage": {"tokens": 10}}


def test_scores_are_ranked_across_slices() -> None:
    scores = [0.1, 0.9, 0.5, 0.5, 0.95, 0.2, 0.5]
    parts = [score_part(0, scores[:3], ids=True), score_part(3, scores[3:6], ids=True),
             score_part(6, scores[6:], ids=True)]
    expected = {0: 3, 3: 3, 6: 1}
    merged = merge_scores("m", parts, expected, top_k=None)
    # score descending, ties by the request's index: what one worker would answer
    assert [r["index"] for r in merged["results"]] == [4, 1, 2, 3, 6, 5, 0]
    assert [r["rank"] for r in merged["results"]] == list(range(1, 8))
    assert all(r["id"] == f"doc{r['index']}" for r in merged["results"])
    assert merged["usage"]["tokens"] == 30
    top = merge_scores("m", parts, expected, top_k=2)
    assert [(r["index"], r["rank"]) for r in top["results"]] == [(4, 1), (1, 2)]


def test_merged_scores_match_one_slice_ranking() -> None:
    rng = random.Random(3)
    scores = [round(rng.random(), 2) for _ in range(40)]  # rounding makes ties
    one = merge_scores("m", [score_part(0, scores)], {0: 40}, top_k=7)
    parts = [score_part(s, scores[s:s + 13]) for s in range(0, 40, 13)]
    many = merge_scores("m", parts, {s: len(scores[s:s + 13]) for s in range(0, 40, 13)},
                        top_k=7)
    assert one["results"] == many["results"]


def test_timings_are_the_last_answered_slice_whole_not_per_phase_maxima() -> None:
    """Per-phase maxima of different slices overlap in time and could add up to more
    than the request took; the slice that answered last is the request's critical path."""
    r = Reassembly("r", SLICES[:2])
    r.gateway_timings["publish"] = 0.001
    first = WorkResult.from_wire({**encode_wire(0, 3), "timings": {
        "batch_wait": 0.050, "inference": 0.010, "total": 0.061}})
    last = WorkResult.from_wire({**encode_wire(3, 3), "timings": {
        "batch_wait": 0.005, "inference": 0.040, "total": 0.046}})
    assert r.add(first) is Added.ACCEPTED and r.add(last) is Added.COMPLETE
    assert r.timings == {"publish": 0.001, "batch_wait": 0.005, "inference": 0.040,
                         "total": 0.046}


def test_publish_is_capped_by_the_time_outside_the_worker() -> None:
    # the ack came back 4 ms after the worker had already answered: publish overlaps it
    assert split_unaccounted(0.006, 0.002) == (0.002, 0.0)
    publish, queue_wait = split_unaccounted(0.001, 0.0035)
    assert publish == 0.001 and abs(queue_wait - 0.0025) < 1e-12
    assert split_unaccounted(0.001, -0.0005) == (0.0, 0.0)  # clocks: never negative
    assert split_unaccounted(0.001, None) == (0.001, 0.0)  # no worker told its time
