"""Publish one work item to JetStream, retried through a leader election.

A publish that fails for want of a JetStream leader (an election after a node loss: no
responders, timeouts, NATS reconnecting) is tried again with a backoff until a given time
(the request's deadline, at most ``publish_retry_max_s``): a node loss is latency, not
errors. A retried publish may have been stored the first time: the work item is then
computed twice and the second result is dropped as a duplicate (Reassembly), which is
cheaper than deduplicating every publish. A full stream is not retried: 429 QUEUE_FULL.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable

from nats.js.errors import APIError

from heron.gateway.metrics import GatewayMetrics
from heron.gateway.settings import GatewaySettings
from heron.runtime.nats_link import NatsLink
from heron_sdk.errors import ErrorCode, HeronError

log = logging.getLogger("heron.gateway.dispatch")

# Between tries of a publish that failed: a JetStream stream leader election on loopback
# takes about 5 s (docs/benchmarks.md), so the tries go on for seconds, sparsely.
PUBLISH_BACKOFF_S = (0.05, 0.1, 0.2, 0.4, 0.8, 1.0)


class WorkPublisher:
    def __init__(self, link: NatsLink, settings: GatewaySettings, metrics: GatewayMetrics,
                 nats_unavailable: Callable[[str], HeronError]) -> None:
        self.link = link
        self.settings = settings
        self.metrics = metrics
        self._nats_unavailable = nats_unavailable

    async def publish(self, pool: str, subject: str, payload: bytes,
                      headers: dict[str, str], give_up_at: float) -> None:
        """One work item, retried with a backoff through a leader election (no responders,
        timeouts, NATS reconnecting) until ``give_up_at``. A full stream is not retried."""
        tries = 0
        while True:
            left = give_up_at - time.monotonic()
            js = self.link.js
            if js is not None and self.link.ready:
                try:
                    await js.publish(subject, payload, headers=headers,
                                     timeout=max(0.05, min(self.settings.publish_timeout_s,
                                                           left)))
                    if tries:
                        self.metrics.publish_retries.labels(pool).inc(tries)
                    return
                except APIError as exc:
                    if _stream_full(exc):
                        raise
                    failure: BaseException = exc
                except Exception as exc:  # no responders, timeout, connection lost
                    failure = exc
            else:
                failure = ConnectionError("not connected to NATS")
            pause = PUBLISH_BACKOFF_S[min(tries, len(PUBLISH_BACKOFF_S) - 1)]
            tries += 1
            if time.monotonic() + pause >= give_up_at:
                raise failure
            if tries == 1:
                log.info("publishing to %s failed (%r); retrying for up to %.1f s",
                         subject, failure, left)
            await asyncio.sleep(pause)

    def error(self, pool: str, exc: BaseException) -> HeronError:
        """What the caller hears of a publish that failed for good: 429 for a full stream,
        else 503 NATS_UNAVAILABLE."""
        if isinstance(exc, APIError) and _stream_full(exc):
            return HeronError(ErrorCode.QUEUE_FULL,
                              f"the work stream of pool {pool} is full: {exc.description}",
                              retry_after_s=self.settings.queue_full_retry_after_s)
        if isinstance(exc, HeronError):
            return exc
        log.warning("publishing work to pool %s failed: %r", pool, exc)
        return self._nats_unavailable(
            f"could not queue the work on NATS ({type(exc).__name__}); retry shortly")


def _stream_full(exc: APIError) -> bool:
    return "maximum" in str(exc.description or "").lower()
