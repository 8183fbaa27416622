# lowtail: the two commands a fresh machine needs are `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.lowtail-installed
REQS := python/requirements.txt requirements-dev.txt python/pyproject.toml

.PHONY: venv demo test lint typecheck pytest clean sandbox-image ansible-lint molecule

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
	$(BIN)/ruff check python tests library filter_plugins
	$(BIN)/ruff format --check python tests library filter_plugins

typecheck: $(STAMP)
	$(BIN)/mypy

pytest: $(STAMP)
	$(BIN)/pytest -q

# Ansible tools find each other (ansible-config, ansible-playbook) on PATH.
ANSIBLE_ENV := PATH=$(CURDIR)/$(BIN):$$PATH

# Roles and playbooks: ansible-lint (production profile, strict) and yamllint.
ansible-lint: $(STAMP)
	$(ANSIBLE_ENV) $(BIN)/ansible-lint
	$(BIN)/yamllint -s .

# The molecule scenario: two systemd containers (podman) converge site.yml; builds the sandbox image
# on first use (about 3 minutes), then the whole sequence takes about 10 minutes.
molecule: $(STAMP)
	$(ANSIBLE_ENV) $(BIN)/molecule test

test: lint typecheck pytest ansible-lint molecule

# The Debian bookworm systemd image that molecule and the demo's sandbox node boot (built once, reused).
sandbox-image:
	scripts/sandbox-image.sh

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache
