"""Operator settings: every limit and timeout of a service is a field of one frozen dataclass,
settable as a command-line flag and as an environment variable, with one help text.

A field declares itself with ``setting(default, "what it does")``: its help (also the line
the settings reference in docs/operations.md shows; a unit test holds the two equal), its
bounds, and its environment variable where that is not ``<env_prefix><NAME>``. The flag is
``--name-with-dashes``. From the dataclass (a subclass of ``Settings``):

- ``cls.add_flags(parser)``: one option per field, its help naming the variable and default;
- ``cls.from_args(args)``: the flag, else the variable, else the default;
- ``cls.from_env()``: the variable, else the default (a process not started by the command);
- ``settings.export_env()``: the values back into ``os.environ``, so every part of the
  process that reads a variable (and every child) sees what the command runs with;
- ``cls.reference()``: the rows of the reference table (flag, variable, default, meaning).

Every value is checked where it enters: text that is not a number, NaN, an infinity, a
negative number or one outside the field's bounds is a ``ConfigError`` naming the flag or
the variable (``heron: config error: ...``, exit status 2) before anything binds. Building
the dataclass in Python checks the same bounds. An empty variable counts as unset.
"""

from __future__ import annotations

import argparse
import functools
import inspect
import math
import os
import re
import types
import typing
from collections.abc import Callable, Iterator, MutableMapping
from dataclasses import MISSING, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, Self

from heron.runtime.modelconfig import ConfigError

if TYPE_CHECKING:
    from heron.runtime.nats_names import WorkStreamSpec

_KEY = "heron_setting"
# Words that mean "no value" for a field that may be None (its default decides then).
_NONE_WORDS = frozenset({"none", "auto"})
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})
_SIZE_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2,
               "mb": 1000**2, "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3,
               "t": 1000**4, "tb": 1000**4, "tib": 1024**4}


@dataclass(frozen=True, slots=True)
class SettingSpec:
    """What ``setting()`` stores in a field's metadata."""

    help: str
    env: str | None = None  # None: <env_prefix><NAME>
    minimum: float | None = 0  # inclusive; numbers only
    above: float | None = None  # exclusive lower bound
    maximum: float | None = None  # inclusive
    shown: str | None = None  # the default as the docs show it (for computed defaults)
    aliases: tuple[str, ...] = ()  # older flag names, still accepted
    size: bool = False  # a byte count that also reads 800MB, 1.5GiB, 16MiB
    baseline: Any = None  # a computed default's value when nothing is set (docs, changed())


def setting(default: Any = MISSING, help: str = "", *,
            factory: Callable[[], Any] | None = None, env: str | None = None,
            minimum: float | None = 0, above: float | None = None,
            maximum: float | None = None, shown: str | None = None,
            aliases: tuple[str, ...] = (), size: bool = False) -> Any:
    """A settings field: ``timeout_s: float = setting(30.0, "what it bounds")``. With a
    ``factory``, ``default`` is only what the docs show (the factory's value when nothing
    is set)."""
    if not help:
        raise ValueError("a setting needs its help text")
    if above is not None and minimum is not None and minimum <= above:
        minimum = None  # "more than 0" says it all
    meta = {_KEY: SettingSpec(help, env, minimum, above, maximum, shown, aliases, size,
                              None if default is MISSING else default)}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def parse_size(text: str) -> int:
    """``"1.5GiB"``, ``"800MB"``, ``"16MiB"``, ``"123456"`` -> bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).lower() not in _SIZE_UNITS:
        raise ValueError("not a size (e.g. 123456, 800MB, 1.5GiB)")
    return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).lower()])


def _show_size(value: int) -> str:
    for unit, scale in (("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if value >= scale and value % scale == 0:
            return f"{value // scale}{unit}"
    return str(value)


@dataclass(frozen=True, slots=True)
class _Field:
    """A settings field, resolved: its name, type, spec and names outside Python."""

    name: str
    kind: type  # int, float, bool or str
    optional: bool  # may be None
    spec: SettingSpec
    env: str
    flag: str
    default: Any  # for a computed default, its value when nothing is set

    def parse(self, raw: str, source: str) -> Any:
        """A flag's or a variable's text -> a checked value (ConfigError naming ``source``)."""
        text = raw.strip()
        if self.optional and text.lower() in _NONE_WORDS:
            return None
        try:
            if self.kind is bool:
                if text.lower() not in _TRUE | _FALSE:
                    raise ValueError("must be true or false")
                value: Any = text.lower() in _TRUE
            elif self.kind is int:
                if self.spec.size:
                    value = parse_size(text)
                elif re.fullmatch(r"[+-]?\d+", text):
                    value = int(text)
                else:
                    raise ValueError("must be a whole number")
            elif self.kind is float:
                try:
                    value = float(text)
                except ValueError:
                    raise ValueError("must be a number") from None
            else:
                value = text
        except ValueError as exc:
            raise ConfigError(source, repr(raw), str(exc)) from None
        self.check(value, source, repr(raw))
        return value

    def check(self, value: Any, source: str, text: str | None = None) -> None:
        """ConfigError unless ``value`` has the field's type and bounds; ``text``: what
        the flag or variable said, for the message."""
        said = repr(value) if text is None else text
        if value is None:
            if not self.optional:
                raise ConfigError(source, said, "must have a value")
            return
        if self.kind is bool or self.kind is str:
            if not isinstance(value, self.kind):
                raise ConfigError(source, said, f"must be a {self.kind.__name__}")
            return
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ConfigError(source, said, "must be a number")
        if self.kind is int and not isinstance(value, int):
            raise ConfigError(source, said, "must be a whole number")
        spec = self.spec
        if not math.isfinite(value):
            raise ConfigError(source, said, "must be a finite number")
        if spec.minimum is not None and value < spec.minimum:
            raise ConfigError(source, said, f"must be at least {spec.minimum:g}")
        if spec.above is not None and value <= spec.above:
            raise ConfigError(source, said, f"must be more than {spec.above:g}")
        if spec.maximum is not None and value > spec.maximum:
            raise ConfigError(source, said, f"must be at most {spec.maximum:g}")

    def shown_default(self) -> str:
        if self.spec.shown is not None:
            return self.spec.shown
        return show(self.default, self.spec.size)

    def to_env(self, value: Any) -> str | None:
        """The text a variable holds for ``value`` (None: the variable is unset)."""
        if value is None:
            return None
        if isinstance(value, bool):
            return "true" if value else "false"
        return repr(value) if isinstance(value, float) else str(value)


def show(value: Any, size: bool = False) -> str:
    """A value as the docs and --help show it."""
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if size and isinstance(value, int):
        return _show_size(value)
    return str(value)


def _kind(hint: Any) -> tuple[type, bool]:
    if hint in (int, float, bool, str):
        return hint, False
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if len(args) == 1 and args[0] in (int, float, bool, str):
            return args[0], True
    raise TypeError(f"a setting must be int, float, bool or str (or | None), not {hint}")


class Settings:
    """Base of the settings dataclasses (frozen, slots): the flags, the variables, the checks
    and the reference rows of their fields. ``env_prefix``: e.g. ``HERON_GATEWAY_``."""

    __slots__ = ()
    env_prefix: ClassVar[str] = "HERON_"

    def __post_init__(self) -> None:
        for f in self._fields():
            f.check(getattr(self, f.name), f"{type(self).__name__}.{f.name}")

    @classmethod
    @functools.cache
    def _fields(cls) -> tuple[_Field, ...]:
        """The fields, the class's own first, then those of its bases (as --help shows)."""
        hints = typing.get_type_hints(cls)
        own = set(inspect.get_annotations(cls))
        resolved = []
        for f in sorted(fields(cls), key=lambda f: f.name not in own):  # stable
            spec = f.metadata.get(_KEY)
            if not isinstance(spec, SettingSpec):
                raise TypeError(f"{cls.__name__}.{f.name} is not declared with setting()")
            kind, optional = _kind(hints[f.name])
            resolved.append(_Field(f.name, kind, optional, spec,
                                   spec.env or cls.env_prefix + f.name.upper(),
                                   "--" + f.name.replace("_", "-"),
                                   spec.baseline if f.default is MISSING else f.default))
        return tuple(resolved)

    # ---- building one -----------------------------------------------------------------
    @classmethod
    def from_args(cls, args: argparse.Namespace,
                  environ: typing.Mapping[str, str] | None = None) -> Self:
        """The flag given on the command line, else the variable, else the default."""
        environ = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for f in cls._fields():
            given = getattr(args, f.name, None)
            if given is not None:
                values[f.name] = given if f.kind is bool else f.parse(given, f.flag)
            elif environ.get(f.env, "").strip():
                values[f.name] = f.parse(environ[f.env], f.env)
        return cls(**values)

    @classmethod
    def from_env(cls, environ: typing.Mapping[str, str] | None = None) -> Self:
        """The variable, else the default."""
        return cls.from_args(argparse.Namespace(), environ)

    def export_env(self, environ: MutableMapping[str, str] | None = None) -> None:
        """Write every value into its variable (None: unset it), for the parts of the
        process that read the environment and for its children."""
        environ = os.environ if environ is None else environ
        for f in self._fields():
            text = f.to_env(getattr(self, f.name))
            if text is None:
                environ.pop(f.env, None)
            else:
                environ[f.env] = text

    # ---- the command line and the docs --------------------------------------------------
    @classmethod
    def add_flags(cls, parser: argparse.ArgumentParser, title: str = "settings") -> None:
        """``--name-of-field`` for every field, in an argument group of its own."""
        group = parser.add_argument_group(
            title, "each flag wins over its environment variable, which wins over the default "
                   "(docs/operations.md#settings-reference)")
        for f in cls._fields():
            default = f.shown_default().replace("`", "")
            text = f"{f.spec.help} [{f.env}; default {default}]".replace("%", "%%")
            if f.kind is bool:
                group.add_argument(f.flag, *f.spec.aliases, dest=f.name, default=None,
                                   action=argparse.BooleanOptionalAction, help=text)
            else:
                group.add_argument(f.flag, *f.spec.aliases, dest=f.name, default=None,
                                   metavar=_metavar(f), help=text)

    @classmethod
    def reference(cls, markdown: bool = False) -> list[tuple[str, str, str, str]]:
        """(flag, variable, default, meaning) for every field, in --help's order; with
        ``markdown``, a plain default in backticks (a computed one's text is markdown)."""
        return [(f.flag, f.env, f.shown_default() if f.spec.shown or not markdown
                 else f"`{f.shown_default()}`", f.spec.help) for f in cls._fields()]

    @classmethod
    def reference_table(cls) -> str:
        """The markdown table docs/operations.md holds for this class."""
        lines = ["| Flag | Environment | Default | Meaning |", "|---|---|---|---|"]
        lines += [f"| `{flag}` | `{env}` | {default} | {meaning} |"
                  for flag, env, default, meaning in cls.reference(markdown=True)]
        return "\n".join(lines)

    def changed(self) -> Iterator[tuple[str, Any]]:
        """(name, value) of the fields that differ from their defaults (for the start log)."""
        for f in self._fields():
            value = getattr(self, f.name)
            if value != f.default:
                yield f.name, value


def _metavar(f: _Field) -> str:
    if f.spec.size:
        return "BYTES"
    if f.name.endswith("_s"):
        return "SECONDS"
    return {int: "N", float: "X", str: "TEXT"}.get(f.kind, "X")


# ---- shared by several services -------------------------------------------------------------
_REPLICAS_ENV = "HERON_STREAM_REPLICAS"


def _replicas_from_env() -> int:
    """HERON_STREAM_REPLICAS for a settings object built in Python (as
    heron.runtime.nats_names.stream_replicas reads it: in-process gateways on a 3-node
    cluster rely on it), checked like every other value."""
    raw = os.environ.get(_REPLICAS_ENV, "").strip()
    if not raw:
        return 1
    replicas = {f.name: f for f in WorkStreamSettings._fields()}["stream_replicas"]
    return replicas.parse(raw, _REPLICAS_ENV)


def stream_replicas_setting() -> Any:
    """The one ``stream_replicas`` field: every component declares streams and buckets with
    it, and they compare (docs/cluster.md)."""
    return setting(1, "Replicas of every stream and KV bucket this process declares: 3 on a "
                      "3-node JetStream cluster; the same on every component",
                   factory=_replicas_from_env, env=_REPLICAS_ENV, minimum=1, maximum=5)


def _stream(default: Any, help: str, name: str, **bounds: Any) -> Any:
    return setting(default, help, env=f"HERON_{name.upper()}", **bounds)


@dataclass(frozen=True, slots=True)
class WorkStreamSettings(Settings):
    """How a pool's work stream and its consumer are declared. The gateway and the workers
    both declare them (whichever starts first creates them), so both take these settings,
    from the same HERON_STREAM_* variables; a stream declared otherwise is refused."""

    stream_replicas: int = stream_replicas_setting()
    stream_file_storage: bool = _stream(
        True, "Work streams (and HERON_DLQ) on disk, so nothing queued is lost when NATS "
              "restarts (false: in memory)", "stream_file_storage")
    stream_max_age_s: float = _stream(
        3600.0, "Longest a work item may wait in its pool's stream before NATS drops it",
        "stream_max_age_s", above=0)
    stream_max_bytes: int = _stream(
        1 << 30, "Bytes a pool's work stream may hold, reserved on NATS's store when the "
                 "stream is declared; past it, new work is refused (429 QUEUE_FULL)",
        "stream_max_bytes", minimum=1, size=True)
    stream_ack_wait_s: float = _stream(
        5.0, "Seconds a work item stays with a worker that gives no sign of life before "
             "NATS hands it to another (a computing worker signals every half of this)",
        "stream_ack_wait_s", minimum=1)
    stream_max_deliver: int = _stream(
        5, "Deliveries of a work item before it goes to HERON_DLQ and its caller gets an "
           "error", "stream_max_deliver", minimum=1)
    stream_max_ack_pending: int = _stream(
        4096, "Work items of a pool held by its workers and not yet acknowledged, all "
              "workers together", "stream_max_ack_pending", minimum=1)

    def stream_spec(self, pool: str) -> WorkStreamSpec:
        """The pool's WorkStreamSpec (heron.runtime.nats_names: imported here, so that the
        command's parser does not load the NATS client)."""
        from heron.runtime.nats_names import WorkStreamSpec

        return WorkStreamSpec(pool=pool, replicas=self.stream_replicas,
                              file_storage=self.stream_file_storage,
                              max_age_s=self.stream_max_age_s, max_bytes=self.stream_max_bytes,
                              ack_wait_s=self.stream_ack_wait_s,
                              max_deliver=self.stream_max_deliver,
                              max_ack_pending=self.stream_max_ack_pending)


# ---- what every server of the inference API takes -----------------------------------------
DEFAULT_MODEL_ENV = "HERON_DEFAULT_MODEL"
CORS_ORIGINS_ENV = "HERON_CORS_ORIGINS"
IMAGE_URL_HOSTS_ENV = "HERON_IMAGE_URL_HOSTS"


def listed(text: str | None) -> tuple[str, ...]:
    """A comma-separated setting's entries, stripped, empty ones left out."""
    return tuple(part.strip() for part in (text or "").split(",") if part.strip())


@dataclass(frozen=True, slots=True)
class InferenceServerSettings(WorkStreamSettings):
    """The settings of a server with the inference API (``heron serve``, ``heron worker``,
    the gateway) that its HTTP side reads (heron.runtime.inference_app): the same variables
    on every component, so a cluster and a single node are set up alike."""

    default_model: str | None = setting(
        None, "The models the TEI routes (/embed, /rerank, /info, ...) use, comma-separated: "
              "each route takes the first listed made for its task, else the first that can "
              "answer it (none: the one model served that can, if exactly one)",
        env=DEFAULT_MODEL_ENV)
    cors_origins: str | None = setting(
        None, "Origins browsers may call the API from, comma-separated, or * for any "
              "(credentials are never allowed); none: no CORS headers",
        env=CORS_ORIGINS_ENV)
    image_url_hosts: str | None = setting(
        None, "Hosts whose http(s) image URLs the server fetches, comma-separated: exact "
              "names or IP addresses (any port), or *.example.com for the names under "
              "example.com; redirects only to these. none: every image URL is refused (a "
              "server that fetches URLs can be pointed at internal addresses: SSRF)",
        env=IMAGE_URL_HOSTS_ENV)
    image_url_timeout_s: float = setting(
        10.0, "Longest the server spends fetching the image URLs of one request, redirects "
              "included, before 422 IMAGE_FETCH_FAILED", env="HERON_IMAGE_URL_TIMEOUT_S",
        above=0, maximum=300)

    def __post_init__(self) -> None:
        Settings.__post_init__(self)  # (slots dataclasses cannot call super() bare)
        from heron.runtime.cors import parse_origins

        try:
            parse_origins(self.cors_origins)
        except ValueError as exc:
            raise ConfigError("--cors-origins / " + CORS_ORIGINS_ENV, repr(self.cors_origins),
                              str(exc)) from None
        from heron.runtime.image_urls import HostAllowlist

        try:
            HostAllowlist.parse(self.image_url_hosts)
        except ValueError as exc:
            raise ConfigError("--image-url-hosts / " + IMAGE_URL_HOSTS_ENV,
                              repr(self.image_url_hosts), str(exc)) from None
        if self.default_model is not None and not listed(self.default_model):
            raise ConfigError("--default-model / " + DEFAULT_MODEL_ENV,
                              repr(self.default_model), "names no model")
