"""What the SDK's calls return: numpy arrays and small dataclasses, built from a response
body in either wire format (msgpack already carries numpy arrays; JSON carries lists).

Every result keeps the response body it came from as ``raw`` (``to_dict()`` makes it JSON
friendly), so nothing the server sent is lost to the typed view.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from heron_sdk.errors import HeronError, error_for_status, error_from_wire
from heron_sdk.types import Entity, Item, SparseVector

# output_dtype -> the numpy dtype its arrays arrive in ("binary" is packed sign bits)
ARRAY_DTYPES = {"float32": np.float32, "float16": np.float16, "int8": np.int8,
                "uint8": np.uint8, "binary": np.uint8}


def _array(value: Any, dtype: Any) -> np.ndarray:
    return value if isinstance(value, np.ndarray) else np.asarray(value, dtype=dtype)


def _item_error(row: Mapping[str, Any]) -> HeronError | None:
    """An item that failed on its own is ``{"error": {...}}``: an image its model could
    not decode (4xx), or, from a gateway, an item whose slice failed (5xx)."""
    error = row.get("error")
    return error_from_wire(error) if isinstance(error, Mapping) else None


@dataclass(frozen=True, slots=True)
class TextChunk:
    """One chunk of an item encoded with ``chunking``: ``text[start:end]`` of the item's
    text (character offsets), and its outputs, as if that text had been sent alone."""

    start: int
    end: int
    dense: np.ndarray | None = None
    sparse: SparseVector | None = None
    multi_vector: np.ndarray | None = None
    muvera: np.ndarray | None = None
    tokens: int = 0

    def text(self, of: str) -> str:
        """This chunk's text, cut from ``of``: the item's text."""
        return of[self.start:self.end]


@dataclass(frozen=True, slots=True)
class Embedding:
    """One item of an encode result. Outputs not asked for are None. With ``chunking``,
    ``chunks`` holds each chunk's outputs, and ``dense`` is the pooled vector (``pool:
    "mean"``) or None."""

    dense: np.ndarray | None = None  # 1-D
    sparse: SparseVector | None = None
    multi_vector: np.ndarray | None = None  # [tokens, dim]
    muvera: np.ndarray | None = None  # 1-D: MUVERA's fixed-size encoding of multi_vector
    tokens: int = 0
    truncated: bool = False
    id: str | None = None
    error: HeronError | None = None  # set when this item's part failed (gateway only)
    chunks: list[TextChunk] | None = None  # with chunking: the item's chunks, in order
    cached: bool = False  # not computed for this request: the worker's result cache


def _embedding(row: Mapping[str, Any], dtype: Any) -> Embedding:
    error = _item_error(row)
    if error is not None:
        return Embedding(id=row.get("id"), error=error)
    chunks = row.get("chunks")
    return Embedding(
        **_outputs(row, dtype),
        chunks=None if chunks is None else [
            TextChunk(int(c["start"]), int(c["end"]), **_outputs(c, dtype),
                      tokens=int(c.get("tokens", 0))) for c in chunks],
        tokens=int(row.get("tokens", 0)), truncated=bool(row.get("truncated", False)),
        id=row.get("id"), cached=bool(row.get("cached", False)))


def _outputs(row: Mapping[str, Any], dtype: Any) -> dict[str, Any]:
    """The outputs of an item (or of a chunk) as numpy arrays; None where not asked for."""
    sparse = row.get("sparse")
    sparse_dtype = np.float16 if dtype is np.float16 else np.float32
    return {
        "dense": None if row.get("dense") is None else _array(row["dense"], dtype),
        "sparse": None if sparse is None else SparseVector(
            _array(sparse["indices"], np.int32), _array(sparse["values"], sparse_dtype)),
        "multi_vector": (None if row.get("multi_vector") is None
                         else _array(row["multi_vector"], dtype)),
        "muvera": None if row.get("muvera") is None else _array(row["muvera"], dtype)}


class _Items:
    """Shared by the per-item results: a sequence of items, errors, raw body."""

    items: list[Any]
    raw: dict[str, Any]

    def __len__(self) -> int:
        return len(self.items)

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)

    def __getitem__(self, index: int) -> Any:
        return self.items[index]

    @property
    def errors(self) -> list[tuple[int, HeronError]]:
        """(index, error) of every item whose part failed; empty when all succeeded."""
        return [(n, item.error) for n, item in enumerate(self.items) if item.error is not None]

    def raise_for_errors(self) -> None:
        if self.errors:
            index, first = self.errors[0]
            # A 4xx item (an image its model could not decode) raises a RequestError.
            raise error_for_status(first.status, str(first.code),
                                   f"{len(self.errors)} of {len(self.items)} items failed; "
                                   f"item {index}: {first.message}", field=first.field)

    def to_dict(self) -> dict[str, Any]:
        return jsonable(self.raw)


@dataclass(slots=True)
class EncodeResult(_Items):
    model: str
    items: list[Embedding]
    tokens: int  # usage: every item's tokens, summed
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def from_body(cls, body: Mapping[str, Any], output_dtype: str = "float32") -> EncodeResult:
        dtype = ARRAY_DTYPES.get(output_dtype, np.float32)
        return cls(model=body["model"], items=[_embedding(r, dtype) for r in body["items"]],
                   tokens=int(body.get("usage", {}).get("tokens", 0)), raw=dict(body))

    @property
    def dense(self) -> np.ndarray:
        """Every item's dense vector as one [items, dim] array; raises the first failed
        item's error (RequestError for a 4xx, ServerError for a 5xx) if any failed."""
        self.raise_for_errors()
        if any(item.dense is None for item in self.items):
            raise ValueError("this result has no dense output; ask for output_types=['dense']")
        return np.stack([item.dense for item in self.items])  # type: ignore[misc]

    @classmethod
    def joined(cls, parts: Sequence[EncodeResult]) -> EncodeResult:
        """One result from the results of consecutive chunks of one input, in order."""
        if not parts:
            raise ValueError("items must not be empty")
        raw = merge_bodies("encode", [p.raw for p in parts], [0] * len(parts))
        items, offset = [], 0
        for part in parts:
            items += [_moved(e, offset) for e in part.items]
            offset += len(part.items)
        return cls(model=parts[0].model, items=items, tokens=sum(p.tokens for p in parts),
                   raw=raw)


_ITEM_INDEX = re.compile(r"items\[(\d+)\]")


def _moved(item: Embedding, offset: int) -> Embedding:
    """``item`` of a chunk that started at ``offset`` of the call: its error names the
    call's item (``items[i]``), not the chunk's."""
    error = item.error
    if error is None or not offset:
        return item

    def shift(text: str) -> str:
        return _ITEM_INDEX.sub(lambda m: f"items[{int(m.group(1)) + offset}]", text, count=1)

    return replace(item, error=error_for_status(
        error.status, str(error.code), shift(error.message),
        field=None if error.field is None else shift(error.field)))


@dataclass(frozen=True, slots=True)
class EncodedChunk:
    """One request's worth of a bulk encode (``encode_stream``): the inputs
    ``items[offset:offset + len(chunk)]`` of the stream, and what came back for them."""

    offset: int  # input position of the chunk's first item
    inputs: list[Item]  # what was sent (strings as Item(text))
    result: EncodeResult  # one Embedding per input, in order

    def __len__(self) -> int:
        return len(self.inputs)

    def __iter__(self) -> Iterator[Embedding]:
        return iter(self.result.items)

    def __getitem__(self, index: int) -> Embedding:
        return self.result.items[index]

    @property
    def dense(self) -> np.ndarray:
        """The chunk's dense vectors as one [items, dim] array (see ``EncodeResult``)."""
        return self.result.dense

    @property
    def positions(self) -> range:
        """The input positions of the chunk's items."""
        return range(self.offset, self.offset + len(self.inputs))


@dataclass(frozen=True, slots=True)
class ScoredItem:
    index: int  # the document's position in the request's items
    score: float
    rank: int  # 1-based
    id: str | None = None
    truncated: bool = False


@dataclass(slots=True)
class ScoreResult:
    model: str
    results: list[ScoredItem]  # best first
    tokens: int
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> ScoreResult:
        return cls(model=body["model"], results=[
            ScoredItem(index=int(r["index"]), score=float(r["score"]), rank=int(r["rank"]),
                       id=r.get("id"), truncated=bool(r.get("truncated", False)))
            for r in body["results"]], tokens=int(body.get("usage", {}).get("tokens", 0)),
            raw=dict(body))

    def __len__(self) -> int:
        return len(self.results)

    def __iter__(self) -> Iterator[ScoredItem]:
        return iter(self.results)

    def __getitem__(self, index: int) -> ScoredItem:
        return self.results[index]

    @property
    def scores(self) -> np.ndarray:
        """Scores in the request's document order (documents cut by top_k are NaN)."""
        size = max((r.index for r in self.results), default=-1) + 1
        out = np.full(size, np.nan, dtype=np.float32)
        for r in self.results:
            out[r.index] = r.score
        return out

    def to_dict(self) -> dict[str, Any]:
        return jsonable(self.raw)


@dataclass(frozen=True, slots=True)
class ExtractedItem:
    entities: list[Entity]
    tokens: int = 0
    truncated: bool = False
    id: str | None = None
    error: HeronError | None = None


@dataclass(slots=True)
class ExtractResult(_Items):
    model: str
    items: list[ExtractedItem]
    tokens: int
    raw: dict[str, Any] = field(repr=False)

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> ExtractResult:
        items = []
        for row in body["items"]:
            error = _item_error(row)
            entities = [] if error else [
                Entity(label=e["label"], text=e["text"], start=int(e["start"]),
                       end=int(e["end"]), score=float(e["score"])) for e in row["entities"]]
            items.append(ExtractedItem(entities, tokens=int(row.get("tokens", 0)),
                                       truncated=bool(row.get("truncated", False)),
                                       id=row.get("id"), error=error))
        return cls(model=body["model"], items=items,
                   tokens=int(body.get("usage", {}).get("tokens", 0)), raw=dict(body))


# ---- stitching the parts of a split call --------------------------------------------------
def merge_bodies(task: str, bodies: Sequence[Mapping[str, Any]], offsets: Sequence[int],
                 top_k: int | None = None) -> dict[str, Any]:
    """One response body from the bodies of consecutive chunks of one call's items (the
    chunk starting at ``offsets[i]`` answered ``bodies[i]``). Scores are ranked again over
    all chunks, exactly as one server ranks one request: score descending, ties by index."""
    tokens = sum(int(b.get("usage", {}).get("tokens", 0)) for b in bodies)
    merged: dict[str, Any] = {"model": bodies[0]["model"], "usage": {"tokens": tokens}}
    if task != "score":
        merged["items"] = [row for body in bodies for row in body["items"]]
        errors = sum(int(b.get("errors", 0)) for b in bodies)
        if errors:
            merged["errors"] = errors
        return merged
    rows = [{**row, "index": int(row["index"]) + offset}
            for body, offset in zip(bodies, offsets, strict=True) for row in body["results"]]
    rows.sort(key=lambda r: (-float(r["score"]), r["index"]))
    rows = rows if top_k is None else rows[:top_k]
    merged["results"] = [{**row, "rank": rank} for rank, row in enumerate(rows, start=1)]
    return merged


def jsonable(value: Any) -> Any:
    """``value`` with numpy arrays and scalars as lists and Python numbers (for JSON)."""
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, Mapping):
        return {k: jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [jsonable(v) for v in value]
    return value
