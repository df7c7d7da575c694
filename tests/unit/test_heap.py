"""heron.runtime.heap: frozen start-up objects leave the collector's walks; a release
collects the cycles among them that became garbage (an evicted model's); a process that
exits leaves its heap to the OS, not to the collector."""

from __future__ import annotations

import gc
import subprocess
import sys
import weakref
from collections.abc import Iterator

import pytest

from heron.runtime import heap
from tests.support.servers import REPO


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


EXITING = """
import atexit, gc, sys
atexit.register(lambda: print("after the exit handlers:", gc.get_freeze_count() > 0))
from heron.runtime import heap
heap.freeze_at_exit()
heap.freeze_at_exit()
atexit.register(lambda: print("in a later handler:", gc.get_freeze_count() > 0))
heap.settle()
heap.thaw()  # an app stopped: the whole heap is walked again, as at a server's exit
sys.exit(3)
"""


def test_an_exiting_process_freezes_its_heap_once_its_handlers_have_run() -> None:
    """The interpreter's final collections walk nothing; the exit handlers registered
    after (each app's clean-up) still run first, on a heap that collects as usual, and the
    exit status is kept."""
    proc = subprocess.run([sys.executable, "-c", EXITING], capture_output=True, text=True,
                          timeout=60, cwd=REPO)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.splitlines() == ["in a later handler: False",
                                        "after the exit handlers: True"]
