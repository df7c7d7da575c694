"""The messages between Heron's processes (heron.runtime.protocol): every one survives its
wire form unchanged, puts the same bytes on the wire as the builders it replaced, reads
what older processes send, and refuses malformed input with ProtocolError alone."""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from heron.runtime.protocol import (
    ConfigDelta,
    DemandNotice,
    PoolLease,
    ProtocolError,
    WorkerHeartbeat,
    WorkItemHeaders,
    WorkResult,
)
from heron_sdk import wire

# ---- strategies -----------------------------------------------------------------------------
texts = st.text(max_size=24)
counts = st.integers(min_value=0, max_value=2**40)
seconds = st.floats(min_value=0, max_value=1e10, allow_nan=False)
scalars = st.none() | st.booleans() | st.integers(-(2**53), 2**53) | texts | \
    st.floats(allow_nan=False, allow_infinity=False)
json_like = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) |
                         st.dictionaries(texts, inner, max_size=4), max_leaves=12)
maps = st.dictionaries(texts, json_like, max_size=4)

# Deadlines travel with six decimals: any whole number of microseconds comes back exactly
# (up to year 2096: a double still resolves well under a microsecond there).
deadlines = st.none() | st.integers(0, 4 * 10**15).map(lambda us: us / 1e6)
work_items = st.builds(WorkItemHeaders, texts, texts, texts, texts, counts, counts, deadlines,
                       st.none() | st.integers(-(2**31), 2**31))
# One of body and error; timings None or not empty (an empty dict is sent as none).
work_results = st.one_of(
    st.builds(WorkResult, texts, counts, counts, body=maps,
              timings=st.none() | st.dictionaries(texts, seconds, min_size=1, max_size=5)),
    st.builds(WorkResult, texts, counts, counts,
              error=st.fixed_dictionaries({"code": texts, "message": texts})))
heartbeats = st.builds(
    WorkerHeartbeat, texts, texts, bundle=texts, bundle_hash=texts,
    models=st.dictionaries(texts, st.sampled_from(["ready", "loading", "not_loaded"])),
    queue_depth=counts, in_flight=counts, memory_rss=counts, ready=st.booleans(),
    address=texts, items_done=counts, model_items=st.dictionaries(texts, counts),
    model_memory=st.dictionaries(texts, counts),
    lanes=st.lists(st.sampled_from(["first", "low", "bulk"]), max_size=3).map(tuple), ts=seconds)
notices = st.builds(DemandNotice, texts, texts, seconds)
deltas = st.builds(ConfigDelta, st.integers(0, 2**53),
                   st.builds(lambda model_id, rest: {**rest, "id": model_id}, texts, maps),
                   st.lists(texts, max_size=4).map(tuple), st.dictionaries(texts, texts))
leases = st.builds(PoolLease, texts, texts, st.integers(0, 64), seconds, seconds, seconds)


def through_msgpack(message: dict[str, Any]) -> Any:
    """What a reader gets: the dict, encoded as its producer does and decoded."""
    return wire.decode(wire.encode(message, wire.MSGPACK), wire.MSGPACK)


# ---- round trips --------------------------------------------------------------------------
@settings(max_examples=300)
@given(work_items)
def test_work_item_headers_round_trip(item: WorkItemHeaders) -> None:
    headers = item.to_wire()
    assert all(isinstance(v, str) for v in headers.values())  # NATS headers are text
    assert WorkItemHeaders.from_wire(headers) == item


@settings(max_examples=300)
@given(work_results)
def test_work_results_round_trip(result: WorkResult) -> None:
    assert WorkResult.from_wire(through_msgpack(result.to_wire())) == result


@given(heartbeats)
def test_heartbeats_round_trip(beat: WorkerHeartbeat) -> None:
    assert WorkerHeartbeat.from_wire(through_msgpack(beat.to_wire())) == beat


@given(notices)
def test_demand_notices_round_trip(notice: DemandNotice) -> None:
    assert DemandNotice.from_wire(through_msgpack(notice.to_wire())) == notice


@given(deltas)
def test_config_deltas_round_trip(delta: ConfigDelta) -> None:
    assert ConfigDelta.from_wire(through_msgpack(delta.to_wire())) == delta


@given(leases)
def test_pool_leases_round_trip_as_stored_and_as_the_api_shows_them(lease: PoolLease) -> None:
    assert PoolLease.from_kv(lease.to_kv()) == lease
    assert PoolLease.from_wire(lease.to_wire()) == lease


# ---- golden: the bytes the builders that these classes replaced put on the wire ---------------
def test_work_item_headers_are_the_old_headers() -> None:
    item = WorkItemHeaders("req-1", "encode", "org/m", "_INBOX.heron.gw.k", 64, 32,
                           1700000012.3456789, 2)
    assert list(item.to_wire().items()) == [
        ("Heron-Request-Id", "req-1"), ("Heron-Task", "encode"), ("Heron-Model", "org/m"),
        ("Heron-Reply", "_INBOX.heron.gw.k"), ("Heron-Item-Start", "64"),
        ("Heron-Item-Count", "32"), ("Heron-Priority", "2"),
        ("Heron-Deadline", "1700000012.345679")]
    no_deadline = WorkItemHeaders("req-1", "score", "m", "r", 0, 1, None, 0)
    assert no_deadline.to_wire() == {
        "Heron-Request-Id": "req-1", "Heron-Task": "score", "Heron-Model": "m",
        "Heron-Reply": "r", "Heron-Item-Start": "0", "Heron-Item-Count": "1",
        "Heron-Priority": "0"}


def test_work_results_are_the_old_results() -> None:
    answered = WorkResult("req-1", 64, 2, body={"model": "m", "items": [{"dense": [0.5]}],
                                                "usage": {"tokens": 3}},
                          timings={"tokenize": 0.001, "total": 0.01})
    assert wire.encode(answered.to_wire(), wire.MSGPACK).hex() == (
        "85aa726571756573745f6964a57265712d31a5737461727440a5636f756e7402a4626f647983a56d6f64"
        "656ca16da56974656d739181a564656e736591cb3fe0000000000000a5757361676581a6746f6b656e73"
        "03a774696d696e677382a8746f6b656e697a65cb3f50624dd2f1a9fca5746f74616ccb3f847ae147ae147b")
    failed = WorkResult("req-1", 0, 3, error={"code": "INPUT_TOO_LONG", "message": "x",
                                              "field": "items[1]"})
    assert list(failed.to_wire().items()) == [
        ("request_id", "req-1"), ("start", 0), ("count", 3),
        ("error", {"code": "INPUT_TOO_LONG", "message": "x", "field": "items[1]"})]
    no_timings = WorkResult("req-1", 0, 3, body={"items": []}, timings={})
    assert no_timings.to_wire() == {"request_id": "req-1", "start": 0, "count": 3,
                                    "body": {"items": []}}


def test_heartbeats_are_the_old_heartbeats() -> None:
    beat = WorkerHeartbeat(
        worker_id="w-1", pool="p1", bundle="small", bundle_hash="abc", models={"m": "ready"},
        queue_depth=3, in_flight=2, memory_rss=123456, ready=True, address="10.0.0.1:8080",
        items_done=42, model_items={"m": 42}, model_memory={"m": 9000}, ts=1700000000.25)
    assert wire.encode(beat.to_wire(), wire.MSGPACK).hex() == (
        "8ea9776f726b65725f6964a3772d31a4706f6f6ca27031a662756e646c65a5736d616c6cab62756e646c"
        "655f68617368a3616263a66d6f64656c7381a16da57265616479ab71756575655f646570746803a9696e"
        "5f666c6967687402aa6d656d6f72795f727373ce0001e240a57265616479c3a761646472657373ad3130"
        "2e302e302e313a38303830aa6974656d735f646f6e652aab6d6f64656c5f6974656d7381a16d2aac6d6f"
        "64656c5f6d656d6f727981a16dcd2328a27473cb41d954fc40100000")
    idle = WorkerHeartbeat("w-2", "p1", bundle="small", ts=1700000000.25)
    assert idle.to_wire() == {
        "worker_id": "w-2", "pool": "p1", "bundle": "small", "bundle_hash": "", "models": {},
        "queue_depth": 0, "in_flight": 0, "memory_rss": 0, "ready": False, "address": "",
        "items_done": 0, "model_items": {}, "model_memory": {}, "ts": 1700000000.25}


def test_demand_notices_config_deltas_and_leases_are_the_old_ones() -> None:
    assert list(DemandNotice("p1", "small", 1700000000.25).to_wire().items()) == [
        ("pool", "p1"), ("bundle", "small"), ("ts", 1700000000.25)]
    delta = ConfigDelta(7, {"id": "org/m", "adapter": "dense"}, ("b1", "b2"),
                        {"b1": "h1", "b2": "h2"})
    assert wire.encode(delta.to_wire(), wire.MSGPACK).hex() == (
        "84a565706f636807a56d6f64656c82a26964a56f72672f6da761646170746572a564656e7365a762756e"
        "646c657392a26231a26232ac62756e646c65735f6861736882a26231a26831a26232a26832")
    lease = PoolLease("team-a", "small", 2, 300.0, 1700000000.5, 1700000100.25)
    assert lease.to_kv() == (b'{"name":"team-a","bundle":"small","workers":2,"ttl_s":300.0,'
                             b'"created_at":1700000000.5,"renewed_at":1700000100.25}')


# ---- tolerant reading: what older processes send ---------------------------------------------
def test_an_older_workers_heartbeat_reads_with_defaults() -> None:
    beat = WorkerHeartbeat.from_wire({"worker_id": "w", "pool": "p", "ready": True,
                                      "models": {"m": "ready"}, "queue_depth": None})
    assert beat == WorkerHeartbeat("w", "p", models={"m": "ready"}, ready=True, ts=0.0)


def test_a_heartbeat_names_what_auto_models_loaded_as_only_when_there_are_some() -> None:
    beat = WorkerHeartbeat(worker_id="w", pool="p", models={"m": "ready"},
                           model_adapters={"m": "cross_encoder"})
    assert WorkerHeartbeat.from_wire(beat.to_wire()).model_adapters == {"m": "cross_encoder"}
    assert "model_adapters" not in WorkerHeartbeat(worker_id="w", pool="p").to_wire()


def test_a_heartbeat_names_the_lanes_its_worker_pulls_only_when_it_pulls_them() -> None:
    beat = WorkerHeartbeat(worker_id="w", pool="p", lanes=("first", "low", "bulk"))
    assert WorkerHeartbeat.from_wire(beat.to_wire()).lanes == ("first", "low", "bulk")
    assert "lanes" not in WorkerHeartbeat(worker_id="w", pool="p").to_wire()


def test_headers_without_priority_or_deadline_leave_them_to_the_request() -> None:
    item = WorkItemHeaders.from_wire({"Heron-Task": "encode", "Heron-Item-Count": "3"})
    assert (item.task, item.count, item.start, item.reply) == ("encode", 3, 0, "")
    assert item.priority is None and item.deadline is None
    assert WorkItemHeaders.from_wire(None) == WorkItemHeaders("", "", "", "", 0, 0, None, None)


def test_minimal_notices_deltas_and_results_read() -> None:
    assert DemandNotice.from_wire({"pool": "p"}) == DemandNotice("p", "", 0.0)
    assert ConfigDelta.from_wire({"epoch": 3, "model": {"id": "m"}}) == \
        ConfigDelta(3, {"id": "m"})
    # A body that is no map reads as none: the gateway fails the request at once with it.
    assert WorkResult.from_wire({"request_id": "r", "start": 0, "count": 1,
                                 "body": [1], "timings": "soon"}) == WorkResult("r", 0, 1)


def test_a_result_holds_a_body_or_an_error_not_both() -> None:
    with pytest.raises(ValueError, match="not both"):
        WorkResult("r", 0, 1, body={}, error={"code": "INTERNAL", "message": "x"})
    both = {"request_id": "r", "start": 0, "count": 1, "body": {},
            "error": {"code": "INTERNAL", "message": "x"}}
    assert WorkResult.from_wire(both).body is None  # the error wins, as it always did


# ---- malformed input: ProtocolError, and nothing else ----------------------------------------
@pytest.mark.parametrize(("cls", "message"), [
    (WorkResult, {"start": 0, "count": 1, "body": {}}),  # no request_id
    (WorkResult, {"request_id": "r", "start": "0", "count": 1, "body": {}}),
    (WorkResult, {"request_id": "r", "start": 0, "count": 1, "error": "boom"}),
    (WorkResult, [1, 2]),
    (WorkerHeartbeat, {"pool": "p"}),
    (WorkerHeartbeat, {"worker_id": "w", "pool": "p", "queue_depth": "many"}),
    (WorkerHeartbeat, {"worker_id": "w", "pool": "p", "model_items": ["a"]}),
    (WorkerHeartbeat, None),
    (DemandNotice, {"bundle": "b"}),
    (DemandNotice, {"pool": "p", "ts": "now"}),
    (ConfigDelta, {"epoch": 1}),
    (ConfigDelta, {"epoch": 1, "model": {"adapter": "dense"}}),
    (ConfigDelta, {"epoch": "one", "model": {"id": "m"}}),
    (ConfigDelta, {"epoch": 1, "model": {"id": "m"}, "bundles": "b1"}),
    (PoolLease, {"name": "a", "bundle": "b", "workers": 1, "ttl_s": 5, "created_at": 0}),
    (PoolLease, {"name": "a", "bundle": "b", "workers": "x", "ttl_s": 5, "created_at": 0,
                 "renewed_at": 0}),
])
def test_malformed_messages_raise_protocol_error(cls: Any, message: Any) -> None:
    with pytest.raises(ProtocolError):
        cls.from_wire(message)


@pytest.mark.parametrize("headers", [{"Heron-Item-Start": "x"}, {"Heron-Item-Count": "-2"},
                                     {"Heron-Deadline": "soon"}, {"Heron-Priority": "1.5"}])
def test_malformed_headers_raise_protocol_error(headers: dict[str, str]) -> None:
    with pytest.raises(ProtocolError):
        WorkItemHeaders.from_wire(headers)


def test_a_lease_that_is_not_json_raises_protocol_error() -> None:
    with pytest.raises(ProtocolError):
        PoolLease.from_kv(b"{not json")


# Anything msgpack can decode to, infinities and NaN included.
any_scalars = st.none() | st.booleans() | st.integers(-(2**64), 2**64) | texts | st.floats()
any_values = st.recursive(any_scalars, lambda inner: st.lists(inner, max_size=4) |
                          st.dictionaries(texts, inner, max_size=4), max_leaves=12)
message_keys = st.sampled_from(["request_id", "start", "count", "body", "error", "timings",
                                "worker_id", "pool", "queue_depth", "models", "model_items",
                                "ts", "epoch", "model", "bundles", "bundles_hash", "name",
                                "workers", "ttl_s"])


@settings(max_examples=500)
@given(any_values | st.dictionaries(message_keys, any_values))
def test_any_decoded_value_reads_or_raises_protocol_error(value: Any) -> None:
    for cls in (WorkResult, WorkerHeartbeat, DemandNotice, ConfigDelta, PoolLease):
        with contextlib.suppress(ProtocolError):
            cls.from_wire(value)


@given(st.dictionaries(st.sampled_from(["Heron-Item-Start", "Heron-Item-Count",
                                        "Heron-Deadline", "Heron-Priority", "Heron-Task"]),
                       texts))
def test_any_header_values_read_or_raise_protocol_error(headers: dict[str, str]) -> None:
    with contextlib.suppress(ProtocolError):
        WorkItemHeaders.from_wire(headers)
