"""heron.runtime.heap: frozen start-up objects leave the collector's walks; a release
collects the cycles among them that became garbage (an evicted model's)."""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator

import pytest

from heron.runtime import heap


class Node:
    """An object in a reference cycle: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture(autouse=True)
def thawed() -> Iterator[None]:
    yield
    gc.unfreeze()  # the rest of the test process collects as before


def test_settle_freezes_what_lives_and_collects_what_does_not() -> None:
    garbage = Node()
    gone = weakref.ref(garbage)
    del garbage
    heap.settle()
    assert gone() is None  # collected before the freeze, not frozen
    assert gc.get_freeze_count() > 0


def test_a_cycle_frozen_alive_is_collected_once_released() -> None:
    model = Node()
    alive = weakref.ref(model)
    heap.settle()
    del model
    gc.collect()
    assert alive() is not None  # frozen: a full collection does not walk it
    heap.release()
    assert alive() is None
    assert gc.get_freeze_count() > 0  # what still lives is frozen again


def test_a_thaw_lets_every_frozen_cycle_be_collected() -> None:
    app_state = Node()
    alive = weakref.ref(app_state)
    heap.settle()
    del app_state
    heap.thaw()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert alive() is None
