"""The config store on a directory: commit order, the journal as commit point, orphans,
failures that leave nothing half-written."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from heron.config_service.blobs import DirBlobs, StoreError, open_blobs
from heron.config_service.body import parse_posted
from heron.config_service.state import Registry
from heron.config_service.store import JOURNAL, ConfigStore, LeaseLost, change_key
from tests.support.config_procs import model_body, write_bundles


@pytest.fixture()
def registry(tmp_path: Path) -> Registry:
    return Registry.from_bundles_dir(write_bundles(tmp_path / "bundles"))


def plan(registry: Registry, model_id: str):  # type: ignore[no-untyped-def]
    change = registry.plan(parse_posted(model_body(model_id)).model, None)
    assert change is not None
    return change


def test_commit_then_read_back(tmp_path: Path, registry: Registry) -> None:
    store = ConfigStore(DirBlobs(tmp_path / "s"))
    journal = store.read_journal()
    assert journal.epoch == 0 and journal.entries == []
    for model_id in ("org/a", "org/b"):
        change = plan(registry, model_id)
        journal = store.commit(journal, change)
        registry.apply(change)
    assert [(e.epoch, e.id, e.published) for e in journal.entries] == [
        (1, "org/a", False), (2, "org/b", False)]
    journal = store.mark_published(journal, {1})
    again = store.read_journal()
    assert [e.published for e in again.entries] == [True, False]
    changes = list(store.read_changes(again))
    assert [c.id for c in changes] == ["org/a", "org/b"]
    assert changes[1].bundles_hash == {b: registry.bundle_hash(b) for b in ("alpha", "beta")}
    assert [c.epoch for c in store.read_changes(again, after=1)] == [2]
    assert sorted(p.name for p in (tmp_path / "s").rglob("*")) == [
        "000000000001.json", "000000000002.json", "changes", "journal.json"]


class FailingJournal(DirBlobs):
    def write(self, key: str, data: bytes) -> None:
        if key == JOURNAL:
            raise OSError("disk full")
        super().write(key, data)


def test_failed_journal_write_leaves_nothing(tmp_path: Path, registry: Registry) -> None:
    store = ConfigStore(FailingJournal(tmp_path / "s"))
    with pytest.raises(OSError):
        store.commit(store.read_journal(), plan(registry, "org/a"))
    assert [p for p in (tmp_path / "s").rglob("*") if p.is_file()] == []


def test_orphans_are_ignored_and_removed(tmp_path: Path, registry: Registry) -> None:
    blobs = DirBlobs(tmp_path / "s")
    store = ConfigStore(blobs)
    change = plan(registry, "org/a")
    journal = store.commit(store.read_journal(), change)
    blobs.write(change_key(2), b"half")
    assert [c.epoch for c in store.read_changes(store.read_journal())] == [1]
    assert store.remove_orphans(journal) == [change_key(2)]
    assert blobs.read(change_key(2)) is None and blobs.read(change_key(1)) is not None


def test_corrupt_or_inconsistent_store_is_reported(tmp_path: Path, registry: Registry) -> None:
    blobs = DirBlobs(tmp_path / "s")
    store = ConfigStore(blobs)
    blobs.write(JOURNAL, b"{not json")
    with pytest.raises(StoreError):
        store.read_journal()
    blobs.write(JOURNAL, json.dumps({"epoch": 2, "entries": [
        {"epoch": 1, "id": "a", "published": True}]}).encode())
    with pytest.raises(StoreError, match=r"1\.\.2"):
        store.read_journal()
    blobs.write(JOURNAL, json.dumps({"epoch": 1, "entries": [
        {"epoch": 1, "id": "org/a", "published": True}]}).encode())
    with pytest.raises(StoreError, match="missing"):
        list(store.read_changes(store.read_journal()))
    change = plan(registry, "org/b")  # epoch 1, but of another model
    blobs.write(change_key(1), json.dumps(change.to_json()).encode())
    with pytest.raises(StoreError, match="the journal says"):
        list(store.read_changes(store.read_journal()))


def test_open_blobs_urls(tmp_path: Path) -> None:
    assert isinstance(open_blobs(tmp_path), DirBlobs)
    assert isinstance(open_blobs(f"file://{tmp_path}"), DirBlobs)
    for bad in ("http://x/y", "s3:///nobucket"):
        with pytest.raises(StoreError):
            open_blobs(bad)


def test_dir_write_is_atomic_replace(tmp_path: Path) -> None:
    blobs = DirBlobs(tmp_path / "s")
    blobs.write("a/b.json", b"1")
    blobs.write("a/b.json", b"22")
    assert blobs.read("a/b.json") == b"22"
    assert blobs.list("a") == ["a/b.json"]  # no temp files left behind
    blobs.delete("a/b.json")
    blobs.delete("a/b.json")
    assert blobs.read("a/b.json") is None and blobs.list("nothing") == []


def test_lost_lease_commits_nothing(tmp_path: Path, registry: Registry) -> None:
    store = ConfigStore(DirBlobs(tmp_path / "s"))
    answers = iter([True, False])  # still leader before the change file, not after it
    with pytest.raises(LeaseLost):
        store.commit(store.read_journal(), plan(registry, "org/a"), lambda: next(answers))
    assert [p for p in (tmp_path / "s").rglob("*") if p.is_file()] == []
    assert store.read_journal().epoch == 0
