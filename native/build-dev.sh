#!/usr/bin/env bash
# Build the extension in place for tests from a worktree: build/native-dev/lowtail_native.abi3.so.
set -euo pipefail
cd "$(dirname "$0")"
PYO3_PYTHON=${PYTHON:-../.venv/bin/python} cargo build --release --locked --quiet
mkdir -p ../build/native-dev
# A new file renamed over the old one: a process that has the old one mapped keeps it intact (copying
# onto it in place changed the code under a running test, which died with SIGSEGV).
cp target/release/liblowtail_native.so ../build/native-dev/.lowtail_native.abi3.so.new
mv -f ../build/native-dev/.lowtail_native.abi3.so.new ../build/native-dev/lowtail_native.abi3.so
