# lowtail: the two commands a fresh machine needs are `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.lowtail-installed
REQS := python/requirements.txt requirements-dev.txt python/pyproject.toml

.PHONY: venv demo test lint typecheck pytest clean sandbox-image wheelhouse molecule-runtime

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

lint: $(STAMP)
	$(BIN)/ruff check python tests
	$(BIN)/ruff format --check python tests

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/pytest -q

test: lint typecheck pytest molecule-runtime

# The Debian bookworm systemd image that molecule and the demo's sandbox node boot (built once, reused).
sandbox-image:
	scripts/sandbox-image.sh

# lowtail and every pinned dependency as wheels, for `pip install --no-index` on the nodes; content-hashed,
# so the dependency wheels are rebuilt only when python/requirements.txt changes (scripts/wheelhouse.sh).
wheelhouse: $(STAMP)
	scripts/wheelhouse.sh

# The runtime install and the manifests on a systemd container: converge, idempotence, check, verify.
molecule-runtime: wheelhouse
	PATH=$(abspath $(BIN)):$$PATH molecule test -s runtime

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
