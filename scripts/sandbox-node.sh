#!/usr/bin/env bash
# Start or remove a sandbox node: a systemd container from the sandbox image (scripts/sandbox-image.sh)
# that Ansible provisions through the containers.podman.podman connection, as it would a host.
#
#   scripts/sandbox-node.sh start NAME [--shm-size=SIZE] [--net=none | --net-of=NODE]
#                                    boot it (reused if it runs already) and wait for systemd.
#                                    --net=none: a network namespace of its own with loopback only;
#                                    --net-of=NODE: join NODE's network namespace and nothing else of it
#                                    (IPC, /dev/shm, PID, UTS, filesystem stay its own), so two nodes talk
#                                    over a loopback no one outside them can reach (the two-node demo)
#   scripts/sandbox-node.sh rm NAME...   stop and remove them (nothing left running)
#
# Never privileged: /proc/sys stays read-only (a sysctl written inside would change the host), so the
# roles' live-apply steps are switched off by inventory variables instead. The one capability added is
# SYS_NICE, exactly what lowtail's worker pods get (roles/lowtail_k8s): SCHED_FIFO and nice -20 for the
# pinned worker, and mbind/move_pages, which podman's default seccomp profile allows only with it. runc and low ulimits because
# crun fails on this kernel/cgroup setup and podman's default ulimits are too high for it (docs/testing.md).
set -euo pipefail
cd "$(dirname "$0")/.."

log() { echo "sandbox-node: $*" >&2; }

cmd=${1:-}
name=${2:-}
[[ -n $cmd && -n $name ]] || {
  echo "usage: $0 start NAME [--shm-size=SIZE] [--net=none|--net-of=NODE] | rm NAME..." >&2
  exit 2
}

case $cmd in
start)
  shm=--shm-size=1g
  net=()
  for arg in "${@:3}"; do
    case $arg in
    --shm-size=*) shm=$arg ;;
    --net=none) net=(--network=none) ;;
    --net-of=?*) net=("--network=container:${arg#--net-of=}") ;;
    *)
      echo "sandbox-node: unknown option '$arg': expected --shm-size=SIZE, --net=none or --net-of=NODE" >&2
      exit 2
      ;;
    esac
  done
  if [[ $(podman container inspect -f '{{.State.Running}}' "$name" 2>/dev/null) == true ]]; then
    log "reusing running container $name"
  else
    podman rm -f "$name" >/dev/null 2>&1 || true
    image=$(scripts/sandbox-image.sh)
    log "starting $name from $image"
    podman run -d --name "$name" --hostname "$name" --runtime=runc --systemd=always \
      --ulimit=nofile=4096:4096 --ulimit=nproc=4096:4096 "$shm" --cap-add=SYS_NICE \
      --label lowtail.sandbox=1 ${net[@]+"${net[@]}"} "$image" /sbin/init >/dev/null
  fi
  # systemd reports "degraded" when a unit a container cannot run failed; that is fine for a sandbox.
  for _ in $(seq 1 60); do
    state=$(podman exec "$name" systemctl is-system-running 2>/dev/null || true)
    case $state in
    running | degraded)
      log "$name is up (systemd $state)"
      exit 0
      ;;
    esac
    sleep 1
  done
  log "$name: systemd did not finish booting in 60 s (state: ${state:-unknown})"
  podman logs --tail 20 "$name" >&2 || true
  exit 1
  ;;
rm)
  for node in "${@:2}"; do
    if podman container exists "$node"; then
      podman rm -f -t 10 "$node" >/dev/null
      log "removed $node"
    fi
  done
  ;;
*)
  echo "usage: $0 start NAME [--shm-size=SIZE] [--net=none|--net-of=NODE] | rm NAME..." >&2
  exit 2
  ;;
esac
