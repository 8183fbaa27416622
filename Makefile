# lowtail: the two commands a fresh machine needs are `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.lowtail-installed
REQS := python/requirements.txt requirements-dev.txt python/pyproject.toml

.PHONY: venv demo test lint typecheck pytest clean sandbox-image

venv: $(STAMP)

# Re-installs only when a pinned requirement or the package metadata changed.
$(STAMP): $(REQS)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "==> installing pinned requirements into $(VENV) (first run takes a few minutes)"
	$(BIN)/pip install --quiet --disable-pip-version-check -r python/requirements.txt -r requirements-dev.txt
	$(BIN)/pip install --quiet --disable-pip-version-check --no-deps -e python
	@touch $@

demo: $(STAMP)
	$(BIN)/lowtail topology
	@echo
	$(BIN)/lowtail plan
	@echo
	@mkdir -p build
	$(BIN)/lowtail demo ray --seconds 10 --plot build/demo-ray-tails.png --json build/demo-ray.json

lint: $(STAMP)
	$(BIN)/ruff check python tests
	$(BIN)/ruff format --check python tests

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/pytest -q

test: lint typecheck pytest

# The Debian bookworm systemd image that molecule and the demo's sandbox node boot (built once, reused).
sandbox-image:
	scripts/sandbox-image.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
