#!/usr/bin/env bash
# Build (or reuse) the lowtail sandbox image: a Debian bookworm root filesystem with systemd as PID 1,
# made offline-capable with debootstrap and imported into podman. Molecule (roles' tests) and the
# `make demo` sandbox node both boot it with:
#   podman run -d --runtime=runc --systemd=always --ulimit=nofile=4096:4096 --ulimit=nproc=4096:4096 IMAGE /sbin/init
# (crun fails on this kernel/cgroup setup and podman's default ulimits are too high for it; docs/testing.md).
#
# The tag is a hash of this script, so changing the package list builds a new image and an unchanged
# script reuses the one already present. Prints the image reference on stdout; progress goes to stderr.
#
# Usage: scripts/sandbox-image.sh [--name]     --name prints the reference without building
# Env:   LOWTAIL_DEBIAN_MIRROR (default http://deb.debian.org/debian)
set -euo pipefail

# Packages: systemd as init (systemd-sysv, dbus) and python3 for Ansible; procps (sysctl), irqbalance and
# kmod are what the provisioning roles configure or call; python3-venv is for the runtime install role.
PACKAGES=python3,python3-venv,systemd,systemd-sysv,dbus,procps,irqbalance,kmod,iproute2,util-linux,rt-tests
SUITE=bookworm
MIRROR=${LOWTAIL_DEBIAN_MIRROR:-http://deb.debian.org/debian}

script_hash=$(sha256sum "${BASH_SOURCE[0]}" | cut -c1-12)
IMAGE=localhost/lowtail-sandbox:${script_hash}

if [[ ${1:-} == --name ]]; then
  echo "$IMAGE"
  exit 0
fi

log() { echo "sandbox-image: $*" >&2; }

for tool in podman debootstrap tar; do
  command -v "$tool" >/dev/null || {
    log "missing '$tool': apt-get install podman runc debootstrap (see .ci/run)"
    exit 1
  }
done
if [[ $(id -u) -ne 0 ]]; then
  log "debootstrap needs root (it creates device nodes and chroots); run as root"
  exit 1
fi

# Two callers (molecule and make demo) may start at once: build once, under a lock.
exec 9>"${TMPDIR:-/tmp}/lowtail-sandbox-image.lock"
flock 9

if podman image exists "$IMAGE"; then
  log "reusing $IMAGE"
  echo "$IMAGE"
  exit 0
fi

rootfs=$(mktemp -d "${TMPDIR:-/tmp}/lowtail-rootfs.XXXXXX")
cleanup() { rm -rf --one-file-system "$rootfs"; }
trap cleanup EXIT

log "debootstrap $SUITE (minbase + $PACKAGES) from $MIRROR into $rootfs (about a minute)"
start=$SECONDS
debootstrap --variant=minbase --include="$PACKAGES" "$SUITE" "$rootfs" "$MIRROR" >&2

# Stub what the roles expect on a real host but a container has no use for: GRUB's drop-in directory
# (the kernel role renders a drop-in; update-grub itself is switched off in containers by a role variable).
mkdir -p "$rootfs/etc/default/grub.d"
: >"$rootfs/etc/default/grub"
# systemd generates a fresh machine-id at boot when the file is empty.
: >"$rootfs/etc/machine-id"
# Units that only make sense on real hardware or a console; masked so boots are quiet and fast.
for unit in getty@tty1.service console-getty.service systemd-udevd.service systemd-modules-load.service \
  sys-kernel-config.mount sys-kernel-debug.mount sys-kernel-tracing.mount; do
  ln -sf /dev/null "$rootfs/etc/systemd/system/$unit"
done
# Smaller image: the package cache, docs and man pages are not needed.
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/usr/share/doc/* \
  "$rootfs"/usr/share/man/*

log "importing into podman as $IMAGE"
tar --numeric-owner -C "$rootfs" -c . |
  podman import --change 'CMD ["/sbin/init"]' --change 'STOPSIGNAL SIGRTMIN+3' \
    --message "lowtail sandbox ($SUITE, debootstrap minbase)" - "$IMAGE" >&2
log "built $IMAGE in $((SECONDS - start)) s"
echo "$IMAGE"
