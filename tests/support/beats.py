"""Worker heartbeats and a settable clock, for tests of what the gateway makes of beats."""

from __future__ import annotations

from typing import Any


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def beat(worker: str, pool: str = "p", ready: bool = True, **extra: Any) -> dict[str, Any]:
    return {"worker_id": worker, "pool": pool, "bundle": "b", "bundle_hash": "h",
            "models": {"m": "ready"}, "queue_depth": 0, "in_flight": 0, "memory_rss": 1,
            "ready": ready, "address": "", "ts": 0.0, **extra}
