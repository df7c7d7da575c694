"""The coalescer's decisions (no NATS): which requests share a work item and when it leaves;
and how a shared work item's result splits back into its requests' own."""

from __future__ import annotations

from typing import Any

from heron.gateway.coalescing import MIN_WAIT_S, Coalescer, Group, Member, split_result
from heron.runtime.protocol import WorkResult


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def member(name: str, items: int = 1, tokens: int = 10, size: int = 100,
           deadline: float = 1e9) -> Member:
    return Member(name, f"req-{name}", [f"{name}{i}" for i in range(items)], tokens, size,
                  deadline, 0.0)


def coalescer(clock: Clock | None = None, **bounds: int) -> Coalescer:
    limits = {"max_items": 8, "max_tokens": 1000, "max_bytes": 10_000, **bounds}
    return Coalescer(max_wait_s=0.002, clock=clock or Clock(), **limits)


def test_a_request_alone_is_not_held_but_its_loop_turn_joins_it() -> None:
    c = coalescer()
    first = c.join("k", "pool", {"dims": 8}, member("a"), busy=False)
    assert first.ready == [] and first.opened is not None and first.opened.wait_s == 0
    second = c.join("k", "pool", {"dims": 8}, member("b", items=2), busy=True)
    assert second.ready == [] and second.opened is None  # joined the open group
    group = first.opened
    assert c.close(group) and group.left
    assert [m.inbox_key for m in group.members] == ["a", "b"]
    assert group.wire_items() == ["a0", "b0", "b1"]
    assert [(m.inbox_key, start) for m, start in group.offsets()] == [("a", 0), ("b", 1)]
    assert group.body == {"dims": 8} and c.open_groups() == 0
    assert c.window("k") == 0.002  # a loop-turn group does not move the window


def test_a_busy_pool_holds_a_group_for_the_window_which_adapts() -> None:
    c = coalescer()
    lonely = c.join("k", "pool", {}, member("a"), busy=True).opened
    assert lonely is not None and lonely.wait_s == 0.002
    assert c.close(lonely)
    assert c.window("k") == 0.001  # nobody joined: half the wait next time
    for _ in range(20):
        group = c.join("k", "pool", {}, member("x"), busy=True).opened
        assert group is not None
        c.close(group)
    assert c.window("k") == MIN_WAIT_S  # never below the floor
    company = c.join("k", "pool", {}, member("a"), busy=True).opened
    c.join("k", "pool", {}, member("b"), busy=True)
    assert company is not None and c.close(company)
    assert c.window("k") == 2 * MIN_WAIT_S  # company: twice the wait
    assert c.window("other") == 0.002  # per key


def test_full_groups_leave_at_once_and_one_that_cannot_take_a_member_leaves_first() -> None:
    c = coalescer(max_items=4, max_tokens=100, max_bytes=1000)
    opened = c.join("k", "p", {}, member("a", items=3), busy=True).opened
    assert opened is not None
    filled = c.join("k", "p", {}, member("b", items=1), busy=True)
    assert filled.ready == [opened] and filled.opened is None and opened.left
    assert not c.close(opened)  # its timer fires later: already gone
    first = c.join("k", "p", {}, member("c", items=3), busy=True).opened
    over = c.join("k", "p", {}, member("d", items=2), busy=True)
    assert over.ready == [first] and over.opened is not None  # d opens the next group
    assert [m.inbox_key for m in over.opened.members] == ["d"]
    tokens = c.join("j", "p", {}, member("e", tokens=60), busy=True).opened
    assert c.join("j", "p", {}, member("f", tokens=60), busy=True).ready == [tokens]
    size = c.join("s", "p", {}, member("g", size=1000), busy=True)
    assert size.ready and size.opened is None  # reached max_bytes alone: leaves at once


def test_release_lets_the_pools_open_groups_go_and_no_other() -> None:
    c = coalescer()
    a = c.join("k1", "pool-a", {}, member("a"), busy=True).opened
    b = c.join("k2", "pool-a", {}, member("b"), busy=True).opened
    other = c.join("k3", "pool-b", {}, member("c"), busy=True).opened
    assert {id(g) for g in c.release("pool-a")} == {id(a), id(b)}
    assert c.open_groups() == 1 and not other.left  # type: ignore[union-attr]
    assert c.release("pool-a") == []


def test_the_work_items_deadline_is_its_latest_members() -> None:
    c = coalescer()
    group = c.join("k", "p", {}, member("a", deadline=50.0), busy=True).opened
    c.join("k", "p", {}, member("b", deadline=80.0), busy=True)
    assert group is not None and group.deadline == 80.0


# ---- splitting a shared work item's result ---------------------------------------------
def _group(counts: list[int]) -> Group:
    c = coalescer(max_items=64)
    group = c.join("k", "pool", {}, member("m0", items=counts[0]), busy=True).opened
    assert group is not None
    for n, count in enumerate(counts[1:], start=1):
        c.join("k", "pool", {}, member(f"m{n}", items=count), busy=True)
    return group


def _rows(n: int) -> list[dict[str, Any]]:
    return [{"dense": [float(i)], "tokens": i + 1} for i in range(n)]


def everyone(_: str) -> bool:
    return True


def test_a_shared_result_is_split_by_item_range_with_each_members_usage() -> None:
    group = _group([2, 1, 3])
    body = {"model": "m", "items": _rows(6), "usage": {"tokens": 21}}
    split = split_result(group, WorkResult("req-m0", 0, 6, body, None, {"total": 0.01}),
                         lambda key: key != "m1")  # m1 timed out meanwhile
    assert split.resend == []
    assert [m.inbox_key for m, _ in split.results] == ["m0", "m2"]
    parts = [part for _, part in split.results]
    assert [(p.start, p.count, p.timings) for p in parts] == [(0, 2, {"total": 0.01}),
                                                              (0, 3, {"total": 0.01})]
    assert [[r["dense"][0] for r in p.body["items"]] for p in parts] == [[0.0, 1.0],
                                                                         [3.0, 4.0, 5.0]]
    assert [p.body["usage"]["tokens"] for p in parts] == [1 + 2, 4 + 5 + 6]


def test_an_input_error_fails_only_its_owner_and_the_rest_go_again() -> None:
    group = _group([2, 3, 1])
    error = {"code": "INPUT_TOO_LONG", "field": "items[3]",
             "message": "items[3]: longer than the model's 256 tokens"}
    split = split_result(group, WorkResult("req-m0", 0, 6, None, error, None), everyone)
    assert [m.inbox_key for m in split.resend] == ["m0", "m2"]
    [(owner, part)] = split.results
    assert owner.inbox_key == "m1" and part.error is not None
    assert part.error["field"] == "items[1]"  # its own second item
    assert part.error["message"].startswith("items[1]:")
    assert group.only(split.resend).items == 3


def test_an_error_of_the_whole_work_item_is_every_members() -> None:
    group = _group([1, 2])
    error = {"code": "MODEL_LOADING", "message": "gave up after 5 deliveries"}
    split = split_result(group, WorkResult("req-m0", 0, 3, None, error, None), everyone)
    assert split.resend == [] and [p.error for _, p in split.results] == [error, error]
    # 5xx naming an item is still the whole work item's
    crash = {"code": "INTERNAL", "field": "items[0]", "message": "bug"}
    assert split_result(group, WorkResult("r", 0, 3, None, crash, None),
                        everyone).resend == []
    # a worker that answered the wrong number of items: refused, never served shifted
    short = {"model": "m", "items": _rows(2), "usage": {"tokens": 3}}
    split = split_result(group, WorkResult("req-m0", 0, 3, short, None, None), everyone)
    assert [p.error["code"] for _, p in split.results] == ["INTERNAL", "INTERNAL"]


def test_an_items_own_error_stays_with_its_member_counted_in_its_items() -> None:
    group = _group([2, 2])
    rows = _rows(4)
    rows[3] = {"error": {"code": "IMAGE_INVALID", "field": "items[3].image",
                         "message": "items[3].image: not an image"}, "id": "x"}
    body = {"model": "m", "items": rows, "usage": {"tokens": 6}}
    split = split_result(group, WorkResult("req-m0", 0, 4, body, None, None), everyone)
    first, second = (part.body for _, part in split.results)
    assert "errors" not in first and first["items"] == _rows(2)
    assert second["errors"] == 1 and second["items"][0] == _rows(4)[2]
    assert second["items"][1] == {"id": "x", "error": {
        "code": "IMAGE_INVALID", "field": "items[1].image",
        "message": "items[1].image: not an image"}}
