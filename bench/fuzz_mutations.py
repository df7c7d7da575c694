"""Mutations of valid bodies for bench/fuzz.py, and ``CaseFactory``: case ``i`` of a server
is the same bytes on every run with the same seed (its own random.Random, seeded by the
seed, the server and ``i``), so any failure is replayed with ``--show-case``."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import msgpack

from bench.fuzz_bodies import (
    ACCEPTS,
    CONTENT_TYPES,
    DEPTHS,
    HUGE,
    HUGE_TEXT_ONLY,
    JSON,
    MSGPACK,
    NON_FINITE,
    ODD_TEXT,
    TINY,
    UNKNOWN_KEYS,
    UNSUPPORTED_TYPES,
    YAML,
    FuzzCase,
    Path,
    Route,
    SchemaSampler,
    deep_bytes,
    delete_at,
    encode_safely,
    get_at,
    leaf_paths,
    paths,
    set_at,
    shown_path,
)

_PLACEHOLDER = "__fuzz_deep__"

TYPED_VALUES: list[Any] = [0, -1, 1.5, "x", "", True, False, None, [], {}, [1, 2], {"a": 1},
                           ["dense"], "dense", 384]


@dataclass(slots=True)
class Draft:
    """A body on its way out: the value, its format and type, or raw bytes instead."""

    rng: random.Random
    route: Route
    body: Any
    fmt: str
    content_type: str | None
    note: str = ""
    content: bytes | None = None

    def encoded(self) -> bytes:
        return self.content if self.content is not None else encode_safely(
            self.body, self.fmt, self.rng)

    def any_path(self) -> Path:
        return self.rng.choice(paths(self.body)[1:] or [()])

    def leaf(self, numeric: bool = False) -> Path:
        return self.rng.choice(leaf_paths(self.body, numeric) or [()])

    def replace(self, path: Path, value: Any, what: str) -> None:
        self.body = set_at(self.body, path, value)
        self.note = f"{shown_path(path)} = {what}"


def _wrong_type(d: Draft) -> None:
    path = d.any_path()
    current = get_at(d.body, path)
    value = copy.deepcopy(d.rng.choice([v for v in TYPED_VALUES
                                         if type(v) is not type(current)]))
    d.replace(path, value, repr(value))


def _missing(d: Draft) -> None:
    keyed = [p for p in paths(d.body) if p and isinstance(get_at(d.body, p[:-1]), dict)]
    if keyed:
        path = d.rng.choice(keyed)
        d.body = delete_at(d.body, path)
        d.note = f"without {shown_path(path)}"
    else:
        d.body, d.note = {}, "{}"


def _unknown_field(d: Draft) -> None:
    maps = [p for p in paths(d.body) if isinstance(get_at(d.body, p), dict)]
    if not maps:
        d.body, maps = {}, [()]
    path = d.rng.choice(maps)
    key = d.rng.choice([*UNKNOWN_KEYS, f"f{d.rng.randrange(10**6)}"])
    get_at(d.body, path)[key] = copy.deepcopy(d.rng.choice(TYPED_VALUES))
    d.note = f"{shown_path(path)} gets {key[:40]!r}"


def _huge(d: Draft) -> None:
    values = HUGE + (HUGE_TEXT_ONLY if d.fmt != MSGPACK else [])
    value = d.rng.choice(values)
    d.replace(d.leaf(numeric=True), value, repr(value))


def _tiny(d: Draft) -> None:
    value = d.rng.choice(TINY)
    d.replace(d.leaf(numeric=True), value, repr(value))


def _non_finite(d: Draft) -> None:
    value = d.rng.choice(NON_FINITE)
    d.replace(d.leaf(numeric=d.rng.random() < 0.8), value, repr(value))


def _deep(d: Draft) -> None:
    depth, as_map = d.rng.choice(DEPTHS), d.rng.random() < 0.3
    path = d.any_path() if d.rng.random() < 0.8 else ()
    deep = deep_bytes(d.fmt, depth, as_map)
    d.note = f"{shown_path(path)} nested {depth} deep ({'maps' if as_map else 'lists'})"
    if not path:
        d.content = deep
        return
    d.body = set_at(d.body, path, _PLACEHOLDER)
    marker = (msgpack.packb(_PLACEHOLDER) if d.fmt == MSGPACK
              else b'"' + _PLACEHOLDER.encode() + b'"' if d.fmt == JSON
              else _PLACEHOLDER.encode())
    d.content = encode_safely(d.body, d.fmt, d.rng).replace(marker, deep, 1)


def _odd_unicode(d: Draft) -> None:
    text = d.rng.choice(ODD_TEXT)
    strings = [p for p in leaf_paths(d.body) if isinstance(get_at(d.body, p), str)]
    maps = [p for p in paths(d.body) if isinstance(get_at(d.body, p), dict)]
    if maps and (not strings or d.rng.random() < 0.3):  # an odd key
        path = d.rng.choice(maps)
        get_at(d.body, path)[text] = "x"
        d.note = f"{shown_path(path)} gets key {text[:20]!r}"
    elif strings:
        path = d.rng.choice(strings)
        d.replace(path, get_at(d.body, path)[:5] + text, repr(text[:20]))
    else:
        d.body, d.note = text, repr(text[:20])


def _truncated(d: Draft) -> None:
    raw = d.encoded()
    cut = d.rng.randrange(max(1, len(raw)))
    d.content, d.note = raw[:cut], f"first {cut} of {len(raw)} bytes"


GARBAGE = [b"\xff\xfe", b"\x00", b"null", b"{}", b"[]", b"   ", b"\xc1", b"\xdd\xff\xff\xff\xff",
           b"\xdb\xff\xff\xff\xff", b"\xdf\xff\xff\xff\xff", b"\x92" * 100000, b"\xef\xbb\xbf{}",
           b"\n---\n...\n", b"!!python/object/apply:os.system ['true']", b"*a", b"{{{{",
           b'{"items": ["a"]} trailing', b"\x80\x81\x82", b"%YAML 9.9\n---\na: 1"]


def _garbage(d: Draft) -> None:
    if d.rng.random() < 0.5:
        d.content = d.rng.choice(GARBAGE)
    else:
        d.content = d.rng.randbytes(d.rng.randint(1, 2000))
    d.note = f"{len(d.content)} garbage bytes"


def _content_type(d: Draft) -> None:
    d.content_type = d.rng.choice(UNSUPPORTED_TYPES)
    d.note = f"Content-Type {d.content_type[:40]!r}"


def _wrong_format(d: Draft) -> None:
    real = d.rng.choice([f for f in (JSON, MSGPACK, YAML) if f != d.fmt])
    d.content = encode_safely(d.body, real, d.rng)
    d.note = f"{real} sent as {d.content_type}"


def _too_big(d: Draft) -> None:
    roll = d.rng.random()
    if roll < 0.05:  # past the body limit: a few of these are enough
        d.content = b'{"items": ["' + b"a" * d.route.max_body_bytes + b'"]}'
        d.note = f"{len(d.content)} bytes"
    elif roll < 0.35 and isinstance(d.body, dict):
        key = "input" if "input" in d.body else "items"
        d.body[key] = ["a"] * 2049
        d.note = f"{key}: 2049 items"
    elif roll < 0.55 and isinstance(d.body, dict):
        d.body.update({f"k{i}": i for i in range(5000)})
        d.note = "5000 unknown keys"
    else:
        path = d.leaf()
        d.replace(path, "word " * 200_001, "1,000,005 characters")


def _msgpack_kinds(d: Draft) -> None:
    d.fmt = MSGPACK
    d.content_type = d.rng.choice(CONTENT_TYPES[MSGPACK])
    pickled = (b"\x80\x04\x95\t\x00\x00\x00\x00\x00\x00\x00\x8c\x05heron\x94.")  # "heron"
    value = d.rng.choice([
        b"text", msgpack.ExtType(5, b"xx"), msgpack.Timestamp(2**33, 5),
        msgpack.ExtType(127, b""), {1: "a"}, {None: 1}, 2**64 - 1, -(2**63),
        {b"nd": True, b"type": "<f4", b"kind": b"", b"shape": [2], b"data": b"\0" * 8},
        {b"nd": True, b"type": "|O", b"kind": b"O", b"shape": [1], b"data": pickled},
        {b"nd": False, b"type": "<f8", b"data": b""},
        {b"nd": True, b"type": "<f4", b"kind": b"", b"shape": [10**9], b"data": b""},
        {b"complex": True, b"data": "1+2j"}])
    d.replace(d.any_path(), value, repr(value)[:60])


def _not_object(d: Draft) -> None:
    d.body = d.rng.choice([[], [d.body], "text", 1, None, True, 1.5, "", [None]])
    d.note = repr(d.body)[:60]


def _empty(d: Draft) -> None:
    d.content = d.rng.choice([b"", b" ", b"\n\n", b"\t"])
    d.note = f"{d.content!r}"


def _no_auth(d: Draft) -> None:
    d.note = "without the token or with another"


# name -> (mutation, weight out of 100); "valid" and "minimal" bodies are left as drawn.
MUTATIONS: dict[str, tuple[Callable[[Draft], None] | None, float]] = {
    "valid": (None, 15), "minimal": (None, 10), "wrong_type": (_wrong_type, 10),
    "missing": (_missing, 5), "unknown_field": (_unknown_field, 8), "huge_number": (_huge, 6),
    "tiny_number": (_tiny, 5), "non_finite": (_non_finite, 6), "deep": (_deep, 5),
    "odd_unicode": (_odd_unicode, 7), "truncated": (_truncated, 4), "garbage": (_garbage, 4),
    "content_type": (_content_type, 4), "wrong_format": (_wrong_format, 3),
    "too_big": (_too_big, 2), "msgpack_kinds": (_msgpack_kinds, 4),
    "not_object": (_not_object, 1), "empty": (_empty, 1), "no_auth": (_no_auth, 0),
}


class CaseFactory:
    """Case ``index`` of one server: a route, a body drawn from its schema, a mutation."""

    def __init__(self, server: str, seed: int, routes: list[Route],
                 components: dict[str, Any],
                 patterns: dict[str, Callable[[random.Random], str]]) -> None:
        self.server = server
        self.seed = seed
        self.routes = routes
        self.components = components
        self.patterns = patterns
        self.kinds = [k for k, (_, w) in MUTATIONS.items() if w > 0]
        self.weights = [MUTATIONS[k][1] for k in self.kinds]

    def case(self, index: int) -> FuzzCase:
        rng = random.Random(f"{self.seed}:{self.server}:{index}")
        route = rng.choice(self.routes)
        kind = rng.choices(self.kinds, self.weights)[0]
        if "Authorization" in route.headers and rng.random() < 0.02:
            kind = "no_auth"
        sampler = SchemaSampler(rng, self.components, self.patterns)
        body = sampler.sample({"$ref": f"#/components/schemas/{route.component}"},
                              route.choices, minimal=kind == "minimal")
        fmt = rng.choice(route.formats)
        draft = Draft(rng, route, body, fmt, rng.choice(CONTENT_TYPES[fmt]))
        mutate = MUTATIONS[kind][0]
        if mutate is not None:
            mutate(draft)
        headers = dict(route.headers)
        if kind == "no_auth":
            if rng.random() < 0.5:
                headers.pop("Authorization")
            else:
                headers["Authorization"] = rng.choice(["Bearer wrong", "Basic x", "Bearer"])
        if draft.content_type is not None:
            headers["Content-Type"] = draft.content_type
        accept = rng.choice(ACCEPTS)
        if accept is not None:
            headers["Accept"] = accept
        timeout_s = draft.body.get("timeout_s") if isinstance(draft.body, dict) else None
        return FuzzCase(index, route.name, route.method, route.path, kind, headers,
                        draft.encoded(), draft.note,
                        timeout_s if isinstance(timeout_s, int | float) else None)
