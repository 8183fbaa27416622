# lowtail: the two commands a fresh machine needs are `make demo` and `make test`.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.lowtail-installed
REQS := python/requirements.txt python/constraints.txt requirements-dev.txt python/pyproject.toml
PIP := $(BIN)/pip install --quiet --disable-pip-version-check

.PHONY: venv demo demo-clean demo-local test quick lint typecheck pytest pytest-most pytest-ansible pytest-deploy pytest-actor-kill \
	pytest-fast clean sandbox-image wheelhouse native molecule-runtime ansible-lint molecule system-deps oracle \
	kubelet-equipment test-kubelet test-native-debug

# Debian packages `make test` and `make demo` need, checked before anything else runs, so a missing one
# stops the run at once rather than minutes into the tests: podman with runc (crun fails on this
# kernel's cgroup setup), debootstrap, uidmap, slirp4netns and fuse-overlayfs build and run the sandbox
# systemd container that molecule and the demo boot (scripts/sandbox-image.sh); rt-tests gives
# cyclictest and oslat to `lowtail validate`; python3-venv makes the venv; gcc, libc6-dev, pkg-config and
# libseccomp-dev build the runc the real-kubelet tests use (cgo, seccomp), util-linux's unshare runs
# their kubelet in a mount namespace of its own (`make kubelet-equipment`; Go itself is not a Debian
# package here: bookworm's is too old).
APT_PACKAGES := make git podman runc debootstrap uidmap slirp4netns fuse-overlayfs rt-tests python3-venv \
	gcc libc6-dev pkg-config libseccomp-dev util-linux

# Installs the missing ones as root with apt; otherwise stops at once and prints the command to run.
system-deps:
	@missing=$$(for p in $(APT_PACKAGES); do \
	  dpkg-query -W -f='$${Status}' "$$p" 2>/dev/null | grep -q 'ok installed' || printf "%s " "$$p"; done | sed "s/ $$//"); \
	if [ -z "$$missing" ]; then echo "==> system packages present: $(APT_PACKAGES)"; exit 0; fi; \
	cmd="apt-get update && apt-get install -y --no-install-recommends $$missing"; \
	if [ "$$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then \
	  echo "lowtail needs these Debian packages: $$missing" >&2; \
	  echo "install them as root, then run make again:  sudo sh -c '$$cmd'" >&2; exit 1; fi; \
	echo "==> installing system packages: $$missing"; \
	DEBIAN_FRONTEND=noninteractive sh -c "$$cmd"

venv: $(STAMP)

# Re-installs only when a pinned requirement or the package metadata changed.
# The package declares compatible ranges (python/requirements.txt); the exact versions it is tested with
# are python/constraints.txt, applied here and in the wheelhouse the nodes install from.
$(STAMP): $(REQS)
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@echo "==> installing pinned requirements into $(VENV) (first run takes a few minutes)"
	$(PIP) -c python/constraints.txt -r python/requirements.txt -r requirements-dev.txt
	$(PIP) --no-deps -e python
	@touch $@

# The main job for real on a two-node sandbox (scripts/demo.sh): the sandbox image and the wheelhouse (both
# reused once built), two systemd containers as the nodes, one site.yml run against both, the runtime
# installed from the wheelhouse and Ray started by its unit on each, the fleet validation, the serving demo
# with a worker SIGKILL and the loss of the worker node, a summary; nothing left running.
demo: system-deps $(STAMP)
	scripts/demo.sh

# Remove the demo's two nodes if they are left (LOWTAIL_DEMO_KEEP=1 or an interrupted run); ALL=1 also removes
# the sandbox image, the wheelhouse and the demo's outputs.
demo-clean:
	scripts/sandbox-node.sh rm lowtail-demo-worker lowtail-demo-head
	@if [ "$(ALL)" = 1 ]; then \
	  podman image rm -f "$$(scripts/sandbox-image.sh --name)" 2>/dev/null || true; \
	  rm -rf build/wheelhouse build/demo build/manifests; \
	  echo "removed the sandbox image, build/wheelhouse, build/demo and build/manifests"; \
	fi

# The serving demo alone, on this machine's own Ray (no sandbox node): topology, plan, lowtail demo ray.
demo-local: $(STAMP)
	$(BIN)/lowtail topology
	@echo
	$(BIN)/lowtail plan
	@echo
	@mkdir -p build
	$(BIN)/lowtail demo ray --seconds 10 --plot build/demo-ray-tails.png --json build/demo-ray.json

# The native core (native/, Rust + PyO3, the lowtail_native module): its wheel is built by maturin with the
# crates pinned by native/Cargo.lock (fetched from crates.io once, then cached by cargo), checked against
# the layout it was generated from, and installed into the venv; rebuilt when its sources or the layout
# change. Needs a Rust toolchain (rustup); the queue runs its Python path where the module is absent.
NATIVE_STAMP := build/native/.installed
NATIVE_SRC := $(wildcard native/src/*.rs) native/Cargo.toml native/Cargo.lock native/pyproject.toml \
	native/gen_layout.py python/lowtail/shm/layout.py python/lowtail/shm/payload.py
native: $(NATIVE_STAMP)

$(NATIVE_STAMP): $(STAMP) $(NATIVE_SRC)
	$(BIN)/python native/gen_layout.py --check
	@command -v cargo >/dev/null || { echo "the native core needs a Rust toolchain: https://rustup.rs" >&2; exit 1; }
	@echo "==> building the native core (native/) with maturin and installing it into $(VENV)"
	@rm -rf build/native/wheels
	time $(BIN)/maturin build --release --locked --compatibility linux -m native/Cargo.toml \
	  -i $(BIN)/python -o build/native/wheels
	$(PIP) --force-reinstall --no-deps build/native/wheels/lowtail_native-*.whl
	@touch $@

lint: $(STAMP)
	$(BIN)/python native/gen_layout.py --check
	$(BIN)/ruff check python tests library filter_plugins benchmarks
	$(BIN)/ruff format --check python tests library filter_plugins benchmarks

typecheck: $(STAMP)
	$(BIN)/mypy

# --durations: where the time goes, in every run's output (docs/testing.md keeps the table).
pytest: $(STAMP) $(NATIVE_STAMP)
	$(BIN)/pytest -q --durations=25

# The tests that kill a whole inference actor under samplers and count the requests each sampler lost.
# No full run has shown them passing beside the molecule scenarios and the other suites (docs/testing.md,
# "Actor-kill tests"), so `make test` runs them alone once the parallel suites have ended, and
# `pytest-most` runs every other test.
ACTOR_KILL_TESTS := tests/actors/test_failover.py tests/actors/test_restart.py
pytest-actor-kill: $(STAMP) $(NATIVE_STAMP)
	$(BIN)/pytest -q --durations=5 $(ACTOR_KILL_TESTS)

# The ansible-playbook runs against fixture trees and stand-ins (tests/ansible), and the k8s role and the
# two-node sandbox (tests/deploy, five minutes of it the whole `make demo` on one CPU): they create no
# shared-memory segment on this host (tests/conftest.py, SEGMENT_FREE_DIRS), so `make test` runs each
# as a session of their own beside the rest, the deploy one from the start so that its demo does not
# run alone at the end.
ANSIBLE_TESTS := tests/ansible
DEPLOY_TESTS := tests/deploy
# The stand-in kubelet asks the kubelet oracles (build/oracle) whether a configuration starts.
pytest-ansible: $(STAMP) oracle
	$(BIN)/pytest -q --durations=25 $(ANSIBLE_TESTS)

pytest-deploy: $(STAMP)
	$(BIN)/pytest -q --durations=10 $(DEPLOY_TESTS)

pytest-most: $(STAMP) $(NATIVE_STAMP)
	$(BIN)/pytest -q --durations=25 $(addprefix --ignore=,$(ACTOR_KILL_TESTS) $(ANSIBLE_TESTS) $(DEPLOY_TESTS) $(KUBELET_TEST_DIRS))

# The real kubelet's equipment, built once into build/kubelet/ (content-keyed: an unchanged input
# builds nothing): two kubelets, containerd, ctr, its runc shim and runc from the Go modules pinned
# under tests/kubelet/equipment/ (scripts/kubelet-equipment.sh), lowtail's pause binary, and the pause
# and pod images (tests/kubelet/real/images.py). A missing Go, a failed download or build stops here
# with the failing command and its output. Test equipment only: the product needs no Go.
kubelet-equipment: $(STAMP)
	scripts/kubelet-equipment.sh
	$(BIN)/python -m tests.kubelet.real.images

# The tests not marked slow (tests/conftest.py marks Ray clusters, ansible-playbook runs, podman and
# the long probes slow).
pytest-fast: $(STAMP) $(NATIVE_STAMP)
	$(BIN)/pytest -q -m "not slow"

# The kubelet oracle (tests/kubelet/oracle): one binary per kubelet minor lowtail claims, each built
# against k8s.io/kubernetes at that release (go.<minor>.mod and .sum pin it), into build/oracle/.
# Test equipment only: the product needs no Go. Go's module and build caches are its defaults
# (go env GOMODCACHE GOCACHE: ~/go/pkg/mod, ~/.cache/go-build). A missing go or a failed download or
# build stops make here with go's own output.
ORACLE_DIR := tests/kubelet/oracle
ORACLE_MINORS := $(sort $(patsubst $(ORACLE_DIR)/go.%.mod,%,$(wildcard $(ORACLE_DIR)/go.1.*.mod)))
ORACLES := $(addprefix build/oracle/kubelet-oracle-,$(ORACLE_MINORS))
oracle: $(ORACLES)

build/oracle/kubelet-oracle-%: $(ORACLE_DIR)/go.%.mod $(ORACLE_DIR)/go.%.sum $(wildcard $(ORACLE_DIR)/*.go)
	@command -v go >/dev/null || { echo "make oracle: no go on PATH; the kubelet oracle needs Go 1.26 or later (go.dev/dl)" >&2; exit 1; }
	@mkdir -p build/oracle
	@echo "==> building the kubelet $* oracle ($$(grep -o 'k8s.io/kubernetes v[0-9.]*' $(ORACLE_DIR)/go.$*.mod))"
	cd $(ORACLE_DIR) && go build -modfile=go.$*.mod -o $(CURDIR)/$@.tmp . && mv $(CURDIR)/$@.tmp $(CURDIR)/$@

# The kubelet tests alone (a suite of `make test`; pytest-most leaves them out): the differential
# test against every oracle, the standalone kubelet on containerd (tests/kubelet/real), and whatever
# else sits in KUBELET_TEST_DIRS.
KUBELET_TEST_DIRS := tests/kubelet
test-kubelet: oracle kubelet-equipment $(STAMP)
	$(BIN)/pytest -q --durations=15 $(KUBELET_TEST_DIRS)

# The native core built with Rust's overflow checks (cargo's dev profile) and the tests that reach its
# reads of shared memory run against it (their processes and children import it through PYTHONPATH): a
# plain `+` on a word another process can write panics there, where the release build wraps silently.
NATIVE_DEBUG_DIR := build/native-debug
NATIVE_DEBUG_TESTS := tests/shm/test_native_bounds_review.py tests/shm/test_native_core.py \
	tests/shm/test_native_differential.py tests/shm/test_queue_hostile.py tests/shm/test_queue_attacks.py \
	tests/serve/test_call_recorder.py tests/serve/test_serve_loop.py tests/shm/test_known_outputs.py
test-native-debug: $(STAMP)
	$(BIN)/python native/gen_layout.py --check
	cd native && PYO3_PYTHON=$(CURDIR)/$(BIN)/python CARGO_TARGET_DIR=$(CURDIR)/$(NATIVE_DEBUG_DIR)/target \
	  cargo build --locked --quiet
	cp $(NATIVE_DEBUG_DIR)/target/debug/liblowtail_native.so $(NATIVE_DEBUG_DIR)/.lowtail_native.abi3.so.new
	mv -f $(NATIVE_DEBUG_DIR)/.lowtail_native.abi3.so.new $(NATIVE_DEBUG_DIR)/lowtail_native.abi3.so
	PYTHONPATH=$(CURDIR)/$(NATIVE_DEBUG_DIR) $(BIN)/python -c 'import lowtail_native, sys; \
	  from lowtail.shm import native; impl = native.implementation(); print("native-debug:", lowtail_native.__file__, impl); \
	  sys.exit(0 if "$(NATIVE_DEBUG_DIR)/" in lowtail_native.__file__ and native.available() else 1)'
	PYTHONPATH=$(CURDIR)/$(NATIVE_DEBUG_DIR) $(BIN)/pytest -q --durations=5 -k native $(NATIVE_DEBUG_TESTS)

# The developer's inner loop, a few minutes: lint, types and the fast tests. No system packages needed.
quick: lint typecheck pytest-fast

# Ansible tools find each other (ansible-config, ansible-playbook) on PATH.
ANSIBLE_ENV := PATH=$(CURDIR)/$(BIN):$$PATH
# The tests' bytecode cache for the zip files Ansible runs its modules from (tests/ansible/zip_bytecode):
# each module run would compile ansible.module_utils again, about a third of its CPU.
ZIP_BYTECODE_ENV := PYTHONPATH=$(CURDIR)/tests/ansible/zip_bytecode LOWTAIL_TEST_ZIP_BYTECODE=$(CURDIR)/build/ansible-zip-bytecode

# Roles and playbooks: ansible-lint (production profile, strict) and yamllint.
ansible-lint: $(STAMP)
	$(ANSIBLE_ENV) $(BIN)/ansible-lint
	$(BIN)/yamllint -s .

# The molecule scenario: two systemd containers (podman) converge site.yml; builds the sandbox image
# on first use (about 3 minutes), then the whole sequence takes about 10 minutes.
molecule: $(STAMP) oracle
	$(ANSIBLE_ENV) $(ZIP_BYTECODE_ENV) $(BIN)/molecule test -s default

# Everything. The system packages are checked (and installed as root) before anything runs; then the
# static checks, and the sandbox image, the wheelhouse and the kubelet equipment are built once; then the
# six long suites run side by side (scripts/run-suites.sh): the deploy tests, molecule, the
# ansible-playbook tests, the other tests, molecule-runtime and the kubelet tests, and the native
# core's overflow-checked build (a minute) as soon as one of them ends. Together they keep
# both CPUs of a 2-vCPU machine busy, so the run takes about their total CPU time over two
# (docs/testing.md has the figures). Each one's output is printed whole when it ends and kept in
# build/test-logs/; a summary of all of them, with each one's time, its CPU and what failed, is
# printed last.
# TEST_JOBS=1 runs them one after another. The actor-kill tests run alone after them (see
# pytest-actor-kill).
TEST_JOBS ?= 6
test: system-deps
	$(MAKE) --no-print-directory lint typecheck ansible-lint sandbox-image native wheelhouse oracle kubelet-equipment
	TEST_JOBS=$(TEST_JOBS) scripts/run-suites.sh pytest-deploy molecule pytest-ansible pytest-most molecule-runtime test-kubelet \
	  test-native-debug \
	  --then pytest-actor-kill

# The Debian bookworm systemd image that molecule and the demo's sandbox node boot (built once, reused).
sandbox-image:
	scripts/sandbox-image.sh

# lowtail and every pinned dependency as wheels, for `pip install --no-index` on the nodes; content-hashed,
# so the dependency wheels are rebuilt only when python/requirements.txt changes (scripts/wheelhouse.sh).
wheelhouse: $(STAMP) $(NATIVE_STAMP)
	scripts/wheelhouse.sh

# The runtime install and the manifests on a systemd container: converge, idempotence, check, verify.
molecule-runtime: wheelhouse
	PATH=$(abspath $(BIN)):$$PATH molecule test -s runtime

clean:
	rm -rf $(VENV) .pytest_cache .mypy_cache .ruff_cache build/native native/target
