#!/usr/bin/env bash
# Build the extension in place for tests from a worktree: build/native-dev/lowtail_native.abi3.so.
set -euo pipefail
cd "$(dirname "$0")"
PYO3_PYTHON=${PYTHON:-../.venv/bin/python} cargo build --release --locked --quiet
mkdir -p ../build/native-dev
cp target/release/liblowtail_native.so ../build/native-dev/lowtail_native.abi3.so
