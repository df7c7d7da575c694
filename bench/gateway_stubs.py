"""Short-circuits inside a running gateway, for bench/gateway_layers.py: each answers the
request at one layer, so the gateway's CPU a request can be read layer by layer.

Installed at start-up in the gateway process only (``sitecustomize``, written by the bench,
when ``HERON_BENCH_STUB`` names a mode). Never imported by Heron itself.
"""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np

# The null model's answer: one 384-float vector an item, as a worker sends it.
VECTOR = np.random.default_rng(0).random(384, dtype=np.float32)
TIMINGS = {"tokenize": 1e-4, "batch_wait": 1e-3, "inference": 2e-3, "postprocess": 1e-4,
           "total": 3.2e-3}
MODES = ("route", "dispatch", "wake", "coalesce", "full")


def _body(model_id: str, count: int) -> dict[str, Any]:
    return {"model": model_id, "items": [{"dense": VECTOR, "tokens": 9}] * count,
            "usage": {"tokens": 9 * count}}


def install(mode: str) -> None:
    """``route``: the backend's encode answers once the request is routed (the HTTP edge,
    the front, model and pool resolution). ``dispatch``: ``Dispatcher.submit`` answers at
    once (adds the gateway's dispatch and answer building). ``wake``: it answers after one
    event-loop turn (adds a request's suspension and wake-up). ``coalesce``: the real
    submit, coalescing and result split, with each shared work item answered in-process
    (msgpack, as a worker would) instead of through NATS. ``full``: nothing replaced."""
    from heron.gateway import dispatcher, routes
    from heron.gateway.reassembly import Reassembly
    from heron.gateway.slicing import Slice
    from heron.runtime.backend import Answer
    from heron.runtime.protocol import Header, WorkResult
    from heron_sdk import wire

    def reassembled(work: Any) -> Reassembly:
        count = len(work.items)
        done = Reassembly(work.request_id, [Slice(0, count)], partial=work.partial)
        done.add(WorkResult(work.request_id, 0, count, _body(work.model_id, count), None,
                            dict(TIMINGS)))
        done.gateway_timings.update(coalesce=1e-4, publish=1e-3, queue_wait=1e-3)
        return done

    if mode == "route":
        async def encode(self: Any, model: str, req: Any, call: Any) -> Answer:
            route = self._route(call, model, "encode")
            return Answer(_body(route.model_id, len(req.items)), route.model_id,
                          {"queue_wait": 1e-3, "inference": 2e-3})
        routes.GatewayApp.encode = encode  # type: ignore[method-assign]
    elif mode == "dispatch":
        async def submit(self: Any, work: Any) -> Reassembly:
            return reassembled(work)
        dispatcher.Dispatcher.submit = submit  # type: ignore[method-assign]
    elif mode == "wake":
        async def submit_after_a_turn(self: Any, work: Any) -> Reassembly:
            loop = asyncio.get_running_loop()
            woken = loop.create_future()
            loop.call_soon(woken.set_result, None)
            await woken
            return reassembled(work)
        dispatcher.Dispatcher.submit = submit_after_a_turn  # type: ignore[method-assign]
    elif mode == "coalesce":
        results: dict[int, bytes] = {}

        class Delivered:  # what on_result reads of a NATS message
            __slots__ = ("data", "reply", "subject")

            def __init__(self, subject: str, data: bytes) -> None:
                self.subject, self.data, self.reply = subject, data, None

        original_init = dispatcher.Dispatcher.__init__

        def init(self: Any, *args: Any, **kwargs: Any) -> None:
            original_init(self, *args, **kwargs)

            async def publish(pool: str, subject: str, payload: bytes,
                              headers: dict[str, str], give_up_at: float) -> None:
                count = int(headers[Header.COUNT])
                data = results.get(count)
                if data is None:
                    data = results[count] = wire.encode(WorkResult(
                        "r", 0, count, _body(headers[Header.MODEL], count), None,
                        dict(TIMINGS)).to_wire(), wire.MSGPACK)
                message = Delivered(headers[Header.REPLY], data)
                loop = asyncio.get_running_loop()
                loop.call_soon(lambda: loop.create_task(self.on_result(message)))

            self.publisher.publish = publish
        dispatcher.Dispatcher.__init__ = init  # type: ignore[method-assign]
    elif mode != "full":
        raise ValueError(f"unknown mode {mode!r}; one of {MODES}")
