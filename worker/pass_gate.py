"""PassGate: a model's forward passes share it; a change to the model's modules (a LoRA
adapter's layers wrapped in) takes it alone.

With ``--inference-threads N`` a CPU worker runs up to N forward passes of one model at
once, on N threads, so a thread that changes the model can no longer count on being the
only one using it. Passes enter side by side; a change waits until none is running, and
passes that come while it waits queue behind it (so a steady stream of passes cannot
starve it). Taking and leaving the gate costs one lock each way, a few microseconds a
pass, and never blocks with one inference thread.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator


class PassGate:
    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._passes = 0  # passes inside the gate now
        self._changing = False  # a change holds the gate, or waits for the passes to leave

    @contextlib.contextmanager
    def forward_pass(self) -> Iterator[None]:
        """One forward pass: beside other passes, never beside a change."""
        with self._lock:
            while self._changing:
                self._lock.wait()
            self._passes += 1
        try:
            yield
        finally:
            with self._lock:
                self._passes -= 1
                if not self._passes:
                    self._lock.notify_all()

    @contextlib.contextmanager
    def change(self) -> Iterator[None]:
        """A change to the model's modules: alone, once the running passes have left."""
        with self._lock:
            while self._changing:
                self._lock.wait()
            self._changing = True
            while self._passes:
                self._lock.wait()
        try:
            yield
        finally:
            with self._lock:
                self._changing = False
                self._lock.notify_all()
