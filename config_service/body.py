"""Reading a POST /v1/configs/models body: size limit, YAML or JSON (or msgpack) by
Content-Type, the optional ``bundles`` list, the schema (heron.runtime.modelconfig, the
one the worker loads with), the rules a model id must follow to be safe in paths, URLs
and S3 keys, and the operator's policy on checkpoints that ship their own code."""

from __future__ import annotations

import hashlib
import os
import re
from dataclasses import dataclass
from typing import Any

import yaml
from starlette.requests import Request

from heron.runtime import http
from heron.runtime.modelconfig import ConfigError, ModelConfig, parse_model_config
from heron_sdk import wire
from heron_sdk.errors import ErrorCode, HeronError, invalid_field

MAX_CONFIG_BYTES = 1 << 20  # 1 MiB
MAX_ID_CHARS = 200
_YAML_TYPES = ("application/yaml", "application/x-yaml", "text/yaml", "text/x-yaml",
               "text/plain")
_SEGMENT = r"[A-Za-z0-9_][A-Za-z0-9._+-]*"
_SAFE_ID = re.compile(rf"{_SEGMENT}(?:/{_SEGMENT})*")


@dataclass(frozen=True, slots=True)
class PostedModel:
    model: ModelConfig
    bundles: list[str] | None  # None: the model's adapter picks them


async def read_raw(request: Request, limit: int = MAX_CONFIG_BYTES) -> bytes:
    return await http.read_raw(request, limit)


class _NoAliasLoader(yaml.SafeLoader):
    """safe_load without anchors/aliases (a 1 MiB body cannot expand into gigabytes) and
    with lists and maps nested at most wire.MAX_BODY_DEPTH levels: PyYAML composes a
    document recursively, so 5,000 levels (10 KB of ``[``) ran out of Python's stack."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self.depth = 0  # lists and maps open around the node being composed

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent):
            raise yaml.composer.ComposerError(None, None, "YAML aliases are not accepted",
                                              event.start_mark)
        if not isinstance(event, yaml.CollectionStartEvent):
            return super().compose_node(parent, index)
        if self.depth >= wire.MAX_BODY_DEPTH:
            raise yaml.composer.ComposerError(
                None, None, f"lists and maps nest deeper than {wire.MAX_BODY_DEPTH} levels",
                event.start_mark)
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1


def decode(raw: bytes, content_type: str | None) -> Any:
    """YAML for YAML types, for no type and for curl's default form type (YAML reads JSON
    too); JSON for JSON types; msgpack for msgpack types; anything else is 415."""
    if not raw.strip():
        raise HeronError(ErrorCode.MALFORMED_BODY, "request body is empty")
    value = (content_type or "").split(";")[0].strip().lower()
    fmt = wire.media_type(value) if value not in ("", "*/*") else None
    if fmt is not None:
        return wire.decode_request(raw, fmt)
    if value and value not in _YAML_TYPES and value != "application/x-www-form-urlencoded":
        raise HeronError(ErrorCode.UNSUPPORTED_MEDIA_TYPE,
                         f"Content-Type {content_type!r} is not supported; use "
                         f"application/yaml or application/json")
    try:
        data = yaml.load(raw.decode("utf-8"), Loader=_NoAliasLoader)
    except UnicodeDecodeError as exc:
        raise HeronError(ErrorCode.MALFORMED_BODY, f"body is not UTF-8: {exc}") from exc
    # ValueError: an integer of more than 4,300 digits, which Python will not convert.
    except (yaml.YAMLError, ValueError) as exc:
        raise HeronError(ErrorCode.MALFORMED_BODY,
                         f"body is not valid YAML: {' '.join(str(exc).split())[:300]}"
                         ) from exc
    _check_yaml_text(data)
    return data


def _check_yaml_text(data: Any) -> None:
    """400 for a string (or key) that is no Unicode text: YAML's ``"\\ud800"`` escape
    makes a lone surrogate, which no JSON or msgpack answer, store or log could write."""
    stack = [data]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            stack.extend(node.keys())
            stack.extend(node.values())
        elif isinstance(node, list | set):
            stack.extend(node)
        elif isinstance(node, str):
            try:
                node.encode("utf-8")
            except UnicodeEncodeError as exc:
                raise HeronError(ErrorCode.MALFORMED_BODY,
                                 f"body is not valid YAML text: {exc.reason} at "
                                 f"{exc.start}") from None


def check_name(name: str, field: str) -> None:
    """Model ids and aliases: ``org/name`` segments of letters, digits and ``._+-``; no
    ``..``, spaces or leading ``/``; at most 200 characters."""
    if len(name) > MAX_ID_CHARS:
        raise invalid_field(field, f"is longer than {MAX_ID_CHARS} characters")
    if ".." in name or not _SAFE_ID.fullmatch(name):
        raise invalid_field(field, f"{name!r} is not a safe model name: use segments of "
                            "letters, digits and ._+- joined by '/', with no '..', spaces "
                            "or leading '/'")


def parse_posted(data: Any) -> PostedModel:
    if not isinstance(data, dict):
        raise HeronError(ErrorCode.MALFORMED_BODY,
                         "body must be a mapping (a model config), not "
                         f"{type(data).__name__}")
    data = dict(data)
    bundles = data.pop("bundles", None)
    if bundles is not None and (not isinstance(bundles, list) or not bundles or
                                not all(isinstance(b, str) and b for b in bundles)):
        raise invalid_field("bundles", "must be a non-empty list of bundle names")
    try:
        model = parse_model_config(data, "body")
    except ConfigError as exc:
        raise invalid_field(exc.field, exc.reason) from exc
    check_name(model.id, "id")
    for i, alias in enumerate(model.aliases):
        check_name(alias, f"aliases[{i}]")
    return PostedModel(model, sorted(set(bundles)) if bundles is not None else None)


# What enables trust_remote_code in posted configs (heron config --allow-remote-code).
ALLOW_REMOTE_CODE_ENV = "HERON_ALLOW_REMOTE_CODE"


def remote_code_allowed_by_env() -> bool:
    return os.environ.get(ALLOW_REMOTE_CODE_ENV, "").strip().lower() in ("1", "true", "yes")


def check_remote_code(model: ModelConfig, allowed: bool) -> None:
    """422 for a model that asks to run its checkpoint's code, unless the operator allowed
    such models. The code is arbitrary Python that every worker of every pool serving the
    model imports, with the worker's credentials and network: whoever may post configs
    would otherwise run code on the whole fleet, so the operator decides, not the poster."""
    if model.trust_remote_code and not allowed:
        raise invalid_field(
            "trust_remote_code",
            "this config service does not accept models that run their checkpoint's own "
            "Python code (config.json auto_map): that code would run inside every worker of "
            "each pool that serves the model. Its operator can allow such models by starting "
            f"`heron config --allow-remote-code` (or {ALLOW_REMOTE_CODE_ENV}=1); see "
            "docs/models.md")


def body_digest(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()
