# Seedance: the two commands (see README). Works on a fresh machine with Python >= 3.10.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
HOST   ?= 127.0.0.1
PORT   ?= 8000
LITELLM_VENV    ?= .venv-litellm
LITELLM_VERSION ?= 1.108.7

.PHONY: serve test bench lint clean

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# Reinstall when the project's metadata changes.
$(VENV)/.installed-%: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[$*]'
	@touch $@

$(VENV)/.installed-base: pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e .
	@touch $@

# The embedded default model (SmolLM2-135M-Instruct on llama.cpp); SERVE_ARGS for more flags.
serve: $(VENV)/.installed-base
	$(BIN)/seedance serve --host $(HOST) --port $(PORT) $(SERVE_ARGS)

test: $(VENV)/.installed-test
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# Comparison suites (raw websockets and picows servers; llama-cpp-python's server and a bare
# llama.cpp loop; WebSocket vs HTTP; LiteLLM's proxy); rewrites docs/benchmarks.md (~35 min).
# BENCH_ARGS=--quick for a short run, BENCH_ARGS="--suites 5" for one suite.
bench: $(VENV)/.installed-bench $(LITELLM_VENV)/.installed
	$(BIN)/python -m seedance.bench.suites $(BENCH_ARGS)

# LiteLLM's proxy, the peer of suite 7, in a virtual environment of its own: its dependencies
# (an older websockets, huggingface_hub) would change the project's.
$(LITELLM_VENV)/.installed:
	$(PYTHON) -m venv $(LITELLM_VENV)
	$(LITELLM_VENV)/bin/python -m pip install --quiet 'litellm[proxy]==$(LITELLM_VERSION)'
	@touch $@

lint: $(VENV)/.installed-dev
	$(BIN)/ruff check src tests
	$(BIN)/ruff format --check src tests
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .mypy_cache .ruff_cache
