"""transformers' start-up scan of its model folder, kept on disk between processes.

``import transformers`` and then ``transformers.models`` each build the lazy-import map of
every model module by reading the source of all of them (about 1,670 files, looking for
``__all__``): 0.45-0.55 s of CPU each time, about 1 s of a worker's start on the 2-core
machine (5-7 s in all), in every process that imports a tokenizer or a model. The map
depends only on the installed files, so the first process stores it and later ones read it
(a few milliseconds).

How: an import hook wraps ``transformers.utils.import_utils.create_import_structure_from_path``
as that module loads, before ``transformers/__init__.py`` calls it. The stored map is keyed
by transformers' version, the folder, and the names and modification times of the folder's
entries (a reinstall or an added model changes them). It is JSON: nothing read from the
cache folder runs as code. Anything unexpected (another transformers whose internals differ, an
unreadable or unwritable cache) falls back to transformers' own scan: the cache can make a
start slower by a stat of each entry (a few ms), never wrong.
``HERON_TRANSFORMERS_SCAN_CACHE=off`` turns it off; it lives in ``cache_dir()``.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib.abc
import importlib.machinery
import json
import os
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

TARGET = "transformers.utils.import_utils"
FUNCTION = "create_import_structure_from_path"
FORMAT = 1  # of the stored JSON


def cache_dir() -> Path:
    """``$XDG_CACHE_HOME/heron/transformers-scan`` (``~/.cache/...``); not under
    ``HERON_CACHE_DIR``, which is the weight cache's own root."""
    root = os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache")
    return Path(root) / "heron" / "transformers-scan"


def _encode(structure: dict[Any, Any]) -> list[Any]:
    out: list[Any] = []
    for key, value in structure.items():
        if isinstance(key, frozenset):  # backends -> {module: names}
            out.append(["b", sorted(key), {m: sorted(names) for m, names in value.items()}])
        elif isinstance(key, str):  # a sub-folder
            out.append(["d", key, _encode(value)])
        else:
            raise TypeError(f"unexpected key {key!r}")
    return out


def _decode(entries: list[Any]) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for kind, key, value in entries:
        if kind == "b":
            out[frozenset(key)] = {m: set(names) for m, names in value.items()}
        elif kind == "d":
            out[key] = _decode(value)
        else:
            raise ValueError(f"unexpected entry kind {kind!r}")
    return out


def _folder(module_path: Any) -> Path:
    path = Path(module_path)
    return path if path.is_dir() else path.parent


def cache_key(folder: Path, version: str) -> str:
    """What the scan depends on: transformers' version, the folder, and its entries' names
    and modification times (a file replaced by pip changes its folder's)."""
    digest = hashlib.sha256(f"{FORMAT}\0{version}\0{folder.resolve()}".encode())
    with os.scandir(folder) as entries:
        for entry in sorted(entries, key=lambda e: e.name):
            digest.update(f"\0{entry.name}\0{entry.stat().st_mtime_ns}".encode())
    return digest.hexdigest()[:32]


def cached_scan(scan: Callable[[Any], dict[Any, Any]], version: str,
                directory: Path) -> Callable[[Any], dict[Any, Any]]:
    """``scan`` (transformers' function), answered from ``directory`` when it holds this
    folder's map, else computed and stored there."""

    @functools.lru_cache
    def by_folder(folder: Path) -> list[Any] | None:
        """The folder's map in stored form (None: the cache cannot be used here)."""
        try:
            path = directory / f"{cache_key(folder, version)}.json"
        except OSError:
            return None
        with contextlib.suppress(OSError, ValueError):
            return json.loads(path.read_text())
        try:
            entries = _encode(scan(folder))
        except TypeError:  # a map of another shape: transformers' own answer, uncached
            return None
        with contextlib.suppress(OSError):
            directory.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=directory, suffix=".tmp")
            try:
                with os.fdopen(fd, "w") as out:
                    json.dump(entries, out)
                os.replace(tmp, path)  # whole or absent, with processes starting at once
            finally:
                with contextlib.suppress(OSError):
                    os.unlink(tmp)
        return entries

    scanning = threading.local()

    def scan_from_cache(module_path: Any) -> dict[Any, Any]:
        # The scan calls itself for each sub-folder: only the outermost call is stored.
        if getattr(scanning, "active", False):
            return scan(module_path)
        scanning.active = True
        try:
            # A file stands for its folder (transformers scans the parent): both scans of a
            # start (the folder, then models/__init__.py) read one stored map, each its own
            # copy (transformers' callers get distinct objects, as from its own scan).
            entries = by_folder(_folder(module_path))
        finally:
            scanning.active = False
        if entries is not None:
            with contextlib.suppress(ValueError, TypeError, KeyError):
                return _decode(entries)
        return scan(module_path)

    scan_from_cache.__wrapped__ = scan  # type: ignore[attr-defined]
    return scan_from_cache


def _patch(module: ModuleType) -> None:
    scan = getattr(module, FUNCTION, None)
    if not callable(scan) or getattr(scan, "__name__", "") == "scan_from_cache":
        return
    # transformers/__init__.py sets __version__ before it imports its utils.
    version = getattr(sys.modules.get("transformers"), "__version__", "")
    if version:
        setattr(module, FUNCTION, cached_scan(scan, version, cache_dir()))


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: importlib.abc.Loader) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._loader.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._loader.exec_module(module)
        with contextlib.suppress(Exception):  # never break the import
            _patch(module)

    def __getattr__(self, name: str) -> Any:  # get_source, get_code...: the real loader's
        return getattr(self._loader, name)


class _ScanCacheFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _PatchingLoader(spec.loader)
        return spec


def install() -> None:
    """Cache the scan in this process (call before transformers is imported; after, only
    later scans are cached). Off with HERON_TRANSFORMERS_SCAN_CACHE=off."""
    if os.environ.get("HERON_TRANSFORMERS_SCAN_CACHE", "").lower() in ("off", "0", "false"):
        return
    if TARGET in sys.modules:
        with contextlib.suppress(Exception):
            _patch(sys.modules[TARGET])
        return
    if not any(isinstance(f, _ScanCacheFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _ScanCacheFinder())
