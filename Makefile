# Quick start: `make demo` runs the main job, `make test` runs the tests. Each installs what it needs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench-overhead install e2e-vllm

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q -e '.[test]'
	touch $@

install: $(VENV)/.installed

demo: $(VENV)/.installed
	$(BIN)/llm-gateway demo

test: $(VENV)/.installed
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/pytest

lint: $(VENV)/.installed
	$(BIN)/ruff check . && $(BIN)/ruff format --check .

# Real vLLM (CPU build) replicas behind the gateway: installs .venv-vllm once (~80 s), then
# two replicas start (~40-90 s) and the suite runs (~1-2 min). Not part of `make test`.
e2e-vllm: $(VENV)/.installed
	bash loadtest/realvllm/install.sh
	LLMGW_E2E_VLLM=1 $(BIN)/pytest tests/e2e_vllm -q
