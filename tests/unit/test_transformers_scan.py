"""transformers' model-folder scan read from disk: the same map as transformers' own scan,
a new key when the folder changes, and transformers' own answer whenever the cache cannot
be used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import transformers
from transformers.utils import import_utils

from heron.runtime.transformers_scan import cache_key, cached_scan
from tests.support.servers import REPO

MODELS = Path(transformers.__file__).parent / "models"


def _original():  # transformers' own scan, even where this process installed the cache
    scan = import_utils.create_import_structure_from_path
    return getattr(scan, "__wrapped__", scan)


def test_the_stored_map_is_transformers_own(tmp_path: Path) -> None:
    scan = _original()
    want = scan(MODELS)
    calls: list[object] = []

    def counted(path: object) -> dict:
        calls.append(path)
        return scan(path)

    first = cached_scan(counted, transformers.__version__, tmp_path)
    assert first(MODELS) == want and len(calls) == 1  # scanned, then stored
    assert len(list(tmp_path.glob("*.json"))) == 1
    again = cached_scan(counted, transformers.__version__, tmp_path)  # a later process
    got = again(MODELS / "__init__.py")  # a file stands for its folder
    assert got == want and len(calls) == 1  # read, not scanned
    assert got is not again(MODELS)  # each caller its own copy, as from transformers


def test_the_key_changes_with_the_folder_and_the_version(tmp_path: Path) -> None:
    folder = tmp_path / "models"
    (folder / "a").mkdir(parents=True)
    key = cache_key(folder, "5.0")
    assert cache_key(folder, "5.0") == key
    assert cache_key(folder, "5.1") != key
    (folder / "b").mkdir()  # a model added
    added = cache_key(folder, "5.0")
    assert added != key
    os.utime(folder / "a", ns=(1, 1))  # a model's files replaced
    assert cache_key(folder, "5.0") != added


def test_a_corrupt_or_unwritable_cache_gives_transformers_own_answer(tmp_path: Path) -> None:
    scan = _original()
    want = scan(MODELS)
    path = tmp_path / f"{cache_key(MODELS, transformers.__version__)}.json"
    path.write_text("{not json")
    assert cached_scan(scan, transformers.__version__, tmp_path)(MODELS) == want
    path.write_text(json.dumps([["x", "y", "z"]]))  # valid JSON, not a map
    assert cached_scan(scan, transformers.__version__, tmp_path)(MODELS) == want
    blocked = tmp_path / "file"
    blocked.write_text("")  # the cache folder cannot be made
    assert cached_scan(scan, transformers.__version__, blocked / "cache")(MODELS) == want


def _start(cache: Path, models: bool = True, **env: str) -> str:
    """A process that imports the CLI (which installs the cache) and, with ``models``,
    loads a tokenizer and a model class (10 s of imports on the CI machine); what it
    printed."""
    code = ("import heron.cli.main\n"
            "from transformers.utils import import_utils\n"
            "print(import_utils.create_import_structure_from_path.__name__, end='')\n")
    if models:
        code += ("from transformers import AutoTokenizer, BertModel\n"
                 "print('', AutoTokenizer.__name__, BertModel.__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                         text=True, timeout=120, check=True,
                         env={**os.environ, "XDG_CACHE_HOME": str(cache), **env})
    return out.stdout.strip()


def test_heron_processes_read_the_scan_from_disk(tmp_path: Path) -> None:
    assert _start(tmp_path) == "scan_from_cache AutoTokenizer BertModel"
    stored = list((tmp_path / "heron" / "transformers-scan").glob("*.json"))
    assert stored  # the models folder, and the packages imported since
    assert _start(tmp_path) == "scan_from_cache AutoTokenizer BertModel"  # from the cache
    assert sorted((tmp_path / "heron" / "transformers-scan").glob("*.json")) == sorted(stored)
    off = tmp_path / "off"
    # Off: transformers' own scan, and nothing written (the CLI's import is what decides).
    assert _start(off, models=False, HERON_TRANSFORMERS_SCAN_CACHE="off") == \
        "create_import_structure_from_path"
    assert not off.exists()
