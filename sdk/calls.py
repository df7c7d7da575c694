"""The SDK's logic without I/O: what to send, when to retry, how to stitch split calls.

``Client`` and ``AsyncClient`` differ only in how they send a request and how they sleep.
Everything else is here, written once: a call is a generator (``attempts``) that yields
the request to send or the seconds to sleep, is sent back the reply (or the transport
error), and returns the final reply or raises the typed error. The two clients drive it.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, NotRequired, TypedDict

from heron_sdk import wire
from heron_sdk.chunking import ChunkingOptions
from heron_sdk.errors import (
    CONNECTION_FAILED,
    PROVISIONING_TIMEOUT,
    ConnectionError,
    ErrorCode,
    HeronError,
    ProvisioningTimeout,
    error_for_status,
)
from heron_sdk.images import MAX_IMAGES_PER_REQUEST, image_bytes
from heron_sdk.pools import POOL_HEADER
from heron_sdk.results import EncodeResult, ExtractResult, ScoreResult, merge_bodies
from heron_sdk.types import (
    MAX_ITEMS_PER_REQUEST,
    EncodeRequest,
    ExtractRequest,
    Item,
    RequestOptions,
    ScoreRequest,
)

# A text, an Item, or an image: its file's bytes or a PIL.Image.Image (Any: the SDK does not
# import Pillow; heron_sdk.images).
ItemLike = str | Item | bytes | Any

# 503 codes that mean "capacity is on its way": waited out like a 202.
CAPACITY_CODES = {ErrorCode.MODEL_LOADING, ErrorCode.INSUFFICIENT_MEMORY, ErrorCode.NOT_READY,
                  ErrorCode.NATS_UNAVAILABLE}
# Failures of one attempt that another attempt may not see (a worker died mid-request, a
# proxy hiccup, a request that met a deadline on a busy server).
RETRY_STATUSES = {502, 503, 504}
# Texts per call are bounded by bytes too: the server takes 16 MiB bodies, and JSON
# escaping can double a text's size.
MAX_CHUNK_TEXT_BYTES = 6 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class HttpCall:
    method: str
    path: str
    body: dict[str, Any] | None = None
    headers: Mapping[str, str] = field(default_factory=dict)
    ok: tuple[int, ...] = (200,)
    timeout_s: float = 60.0  # this attempt's budget (the call's remaining deadline)


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    headers: Mapping[str, str]
    body: Any

    @property
    def retry_after_s(self) -> float | None:
        value = self.headers.get("retry-after")
        try:
            return None if value is None else max(0.0, float(value))
        except ValueError:
            return None

    @property
    def error(self) -> tuple[str, str, str | None]:
        """(code, message, field) of an error body; a body of another shape is INTERNAL."""
        error = self.body.get("error") if isinstance(self.body, Mapping) else None
        if not isinstance(error, Mapping):
            return ErrorCode.INTERNAL, f"HTTP {self.status}: {str(self.body)[:200]}", None
        return (str(error.get("code") or ErrorCode.INTERNAL), str(error.get("message", "")),
                error.get("field"))


@dataclass(frozen=True, slots=True)
class CallPolicy:
    """How long one call may take, and how it waits for capacity."""

    timeout_s: float = 60.0  # for the call itself, retries included, capacity waits not
    wait_for_capacity: bool = True
    provision_timeout_s: float = 300.0  # how long 202s and 503s are waited out
    max_capacity_poll_s: float = 5.0  # never sleep longer than this between capacity polls
    backoff_base_s: float = 0.1
    backoff_max_s: float = 4.0


def typed_error(reply: Reply) -> HeronError:
    code, message, fld = reply.error
    return error_for_status(reply.status, code, message, field=fld,
                            retry_after_s=reply.retry_after_s)


def attempts(call: HttpCall, policy: CallPolicy, *, clock: Callable[[], float] = time.monotonic,
             rng: Callable[[], float] = random.random
             ) -> Generator[HttpCall | float, Reply | Exception | None, Reply]:
    """One call with its retries. Yields an HttpCall (send it, send back the Reply or the
    transport exception) or a float (sleep that long, send back None)."""
    started = clock()
    capacity_since: float | None = None  # when this call began waiting for capacity
    capacity_waited = 0.0  # capacity waits do not eat into the call's own timeout
    failures = 0

    def remaining() -> float:
        return started + capacity_waited + policy.timeout_s - clock()

    def backoff(floor: float = 0.0) -> float:
        # Jitter, so that many callers refused together do not come back together.
        step = min(policy.backoff_max_s, policy.backoff_base_s * 2 ** (failures - 1))
        return max(floor * (1 + rng() / 4), step * (0.5 + rng() / 2))

    while True:
        outcome = yield replace(call, timeout_s=max(0.05, remaining()))
        if isinstance(outcome, Reply) and outcome.status in call.ok:
            return outcome
        if isinstance(outcome, Reply) and _is_capacity(outcome):
            now = clock()
            capacity_since = now if capacity_since is None else capacity_since
            waited = now - capacity_since
            hint = outcome.retry_after_s or 1.0
            if not policy.wait_for_capacity or waited + min(hint, 0.5) > \
                    policy.provision_timeout_s:
                raise _provisioning_timeout(outcome, waited, policy.wait_for_capacity)
            delay = min(hint, policy.max_capacity_poll_s, policy.provision_timeout_s - waited)
            yield delay
            capacity_waited += delay
            continue
        capacity_since, failures = None, failures + 1
        if isinstance(outcome, Exception):
            delay = backoff()
            if delay >= remaining():
                raise ConnectionError(CONNECTION_FAILED, f"could not reach the server for "
                                      f"{call.method} {call.path}: {outcome!r}",
                                      status=0) from outcome
        else:
            assert isinstance(outcome, Reply)
            if not _retryable(outcome):
                raise typed_error(outcome)
            floor = (outcome.retry_after_s or 0.0) if outcome.status == 429 else 0.0
            delay = backoff(floor)
            if delay >= remaining():
                raise typed_error(outcome)
        yield delay


def _is_capacity(reply: Reply) -> bool:
    return reply.status == 202 or (reply.status == 503 and reply.error[0] in CAPACITY_CODES)


def _retryable(reply: Reply) -> bool:
    if reply.status == 429:
        return True
    return reply.status in RETRY_STATUSES and reply.error[0] != ErrorCode.MODEL_LOAD_FAILED


def _provisioning_timeout(reply: Reply, waited: float, waiting: bool) -> ProvisioningTimeout:
    body = reply.body if isinstance(reply.body, Mapping) else {}
    what = (f"pool {body['pool']} is provisioning" if "pool" in body
            else reply.error[1] or f"HTTP {reply.status}")
    why = (f"no capacity after {waited:.1f} s (provision_timeout_s)" if waiting
           else "no capacity now (wait_for_capacity=False)")
    return ProvisioningTimeout(PROVISIONING_TIMEOUT, f"{why}: {what}", status=reply.status,
                               retry_after_s=reply.retry_after_s)


# ---- building calls ------------------------------------------------------------------------
def as_items(items: Sequence[ItemLike] | str) -> list[Item]:
    if isinstance(items, str):
        items = [items]
    out = []
    for n, item in enumerate(items):
        if isinstance(item, Item):
            out.append(item)
        elif isinstance(item, str):
            out.append(Item(item))
        elif (image := image_bytes(item)) is not None:
            out.append(Item.of_image(image))
        else:
            raise TypeError(f"items[{n}] must be a str or an sdk.Item (or an image: bytes, "
                            f"a PIL image), not {type(item).__name__}")
    if not out:
        raise ValueError("items must not be empty")
    return out


def chunks(items: list[Item], max_items: int = MAX_ITEMS_PER_REQUEST,
           max_bytes: int = MAX_CHUNK_TEXT_BYTES) -> list[tuple[int, list[Item]]]:
    """Consecutive (offset, items) pieces each within the server's per-request limits."""
    out: list[tuple[int, list[Item]]] = []
    start, size, images = 0, 0, 0
    for n, item in enumerate(items):
        image = item.is_image  # bytes or a URL: either counts against the images' limit
        # An image goes as base64 under JSON: 4 bytes for 3.
        nbytes = (len(item.image) * 4 // 3 + 4 if item.image is not None
                  else len(item.image_url) if item.image_url is not None
                  else len(item.text.encode("utf-8", "surrogatepass")))
        if n > start and (n - start >= max_items or size + nbytes > max_bytes
                          or (image and images >= MAX_IMAGES_PER_REQUEST)):
            out.append((start, items[start:n]))
            start, size, images = n, 0, 0
        size += nbytes
        images += image
    out.append((start, items[start:]))
    return out


@dataclass(slots=True)
class SplitCall:
    """The HTTP calls of one SDK call (one per chunk of items), and how to join them."""

    task: str
    calls: list[HttpCall]
    offsets: list[int]
    output_dtype: str = "float32"
    top_k: int | None = None

    def finish(self, bodies: Sequence[Any]) -> EncodeResult | ScoreResult | ExtractResult:
        body = bodies[0] if len(bodies) == 1 else merge_bodies(self.task, bodies,
                                                               self.offsets, self.top_k)
        if self.task == "encode":
            return EncodeResult.from_body(body, self.output_dtype)
        if self.task == "score":
            return ScoreResult.from_body(body)
        return ExtractResult.from_body(body)


class CallOptions(TypedDict):
    """Keyword arguments every inference call takes (see docs/sdk.md)."""

    truncate: NotRequired[bool]  # cut texts over the model's limit (else 422)
    priority: NotRequired[int]  # 0 is the highest
    pool: NotRequired[str | None]  # route to this pool (X-Heron-Pool)
    timeout: NotRequired[float | None]  # seconds for the call; also sent as timeout_s
    wait_for_capacity: NotRequired[bool | None]  # wait out 202/503 (default: the client's)
    provision_timeout_s: NotRequired[float | None]  # how long to wait for capacity
    adapter: NotRequired[str | None]  # a LoRA adapter the model's config lists
    cache: NotRequired[bool]  # False: the worker's result cache is neither read nor written


class EncodeOptions(CallOptions):
    output_types: NotRequired[Sequence[str]]
    output_dtype: NotRequired[str]
    dims: NotRequired[int | None]
    is_query: NotRequired[bool]
    instruction: NotRequired[str | None]
    # "query", "document" (or Cohere's search_query, search_document, classification,
    # clustering): the model's own prompt for that side; instead of is_query.
    input_type: NotRequired[str | None]
    # Long texts split into chunks, each embedded: ChunkingOptions, its wire dict
    # ({"max_tokens", "overlap", "strategy", "pool"}) or True for the defaults.
    chunking: NotRequired[ChunkingOptions | Mapping[str, Any] | bool | None]


class ScoreOptions(CallOptions):
    top_k: NotRequired[int | None]
    max_tokens_per_doc: NotRequired[int | None]  # each item cut to this many tokens first


class ExtractOptions(CallOptions):
    labels: NotRequired[Sequence[str] | None]
    threshold: NotRequired[float]


class CallBuilder:
    """Everything a client call needs besides I/O: headers (wire format, API key, pool),
    bodies, the split into chunks, and the call's retry policy."""

    def __init__(self, fmt: str, api_key: str | None, policy: CallPolicy,
                 max_items: int = MAX_ITEMS_PER_REQUEST,
                 max_chunk_bytes: int = MAX_CHUNK_TEXT_BYTES) -> None:
        self.fmt = fmt
        self.policy = policy
        self.max_items = max_items
        self.max_chunk_bytes = max_chunk_bytes
        self.base_headers = {"accept": fmt, "content-type": fmt}
        if api_key:
            self.base_headers["authorization"] = f"Bearer {api_key}"

    def headers(self, pool: str | None) -> dict[str, str]:
        return {**self.base_headers, POOL_HEADER: pool} if pool else dict(self.base_headers)

    def request(self, method: str, path: str, body: dict[str, Any] | None = None, *,
                pool: str | None = None, ok: tuple[int, ...] = (200,)) -> HttpCall:
        return HttpCall(method, path, body, self.headers(pool), ok, self.policy.timeout_s)

    def call_policy(self, timeout: float | None = None, wait_for_capacity: bool | None = None,
                    provision_timeout_s: float | None = None) -> CallPolicy:
        policy = self.policy
        if timeout is not None:
            policy = replace(policy, timeout_s=timeout)
        if wait_for_capacity is not None:
            policy = replace(policy, wait_for_capacity=wait_for_capacity)
        if provision_timeout_s is not None:
            policy = replace(policy, provision_timeout_s=provision_timeout_s)
        return policy

    def _split(self, task: str, model: str, items: Sequence[ItemLike] | str,
               body: Callable[[list[Item], RequestOptions], dict[str, Any]],
               opts: CallOptions, output_dtype: str = "float32",
               top_k: int | None = None) -> tuple[SplitCall, CallPolicy]:
        options = RequestOptions(truncate=opts.get("truncate", True),
                                 priority=opts.get("priority", 0), timeout_s=opts.get("timeout"),
                                 adapter=opts.get("adapter"), cache=opts.get("cache", True))
        pieces = chunks(as_items(items), self.max_items, self.max_chunk_bytes)
        pool = opts.get("pool")
        calls = [self.request("POST", f"/v1/{task}/{model}", body(part, options), pool=pool)
                 for _, part in pieces]
        split = SplitCall(task, calls, [offset for offset, _ in pieces], output_dtype, top_k)
        return split, self.call_policy(opts.get("timeout"), opts.get("wait_for_capacity"),
                                       opts.get("provision_timeout_s"))

    def encode(self, model: str, items: Sequence[ItemLike] | str,
               opts: EncodeOptions) -> tuple[SplitCall, CallPolicy]:
        def body(part: list[Item], options: RequestOptions) -> dict[str, Any]:
            return EncodeRequest(
                items=part, output_types=tuple(opts.get("output_types", ("dense",))),
                output_dtype=dtype, dims=opts.get("dims"), is_query=opts.get("is_query", False),
                instruction=opts.get("instruction"), input_type=opts.get("input_type"),
                options=options, chunking=chunking).to_wire()

        check_keys(opts, EncodeOptions)
        dtype = opts.get("output_dtype", "float32")
        chunking = ChunkingOptions.of(opts.get("chunking"))
        return self._split("encode", model, items, body, opts, output_dtype=dtype)

    def score(self, model: str, query: str | Any, items: Sequence[ItemLike],
              opts: ScoreOptions) -> tuple[SplitCall, CallPolicy]:
        check_keys(opts, ScoreOptions)
        top_k = opts.get("top_k")
        pieces = len(chunks(as_items(items), self.max_items, self.max_chunk_bytes))

        def body(part: list[Item], options: RequestOptions) -> dict[str, Any]:
            # top_k applies to the whole call: with several chunks, after the merge.
            return ScoreRequest(query=query if picture is None and url is None else "",
                                items=part,
                                top_k=top_k if pieces == 1 else None,
                                max_tokens_per_doc=opts.get("max_tokens_per_doc"),
                                options=options, query_image=picture,
                                query_image_url=url).to_wire()

        picture = image_bytes(query)  # an image query: bytes or a PIL image
        # or Item.of_image_url(url), for the server to fetch
        url = query.image_url if isinstance(query, Item) else None

        return self._split("score", model, items, body, opts, top_k=top_k)

    def extract(self, model: str, items: Sequence[ItemLike] | str,
                opts: ExtractOptions) -> tuple[SplitCall, CallPolicy]:
        check_keys(opts, ExtractOptions)
        labels = opts.get("labels")

        def body(part: list[Item], options: RequestOptions) -> dict[str, Any]:
            return ExtractRequest(items=part, labels=None if labels is None else list(labels),
                                  threshold=opts.get("threshold", 0.0),
                                  options=options).to_wire()

        return self._split("extract", model, items, body, opts)

    def encode_body(self, body: dict[str, Any]) -> bytes:
        return wire.encode(body, self.fmt)


def check_keys(opts: Mapping[str, Any], options: type) -> None:
    unknown = set(opts) - set(options.__annotations__) - set(CallOptions.__annotations__)
    if unknown:
        raise TypeError(f"unexpected keyword argument(s): {', '.join(sorted(unknown))}")


def decode_reply(status: int, headers: Mapping[str, str], content: bytes) -> Reply:
    fmt = wire.media_type(headers.get("content-type")) or wire.JSON
    try:
        body = wire.decode(content, fmt) if content else {}
    except HeronError:  # e.g. an HTML page from a proxy in front of Heron
        body = {"error": {"code": ErrorCode.INTERNAL,
                          "message": content[:200].decode("utf-8", "replace")}}
    return Reply(status, headers, body)

