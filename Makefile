# Every target creates .venv when it is missing, so a fresh clone needs only Python 3.11 and make.
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
DEMO_SECONDS ?= 60
BENCH_PROFILE ?= quick

.PHONY: venv install system-packages system-tools lint docs docs-reference test demo dist \
	wheelhouse image base-image image-offline bench bench-full bench-typecheck bench-vllm-router \
	profile clean

venv: $(BIN)/python

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -m pip install --quiet -e '.[test,docs]'
	touch $(STAMP)

$(VENV)/.bench-installed: $(STAMP)
	$(BIN)/python -m pip install --quiet -e '.[test,docs,bench]'
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

install: $(STAMP)

# What the image test (tests/packaging/test_image.py) needs from Debian, installed only when missing
# (as root, or through sudo).
SYSTEM_TOOLS := podman mmdebstrap
SUDO := $(if $(filter 0,$(shell id -u)),,sudo)

system-tools:
	@missing=""; for tool in $(SYSTEM_TOOLS); do \
	  command -v $$tool >/dev/null 2>&1 || missing="$$missing $$tool"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing$$missing"; \
	  $(SUDO) apt-get update -q && DEBIAN_FRONTEND=noninteractive $(SUDO) apt-get install -y -q $$missing; \
	fi

lint: install
	$(BIN)/ruff check trio_pdrouter trio_pdrouter_sim demo tests benchmarks reference
	$(BIN)/ruff format --check trio_pdrouter trio_pdrouter_sim demo tests benchmarks reference
	$(BIN)/mypy --strict trio_pdrouter trio_pdrouter_sim demo reference

# The documentation site (mkdocs.yml, docs/) into site/, strictly: a broken link or anchor, or a
# page missing from the nav, fails the build (not --quiet: it would hide the warnings that strict
# counts).
docs: install
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

# Regenerate the pages rendered from the code (the configuration and metrics references, the
# benchmarks page); tests/docs/test_reference.py fails while a committed one is stale.
docs-reference: install
	$(BIN)/python -m reference

test: lint docs system-tools system-packages
	$(BIN)/pytest

demo: install
	$(BIN)/python -m demo --seconds $(DEMO_SECONDS)

# The wheel and the sdist, in dist/ (the simulator is in the same wheel: trio-pdrouter-sim).
dist: install
	rm -rf dist
	$(BIN)/python -m build --outdir dist .

# Every wheel the image needs, built on this machine: the router's, its dependencies', and its
# build requirements' (for the Containerfile's builder stage), for an image built offline.
wheelhouse: install
	rm -rf wheelhouse
	$(BIN)/python -m pip wheel --quiet --wheel-dir wheelhouse .
	$(BIN)/python -m pip download --quiet --no-deps --dest wheelhouse \
	  $$($(BIN)/python -c 'import tomllib; print(*tomllib.load(open("pyproject.toml", "rb"))["build-system"]["requires"])')

VERSION := $(shell sed -n 's/^__version__ = "\(.*\)"/\1/p' trio_pdrouter/__init__.py)
IMAGE ?= trio-pdrouter:$(VERSION)
IMAGE_BASE ?= docker.io/library/python:3.11-slim
IMAGE_PIP_OPTIONS ?=

# --format docker keeps the HEALTHCHECK; --isolation=chroot needs no container runtime.
image: system-tools
	podman build --isolation=chroot --format docker --layers=false \
	  --build-arg BASE=$(IMAGE_BASE) --build-arg PIP_OPTIONS="$(IMAGE_PIP_OPTIONS)" \
	  --tag $(IMAGE) --file Containerfile .

# Without a container registry: a base made from Debian's packages (kept in podman's store once
# made) and the wheels of `make wheelhouse`.
DEBIAN_BASE ?= localhost/trio-pdrouter-base:bookworm
DEBIAN_PACKAGES := python3,python3-venv,ca-certificates

base-image: system-tools
	podman image exists $(DEBIAN_BASE) || { \
	  mkdir -p build && \
	  mmdebstrap --variant=minbase --include=$(DEBIAN_PACKAGES) bookworm build/debian-base.tar && \
	  podman import build/debian-base.tar $(DEBIAN_BASE) && rm build/debian-base.tar; }

image-offline: base-image wheelhouse
	$(MAKE) image IMAGE_BASE=$(DEBIAN_BASE) IMAGE_PIP_OPTIONS="--no-index --find-links=/src/wheelhouse"

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
	rm -rf $(VENV) $(VLLM_ROUTER_VENV) .mypy_cache .pytest_cache .ruff_cache dist wheelhouse
