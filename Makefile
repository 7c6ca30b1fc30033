# Every target creates .venv when it is missing, so a fresh clone needs only Python 3.11 and make.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_SECONDS ?= 60
BENCH_PROFILE ?= quick

.PHONY: venv install system-packages lint test demo bench bench-full bench-typecheck bench-vllm-router profile clean

venv: $(BIN)/python

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $(STAMP)

$(VENV)/.bench-installed: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[test,bench]'
	touch $@

# vllm-router, for the side-by-side rows, in its own venv so its dependencies leave ours alone.
# A failed install is not fatal: the benchmarks skip vllm-router's rows and say so.
VLLM_ROUTER_VENV := .venv-bench-vllm-router
VLLM_ROUTER_VERSION ?= 0.1.17

bench-vllm-router:
	@test -x $(VLLM_ROUTER_VENV)/bin/vllm-router || \
	  ( $(PYTHON) -m venv $(VLLM_ROUTER_VENV) && \
	    $(VLLM_ROUTER_VENV)/bin/python -m pip install --quiet 'vllm-router==$(VLLM_ROUTER_VERSION)' ) || \
	  echo "vllm-router could not be installed: its benchmark rows will be skipped"

# Debian packages the tests run: prometheus and promtool (tests/observe/test_prometheus_e2e.py).
system-packages:
	@command -v prometheus >/dev/null && command -v promtool >/dev/null || \
	  ( apt-get update -qq && \
	    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus )

install: $(STAMP) system-packages

lint: install
	$(BIN)/ruff check trio_pdrouter trio_pdrouter_sim demo tests benchmarks
	$(BIN)/ruff format --check trio_pdrouter trio_pdrouter_sim demo tests benchmarks
	$(BIN)/mypy --strict trio_pdrouter trio_pdrouter_sim demo

test: lint
	$(BIN)/pytest

demo: install
	$(BIN)/python -m demo --seconds $(DEMO_SECONDS)

# benchmarks/ imports the bench extras, so it is type-checked here rather than in `make test`.
bench-typecheck: $(VENV)/.bench-installed
	$(BIN)/mypy --strict benchmarks

# The soak tests marked slow (left out of `make test`) run first.
bench: bench-typecheck bench-vllm-router
	$(BIN)/pytest -m slow
	$(BIN)/python -m benchmarks --profile $(BENCH_PROFILE)

bench-full: bench-typecheck bench-vllm-router
	$(BIN)/python -m benchmarks --profile full

# The token-paced relay under py-spy: PROFILE_TARGET=ours|floor, PROFILE_MODE=regular|pd, a flame
# graph in benchmarks/results/.
PROFILE_TARGET ?= ours
PROFILE_MODE ?= regular
profile: $(VENV)/.bench-installed
	$(BIN)/python -m benchmarks.profile --target $(PROFILE_TARGET) --mode $(PROFILE_MODE)

clean:
	rm -rf $(VENV) $(VLLM_ROUTER_VENV) .mypy_cache .pytest_cache .ruff_cache
