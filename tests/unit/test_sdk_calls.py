"""The SDK's retry decisions and splitting (sdk/calls.py), driven with a simulated clock.

The clients only send and sleep; these tests play the server's answers and check what the
call does with them. The same behaviour against real servers is in
tests/integration/test_sdk.py.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from heron_sdk.calls import CallPolicy, HttpCall, Reply, attempts, chunks
from heron_sdk.errors import (
    ConnectionError,
    ModelNotFound,
    PoolError,
    ProvisioningTimeout,
    RequestError,
    ServerError,
)
from heron_sdk.results import EncodeResult, merge_bodies
from heron_sdk.types import Item

CALL = HttpCall("POST", "/v1/encode/minilm", {"items": ["x"]})
OK = Reply(200, {}, {"model": "m", "items": []})


def error(status: int, code: str, retry_after: int | None = None, **extra: object) -> Reply:
    headers = {} if retry_after is None else {"retry-after": str(retry_after)}
    return Reply(status, headers, {"error": {"code": code, "message": f"{code}!", **extra}})


PROVISIONING = Reply(202, {"retry-after": "2"}, {"status": "provisioning", "pool": "default"})


class Simulation:
    """Drive ``attempts`` against scripted answers on a fake clock."""

    def __init__(self, answers: Callable[[int], Reply | Exception]) -> None:
        self.now = 0.0
        self.sent = 0
        self.sleeps: list[float] = []
        self.answers = answers

    def run(self, policy: CallPolicy) -> Reply:
        plan = attempts(CALL, policy, clock=lambda: self.now, rng=lambda: 0.5)
        step = next(plan)
        while True:
            if isinstance(step, HttpCall):
                assert step.timeout_s > 0
                outcome: Reply | Exception | None = self.answers(self.sent)
                self.sent += 1
                self.now += 0.01
            else:
                self.sleeps.append(step)
                self.now += step
                outcome = None
            try:
                step = plan.send(outcome)
            except StopIteration as done:
                return done.value


def script(*answers: Reply | Exception) -> Callable[[int], Reply | Exception]:
    return lambda n: answers[min(n, len(answers) - 1)]


def test_waits_out_202_for_retry_after_then_returns() -> None:
    sim = Simulation(script(PROVISIONING, PROVISIONING, OK))
    assert sim.run(CallPolicy()) is OK
    assert sim.sleeps == [2.0, 2.0]


def test_capacity_waits_stop_at_provision_timeout() -> None:
    sim = Simulation(script(PROVISIONING))
    with pytest.raises(ProvisioningTimeout) as info:
        sim.run(CallPolicy(provision_timeout_s=9))
    assert 8.5 <= sim.now <= 9.1
    assert info.value.status == 202 and "pool default is provisioning" in str(info.value)


def test_no_waiting_when_asked_not_to() -> None:
    sim = Simulation(script(PROVISIONING, OK))
    with pytest.raises(ProvisioningTimeout):
        sim.run(CallPolicy(wait_for_capacity=False))
    assert sim.sent == 1


def test_model_loading_503_is_a_capacity_wait_and_does_not_eat_the_timeout() -> None:
    loading = error(503, "MODEL_LOADING", retry_after=2)
    sim = Simulation(script(*[loading] * 10, OK))  # 20 s of loading, timeout 5 s
    assert sim.run(CallPolicy(timeout_s=5, provision_timeout_s=60)) is OK
    assert sim.sleeps == [2.0] * 10


def test_429_backs_off_with_jitter_above_retry_after_then_gives_up() -> None:
    sim = Simulation(script(error(429, "QUEUE_FULL", retry_after=1)))
    with pytest.raises(ServerError) as info:
        sim.run(CallPolicy(timeout_s=6))
    assert info.value.status == 429 and info.value.code == "QUEUE_FULL"
    assert all(s >= 1.0 for s in sim.sleeps) and len(sim.sleeps) >= 3
    assert sim.now <= 6.1


def test_connection_errors_retry_within_the_deadline() -> None:
    sim = Simulation(script(OSError("refused"), OSError("refused"), OK))
    assert sim.run(CallPolicy(timeout_s=5)) is OK
    sim = Simulation(script(OSError("refused")))
    with pytest.raises(ConnectionError) as info:
        sim.run(CallPolicy(timeout_s=3))
    assert info.value.code == "CONNECTION_FAILED" and sim.now <= 3.1
    assert sim.sleeps == sorted(sim.sleeps)  # backing off, not hammering


def test_502_and_504_retry_but_model_load_failed_does_not() -> None:
    sim = Simulation(script(error(504, "DEADLINE_EXCEEDED"), error(502, "INTERNAL"), OK))
    assert sim.run(CallPolicy()) is OK
    sim = Simulation(script(error(502, "MODEL_LOAD_FAILED"), OK))
    with pytest.raises(ServerError) as info:
        sim.run(CallPolicy())
    assert info.value.code == "MODEL_LOAD_FAILED" and sim.sent == 1


@pytest.mark.parametrize(("reply", "kind"), [
    (error(404, "MODEL_NOT_FOUND"), ModelNotFound),
    (error(404, "POOL_NOT_FOUND"), PoolError),
    (error(409, "POOL_CONFLICT"), PoolError),
    (error(422, "INVALID_FIELD", field="dims"), RequestError),
    (error(500, "INTERNAL"), ServerError),
    (Reply(502, {}, "<html>bad gateway</html>"), ServerError),
])
def test_errors_are_typed_and_not_retried(reply: Reply, kind: type) -> None:
    sim = Simulation(script(reply))
    with pytest.raises(kind) as info:
        sim.run(CallPolicy(timeout_s=0.05))
    assert info.value.status == reply.status
    if kind is RequestError:
        assert info.value.field == "dims" and sim.sent == 1


def test_chunks_respect_item_and_byte_limits() -> None:
    items = [Item(f"text {n}") for n in range(10)]
    assert [(o, len(p)) for o, p in chunks(items, max_items=4)] == [(0, 4), (4, 4), (8, 2)]
    big = [Item("x" * 100) for _ in range(5)]
    assert [(o, len(p)) for o, p in chunks(big, max_items=100, max_bytes=250)] == \
        [(0, 2), (2, 2), (4, 1)]
    assert chunks([Item("x" * 1000)], max_bytes=10) == [(0, [Item("x" * 1000)])]


def test_split_scores_are_ranked_again_as_one() -> None:
    parts = [{"model": "m", "results": [{"index": 1, "score": 0.9, "rank": 1},
                                        {"index": 0, "score": 0.1, "rank": 2}],
              "usage": {"tokens": 4}},
             {"model": "m", "results": [{"index": 0, "score": 0.5, "rank": 1},
                                        {"index": 1, "score": 0.9, "rank": 2}],
              "usage": {"tokens": 6}}]
    merged = merge_bodies("score", parts, [0, 2], top_k=3)
    assert [(r["index"], r["rank"]) for r in merged["results"]] == [(1, 1), (3, 2), (2, 3)]
    assert merged["usage"]["tokens"] == 10



def test_joined_chunks_name_a_failed_item_by_its_place_in_the_call() -> None:
    bad = {"error": {"code": "IMAGE_INVALID", "field": "items[1].image",
                     "message": "items[1].image: not an image"}}
    chunks = [EncodeResult.from_body({"model": "m", "items": [{"dense": [1.0]}] * 3,
                                      "usage": {"tokens": 3}}),
              EncodeResult.from_body({"model": "m", "items": [{"dense": [2.0]}, bad],
                                      "usage": {"tokens": 1}, "errors": 1})]
    joined = EncodeResult.joined(chunks)
    [(index, error)] = joined.errors
    assert (index, error.field, error.status) == (4, "items[4].image", 422)
    assert error.message.startswith("items[4].image:")
    with pytest.raises(RequestError, match="1 of 5 items failed; item 4"):
        _ = joined.dense
