#!/usr/bin/env bash
# Build the wheelhouse the runtime role installs on nodes: lowtail and every dependency (Ray and OpenVINO
# included, transitive ones too) as wheels, plus pip itself, in one archive, so a node installs with
# `pip install --no-index --find-links` and needs no network (air-gapped hosts).
#
# Content-hashed, in two layers:
#   build/wheelhouse/deps-<hash of requirements.txt, pip pin, Python and platform>/  rebuilt only when the
#       pinned requirements (or the controller's Python) change: the slow part;
#   lowtail-<version>-py3-none-any.whl  rebuilt when the package's source changes (seconds).
# The archive is named after the hash of every wheel in it (lowtail-wheelhouse-<id>.tar), so an unchanged
# wheelhouse keeps its name and the role neither copies nor reinstalls it. wheelhouse.json describes it.
#
# Wheels are for the controller's Python and platform: the nodes must run the same Python minor version
# on the same architecture (the role checks).
#
# Usage: scripts/wheelhouse.sh [OUTDIR]   (default build/wheelhouse; PYTHON defaults to .venv/bin/python)
# Prints the path of wheelhouse.json on stdout; progress goes to stderr.
set -euo pipefail
cd "$(dirname "$0")/.."

OUT=${1:-build/wheelhouse}
PYTHON=${PYTHON:-.venv/bin/python}
# pip for the node's venv, bootstrapped from its own wheel (no ensurepip / python3-venv needed there).
PIP_PIN=pip==23.2.1

log() { echo "wheelhouse: $*" >&2; }

"$PYTHON" -c 'import sys; assert sys.version_info >= (3, 11)' || {
  log "$PYTHON is missing or older than 3.11: run 'make venv' first"
  exit 1
}
mkdir -p "$OUT"
py_tag=$("$PYTHON" -c 'import sys, sysconfig; print(f"cp{sys.version_info[0]}{sys.version_info[1]}-{sysconfig.get_platform()}")')
deps_key=$( (
  cat python/requirements.txt python/constraints.txt
  echo "$PIP_PIN $py_tag"
) | sha256sum | cut -c1-16)
deps="$OUT/deps-$deps_key"

exec 9>"$OUT/.lock"
flock 9

if [[ -f $deps/.complete ]]; then
  log "reusing dependency wheels $deps (python/requirements.txt unchanged)"
else
  log "building dependency wheels for $py_tag into $deps (first time: a few minutes, Ray and OpenVINO are large)"
  rm -rf "$deps" "$deps.tmp"
  mkdir -p "$deps.tmp"
  # (grep drops pip's noise about this machine's unused extra indexes)
  "$PYTHON" -m pip wheel --quiet --disable-pip-version-check --wheel-dir "$deps.tmp" \
    -c python/constraints.txt -r python/requirements.txt "$PIP_PIN" 2>&1 | { grep -v 'is ignored: it is neither' || true; } >&2
  touch "$deps.tmp/.complete"
  mv "$deps.tmp" "$deps"
  # Older dependency sets are dead weight once requirements changed.
  find "$OUT" -maxdepth 1 -name 'deps-*' ! -name "deps-$deps_key" -exec rm -rf {} +
fi

# The package's own files (tracked or new, not ignored), by content: edits rebuild the lowtail wheel.
if git rev-parse --is-inside-work-tree >/dev/null 2>&1; then
  src_files() { git ls-files -z --cached --others --exclude-standard python; }
else
  src_files() { find python -type f -not -path '*/__pycache__/*' -not -path '*.egg-info*' -print0; }
fi
src_key=$(src_files | sort -z | xargs -0 sha256sum | sha256sum | cut -c1-16)
pkg="$OUT/lowtail-$src_key"
if [[ ! -f $pkg/.complete ]]; then
  log "building the lowtail wheel from python/ ($src_key)"
  rm -rf "$pkg"
  mkdir -p "$pkg"
  # A fixed timestamp keeps the wheel byte-identical when rebuilt from the same source.
  SOURCE_DATE_EPOCH=315532800 "$PYTHON" -m pip wheel --quiet --disable-pip-version-check --no-deps \
    --wheel-dir "$pkg" ./python 2>&1 |
    { grep -v 'is ignored: it is neither' || true; } >&2
  # setuptools leaves its build tree next to the sources.
  rm -rf python/build
  touch "$pkg/.complete"
  find "$OUT" -maxdepth 1 -name 'lowtail-*' -type d ! -name "lowtail-$src_key" -exec rm -rf {} +
fi

# The native core's wheel (make native builds it into build/native/wheels): carried when present; a
# wheelhouse without it installs nodes that run the queue's Python path (lowtail validate warns).
NATIVE_WHEELS=${NATIVE_WHEELS:-build/native/wheels}
if compgen -G "$NATIVE_WHEELS/lowtail_native-*.whl" >/dev/null; then
  log "carrying the native core: $(basename "$NATIVE_WHEELS"/lowtail_native-*.whl)"
else
  log "no native core wheel in $NATIVE_WHEELS (make native): the nodes will run the queue's Python path"
  NATIVE_WHEELS=$pkg  # nothing more to add
fi

"$PYTHON" - "$OUT" "$deps" "$pkg" "$PIP_PIN" "$py_tag" "$NATIVE_WHEELS" <<'EOF'
"""Assemble the archive: the wheels, a frozen requirements file naming every one, and wheelhouse.json."""
import hashlib
import io
import json
import os
import sys
import tarfile
from pathlib import Path

out, deps, pkg, pip_pin, py_tag = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], sys.argv[5]
nat = Path(sys.argv[6])
native = [w for w in nat.glob("lowtail_native-*.whl")] if nat != pkg else []
wheels = sorted([*deps.glob("*.whl"), *pkg.glob("*.whl"), *native], key=lambda p: p.name)
digest = hashlib.sha256()
for w in wheels:
    digest.update(w.name.encode() + b"\0" + hashlib.sha256(w.read_bytes()).digest())
wid = digest.hexdigest()[:16]
(lowtail,) = [w for w in pkg.glob("lowtail-*.whl")]
version = lowtail.name.split("-")[1]
# name==version of every wheel: the node installs exactly this set, nothing resolved on the node.
frozen = sorted({"{}=={}".format(*w.name.split("-")[:2]) for w in wheels if not w.name.startswith("pip-")})
archive = out / f"lowtail-wheelhouse-{wid}.tar"
if not archive.exists():
    tmp = archive.with_suffix(".tmp")
    with tarfile.open(tmp, "w") as tar:
        for w in wheels:
            tar.add(w, arcname=w.name)
        data = ("\n".join(frozen) + "\n").encode()
        info = tarfile.TarInfo("requirements.txt")
        info.size, info.mode = len(data), 0o644
        tar.addfile(info, io.BytesIO(data))
    os.replace(tmp, archive)
for old in out.glob("lowtail-wheelhouse-*.tar"):
    if old != archive:
        old.unlink()
meta = {
    "id": wid,
    "archive": str(archive.resolve()),
    "lowtail_version": version,
    "python": py_tag,
    "pip": pip_pin,
    "wheels": [w.name for w in wheels],
    "native": native[0].name if native else None,
    "bytes": archive.stat().st_size,
}
(out / "wheelhouse.json").write_text(json.dumps(meta, indent=2) + "\n")
print(f"wheelhouse: {archive} ({len(wheels)} wheels, {meta['bytes'] / 2**20:.0f} MiB, id {wid})", file=sys.stderr)
print((out / "wheelhouse.json").resolve())
EOF
