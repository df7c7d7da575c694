"""Bulk jobs at the gateway: the ``/v1/jobs`` routes.

``POST /v1/jobs`` checks everything it can before anything runs: the body
(heron_sdk.jobs.JobSpec), the model and task, the input and output URIs against the
operator's allowlist (heron/runtime/job_files.py: 403 JOB_PATH_FORBIDDEN before any read),
that the input exists and the output's folder does; then it stores the job's record
(gateway/job_store.py) and answers 202 with it. Any gateway's job loop runs it
(gateway/job_runner.py); any gateway answers for it, from the bucket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

import nats.errors
from nats.js import JetStreamContext
from starlette.requests import Request
from starlette.responses import Response

from heron.gateway.job_runner import JobLoop
from heron.gateway.job_store import JobRecord, JobStore, new_job_id
from heron.runtime.http import read_body, respond
from heron.runtime.job_files import FileLocation, PathPolicy, check_readable
from heron.runtime.job_output import NPY_ROWS_SUFFIX
from heron_sdk.errors import ErrorCode, HeronError, invalid_field
from heron_sdk.jobs import JobSpec

if TYPE_CHECKING:
    from heron.gateway.routes import GatewayApp

log = logging.getLogger("heron.gateway.jobs")


class GatewayJobs:
    """The routes and this gateway's job loop."""

    def __init__(self, gateway: GatewayApp, *, jetstream: Callable[[], JetStreamContext],
                 nats_unavailable: Callable[[str], HeronError]) -> None:
        settings = gateway.settings
        self.gateway = gateway
        self.settings = settings
        self.policy = PathPolicy.parse(settings.job_roots, settings.job_buckets)
        self.loop = JobLoop(gateway, self.policy)
        self._jetstream = jetstream
        self._nats_unavailable = nats_unavailable

    def _store(self) -> JobStore:
        return JobStore(self._jetstream())

    # ---- routes --------------------------------------------------------------------------
    async def create(self, request: Request) -> Response:
        body, _ = await read_body(request)
        spec = JobSpec.from_wire(body)
        self.gateway.job_route(spec.model, spec.encode_request([]))  # 404/422 now, not later
        encode = spec.encode_request([])
        if spec.output.format == "npy" and encode.output_types != ("dense",):
            raise HeronError(ErrorCode.UNSUPPORTED_OUTPUT, "output.format: npy holds dense "
                             "vectors only (output_types: [\"dense\"]); use parquet or jsonl",
                             field="output.format")
        if spec.output.format == "npy" and encode.chunking is not None \
                and encode.chunking.pool is None:
            raise invalid_field("output.format", 'npy holds one vector a row: with '
                                '"chunking", it needs "pool": "mean" (or parquet, jsonl)')
        source = self.policy.check(spec.input.uri, "input.uri")
        output = self.policy.check(spec.output.uri, "output.uri")
        if spec.output.format == "npy":  # the ids and errors go beside the array
            self.policy.check(spec.output.uri + NPY_ROWS_SUFFIX, "output.uri")
        if isinstance(output, FileLocation) and (not output.path.parent.is_dir()
                                                 or output.path.is_dir()):
            raise invalid_field("output.uri", "must be a file in a folder that exists")
        await asyncio.to_thread(check_readable, source, "input.uri")
        record = JobRecord(new_job_id(), spec.to_wire(), shard_rows=self.settings.job_shard_rows)
        async with self._nats_errors():
            await self._store().create(record)
        log.info("job %s created: %s -> %s (%s)", record.id, spec.input.uri, spec.output.uri,
                 spec.model)
        self.loop.wake()  # this gateway looks for it at once
        return respond(request, record.view(), status=202)

    async def list_jobs(self, request: Request) -> Response:
        async with self._nats_errors():
            records = await self._store().all()
        data = [r.view() for r, _ in sorted(records, key=lambda r: -r[0].created_at)]
        return respond(request, {"object": "list", "data": data})

    async def get_job(self, request: Request) -> Response:
        async with self._nats_errors():
            record, _ = await self._store().read(request.path_params["job_id"])
        return respond(request, record.view())

    async def cancel_job(self, request: Request) -> Response:
        """Cancel (a finished job is answered as it is): its run stops at its next lease
        renewal, and its part files are deleted."""
        def cancel(record: JobRecord) -> bool:
            if record.finished:
                return False
            record.state, record.eta_s = "cancelled", None
            record.finished_at = time.time()
            return True

        async with self._nats_errors():
            record, _ = await self._store().change(request.path_params["job_id"], cancel)
        log.info("job %s: %s", record.id, record.state)
        return respond(request, record.view())

    @contextlib.asynccontextmanager
    async def _nats_errors(self) -> AsyncIterator[None]:
        """NATS failing under a jobs read or write is a 503 NATS_UNAVAILABLE."""
        try:
            yield
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("jobs bucket access failed: %r", exc)
            raise self._nats_unavailable(
                f"NATS did not complete the jobs read or write: {type(exc).__name__}") from exc
