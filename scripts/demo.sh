#!/usr/bin/env bash
# `make demo`: lowtail's main job, for real, on a sandbox node.
#
#   1. the sandbox image (Debian bookworm + systemd, debootstrap; built once, then reused)
#   2. the wheelhouse (lowtail and every pinned dependency as wheels; content-hashed, reused)
#   3. a systemd container from the image as the node (podman, runc, never privileged)
#   4. the real site.yml against it (inventory/sandbox): preflight, kernel command line, tuning, kubelet,
#      runtime install from the wheelhouse, Kubernetes manifests; steps a container cannot take (update-grub,
#      reboot, live sysctls) are switched off by inventory variables
#   5. a short serving demo inside the node with the installed runtime
#   6. the node's validation (lowtail validate --quick through playbooks/validate.yml)
# then a summary, and the container is removed: nothing is left running.
#
# Env: LOWTAIL_DEMO_KEEP=1 keeps the node running afterwards (`make demo-clean` removes it);
#      LOWTAIL_DEMO_SECONDS (default 10) is how long the serving demo runs.
set -euo pipefail
cd "$(dirname "$0")/.."

NODE=lowtail-demo-node
OUT=build/demo
BIN=.venv/bin
SECONDS_DEMO=${LOWTAIL_DEMO_SECONDS:-10}
mkdir -p "$OUT"
rm -f "$OUT"/*.log "$OUT"/serve.json

step_names=()
step_times=()
step_status=()
t_step=0
current=""

bold() { printf '\033[1m%s\033[0m\n' "$*"; }
begin() {
  current=$1
  t_step=$SECONDS
  bold "==> [$((${#step_names[@]} + 1))/6] $1"
}
end() {
  step_names+=("$current")
  step_times+=($((SECONDS - t_step)))
  step_status+=("${1:-ok}")
}

cleanup() {
  local rc=$?
  if [[ ${LOWTAIL_DEMO_KEEP:-0} == 1 ]]; then
    echo "demo: the node $NODE keeps running (LOWTAIL_DEMO_KEEP=1); 'make demo-clean' removes it"
  else
    scripts/sandbox-node.sh rm "$NODE" || true
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

begin "sandbox node"
scripts/sandbox-node.sh start "$NODE"
end

begin "site.yml on the node (preflight, kernel, tuning, kubelet, runtime, manifests)"
extra=()
if [[ -f site.yml ]] && grep -Eq '^[^#]*import_playbook: *playbooks/runtime.yml' site.yml; then
  playbooks=(site.yml)
elif [[ -f site.yml ]]; then
  # site.yml does not import the runtime stage: run it right after, in the same ansible-playbook run, so
  # the plan preflight published (lowtail_node) is there for the runtime role.
  playbooks=(site.yml playbooks/runtime.yml)
else
  # No provisioning play in this checkout: the plan comes from the same code preflight uses.
  playbooks=(playbooks/runtime.yml)
  echo "    (no site.yml here: only the runtime stage runs, with the plan from lowtail plan)"
  "$BIN/lowtail" plan --json - | "$BIN/python" -c \
    'import json, sys; print(json.dumps({"lowtail_runtime_plan": json.load(sys.stdin)}))' >"$OUT/plan-vars.json"
  extra=(-e "@$OUT/plan-vars.json")
fi
echo "    ansible-playbook -i inventory/sandbox ${playbooks[*]}"
if ! run_play "$OUT/site.log" -i inventory/sandbox "${playbooks[@]}" "${extra[@]}"; then
  tail -40 "$OUT/site.log"
  echo "demo: ${playbooks[*]} failed on the sandbox node (full log: $OUT/site.log)" >&2
  exit 1
fi
end

begin "serving demo inside the node (${SECONDS_DEMO} s)"
# Ray's object store must fit the node's /dev/shm (1 GiB here), as the manifests size it for pods;
# its default, 30% of RAM, would fall back to /tmp.
lt=(podman exec -e RAY_AUTH_MODE=disabled -e RAY_DEFAULT_OBJECT_STORE_MAX_MEMORY_BYTES=536870912 "$NODE"
  /opt/lowtail/venv/bin/lowtail)
if "${lt[@]}" demo ray --help >/dev/null 2>&1; then
  serve=(demo ray --seconds "$SECONDS_DEMO" --json /tmp/lowtail-serve.json)
elif "${lt[@]}" bench serve --help >/dev/null 2>&1; then
  serve=(bench serve --quick --samplers 1,2 --json /tmp/lowtail-serve.json)
elif "${lt[@]}" bench queue --help >/dev/null 2>&1; then
  serve=(bench queue --quick --json /tmp/lowtail-serve.json)
else
  serve=()
fi
if ((${#serve[@]})); then
  echo "    lowtail ${serve[*]}"
  if "${lt[@]}" "${serve[@]}" 2>&1 | tee "$OUT/serve.log" | sed 's/^/    /'; then
    podman cp "$NODE:/tmp/lowtail-serve.json" "$OUT/serve.json" 2>/dev/null || true
    end
  else
    end failed
  fi
else
  echo "    the installed runtime has no serving command yet (lowtail demo ray / bench serve / bench queue)"
  end skipped
fi

begin "validation of the node (lowtail validate --quick)"
validate_dir="$PWD/$OUT/validate"
if [[ -f playbooks/validate.yml ]]; then
  # A sandbox is not a tuned node (no kernel arguments in effect, a VM): failures are expected and shown.
  if run_play "$OUT/validate.log" -i inventory/sandbox playbooks/validate.yml \
    -e "lowtail_validate_fetch_dir=$validate_dir"; then
    end
  else
    end "has failures"
  fi
  [[ -f $validate_dir/fleet.txt ]] && sed 's/^/    /' "$validate_dir/fleet.txt"
else
  echo "    playbooks/validate.yml is not there yet"
  end skipped
fi

echo
bold "Summary"
plan=$(podman exec "$NODE" cat /etc/lowtail/plan.json)
version=$(podman exec "$NODE" /opt/lowtail/venv/bin/lowtail --version)
"$BIN/python" - "$plan" "$version" "$wheelhouse_id" "$OUT" "$validate_dir" <<'EOF'
import json, sys
from pathlib import Path
from lowtail.render import table

plan, version, wid, out, vdir = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3], Path(sys.argv[4]), Path(sys.argv[5])
rows = [
    ["node", "lowtail-demo-node (systemd container, this machine's CPUs and kernel)"],
    ["runtime", f"{version} in /opt/lowtail/venv, from wheelhouse {wid} (pip --no-index)"],
    ["plan", f"housekeeping {plan['housekeeping']}, isolated {plan['isolated']} -> /etc/lowtail/plan.json"],
    ["kernel args", " ".join(plan["kernel_args"])],
    ["manifests", ", ".join(sorted(p.name for p in Path("build/manifests").glob("*.yaml")))],
]
serve = out / "serve.json"
if serve.exists():
    rows.append(["serving demo", f"{serve} (numbers above)"])
report = vdir / "lowtail-demo-node.json"
if report.exists():
    s = json.loads(report.read_text())["summary"]
    counts = ", ".join(f"{n} {k}" for k, n in s["counts"].items())
    rows.append(["validation", f"{s['status']} ({counts}); failed: {', '.join(s['failed']) or '-'}"])
    rows.append(["", f"report: {report} and .html"])
print(table.render(["what", "result"], rows, title="lowtail on the sandbox node"))
EOF
echo
printf '%-75s %6s  %s\n' step seconds status
for i in "${!step_names[@]}"; do
  printf '%-75s %6d  %s\n' "${step_names[$i]}" "${step_times[$i]}" "${step_status[$i]}"
done
