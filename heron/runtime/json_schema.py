"""Python type hints -> JSON Schema (2020-12, the dialect of OpenAPI 3.1).

The wire shapes of Heron's bodies are written once, as TypedDicts and dataclasses with type
hints (heron/runtime/api_types.py); the OpenAPI document is generated from them here, so the
document cannot drift from the types the code names. Supported: str, int, float, bool, None,
Any, Literal, StrEnum, list/Sequence/tuple, dict/Mapping with str keys, unions, TypedDict
(Required/NotRequired), dataclasses, and ``Annotated[T, schema(...)]`` for extra keywords
(minItems, maximum, description, ...); ``@closed`` types refuse unknown keys. Named types
(TypedDicts, dataclasses, enums) become components referenced by ``$ref``.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, NotRequired, Required

JsonSchema = dict[str, Any]

_SCALARS: dict[Any, str] = {str: "string", int: "integer", float: "number", bool: "boolean"}


# eq=False: hashed by identity, as typing hashes Annotated metadata and values may be lists.
@dataclass(frozen=True, slots=True, eq=False)
class SchemaKeywords:
    """Extra JSON Schema keywords for the type they annotate: ``Annotated[int, schema(...)]``."""

    keywords: Mapping[str, Any]


def schema(**keywords: Any) -> SchemaKeywords:
    """``Annotated[list[str], schema(minItems=1, description="...")]``."""
    return SchemaKeywords(dict(keywords))


T = typing.TypeVar("T", bound=type)


def closed(cls: T) -> T:
    """Mark a TypedDict or dataclass whose parser refuses unknown keys: its schema gets
    ``additionalProperties: false`` (others leave extra keys allowed, as their parsers do)."""
    cls.__heron_closed__ = True  # type: ignore[attr-defined]
    return cls


class SchemaBuilder:
    """Turns types into schemas, collecting the named ones as components."""

    def __init__(self, ref_prefix: str = "#/components/schemas/") -> None:
        self.ref_prefix = ref_prefix
        self.components: dict[str, JsonSchema] = {}
        self._names: dict[str, Any] = {}  # component name -> the type that owns it

    def of(self, tp: Any) -> JsonSchema:
        """The schema of ``tp`` (a ``$ref`` for named types, whose schemas go to
        ``components``)."""
        if tp is Any or tp is object:
            return {}
        if tp is None or tp is type(None):
            return {"type": "null"}
        if tp in _SCALARS:
            return {"type": _SCALARS[tp]}
        origin = typing.get_origin(tp)
        if origin is typing.Annotated:
            inner, *extras = typing.get_args(tp)
            out = self.of(inner)
            for extra in extras:
                if isinstance(extra, SchemaKeywords):
                    # A $ref's siblings apply too in 2020-12; allOf keeps older tools right.
                    out = {"allOf": [out]} if "$ref" in out else out
                    out = {**out, **extra.keywords}
            return out
        if origin in (Required, NotRequired):
            return self.of(typing.get_args(tp)[0])
        if origin is typing.Literal:
            return _literal(typing.get_args(tp))
        if origin in (typing.Union, types.UnionType):
            return _union([self.of(arg) for arg in typing.get_args(tp)])
        if origin in (list, Sequence, set, frozenset) or origin is typing.Sequence:
            (item,) = typing.get_args(tp) or (Any,)
            return {"type": "array", "items": self.of(item)}
        if origin is tuple:
            args = typing.get_args(tp)
            if len(args) == 2 and args[1] is Ellipsis:
                return {"type": "array", "items": self.of(args[0])}
            return {"type": "array", "prefixItems": [self.of(a) for a in args],
                    "minItems": len(args), "maxItems": len(args)}
        if origin in (dict, Mapping) or origin is typing.Mapping:
            key, value = typing.get_args(tp) or (str, Any)
            if key is not str:
                raise TypeError(f"JSON object keys are strings, not {key!r}")
            return {"type": "object", "additionalProperties": self.of(value)}
        if tp in (list, tuple):
            return {"type": "array"}
        if tp is dict:
            return {"type": "object"}
        if isinstance(tp, type) and issubclass(tp, enum.Enum):
            return self._named(tp, lambda: {"title": tp.__name__,
                                            **_literal(tuple(m.value for m in tp))})
        if typing.is_typeddict(tp):
            return self._named(tp, lambda: self._typeddict(tp))
        if dataclasses.is_dataclass(tp) and isinstance(tp, type):
            return self._named(tp, lambda: self._dataclass(tp))
        raise TypeError(f"no JSON Schema for {tp!r}")

    def _named(self, tp: type, build: typing.Callable[[], JsonSchema]) -> JsonSchema:
        name = tp.__name__
        owner = self._names.get(name)
        if owner is not None and owner is not tp:
            raise TypeError(f"two types are named {name}: {owner!r} and {tp!r}")
        if owner is None:
            self._names[name] = tp
            self.components[name] = {}  # taken first: a type that refers to itself ends
            self.components[name] = build()
        return {"$ref": self.ref_prefix + name}

    def _typeddict(self, tp: type) -> JsonSchema:
        hints = typing.get_type_hints(tp, include_extras=True)
        required_keys: frozenset[str] = getattr(tp, "__required_keys__", frozenset(hints))
        properties: dict[str, JsonSchema] = {}
        required: list[str] = []
        for name, hint in hints.items():
            properties[name] = self.of(hint)
            # The hint's own Required/NotRequired wins: under string annotations, 3.11's
            # TypedDict cannot see them and counts every key as required.
            wrapper = _outer_qualifier(hint)
            if wrapper is NotRequired:
                continue
            if wrapper is Required or name in required_keys:
                required.append(name)
        return _object(tp, properties, required)

    def _dataclass(self, tp: type) -> JsonSchema:
        hints = typing.get_type_hints(tp, include_extras=True)
        properties: dict[str, JsonSchema] = {}
        required: list[str] = []
        for f in dataclasses.fields(tp):
            if not f.init:
                continue
            prop = self.of(hints[f.name])
            if f.default is not dataclasses.MISSING:
                if _is_json(f.default):
                    prop = {**prop, "default": f.default}
            elif f.default_factory is dataclasses.MISSING:
                required.append(f.name)
            properties[f.name] = prop
        return _object(tp, properties, required)


def _outer_qualifier(hint: Any) -> Any:
    """Required or NotRequired around ``hint`` (under Annotated too), else None."""
    origin = typing.get_origin(hint)
    if origin is typing.Annotated:
        return _outer_qualifier(typing.get_args(hint)[0])
    return origin if origin in (Required, NotRequired) else None


def _object(tp: type, properties: dict[str, JsonSchema], required: list[str]) -> JsonSchema:
    out: JsonSchema = {"title": tp.__name__, "type": "object", "properties": properties}
    if required:
        out["required"] = required
    if getattr(tp, "__heron_closed__", False):
        out["additionalProperties"] = False
    doc = (tp.__doc__ or "").strip()
    if doc and not doc.startswith(f"{tp.__name__}("):  # dataclasses' generated signature
        out["description"] = " ".join(doc.split())
    return out


def _literal(values: tuple[Any, ...]) -> JsonSchema:
    values = tuple(v.value if isinstance(v, enum.Enum) else v for v in values)
    kinds = {_json_type(v) for v in values}
    out: JsonSchema = {"enum": list(values)} if len(values) > 1 else {"const": values[0]}
    if len(kinds) == 1:
        out = {"type": kinds.pop(), **out}
    return out


def _json_type(value: Any) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    return _SCALARS.get(type(value), "string")


def _union(options: list[JsonSchema]) -> JsonSchema:
    """One schema for ``a | b``: plain scalar types merge into ``type: [...]``; anything
    else is ``anyOf``."""
    flat: list[JsonSchema] = []
    for option in options:
        flat.extend(option["anyOf"] if set(option) == {"anyOf"} else [option])
    if all(set(o) == {"type"} and isinstance(o["type"], str) for o in flat):
        kinds = list(dict.fromkeys(o["type"] for o in flat))
        return {"type": kinds[0] if len(kinds) == 1 else kinds}
    return {"anyOf": flat}


def _is_json(value: Any) -> bool:
    if value is None or isinstance(value, str | int | float | bool):
        return True
    if isinstance(value, list | tuple):
        return all(_is_json(v) for v in value)
    if isinstance(value, dict):
        return all(isinstance(k, str) and _is_json(v) for k, v in value.items())
    return False
