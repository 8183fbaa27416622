#!/usr/bin/env bash
# Build the real-kubelet test equipment into build/kubelet/ from the Go modules pinned under
# tests/kubelet/equipment/ (go.mod + go.sum each): two kubelets, containerd with ctr and its runc shim,
# runc, and lowtail's own pause binary. Test equipment only: the product needs no Go.
#
# Content-keyed: the key hashes every file under tests/kubelet/equipment/, this script and `go version`;
# an unchanged key with every binary present builds nothing. build/kubelet/manifest.json records, per
# binary, the upstream module and version it was built from, its sha256, and the seconds its module
# download and its compile took (docs/testing.md keeps the figures).
#
# A missing Go toolchain, a failed module download or a failed build stops at once, printing the
# command that failed and its output.
#
# Env: LOWTAIL_KUBELET_EQUIPMENT_FORCE=1 rebuilds whatever the key says (the time of a warm rebuild).
set -euo pipefail

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
equipment=$root/tests/kubelet/equipment
out=$root/build/kubelet
manifest=$out/manifest.json

log() { echo "kubelet-equipment: $*" >&2; }
die() { log "$*"; exit 1; }

command -v go >/dev/null || die "no 'go' on PATH; the kubelet tests build their equipment with Go 1.26 or later \
(https://go.dev/dl, or Debian's golang-1.26): install it, then run make again"
# A go.mod asking for a newer Go fails naming it, instead of fetching another toolchain behind our back.
export GOTOOLCHAIN=local GOFLAGS=-buildvcs=false
go_version=$(go env GOVERSION)

key=$({ sha256sum "${BASH_SOURCE[0]}"; find "$equipment" -type f -print0 | sort -z | xargs -0 sha256sum \
  | sed "s|$equipment/||"; echo "$go_version"; } | sha256sum | cut -c1-16)

# name  module-dir  package  upstream-module  version  cgo  tags  ldflags
K=k8s.io/component-base/version
C=github.com/containerd/containerd/v2
kube_ldflags() { # version major minor
  echo "-s -w -X $K.gitVersion=v$1 -X $K.gitMajor=$2 -X $K.gitMinor=$3 -X $K.gitTreeState=clean" \
    "-X k8s.io/client-go/pkg/version.gitVersion=v$1 -X k8s.io/client-go/pkg/version.gitMajor=$2" \
    "-X k8s.io/client-go/pkg/version.gitMinor=$3"
}
ctr_ldflags="-s -w -X $C/version.Version=v2.3.7 -X $C/version.Package=$C"
BINARIES=(
  "kubelet-1.37|kubelet-1.37|k8s.io/kubernetes/cmd/kubelet|k8s.io/kubernetes|v1.37.2|0||$(kube_ldflags 1.37.2 1 37)"
  "kubelet-1.35|kubelet-1.35|k8s.io/kubernetes/cmd/kubelet|k8s.io/kubernetes|v1.35.4|0||$(kube_ldflags 1.35.4 1 35)"
  "containerd|containerd|$C/cmd/containerd|$C|v2.3.7|0|urfave_cli_no_docs no_btrfs|$ctr_ldflags"
  "ctr|containerd|$C/cmd/ctr|$C|v2.3.7|0|urfave_cli_no_docs|$ctr_ldflags"
  "containerd-shim-runc-v2|containerd|$C/cmd/containerd-shim-runc-v2|$C|v2.3.7|0|urfave_cli_no_docs no_grpc|$ctr_ldflags"
  "runc|runc|github.com/opencontainers/runc|github.com/opencontainers/runc|v1.4.4|1|seccomp|-s -w -X main.version=1.4.4"
  "pause|pause|.|lowtail.test/equipment/pause|(this repository)|0||-s -w -X main.version=$key"
)

present() { for b in "${BINARIES[@]}"; do [[ -x $out/bin/${b%%|*} ]] || return 1; done; }
if [[ -z ${LOWTAIL_KUBELET_EQUIPMENT_FORCE:-} && -f $manifest ]] && grep -q "\"key\": \"$key\"" "$manifest" && present; then
  log "up to date in $out (key $key)"
  exit 0
fi

mkdir -p "$out/bin" "$out/logs"
# Runs one step; on failure prints the command and its whole output and stops everything.
run() { # dir logname command...
  local dir=$1 name=$2
  shift 2
  if ! (cd "$dir" && "$@") >"$out/logs/$name.log" 2>&1; then
    log "FAILED in $dir: $*"
    cat "$out/logs/$name.log" >&2
    exit 1
  fi
}

entries=()
total_start=$SECONDS
for b in "${BINARIES[@]}"; do
  IFS='|' read -r name dir pkg module version cgo tags ldflags <<<"$b"
  start=$SECONDS
  # Loading the package graph downloads exactly the modules the build needs (timed apart from the build).
  run "$equipment/$dir" "$name.download" go list -deps -tags "$tags" "$pkg"
  downloaded=$SECONDS
  log "building $name ($module $version)"
  run "$equipment/$dir" "$name.build" env CGO_ENABLED="$cgo" go build -trimpath -tags "$tags" \
    -ldflags "$ldflags" -o "$out/bin/$name.new" "$pkg"
  mv -f "$out/bin/$name.new" "$out/bin/$name"
  sum=$(sha256sum "$out/bin/$name" | cut -d' ' -f1)
  entries+=("$(printf '    {"name": "%s", "module": "%s", "version": "%s", "sha256": "%s", "download_seconds": %d, "build_seconds": %d}' \
    "$name" "$module" "$version" "$sum" $((downloaded - start)) $((SECONDS - downloaded)))")
  log "$name built in $((SECONDS - downloaded)) s (module download $((downloaded - start)) s)"
done

{
  printf '{\n  "key": "%s",\n  "go": "%s",\n  "seconds": %d,\n  "binaries": [\n' "$key" "$go_version" $((SECONDS - total_start))
  (IFS=$'\n'; echo "${entries[*]}" | sed '$!s/$/,/')
  printf '  ]\n}\n'
} >"$manifest.new"
mv -f "$manifest.new" "$manifest"
log "built in $((SECONDS - total_start)) s: $out/bin ($manifest)"
