#!/usr/bin/env bash
# `make demo`: lowtail's main job, for real, on a two-node sandbox cluster.
#
#   1. the sandbox image (Debian bookworm + systemd, debootstrap; built once, then reused)
#   2. the wheelhouse (lowtail and every pinned dependency as wheels; content-hashed, reused)
#   3. two systemd containers as the nodes (podman, runc, never privileged) sharing one network namespace
#      that the demo creates with the head (--network none: loopback and nothing else) and the worker
#      joins; each node keeps its own IPC namespace, /dev/shm, PID namespace and filesystem, and Ray's
#      traffic between them never leaves that namespace
#   4. one real site.yml run against both (inventory/sandbox): preflight, kernel command line, tuning,
#      kubelet, runtime install from the wheelhouse, each node's /etc/lowtail/plan.json, and Ray started
#      by the installed lowtail-ray.service (head on lowtail-demo-head, worker on lowtail-demo-worker);
#      steps a container cannot take (update-grub, reboot, live sysctls) are off in the inventory
#   5. the fleet validation on both nodes (lowtail validate --quick through playbooks/validate.yml), one table
#   6. the serving demo on that cluster (python -m lowtail.demo.cluster on the head): samplers on both
#      nodes, each with its own node's inference actor through shared memory; a cross-node attach refused;
#      SIGKILL of the worker node's pinned worker; then the loss of the whole worker node (this script kills
#      its container when the driver asks), with the figures of each
# then a summary, and both nodes are removed: nothing is left running.
#
# Env: LOWTAIL_DEMO_KEEP=1 keeps the nodes running afterwards (`make demo-clean` removes them);
#      LOWTAIL_DEMO_SECONDS (default 6) is how long each serving phase runs.
set -euo pipefail
cd "$(dirname "$0")/.."

HEAD=lowtail-demo-head
WORKER=lowtail-demo-worker
NODES=("$HEAD" "$WORKER")
OUT=build/demo
BIN=.venv/bin
SECONDS_DEMO=${LOWTAIL_DEMO_SECONDS:-6}
STEPS=6
mkdir -p "$OUT"
rm -rf "$OUT"/*.log "$OUT"/*.json "$OUT"/validate

step_names=()
step_times=()
step_status=()
t_step=0
current=""

bold() { printf '\033[1m%s\033[0m\n' "$*"; }
begin() {
  current=$1
  t_step=$SECONDS
  bold "==> [$((${#step_names[@]} + 1))/$STEPS] $1"
}
end() {
  step_names+=("$current")
  step_times+=($((SECONDS - t_step)))
  step_status+=("${1:-ok}")
}

cleanup() {
  local rc=$?
  if [[ ${LOWTAIL_DEMO_KEEP:-0} == 1 ]]; then
    echo "demo: the nodes ${NODES[*]} keep running (LOWTAIL_DEMO_KEEP=1); 'make demo-clean' removes them"
  else
    scripts/sandbox-node.sh rm "$WORKER" "$HEAD" || true
  fi
  exit "$rc"
}
trap cleanup EXIT

# Ansible's output goes to a log; the terminal shows one line per task as it starts (a first run takes
# minutes) and the log's tail if the play fails.
run_play() {
  local log=$1
  shift
  local t0=$SECONDS
  set +e
  ANSIBLE_NOCOLOR=1 ANSIBLE_FORCE_COLOR=0 PATH="$PWD/$BIN:$PATH" "$BIN/ansible-playbook" "$@" >"$log" 2>&1 &
  local pid=$!
  local seen=0
  while kill -0 "$pid" 2>/dev/null; do
    local n
    n=$(grep -c '^TASK \[' "$log" 2>/dev/null || true)
    if ((n > seen)); then
      grep '^TASK \[' "$log" | sed -n "$((seen + 1)),${n}p" | sed -E 's/^TASK \[(.*)\] \**$/\1/' |
        while read -r task; do printf '    [%4ds] %s\n' $((SECONDS - t0)) "$task"; done
      seen=$n
    fi
    sleep 1
  done
  wait "$pid"
  local rc=$?
  set -e
  grep -A3 '^PLAY RECAP' "$log" | sed 's/^/    /' || true
  return $rc
}

begin "sandbox image"
image=$(scripts/sandbox-image.sh)
echo "    $image"
end

begin "wheelhouse"
scripts/wheelhouse.sh >/dev/null
wheelhouse_id=$("$BIN/python" -c 'import json; print(json.load(open("build/wheelhouse/wheelhouse.json"))["id"])')
end

begin "two sandbox nodes sharing a loopback-only network namespace (and nothing else)"
scripts/sandbox-node.sh start "$HEAD" --net=none
scripts/sandbox-node.sh start "$WORKER" --net-of="$HEAD"
end

begin "site.yml on both nodes (preflight, kernel, tuning, kubelet, runtime + Ray unit, manifests)"
if grep -Eq '^[^#]*import_playbook: *playbooks/runtime.yml' site.yml; then
  playbooks=(site.yml)
else
  # site.yml does not import the runtime stage: run it right after, in the same ansible-playbook run, so
  # the plan preflight published (lowtail_node) is there for the runtime role.
  playbooks=(site.yml playbooks/runtime.yml)
fi
echo "    ansible-playbook -i inventory/sandbox ${playbooks[*]}"
if ! run_play "$OUT/site.log" -i inventory/sandbox "${playbooks[@]}"; then
  tail -40 "$OUT/site.log"
  echo "demo: ${playbooks[*]} failed on the sandbox nodes (full log: $OUT/site.log)" >&2
  exit 1
fi
for node in "${NODES[@]}"; do
  printf '    %-20s lowtail-ray.service %s\n' "$node" "$(podman exec "$node" systemctl is-active lowtail-ray.service || true)"
done
end

begin "fleet validation of both nodes (lowtail validate --quick)"
validate_dir="$PWD/$OUT/validate"
# A sandbox is not a tuned node (no kernel arguments in effect, a VM): failures are expected and shown.
if run_play "$OUT/validate.log" -i inventory/sandbox playbooks/validate.yml \
  -e "lowtail_validate_fetch_dir=$validate_dir"; then
  end
else
  end "has failures"
fi
[[ -f $validate_dir/fleet.txt ]] && sed 's/^/    /' "$validate_dir/fleet.txt"

begin "serving on both nodes, a worker SIGKILL, the loss of the worker node (${SECONDS_DEMO} s a phase)"
kill_file=/tmp/lowtail-demo-kill-node
podman exec "$HEAD" rm -f "$kill_file"
: >"$OUT/serve.log" # exists before the loop below reads it (the driver's redirection opens it later)
podman exec -e RAY_AUTH_MODE=disabled "$HEAD" /opt/lowtail/venv/bin/python -m lowtail.demo.cluster \
  --seconds "$SECONDS_DEMO" --kill-file "$kill_file" --json /tmp/lowtail-cluster.json \
  --plot /tmp/lowtail-cluster.png >"$OUT/serve.log" 2>&1 &
driver=$!
# The driver's output as it comes; the worker node (its whole container, as a power loss would) is
# killed when the driver asks for it.
shown=0
killed=0
while kill -0 "$driver" 2>/dev/null; do
  n=$(wc -l <"$OUT/serve.log" 2>/dev/null || echo 0)
  if ((n > shown)); then
    sed -n "$((shown + 1)),${n}p" "$OUT/serve.log" | sed 's/^/    /'
    shown=$n
  fi
  if ((!killed)) && podman exec "$HEAD" test -f "$kill_file" 2>/dev/null; then
    podman kill --signal KILL "$WORKER" >/dev/null
    killed=1
    echo "    demo: podman kill --signal KILL $WORKER (the worker node is gone)"
  fi
  sleep 0.3
done
set +e
wait "$driver"
rc=$?
set -e
sed -n "$((shown + 1)),\$p" "$OUT/serve.log" | sed 's/^/    /'
podman cp "$HEAD:/tmp/lowtail-cluster.json" "$OUT/cluster.json" 2>/dev/null || true
podman cp "$HEAD:/tmp/lowtail-cluster.png" "$OUT/cluster-tails.png" 2>/dev/null || true
serve_rc=$rc
if ((rc == 0)); then end; else end "checks failed (rc $rc)"; fi

echo
bold "Summary"
plan=$(podman exec "$HEAD" cat /etc/lowtail/plan.json)
version=$(podman exec "$HEAD" /opt/lowtail/venv/bin/lowtail --version)
"$BIN/python" - "$version" "$wheelhouse_id" "$OUT" "$validate_dir" "$plan" <<'EOF'
import json, sys
from pathlib import Path
from lowtail.render import table

version, wid, out, vdir = sys.argv[1], sys.argv[2], Path(sys.argv[3]), Path(sys.argv[4])
plan = json.loads(sys.argv[5])
rows = [
    ["nodes", "lowtail-demo-head (Ray head), lowtail-demo-worker (Ray worker): systemd containers sharing "
     "one loopback-only network namespace, this machine's CPUs and kernel"],
    ["runtime", f"{version} in /opt/lowtail/venv on both, from wheelhouse {wid} (pip --no-index)"],
    ["Ray", "started by lowtail-ray.service on each node (head 127.0.0.1:6379, worker 127.0.0.2)"],
    ["plan (head)", f"housekeeping {plan['housekeeping']}, isolated {plan['isolated']} -> /etc/lowtail/plan.json"],
    ["kernel args", " ".join(plan["kernel_args"])],
    ["manifests", ", ".join(sorted(p.name for p in Path("build/manifests").glob("*.yaml")))],
]
cluster = out / "cluster.json"
if cluster.exists():
    c = json.loads(cluster.read_text())
    for check, ok in c["checks"].items():
        rows.append([f"check {check}", "pass" if ok else "FAIL"])
    if c.get("cpus_shared_between_nodes"):
        rows.append(["NOTE", f"both nodes' cpuset is {c['cpus_shared_between_nodes']}: one machine's CPUs, so the "
                     "two nodes' leases can be the same physical CPU"])
    rows.append(["", f"report: {cluster}, plot: {out / 'cluster-tails.png'}"])
for report in sorted(vdir.glob("lowtail-demo-*.json")):
    s = json.loads(report.read_text()).get("summary")
    if s:
        counts = ", ".join(f"{n} {k}" for k, n in s["counts"].items())
        rows.append([f"validation {report.stem}", f"{s['status']} ({counts}); failed: {', '.join(s['failed']) or '-'}"])
print(table.render(["what", "result"], rows, title="lowtail on the two-node sandbox"))
EOF
echo
printf '%-100s %6s  %s\n' step seconds status
for i in "${!step_names[@]}"; do
  printf '%-100s %6d  %s\n' "${step_names[$i]}" "${step_times[$i]}" "${step_status[$i]}"
done
# The serving demo's checks decide `make demo`'s exit status (validation failures of a sandbox do not).
exit "$serve_rc"
