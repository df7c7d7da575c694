"""The bodies bench/fuzz.py sends: valid ones drawn from a server's own OpenAPI document,
and mutations of them, each reproducible from (seed, server, index) alone.

A valid body is sampled from the route's request schema (``SchemaSampler``: the JSON Schema
keywords Heron's documents use), kept small (a few short texts) so that the servers answer
in milliseconds. A mutation starts from one and breaks it one way (``MUTATIONS``): a field
of the wrong type, missing or unknown, huge, tiny or non-finite numbers (NaN and the
infinities in msgpack and YAML; the non-standard ``NaN``/``Infinity`` literals in JSON),
nesting thousands of levels deep, odd Unicode (lone surrogates, NUL, bidi controls),
truncated or garbage bytes, content types that do not match or are not supported, the wrong
format (JSON, msgpack, YAML), bodies past the limits, and msgpack's own kinds (binary,
extension types, integer keys, msgpack-numpy maps): bench/fuzz_mutations.py.
"""

from __future__ import annotations

import copy
import json
import math
import random
import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import msgpack
import yaml

JSON, MSGPACK, YAML = "json", "msgpack", "yaml"
CONTENT_TYPES = {
    JSON: ["application/json", None, "application/json; charset=utf-8", "text/json",
           "application/vnd.api+json", "application/x-www-form-urlencoded"],
    MSGPACK: ["application/msgpack", "application/x-msgpack", "application/vnd.msgpack"],
    YAML: ["application/yaml", "text/yaml", "application/x-yaml", "text/plain", None],
}
UNSUPPORTED_TYPES = ["text/csv", "application/xml", "multipart/form-data; boundary=x",
                     "image/png", "application/octet-stream", ";", "application/json;;;",
                     "application/JSON", "application/msgpack, application/json", "*/*",
                     "application/*", "text/html; charset=utf-16", "x" * 300]
ACCEPTS = [None, None, None, "application/msgpack", "application/json", "*/*", "text/html",
           "application/msgpack;q=0.1, application/json", "garbage/;;"]
WORDS = ("heron river wading bird grey long neck fish marsh embeddings rerank extract "
         "Ada Lovelace London Paris model vector query document token").split()
ODD_TEXT = ["", "\x00", "a\x00b", "\u202eevil", "e\u0301", "\U0001f600" * 20, "\ufeff",
            "\uffff", "\ud800", "a\udfffb", "\u200b" * 50, "a" + "\u0301" * 500, "\r\n",
            "\\", '"', "\U0010ffff", "\u0085\u2028\u2029", "\U0001d4d7\U0001d4ee", "\ufdfa" * 100,
            "\x7f\x1b[31m", "%s%n%x", "${jndi:x}", "'; DROP TABLE x; --"]
UNKNOWN_KEYS = ["top_n", "Items", "items ", "", "model", "__proto__", "constructor", "ü",
                "\u202e", "x" * 1000, "1", "null", "timeout", "labels_", "\ud800"]
HUGE = [1e308, -1e308, 1.7976931348623157e308, 2**31, 2**31 - 1, 2**53 + 1, 2**63 - 1,
        -(2**63), 2**64 - 1]
HUGE_TEXT_ONLY = [10**30, 10**400, -(10**30)]  # past msgpack's 64 bits: JSON and YAML only
TINY = [5e-324, -5e-324, 1e-300, -0.0, 0, 0.0, -1, 1e-9, 2.2250738585072014e-308]
NON_FINITE = [math.nan, math.inf, -math.inf]
DEPTHS = [33, 64, 500, 1100, 5000, 20000]


@dataclass(frozen=True, slots=True)
class Route:
    """One route the fuzz sends bodies to: its request schema (a component of the server's
    document), the formats it reads, and choices that make valid bodies likely to pass
    beyond the schema (names the server serves)."""

    name: str
    method: str
    path: str
    component: str
    formats: tuple[str, ...] = (JSON, MSGPACK)
    choices: dict[str, list[Any]] = field(default_factory=dict)  # property -> values
    headers: dict[str, str] = field(default_factory=dict)
    max_body_bytes: int = 16 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class FuzzCase:
    index: int
    route: str
    method: str
    path: str
    kind: str  # "valid", "minimal" or the mutation's name
    headers: dict[str, str]
    content: bytes
    note: str = ""  # what was changed, for a person reading a failure
    timeout_s: float | None = None  # the body's timeout_s, when it is a number


class SchemaSampler:
    """Draws JSON values a JSON Schema allows: $ref, allOf, anyOf/oneOf (siblings apply to
    the branch drawn), type (or a list of types), enum, const, min/max (exclusive too),
    min/maxLength, pattern (from ``patterns``: regex -> generator), min/maxItems,
    properties, required, additionalProperties. Sizes are clamped to ``max_items`` items
    and ``max_text`` characters."""

    def __init__(self, rng: random.Random, components: dict[str, Any],
                 patterns: dict[str, Callable[[random.Random], str]],
                 max_items: int = 4, max_text: int = 40) -> None:
        self.rng = rng
        self.components = components
        self.patterns = patterns
        self.max_items = max_items
        self.max_text = max_text

    def resolve(self, schema: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in schema:
            rest = {k: v for k, v in schema.items() if k != "$ref"}
            schema = {**self.components[schema["$ref"].rsplit("/", 1)[1]], **rest}
        for part in schema.get("allOf", []):
            schema = _merge({k: v for k, v in schema.items() if k != "allOf"},
                            self.resolve(part))
        return schema

    def sample(self, schema: dict[str, Any], choices: dict[str, list[Any]] | None = None,
               minimal: bool = False) -> Any:
        rng = self.rng
        schema = self.resolve(schema)
        for key in ("anyOf", "oneOf"):
            if key in schema:
                branches = schema[key]
                rest = {k: v for k, v in schema.items() if k != key}
                pick = rng.randrange(len(branches))
                branch = self.resolve(branches[pick])
                if set(branch) == {"required"}:  # "exactly one of" these keys
                    others = {k for i, b in enumerate(branches) if i != pick
                              for k in b.get("required", ())}
                    rest["_forbid"] = others - set(branch["required"])
                return self.sample(_merge(rest, branch), choices, minimal)
        if "const" in schema:
            return schema["const"]
        if "enum" in schema:
            return rng.choice(schema["enum"])
        kind = schema.get("type")
        if isinstance(kind, list):
            kind = rng.choice(kind)
        if kind == "null":
            return None
        if kind == "boolean":
            return rng.random() < 0.5
        if kind in ("integer", "number"):
            return self._number(schema, kind == "integer")
        if kind == "string":
            return self._string(schema)
        if kind == "array":
            low = schema.get("minItems", 0)
            high = max(low, min(schema.get("maxItems", self.max_items), self.max_items))
            return [self.sample(schema.get("items", {})) for _ in range(rng.randint(low, high))]
        if kind == "object" or "properties" in schema:
            return self._object(schema, choices or {}, minimal)
        return rng.choice([0, "x", True, None])  # {}: anything

    def _number(self, schema: dict[str, Any], integer: bool) -> float | int:
        low = schema.get("minimum", schema.get("exclusiveMinimum", -1000))
        high = schema.get("maximum", low + 1000)
        if self.rng.random() < 0.7:  # mostly small values: the ones people send
            high = min(high, low + 100)
        if integer:
            value: float | int = self.rng.randint(math.ceil(low), math.floor(high))
        else:
            value = round(self.rng.uniform(low, high), 3)
        if "exclusiveMinimum" in schema and value <= schema["exclusiveMinimum"]:
            value = schema["exclusiveMinimum"] + 1
        return value

    def _string(self, schema: dict[str, Any]) -> str:
        pattern = schema.get("pattern")
        if pattern is not None:
            return self.patterns[pattern](self.rng)
        low = schema.get("minLength", 0)
        high = max(low, min(schema.get("maxLength", self.max_text), self.max_text))
        text = " ".join(self.rng.choice(WORDS) for _ in range(1 + high // 6))
        return text[:self.rng.randint(low, high)].ljust(low, "x")

    def _object(self, schema: dict[str, Any], choices: dict[str, list[Any]],
                minimal: bool) -> dict[str, Any]:
        properties = schema.get("properties", {})
        required = set(schema.get("required", ()))
        forbid = schema.get("_forbid", set())
        out: dict[str, Any] = {}
        for name, sub in properties.items():
            if name in forbid or (name not in required and (minimal or self.rng.random() < .5)):
                continue
            # A copy: mutations change bodies in place, and cases must not share values.
            out[name] = (copy.deepcopy(self.rng.choice(choices[name])) if name in choices
                         else self.sample(sub))
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            for name in sorted(required - set(properties)):  # e.g. profiles' "default"
                out[name] = self.sample(extra)
        return out


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    out = {**a, **b}
    if "required" in a and "required" in b:
        out["required"] = [*a["required"], *b["required"]]
    return out


# ---- encoding -------------------------------------------------------------------------------
def encode(value: Any, fmt: str, rng: random.Random) -> bytes:
    """``value`` in ``fmt``. JSON goes through the standard library, so NaN and the
    infinities come out as its non-standard literals and big integers stay exact; a lone
    surrogate goes out escaped or as the bytes UTF-8 forbids."""
    if fmt == MSGPACK:
        return msgpack.packb(value, use_bin_type=True, unicode_errors="surrogatepass",
                             default=_msgpack_default)
    if fmt == YAML:
        unicode = rng.random() < 0.5
        try:  # libyaml's emitter: a 1 MB text takes it milliseconds, not a second
            text = yaml.dump(value, Dumper=yaml.CSafeDumper, allow_unicode=unicode,
                             width=10**9)
        except (yaml.YAMLError, ValueError):  # a lone surrogate: the Python emitter escapes it
            text = yaml.safe_dump(value, allow_unicode=unicode, width=10**9)
        return text.encode("utf-8", "surrogatepass")
    return json.dumps(value, ensure_ascii=rng.random() < 0.5, default=_json_default).encode(
        "utf-8", "surrogatepass")


def _msgpack_default(obj: Any) -> Any:
    if isinstance(obj, int):  # past 64 bits: no msgpack integer holds it
        return float(obj) if abs(obj) < 1e308 else str(obj)
    raise TypeError(type(obj).__name__)


def _json_default(obj: Any) -> Any:
    if isinstance(obj, bytes):
        return obj.decode("latin-1")
    if isinstance(obj, set):
        return sorted(obj, key=repr)
    raise TypeError(type(obj).__name__)


def encode_safely(value: Any, fmt: str, rng: random.Random) -> bytes:
    try:
        return encode(value, fmt, rng)
    except (TypeError, ValueError, OverflowError, yaml.YAMLError, RecursionError):
        return b"\xc1"  # what cannot be written is sent as a byte no format reads


# ---- paths into a body ----------------------------------------------------------------------
Path = tuple[Any, ...]


def paths(value: Any, prefix: Path = ()) -> list[Path]:
    """Every path to a value inside ``value`` (keys and indices), ``value`` itself first."""
    out = [prefix]
    if isinstance(value, dict):
        for key, sub in value.items():
            out += paths(sub, (*prefix, key))
    elif isinstance(value, list):
        for i, sub in enumerate(value):
            out += paths(sub, (*prefix, i))
    return out


def get_at(value: Any, path: Path) -> Any:
    for step in path:
        value = value[step]
    return value


def set_at(value: Any, path: Path, new: Any) -> Any:
    if not path:
        return new
    get_at(value, path[:-1])[path[-1]] = new
    return value


def delete_at(value: Any, path: Path) -> Any:
    if path:
        del get_at(value, path[:-1])[path[-1]]
    return value


def shown_path(path: Path) -> str:
    return "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in path).lstrip(".") or "$"


def leaf_paths(body: Any, numeric: bool = False) -> list[Path]:
    found = [p for p in paths(body) if p and not isinstance(get_at(body, p), dict | list)]
    if numeric:
        found = [p for p in found if isinstance(get_at(body, p), int | float)
                 and not isinstance(get_at(body, p), bool)] or found
    return found


def deep_bytes(fmt: str, depth: int, as_map: bool) -> bytes:
    """A list (or map) nested ``depth`` levels, written directly: no encoder recurses."""
    if fmt == MSGPACK:
        return (b"\x81\xa1a" if as_map else b"\x91") * depth + b"\xc0"
    if as_map:
        return b'{"a":' * depth + b"1" + b"}" * depth
    return b"[" * depth + b"]" * depth


def pattern_names(prefix: str, count: int) -> Callable[[random.Random], str]:
    """Names for a ``pattern`` keyword: a few, so that posts and leases meet again."""
    return lambda rng: f"{prefix}{rng.randrange(count)}"


def check_pattern(pattern: str, make: Callable[[random.Random], str]) -> None:
    """The generator's names match the schema's pattern (ECMA-262 and Python agree on
    these patterns)."""
    sample = make(random.Random(0))
    assert re.fullmatch(pattern.strip("^$"), sample), (pattern, sample)

