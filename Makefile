# Quick start: `make demo` runs the main job, `make test` runs the tests. Each installs what it needs.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: demo test lint bench-overhead install

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
	$(BIN)/pytest

lint: $(VENV)/.installed
	$(BIN)/ruff check . && $(BIN)/ruff format --check .
