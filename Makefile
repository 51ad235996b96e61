# Seedance: the two commands (see README). Works on a fresh machine with Python >= 3.10.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
HOST   ?= 127.0.0.1
PORT   ?= 8000
LITELLM_VENV    ?= .venv-litellm
LITELLM_VERSION ?= 1.108.7
GUIDELLM_VENV    ?= .venv-guidellm
GUIDELLM_VERSION ?= 0.8.1

.PHONY: serve cluster wheelhouse test test-bench test-workers test-fast bench bench-compare soak gpu-smoke lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# llama-cpp-python (the embedded engine) is built from source, once per version and flags, into
# a cache of wheels shared by every checkout. On Linux with llama.cpp's runtime CPU dispatch:
# one CPU backend per instruction-set level, the best one this CPU runs picked at start, so a
# wheel built on one machine runs on any other (as fast as a -march=native build on the machine
# measured: docs/engines.md). LLAMA_CMAKE_ARGS= (empty) builds for this CPU only.
LLAMA_CPP_VERSION := $(shell sed -n 's/.*"llama-cpp-python==\([^"]*\)".*/\1/p' pyproject.toml | head -n 1)
ifeq ($(shell uname -s),Linux)
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF -DGGML_BACKEND_DL=ON -DGGML_CPU_ALL_VARIANTS=ON \
	-DCMAKE_INSTALL_BINDIR=llama_cpp/lib
endif
export LLAMA_CMAKE_ARGS
SEEDANCE_CACHE ?= $(or $(XDG_CACHE_HOME),$(HOME)/.cache)/seedance
LLAMA_BUILD_ID := $(LLAMA_CPP_VERSION)-$(shell printf '%s' '$(LLAMA_CMAKE_ARGS)' | sha256sum | cut -c1-12)
LLAMA_WHEELS   := $(SEEDANCE_CACHE)/wheels/llama-cpp-python-$(LLAMA_BUILD_ID)

$(LLAMA_WHEELS)/.built: | $(BIN)/python
	CMAKE_ARGS='$(LLAMA_CMAKE_ARGS)' $(BIN)/python -m pip wheel --quiet --no-deps --no-cache-dir \
		--no-binary llama-cpp-python -w $(LLAMA_WHEELS) 'llama-cpp-python==$(LLAMA_CPP_VERSION)'
	@touch $@

# Replaces whatever llama-cpp-python the environment had (a build of pip's own cache, say).
$(VENV)/.llama-cpp-$(LLAMA_BUILD_ID): $(LLAMA_WHEELS)/.built | $(BIN)/python
	$(BIN)/python -m pip install --quiet --no-deps --force-reinstall --no-index \
		--find-links $(LLAMA_WHEELS) 'llama-cpp-python==$(LLAMA_CPP_VERSION)'
	@rm -f $(VENV)/.llama-cpp-*
	@touch $@

# Reinstall when the project's metadata changes.
$(VENV)/.installed-%: pyproject.toml $(VENV)/.llama-cpp-$(LLAMA_BUILD_ID) | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[$*]'
	@touch $@

$(VENV)/.installed-base: pyproject.toml $(VENV)/.llama-cpp-$(LLAMA_BUILD_ID) | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	@touch $@

# The wheels of the project and of everything it needs, llama-cpp-python built as above, in
# $(WHEELHOUSE): what the Containerfile's first stage makes, and what a machine without an
# index installs with `pip install --no-index --find-links $(WHEELHOUSE) seedance`.
WHEELHOUSE ?= wheelhouse
wheelhouse: $(LLAMA_WHEELS)/.built | $(BIN)/python
	$(BIN)/python -m pip wheel --quiet --wheel-dir $(WHEELHOUSE) --find-links $(LLAMA_WHEELS) .

# The embedded default model (SmolLM2-135M-Instruct on llama.cpp); SERVE_ARGS for more flags.
serve: $(VENV)/.installed-base
	$(BIN)/seedance serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

# A cluster on this machine: redis-server, three nodes and HAProxy on $(PORT) (Debian packages
# redis-server and haproxy); Ctrl-C stops them all. SERVE_ARGS go to every node.
cluster: $(VENV)/.installed-base
	$(BIN)/seedance cluster --nodes 3 --port $(PORT) -- $(SERVE_ARGS)

# The whole suite but the quick bench suites, over TEST_WORKERS processes (pytest-xdist); what
# it skipped for want of a program, and the command that installs them, close its report.
TEST_WORKERS ?= 2
test: $(VENV)/.installed-test
	$(BIN)/python -m pytest -n $(TEST_WORKERS) -m "not bench" $(PYTEST_ARGS)

# The quick runs of make bench's suites and the load generator's tests, one at a time (they pin
# servers and clients to cores of their own). CI runs both targets.
test-bench: $(VENV)/.installed-test
	$(BIN)/python -m pytest -m bench $(PYTEST_ARGS)

# The whole suite again, each server a test starts with --workers 2 (tests/support/servers.py:
# an in-process server's settings and engines too); a test that reads one process's insides,
# or what workers refuse, is skipped with the reason. CI runs it too.
test-workers: $(VENV)/.installed-test
	SEEDANCE_TEST_WORKERS=2 $(BIN)/python -m pytest -n $(TEST_WORKERS) -m "not bench" $(PYTEST_ARGS)

# The logic without models, processes, long waits or benchmarks (markers in pyproject.toml).
test-fast: $(VENV)/.installed-test
	$(BIN)/python -m pytest -q -m "not model and not subprocess and not slow and not bench" $(PYTEST_ARGS)

# Comparison suites (raw websockets and picows servers; llama.cpp's llama-server, built from the
# vendored source with LLAMA_CMAKE_ARGS and cached, llama-cpp-python's server and a bare llama.cpp
# loop; WebSocket vs HTTP; LiteLLM's proxy; resuming a dropped stream; a cluster; the client QoS
# A/B table; rendering in headless Chromium; OpenAI's Realtime and Responses APIs' first token;
# the model reloaded under load; end-to-end encryption and TLS against plain streams; /v1/embeddings
# against llama-server and sentence-transformers; schemas, log probabilities and tool calls;
# guidellm; tensor frames, tritonclient's binary data and a WebAssembly filter: suite 19 builds
# examples/wasm/redact.c with clang for wasm32-wasi; the cross-region relay over a lossy link
# between two network namespaces: suite 20, as root; a Redis primary killed under load behind
# redis-sentinel: suite 23; gateway routing by prefix in front of three embedded models: 24);
# rewrites docs/benchmarks.md (~55 min, and about 9 more the first time, to build llama-server).
# BENCH_ARGS=--quick for a short run,
# BENCH_ARGS="--suites 5" for one suite.
bench: $(VENV)/.installed-bench $(LITELLM_VENV)/.installed $(GUIDELLM_VENV)/.installed
	LITELLM=$(LITELLM_VENV)/bin/litellm GUIDELLM=$(GUIDELLM_VENV)/bin/guidellm \
		$(BIN)/python -m benchmarks.suites $(BENCH_ARGS)

# This tree against another revision (BASELINE=REV: a commit, a tag), side by side on the loads of
# suites 1 and 2, and a token's cost in instructions and cache misses under cachegrind (valgrind)
# (~25 min); writes docs/benchmarks-baseline.md. COMPARE_ARGS="--rounds 9" for more rounds.
bench-compare: $(VENV)/.installed-bench
	@test -n "$(BASELINE)" || { echo "usage: make bench-compare BASELINE=REV"; exit 2; }
	$(BIN)/python -m benchmarks.compare $(BASELINE) $(COMPARE_ARGS)

# Ten minutes of mixed traffic against the synthetic engine and the embedded model, watching RSS,
# file descriptors, tasks and p99 TTFT (docs/soak.md), then the parsers' fuzzing at length.
soak: $(VENV)/.installed-test
	$(BIN)/python -m benchmarks.soak $(SOAK_ARGS)
	HYPOTHESIS_PROFILE=soak $(BIN)/python -m pytest -q tests/test_fuzz.py

# The vLLM engine on this machine's CUDA GPU, in a few minutes (docs/gpu.md): a virtual
# environment of its own (.venv-gpu), from WHEELS=folder where the machine has no package access.
gpu-smoke:
	$(PYTHON) scripts/gpu_smoke.py $(if $(WHEELS),--wheels $(WHEELS)) $(GPU_SMOKE_ARGS)

# LiteLLM's proxy, the peer of suite 7, in a virtual environment of its own: its dependencies
# (an older websockets, huggingface_hub) would change the project's.
$(LITELLM_VENV)/.installed:
	$(PYTHON) -m venv $(LITELLM_VENV)
	$(LITELLM_VENV)/bin/python -m pip install --quiet 'litellm[proxy]==$(LITELLM_VERSION)'
	@touch $@

# guidellm, the load generator of suite 18, in a virtual environment of its own for the same
# reason (it pins click and datasets); PyTorch held to the project's version (these machines
# keep its CPU wheel).
$(GUIDELLM_VENV)/.installed:
	$(PYTHON) -m venv $(GUIDELLM_VENV)
	$(GUIDELLM_VENV)/bin/python -m pip install --quiet 'guidellm==$(GUIDELLM_VERSION)' 'torch==2.13.0'
	@touch $@

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check src tests scripts benchmarks
	$(BIN)/ruff format --check src tests scripts benchmarks
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
