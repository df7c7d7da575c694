"""The config service's durable state on a Blobs backend (directory or S3).

Layout (the same keys in a directory and under an S3 prefix)::

    journal.json                  the commit point: {"format": 1, "epoch": N, "entries":
                                  [{"epoch": 1, "id": "org/name", "published": true}, ...]}
    changes/000000000001.json     the change of epoch 1: the model as it is after it, the
                                  bundles that route it and their hashes (Change.to_json)

A change is committed in two atomic writes: its change file, then the journal naming it
(``published: false``). Only the journal makes it real: a change file whose epoch is past
the journal's is an orphan of a crash and is ignored (the next commit of that epoch
replaces it). After the deltas are out, the entry is rewritten ``published: true``; an
entry still false at start is published again (deltas are de-duplicated by epoch).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from heron.config_service.blobs import Blobs, StoreError
from heron.config_service.state import Change
from heron.runtime.modelconfig import ConfigError

log = logging.getLogger("heron.config.store")

JOURNAL = "journal.json"
CHANGES = "changes"
FORMAT = 1


class LeaseLost(StoreError):
    """The writer lease lapsed mid-commit: nothing was committed."""


def change_key(epoch: int) -> str:
    return f"{CHANGES}/{epoch:012d}.json"


@dataclass(slots=True)
class JournalEntry:
    epoch: int
    id: str
    published: bool

    def to_json(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "id": self.id, "published": self.published}


@dataclass(slots=True)
class Journal:
    epoch: int
    entries: list[JournalEntry]

    def to_bytes(self) -> bytes:
        data = {"format": FORMAT, "epoch": self.epoch,
                "entries": [e.to_json() for e in self.entries]}
        return json.dumps(data, indent=1, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes | None, src: str) -> Journal:
        if raw is None:
            return cls(0, [])
        try:
            data = json.loads(raw)
            entries = [JournalEntry(int(e["epoch"]), str(e["id"]), bool(e["published"]))
                       for e in data["entries"]]
            journal = cls(int(data["epoch"]), entries)
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"{src}: the journal is not readable: {exc!r}") from exc
        if [e.epoch for e in entries] != list(range(1, journal.epoch + 1)):
            raise StoreError(f"{src}: the journal's entries do not run 1..{journal.epoch}")
        return journal

    def unpublished(self) -> list[JournalEntry]:
        return [e for e in self.entries if not e.published]

    def copy(self) -> Journal:
        return Journal(self.epoch, [JournalEntry(e.epoch, e.id, e.published)
                                    for e in self.entries])


class ConfigStore:
    """Blocking calls (the service runs them in a thread). Only the leader writes."""

    def __init__(self, blobs: Blobs, *, read_threads: int = 8) -> None:
        self.blobs = blobs
        self.read_threads = read_threads

    def describe(self) -> str:
        return self.blobs.describe()

    def read_journal(self) -> Journal:
        return Journal.from_bytes(self.blobs.read(JOURNAL), f"{self.describe()}/{JOURNAL}")

    def read_changes(self, journal: Journal, after: int = 0) -> Iterator[Change]:
        """The committed changes with epoch > ``after``, in epoch order."""
        wanted = [e for e in journal.entries if e.epoch > after]
        with ThreadPoolExecutor(max(1, min(self.read_threads, len(wanted)))) as pool:
            raws = pool.map(lambda e: self.blobs.read(change_key(e.epoch)), wanted)
            for entry, raw in zip(wanted, raws, strict=True):
                yield self._parse_change(entry, raw)

    def read_change(self, entry: JournalEntry) -> Change:
        return self._parse_change(entry, self.blobs.read(change_key(entry.epoch)))

    def _parse_change(self, entry: JournalEntry, raw: bytes | None) -> Change:
        src = f"{self.describe()}/{change_key(entry.epoch)}"
        if raw is None:
            raise StoreError(f"{src} is missing; the journal commits it")
        try:
            change = Change.from_json(json.loads(raw), src)
        except (ValueError, KeyError, TypeError, ConfigError) as exc:
            raise StoreError(f"{src} is not readable: {exc}") from exc
        if change.epoch != entry.epoch or change.id != entry.id:
            raise StoreError(f"{src} holds epoch {change.epoch} of {change.id}; the journal "
                             f"says epoch {entry.epoch} of {entry.id}")
        return change

    def commit(self, journal: Journal, change: Change,
               fence: Callable[[], bool] | None = None) -> Journal:
        """Write the change, then the journal that commits it (unpublished). ``fence``
        (still the leader?) is asked before each write. On a failure nothing is committed,
        and the change file is removed if it can be."""
        if change.epoch != journal.epoch + 1:
            raise StoreError(f"commit of epoch {change.epoch} on a journal at {journal.epoch}")
        key = change_key(change.epoch)
        payload = json.dumps(change.to_json(), indent=1, sort_keys=True).encode()
        after = journal.copy()
        after.epoch = change.epoch
        after.entries.append(JournalEntry(change.epoch, change.id, False))
        if fence is not None and not fence():
            raise LeaseLost("the writer lease was lost before the change was written")
        self.blobs.write(key, payload)
        try:
            if fence is not None and not fence():
                raise LeaseLost("the writer lease was lost before the change was committed")
            self.blobs.write(JOURNAL, after.to_bytes())
        except BaseException:
            try:
                self.blobs.delete(key)
            except Exception as exc:  # an orphan is harmless: the journal does not name it
                log.warning("could not remove uncommitted %s: %s", key, exc)
            raise
        return after

    def mark_published(self, journal: Journal, epochs: set[int]) -> Journal:
        after = journal.copy()
        for entry in after.entries:
            if entry.epoch in epochs:
                entry.published = True
        self.blobs.write(JOURNAL, after.to_bytes())
        return after

    def remove_orphans(self, journal: Journal) -> list[str]:
        """Change files past the journal's epoch (a crash between the two writes)."""
        orphans = [k for k in self.blobs.list(CHANGES) if _epoch_of(k) > journal.epoch]
        for key in orphans:
            self.blobs.delete(key)
        return orphans


def _epoch_of(key: str) -> int:
    name = key.rsplit("/", 1)[-1].removesuffix(".json")
    return int(name) if name.isdigit() else -1
