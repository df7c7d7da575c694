"""``heron models --catalog``: the model catalogue, read from its configs, printed without a
server.

The catalogue is the bundle ``bundles/catalog.yaml``; each of its model configs carries its
table row in its ``description``, in one fixed form::

    description: "family: dense | outputs: dense | dims: 384 | max length: 512 | license: mit"

That line is the one source of the catalogue's metadata: this command prints it, and the
table in docs/models.md is tested equal to what it prints. "-" marks a value that does not
apply or is not known.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

from heron.runtime.modelconfig import ConfigError, ModelConfig, load_bundle

CATALOG_BUNDLE = "catalog"
# The description's fields, in order: (label in the description, attribute).
FIELDS = (("family", "family"), ("outputs", "outputs"), ("dims", "dims"),
          ("max length", "max_length"), ("license", "license"))
# The printed table's columns: (header, attribute).
COLUMNS = (("MODEL", "id"), ("FAMILY", "family"), ("OUTPUTS", "outputs"), ("DIMS", "dims"),
           ("MAX LENGTH", "max_length"), ("LICENSE", "license"))


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    """One catalogue model: its config's id, hub source and description fields."""

    id: str
    family: str
    outputs: str
    dims: str
    max_length: str
    license: str
    hub: str | None
    revision: str | None
    adapter: str
    trust_remote_code: bool

    def row(self) -> tuple[str, ...]:
        return tuple(getattr(self, attr) for _, attr in COLUMNS)


def parse_description(description: str, src: str) -> dict[str, str]:
    """The description's fields by attribute name; ConfigError if it is not in the form."""
    parts = [p.strip() for p in description.split("|")]
    labels = [label for label, _ in FIELDS]
    values: dict[str, str] = {}
    for part, (label, attr) in zip(parts, FIELDS, strict=False):
        key, sep, value = part.partition(":")
        if not sep or key.strip() != label or not value.strip():
            break
        values[attr] = value.strip()
    if len(parts) != len(FIELDS) or len(values) != len(FIELDS):
        raise ConfigError(src, "description",
                          f"a catalogue model's description must read "
                          f"'{' | '.join(f'{label}: VALUE' for label in labels)}'")
    return values


def entry_of(model: ModelConfig, src: str) -> CatalogEntry:
    fields = parse_description(model.description, src)
    return CatalogEntry(id=model.id, hub=model.source.hub, revision=model.source.revision,
                        adapter=model.adapter, trust_remote_code=model.trust_remote_code,
                        **fields)


def load_catalog(bundles_dir: Path | None = None) -> list[CatalogEntry]:
    """The catalogue's models, in the bundle's order."""
    bundle = load_bundle(CATALOG_BUNDLE, bundles_dir)
    return [entry_of(model, f"{bundle.source}: {model.id}") for model in bundle.models]


def format_table(entries: list[CatalogEntry]) -> str:
    """A plain text table, one model a line, columns aligned."""
    rows = [tuple(header for header, _ in COLUMNS)] + [e.row() for e in entries]
    widths = [max(len(row[i]) for row in rows) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True))
                     .rstrip() for row in rows) + "\n"


def cmd_catalog(args: argparse.Namespace) -> int:
    entries = load_catalog()
    if args.json:
        sys.stdout.write(json.dumps([asdict(e) for e in entries], indent=2) + "\n")
    else:
        sys.stdout.write(format_table(entries))
    return 0


def add_catalog_flags(models: argparse.ArgumentParser) -> None:
    """Give ``heron models`` (a client command, heron/cli/client.py) ``--catalog`` and
    ``--json``: with ``--catalog`` it reads the catalogue here instead of asking a server."""
    models.add_argument("--catalog", action="store_true",
                        help="list the model catalogue (bundles/catalog.yaml) instead of a "
                             "server's models; no server needed")
    models.add_argument("--json", action="store_true",
                        help="with --catalog: print JSON (with revisions) instead of a table")
    served: Callable[[argparse.Namespace], int] = models.get_default("func")

    def run(args: argparse.Namespace) -> int:
        return cmd_catalog(args) if args.catalog else served(args)

    models.set_defaults(func=run)


__all__ = ["CATALOG_BUNDLE", "CatalogEntry", "add_catalog_flags", "cmd_catalog",
           "format_table", "load_catalog", "parse_description"]
