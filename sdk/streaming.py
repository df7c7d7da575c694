"""Bulk encoding: any iterable of texts through bounded, ordered, concurrent requests.

``Client.encode_stream`` and ``AsyncClient.encode_stream`` (docs/sdk.md, "Bulk encoding")
read their input lazily, one chunk (one request) at a time, keep at most ``max_in_flight``
chunks between "read from the input" and "handed back to the caller", and hand chunks back
in input order however the requests finish.

The decisions are pure and clock-free, and unit-tested without a server:
``ChunkBuilder`` groups items into chunks within the server's per-request limits, and
``OrderedWindow`` says when another chunk may go out, which result is next in order, where
a failure surfaces and what to cancel after one. ``drive_sync`` (a thread pool) and
``drive_async`` (tasks) only move chunks between the input, the requests and the caller.

On a failure (a request's typed error, the input iterable raising, a bad item) nothing is
skipped: every chunk before the failing one is handed back, then the error is raised at
that position with a note naming the items; nothing more is sent and the requests after it
are cancelled (async) or left to finish unread (sync: a thread cannot stop a request
already sent).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
from collections.abc import (
    AsyncIterable,
    AsyncIterator,
    Awaitable,
    Callable,
    Iterable,
    Iterator,
    Sized,
)
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

from heron_sdk.calls import (
    CallBuilder,
    CallPolicy,
    EncodeOptions,
    ItemLike,
    SplitCall,
    check_keys,
)
from heron_sdk.errors import ServerError
from heron_sdk.images import MAX_IMAGES_PER_REQUEST, image_bytes
from heron_sdk.results import EncodedChunk, EncodeResult
from heron_sdk.types import Item

R = TypeVar("R")

# Chunks between "read from the input" and "handed back", by default: a server's queue
# holds 8192 items (max_queue_items), four full requests of 2048.
DEFAULT_MAX_IN_FLIGHT = 4
PROGRESS_EXTRA = "pip install 'heron-sdk[progress]'"


@dataclass(frozen=True, slots=True)
class Chunk:
    """One request's worth of consecutive input items: ``items[offset:offset+len]``."""

    seq: int  # 0, 1, 2, ... in input order
    offset: int  # input position of the chunk's first item
    items: list[Item]

    def __len__(self) -> int:
        return len(self.items)

    def describe(self) -> str:
        return f"items {self.offset}..{self.offset + len(self.items) - 1} of the stream"


def as_item(value: object, position: int) -> Item:
    if isinstance(value, Item):
        return value
    if isinstance(value, str):
        return Item(value)
    if (image := image_bytes(value)) is not None:
        return Item.of_image(image)
    raise TypeError(f"items[{position}] must be a str or an Item (or an image: bytes, a PIL "
                    f"image), not {type(value).__name__}")


class ChunkBuilder:
    """Consecutive items into chunks of at most ``chunk_size`` items and ``max_bytes`` of
    UTF-8 text (a single bigger text gets a chunk of its own; the server judges it). A
    chunk closes as soon as it is full, so a slow input never holds a full chunk back."""

    def __init__(self, chunk_size: int, max_bytes: int) -> None:
        if chunk_size < 1:
            raise ValueError("chunk_size must be at least 1")
        self.chunk_size, self.max_bytes = chunk_size, max_bytes
        self.seen = 0  # items taken so far: the input position of the next one
        self._seq = 0
        self._items: list[Item] = []
        self._bytes = 0
        self._images = 0  # image items in the open chunk (MAX_IMAGES_PER_REQUEST a request)

    def add(self, value: object) -> list[Chunk]:
        """Take the next input item; the chunks it closes (none, one or two)."""
        item = as_item(value, self.seen)
        self.seen += 1
        size = len(item.text.encode("utf-8", "surrogatepass"))
        size += 8 * len(getattr(item, "tokens", None) or ())  # token-id items: ids on the wire
        image = item.is_image  # bytes or a URL
        size += len(item.image) * 4 // 3 if item.image is not None else 0  # base64 in JSON
        size += len(item.image_url or "")
        out = []
        if self._items and (self._bytes + size > self.max_bytes
                            or (image and self._images >= MAX_IMAGES_PER_REQUEST)):
            out.append(self._close())
        self._items.append(item)
        self._bytes += size
        self._images += image
        if len(self._items) >= self.chunk_size:
            out.append(self._close())
        return out

    def flush(self) -> Chunk | None:
        """The open chunk, if it holds anything (at the end of the input, or before an
        error surfaces: the items read before it still go out)."""
        return self._close() if self._items else None

    def _close(self) -> Chunk:
        chunk = Chunk(self._seq, self.seen - len(self._items), self._items)
        self._seq, self._items, self._bytes, self._images = self._seq + 1, [], 0, 0
        return chunk


def iter_chunks(items: Iterable[object], builder: ChunkBuilder) -> Iterator[Chunk]:
    """The chunks of ``items``, read lazily. Should the input raise (or hold a bad item),
    the items before it come out as a chunk first and the error is raised after it."""
    source = iter(items)
    while True:
        try:
            value = next(source)
            closed = builder.add(value)
        except StopIteration:
            break
        except Exception as exc:
            if (rest := builder.flush()) is not None:
                yield rest
            _noted(exc, f"the input failed at item {builder.seen}")
            raise
        yield from closed
    if (rest := builder.flush()) is not None:
        yield rest


async def aiter_chunks(items: AsyncIterable[object], builder: ChunkBuilder
                       ) -> AsyncIterator[Chunk]:
    """``iter_chunks`` for an async iterable."""
    source = aiter(items)
    while True:
        try:
            value = await anext(source)
            closed = builder.add(value)
        except StopAsyncIteration:
            break
        except Exception as exc:
            if (rest := builder.flush()) is not None:
                yield rest
            _noted(exc, f"the input failed at item {builder.seen}")
            raise
        for chunk in closed:
            yield chunk
    if (rest := builder.flush()) is not None:
        yield rest


def _noted(exc: BaseException, note: str) -> BaseException:
    exc.add_note(f"heron_sdk encode_stream: {note}; the items before it were handed back")
    return exc


@dataclass(slots=True)
class OrderedWindow(Generic[R]):
    """Which chunk goes out next, which result is handed back next, and what a failure
    stops. ``limit`` bounds the chunks sent and not yet handed back (in flight or done
    and waiting for an earlier one), so it bounds the requests in flight and the results
    held, whatever order the requests finish in."""

    limit: int
    _next_seq: int = 0  # the seq the next sent chunk must carry
    _head: int = 0  # the seq handed back next
    _sent: dict[int, Chunk] = field(default_factory=dict)  # sent, not handed back
    _results: dict[int, R] = field(default_factory=dict)
    _failure: tuple[int, BaseException] | None = None  # the earliest failed seq
    _ended: bool = False  # the input has no more chunks (or raised)

    def __post_init__(self) -> None:
        if self.limit < 1:
            raise ValueError("max_in_flight must be at least 1")

    @property
    def outstanding(self) -> int:
        """Chunks sent and not handed back."""
        return len(self._sent)

    @property
    def in_flight(self) -> list[int]:
        """Seqs sent and not yet answered, in order."""
        failed = None if self._failure is None else self._failure[0]
        return sorted(seq for seq in self._sent if seq not in self._results and seq != failed)

    def can_send(self) -> bool:
        return not self._ended and self._failure is None and self.outstanding < self.limit

    def sent(self, chunk: Chunk) -> None:
        if not self.can_send():
            raise RuntimeError("the window is full or closed")
        if chunk.seq != self._next_seq:
            raise ValueError(f"chunk {chunk.seq} sent out of order (expected "
                             f"{self._next_seq})")
        self._sent[chunk.seq] = chunk
        self._next_seq += 1

    def end(self, error: BaseException | None = None) -> None:
        """The input is exhausted; with ``error``, it raised after the chunks sent so far
        (raised once those are handed back)."""
        self._ended = True
        if error is not None:
            self._fail(self._next_seq, error)

    def completed(self, seq: int, result: R) -> None:
        if seq in self._sent:  # else: cancelled after an earlier failure; dropped
            self._results[seq] = result

    def failed(self, seq: int, error: BaseException) -> None:
        if seq in self._sent:
            chunk = self._sent[seq]
            self._fail(seq, _noted(error, f"the request for {chunk.describe()} failed"))

    def _fail(self, seq: int, error: BaseException) -> None:
        if self._failure is None or seq < self._failure[0]:
            self._failure = (seq, error)

    def cancel(self) -> list[int]:
        """After a failure: the seqs in flight after it, forgotten here; their requests
        should be cancelled (their results would never be handed back)."""
        if self._failure is None:
            return []
        doomed = [seq for seq in self._sent if seq > self._failure[0]]
        for seq in doomed:
            del self._sent[seq]
            self._results.pop(seq, None)
        return doomed

    def pop(self) -> tuple[Chunk, R] | None:
        """The next chunk in order with its result; None while it is still in flight.
        Raises the failure when it is next: everything before it has been handed back."""
        if self._failure is not None and self._failure[0] == self._head:
            error = self._failure[1]
            self._ended = True
            self._sent.clear()
            self._results.clear()
            raise error
        if self._head not in self._results:
            return None
        chunk, result = self._sent.pop(self._head), self._results.pop(self._head)
        self._head += 1
        return chunk, result

    @property
    def done(self) -> bool:
        """The input is exhausted and every chunk has been handed back."""
        return self._ended and self._failure is None and not self._sent


def checked(chunk: Chunk, result: EncodeResult) -> EncodeResult:
    """``result`` if it answers ``chunk`` item for item (its length, and each id that was
    given); else a ServerError, so that no item is dropped or shifted without a word."""
    if len(result.items) != len(chunk.items):
        raise ServerError("INTERNAL", f"{len(result.items)} results for "
                          f"{len(chunk.items)} items ({chunk.describe()})", status=200)
    for n, (item, out) in enumerate(zip(chunk.items, result.items, strict=True)):
        if item.id is not None and out.id != item.id:
            raise ServerError("INTERNAL", f"item {chunk.offset + n} came back with id "
                              f"{out.id!r}, sent as {item.id!r}", status=200)
    return result


# ---- drivers: only I/O and waiting; every decision is the window's --------------------------
def drive_sync(chunks: Iterator[Chunk], window: OrderedWindow[R],
               send: Callable[[Chunk], R]) -> Iterator[tuple[Chunk, R]]:
    """Run ``send`` for each chunk on up to ``window.limit`` threads; (chunk, result) pairs
    in input order. The input is read on the caller's thread only."""
    pool = ThreadPoolExecutor(max_workers=window.limit, thread_name_prefix="heron-stream")
    running: dict[int, Future[R]] = {}
    try:
        while True:
            while (ready := window.pop()) is not None:
                yield ready
            if window.done:
                return
            while window.can_send():
                try:
                    chunk = next(chunks)
                except StopIteration:
                    window.end()
                    break
                except Exception as exc:
                    window.end(exc)
                    break
                window.sent(chunk)
                running[chunk.seq] = pool.submit(send, chunk)
            for seq in window.cancel():
                if (doomed := running.pop(seq, None)) is not None:
                    doomed.cancel()
            if running:
                wait(running.values(), return_when=FIRST_COMPLETED)
            for seq, future in [(s, f) for s, f in running.items() if f.done()]:
                del running[seq]
                error = future.exception()
                if error is None:
                    window.completed(seq, future.result())
                else:
                    window.failed(seq, error)
    finally:
        # Not started: cancelled. Already sent: they end on their own (within the call's
        # timeout); their results are dropped. The caller is not kept waiting for them.
        pool.shutdown(wait=False, cancel_futures=True)


async def drive_async(chunks: AsyncIterator[Chunk], window: OrderedWindow[R],
                      send: Callable[[Chunk], Awaitable[R]]
                      ) -> AsyncIterator[tuple[Chunk, R]]:
    """``drive_sync`` with tasks: up to ``window.limit`` requests at once; on a failure,
    or when the caller stops early, the tasks still running are cancelled and awaited."""
    running: dict[int, asyncio.Task[R]] = {}
    try:
        while True:
            while (ready := window.pop()) is not None:
                yield ready
            if window.done:
                return
            while window.can_send():
                try:
                    chunk = await anext(chunks)
                except StopAsyncIteration:
                    window.end()
                    break
                except Exception as exc:
                    window.end(exc)
                    break
                window.sent(chunk)
                running[chunk.seq] = asyncio.ensure_future(send(chunk))
            for seq in window.cancel():
                if (doomed := running.pop(seq, None)) is not None:
                    doomed.cancel()
            if running:
                await asyncio.wait(running.values(), return_when=asyncio.FIRST_COMPLETED)
            for seq, task in [(s, t) for s, t in running.items() if t.done()]:
                del running[seq]
                error = task.exception()
                if error is None:
                    window.completed(seq, task.result())
                else:
                    window.failed(seq, error)
    finally:
        for task in running.values():
            task.cancel()
        await asyncio.gather(*running.values(), return_exceptions=True)


async def as_async_chunks(items: Iterable[object] | AsyncIterable[object],
                          builder: ChunkBuilder) -> AsyncIterator[Chunk]:
    """Chunks of a sync or an async iterable, as an async iterator."""
    if isinstance(items, AsyncIterable):
        async for chunk in aiter_chunks(items, builder):
            yield chunk
    else:
        for chunk in iter_chunks(items, builder):
            yield chunk


# ---- progress --------------------------------------------------------------------------------
class ProgressBar(Protocol):
    """What ``progress=`` accepts besides ``True``: anything with ``update(n)``, such as a
    ``tqdm`` bar of your own (it is updated, never closed)."""

    def update(self, n: int) -> Any: ...


def progress_bar_class(progress: bool | ProgressBar | None) -> Callable[..., Any] | None:
    """tqdm's bar class when ``progress`` is True (checked when the call is made: without
    tqdm, an ImportError naming the ``heron-sdk[progress]`` extra, before anything is
    read or sent); None for no bar or a bar of the caller's own."""
    if progress is False or progress is None:
        return None
    if progress is not True:
        if not callable(getattr(progress, "update", None)):
            raise TypeError("progress must be True, False or an object with update(n)")
        return None
    try:
        # An optional extra: imported by name, only when a bar is asked for.
        return importlib.import_module("tqdm.auto").tqdm
    except ImportError as exc:
        raise ImportError(f"progress=True needs tqdm: {PROGRESS_EXTRA} (or pass "
                          "progress=False, or a bar of your own)") from exc


def _positive(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, not {value!r}")
    return value


# ---- one encode_stream call ------------------------------------------------------------------
Send = Callable[[tuple[SplitCall, CallPolicy]], EncodeResult]
AsyncSend = Callable[[tuple[SplitCall, CallPolicy]], Awaitable[EncodeResult]]


class EncodeStream:
    """One ``encode_stream`` call: its settings checked when it is made (a bad option, a
    chunk_size over the limit or a missing tqdm raise before any input is read), then run
    by a driver. The clients pass how to run one request; the rest is here."""

    def __init__(self, calls: CallBuilder, model: str,
                 items: Iterable[ItemLike] | AsyncIterable[ItemLike] | str, *,
                 chunk_size: int | None, max_in_flight: int,
                 progress: bool | ProgressBar | None, total: int | None,
                 options: EncodeOptions) -> None:
        check_keys(options, EncodeOptions)
        size = _positive(calls.max_items if chunk_size is None else chunk_size, "chunk_size")
        if size > calls.max_items:
            raise ValueError(f"chunk_size {size} is over the {calls.max_items} items one "
                             "request may hold (the client's max_items_per_request)")
        if not isinstance(items, Iterable | AsyncIterable):
            raise TypeError(f"items must be an iterable of str or Item, not "
                            f"{type(items).__name__}")
        self.window: OrderedWindow[EncodeResult] = OrderedWindow(
            _positive(max_in_flight, "max_in_flight"))
        self.builder = ChunkBuilder(size, calls.max_chunk_bytes)
        self.items = [items] if isinstance(items, str) else items
        self.calls, self.model, self.options = calls, model, options
        self.bar_class = progress_bar_class(progress)
        self.bar = None if isinstance(progress, bool | None) else progress
        if self.bar_class is not None and total is None and isinstance(self.items, Sized):
            total = len(self.items)
        self.total = total

    def request(self, chunk: Chunk) -> tuple[SplitCall, CallPolicy]:
        """The HTTP call of one chunk (one request: a chunk is within the limits)."""
        return self.calls.encode(self.model, chunk.items, self.options)

    def _open_bar(self) -> None:
        if self.bar_class is not None:
            self.bar = self.bar_class(total=self.total, desc=self.model, unit="item")

    def _handed(self, chunk: Chunk, result: EncodeResult) -> EncodedChunk:
        if self.bar is not None:
            self.bar.update(len(chunk))
        return EncodedChunk(chunk.offset, chunk.items, result)

    def _close_bar(self) -> None:
        if self.bar_class is not None and self.bar is not None:
            self.bar.close()  # type: ignore[attr-defined]

    def run_sync(self, send: Send) -> Iterator[EncodedChunk]:
        """The chunks, in order, with requests on up to ``max_in_flight`` threads."""
        if not isinstance(self.items, Iterable):
            raise TypeError("Client.encode_stream takes an iterable; an async iterable "
                            "needs AsyncClient")
        return self._sync(self.items, send)

    def _sync(self, items: Iterable[ItemLike], send: Send) -> Iterator[EncodedChunk]:
        self._open_bar()
        driver = drive_sync(iter_chunks(items, self.builder), self.window,
                            lambda c: checked(c, send(self.request(c))))
        with contextlib.closing(driver):
            try:
                for chunk, result in driver:
                    yield self._handed(chunk, result)
            finally:
                self._close_bar()

    async def run_async(self, send: AsyncSend) -> AsyncIterator[EncodedChunk]:
        """The chunks, in order, with up to ``max_in_flight`` requests as tasks."""
        async def one(chunk: Chunk) -> EncodeResult:
            return checked(chunk, await send(self.request(chunk)))

        self._open_bar()
        driver = drive_async(as_async_chunks(self.items, self.builder), self.window, one)
        async with contextlib.aclosing(driver):
            try:
                async for chunk, result in driver:
                    yield self._handed(chunk, result)
            finally:
                self._close_bar()
