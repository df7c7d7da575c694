"""Bulk jobs: the shape gateways and the SDK share, and the SDK's ``client.jobs``.

A bulk job (``POST /v1/jobs``, cluster gateway only) encodes every row of a file (JSONL,
Parquet or CSV, on a local path the operator allows or in an allowed S3 bucket) into an
output file (Parquet, JSONL or ``.npy``), in shards that go to the model's pool at a
priority below interactive requests. ``JobSpec.from_wire`` is the body's parser (the
gateway's, and what the OpenAPI document is checked against); ``Jobs``/``Job`` are the
client side: ``client.jobs.create(...)`` then ``job.wait(progress=True)``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from heron_sdk.errors import ErrorCode, error_from_wire, invalid_field
from heron_sdk.streaming import ProgressBar, progress_bar_class
from heron_sdk.types import EncodeRequest, Item, check_fields, require_object

TASKS = ("encode",)
INPUT_FORMATS = ("jsonl", "parquet", "csv")
OUTPUT_FORMATS = ("parquet", "jsonl", "npy")
STATES = ("queued", "running", "succeeded", "failed", "cancelled")
FINISHED = frozenset({"succeeded", "failed", "cancelled"})
DEFAULT_TEXT_FIELD = "text"

# The request options of encode a job takes (at the top level of its body, as in
# POST /v1/encode). priority, timeout_s and encoding are the job's own: its shards go at
# the gateway's job priority and deadline, and vectors are kept as arrays.
JOB_OPTION_FIELDS = frozenset({"truncate", "adapter", "output_types", "output_dtype", "dims",
                               "is_query", "instruction", "input_type", "chunking", "cache"})
JOB_FIELDS = frozenset({"model", "task", "input", "output"}) | JOB_OPTION_FIELDS
INPUT_FIELDS = frozenset({"uri", "format", "text_field", "id_field"})
OUTPUT_FIELDS = frozenset({"uri", "format"})


def _text(body: Mapping[str, Any], key: str, where: str, default: str | None = None) -> Any:
    """A non-empty string field (``default`` when absent; required when that is None)."""
    if key not in body and default is not None:
        return default
    value = body.get(key)
    if not isinstance(value, str) or not value:
        raise invalid_field(f"{where}{key}", "must be a non-empty string")
    return value


def _choice(body: Mapping[str, Any], key: str, where: str, choices: tuple[str, ...]) -> str:
    value = body.get(key)
    if not isinstance(value, str) or value not in choices:
        raise invalid_field(f"{where}{key}", f"must be one of {list(choices)}")
    return value


def _section(body: Mapping[str, Any], key: str, known: frozenset[str]) -> Mapping[str, Any]:
    value = body.get(key)
    if not isinstance(value, Mapping):
        raise invalid_field(key, "must be an object")
    check_fields(value, known, key)
    return value


@dataclass(frozen=True, slots=True)
class JobInput:
    uri: str
    format: str  # INPUT_FORMATS
    text_field: str = DEFAULT_TEXT_FIELD
    id_field: str | None = None  # None: a row's id is its number (0-based) in the input

    def to_wire(self) -> dict[str, Any]:
        out = {"uri": self.uri, "format": self.format, "text_field": self.text_field}
        return out if self.id_field is None else {**out, "id_field": self.id_field}


@dataclass(frozen=True, slots=True)
class JobOutput:
    uri: str
    format: str  # OUTPUT_FORMATS

    def to_wire(self) -> dict[str, Any]:
        return {"uri": self.uri, "format": self.format}


@dataclass(frozen=True, slots=True)
class JobSpec:
    """What ``POST /v1/jobs`` asks for. ``options`` are the encode options as sent."""

    model: str
    input: JobInput
    output: JobOutput
    task: str = "encode"
    options: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_wire(cls, body: Any) -> JobSpec:
        body = require_object(body)
        check_fields(body, JOB_FIELDS)
        model = _text(body, "model", "")
        task = body.get("task", "encode")
        if task not in TASKS:
            raise invalid_field("task", f"must be one of {list(TASKS)}")
        source, sink = _section(body, "input", INPUT_FIELDS), _section(body, "output",
                                                                         OUTPUT_FIELDS)
        id_field = _text(source, "id_field", "input.") if "id_field" in source else None
        spec = cls(model=model, task=task,
                   options={k: v for k, v in body.items() if k in JOB_OPTION_FIELDS},
                   input=JobInput(_text(source, "uri", "input."),
                                  _choice(source, "format", "input.", INPUT_FORMATS),
                                  _text(source, "text_field", "input.", DEFAULT_TEXT_FIELD),
                                  id_field),
                   output=JobOutput(_text(sink, "uri", "output."),
                                    _choice(sink, "format", "output.", OUTPUT_FORMATS)))
        spec.encode_request([Item("x")])  # the options, checked as encode checks them
        return spec

    def encode_request(self, items: list[Item]) -> EncodeRequest:
        """A shard's request: ``items`` with the job's options (422 for a bad option)."""
        request = EncodeRequest.from_wire({**self.options, "items": ["x"]})
        request.items = items
        return request

    def to_wire(self) -> dict[str, Any]:
        return {"model": self.model, "task": self.task, **self.options,
                "input": self.input.to_wire(), "output": self.output.to_wire()}


# ---- the client side -------------------------------------------------------------------------
Request = Callable[[str, str, dict[str, Any] | None, tuple[int, ...]], Any]
AsyncRequest = Callable[[str, str, dict[str, Any] | None, tuple[int, ...]], Awaitable[Any]]


def create_body(model: str, input: Mapping[str, Any], output: Mapping[str, Any], task: str,
                options: Mapping[str, Any]) -> dict[str, Any]:
    """The body of ``POST /v1/jobs``, checked as the gateway checks it (422 here).
    ``chunking`` may be a ``ChunkingOptions``, its wire dict, or True (its defaults)."""
    body = {"model": model, "task": task, "input": dict(input), "output": dict(output),
            **options}
    if "chunking" in options:
        from heron_sdk.chunking import ChunkingOptions  # it builds on heron_sdk.types

        chunking = ChunkingOptions.of(options["chunking"])
        body["chunking"] = None if chunking is None else chunking.to_wire()
    JobSpec.from_wire(body)
    return body


class _Progress:
    """``wait(progress=...)``'s bar: tqdm's (True), the caller's own, or none."""

    def __init__(self, progress: bool | ProgressBar) -> None:
        self.bar_class = progress_bar_class(progress)
        self.bar: Any = progress if progress not in (True, False) else None
        self.shown = 0

    def show(self, info: Mapping[str, Any], name: str) -> None:
        total, done = info.get("rows_total"), int(info.get("rows_done") or 0)
        if self.bar_class is not None and self.bar is None and total is not None:
            self.bar = self.bar_class(total=total, unit="row", desc=name)
        if self.bar is not None and done > self.shown:
            self.bar.update(done - self.shown)
            self.shown = done

    def close(self) -> None:
        if self.bar_class is not None and self.bar is not None:
            self.bar.close()


class _JobState:
    """What a job handle knows: the gateway's last answer about it."""

    def __init__(self, info: dict[str, Any]) -> None:
        self.info = info

    @property
    def id(self) -> str:
        return str(self.info["id"])

    @property
    def state(self) -> str:
        return str(self.info["state"])

    @property
    def finished(self) -> bool:
        return self.state in FINISHED

    def _outcome(self) -> None:
        """A failed job raises its error."""
        if self.state == "failed":
            raise error_from_wire(self.info.get("error") or {
                "code": ErrorCode.INTERNAL, "message": f"job {self.id} failed"})

    def _timed_out(self, deadline: float | None, timeout_s: float | None) -> None:
        if deadline is not None and time.monotonic() >= deadline:
            raise TimeoutError(f"job {self.id} is still {self.state} after {timeout_s:g} s")

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.id!r}, {self.state})"


class Job(_JobState):
    """A bulk job as last read from the gateway: ``info`` is its ``GET /v1/jobs/{id}``."""

    def __init__(self, jobs: Jobs, info: dict[str, Any]) -> None:
        super().__init__(info)
        self._jobs = jobs

    def refresh(self) -> Job:
        self.info = self._jobs.get(self.id).info
        return self

    def cancel(self) -> Job:
        self.info = self._jobs.cancel(self.id).info
        return self

    def wait(self, *, progress: bool | ProgressBar = False, poll_s: float = 1.0,
             timeout_s: float | None = None) -> Job:
        """Poll until the job has finished (``progress=True``: a tqdm bar of its rows).
        A failed job raises its error; a cancelled one returns. ``TimeoutError`` after
        ``timeout_s``."""
        bar = _Progress(progress)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while True:
                bar.show(self.info, self.id)
                if self.finished:
                    break
                self._timed_out(deadline, timeout_s)
                time.sleep(poll_s)
                self.refresh()
        finally:
            bar.close()
        self._outcome()
        return self


class Jobs:
    """``client.jobs``: create, read, list and cancel bulk jobs (a cluster gateway)."""

    def __init__(self, request: Request) -> None:
        self._request = request

    def create(self, model: str, *, input: Mapping[str, Any], output: Mapping[str, Any],
               task: str = "encode", **options: Any) -> Job:
        """Start a job: ``input={"uri": "file:///data/in.jsonl", "format": "jsonl",
        "text_field": "text", "id_field": "id"}``, ``output={"uri": ..., "format":
        "parquet"}``, and encode's options (``output_types``, ``dims``, ``chunking``,
        ``cache``...)."""
        body = create_body(model, input, output, task, options)
        return Job(self, self._request("POST", "/v1/jobs", body, (202,)))

    def get(self, job_id: str) -> Job:
        return Job(self, self._request("GET", f"/v1/jobs/{job_id}", None, (200,)))

    def list(self) -> list[Job]:
        answer = self._request("GET", "/v1/jobs", None, (200,))
        return [Job(self, info) for info in answer["data"]]

    def cancel(self, job_id: str) -> Job:
        return Job(self, self._request("DELETE", f"/v1/jobs/{job_id}", None, (200,)))


class AsyncJob(_JobState):
    """``Job`` for ``AsyncClient``: the same, awaited."""

    def __init__(self, jobs: AsyncJobs, info: dict[str, Any]) -> None:
        super().__init__(info)
        self._jobs = jobs

    async def refresh(self) -> AsyncJob:
        self.info = (await self._jobs.get(self.id)).info
        return self

    async def cancel(self) -> AsyncJob:
        self.info = (await self._jobs.cancel(self.id)).info
        return self

    async def wait(self, *, progress: bool | ProgressBar = False, poll_s: float = 1.0,
                   timeout_s: float | None = None) -> AsyncJob:
        bar = _Progress(progress)
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        try:
            while True:
                bar.show(self.info, self.id)
                if self.finished:
                    break
                self._timed_out(deadline, timeout_s)
                await asyncio.sleep(poll_s)
                await self.refresh()
        finally:
            bar.close()
        self._outcome()
        return self


class AsyncJobs:
    """``AsyncClient.jobs``: ``Jobs``, awaited."""

    def __init__(self, request: AsyncRequest) -> None:
        self._request = request

    async def create(self, model: str, *, input: Mapping[str, Any],
                     output: Mapping[str, Any], task: str = "encode",
                     **options: Any) -> AsyncJob:
        body = create_body(model, input, output, task, options)
        return AsyncJob(self, await self._request("POST", "/v1/jobs", body, (202,)))

    async def get(self, job_id: str) -> AsyncJob:
        return AsyncJob(self, await self._request("GET", f"/v1/jobs/{job_id}", None, (200,)))

    async def list(self) -> list[AsyncJob]:
        answer = await self._request("GET", "/v1/jobs", None, (200,))
        return [AsyncJob(self, info) for info in answer["data"]]

    async def cancel(self, job_id: str) -> AsyncJob:
        return AsyncJob(self, await self._request("DELETE", f"/v1/jobs/{job_id}", None,
                                                  (200,)))
