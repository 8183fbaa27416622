#!/usr/bin/env bash
# Runs make targets side by side (at most $TEST_JOBS at once), each one's output in
# build/test-logs/<target>.log and printed whole when it ends, then a summary of every target last:
# CI shows only the tail of a run, so what failed must be the last thing printed, not buried above a
# later suite's success.
#   scripts/run-suites.sh pytest molecule molecule-runtime --then pytest-actor-kill
# --then: the targets after it start only once every target before it has ended (a quiet host).
set -uo pipefail
cd "$(dirname "$0")/.."

jobs_max=${TEST_JOBS:-3}
if ! [[ $jobs_max =~ ^[1-9][0-9]*$ ]]; then
  echo "run-suites: TEST_JOBS=$jobs_max: expected a whole number of jobs, 1 or more" >&2
  exit 2
fi
[ $# -gt 0 ] || { echo "usage: $0 TARGET..." >&2; exit 2; }

logs=build/test-logs
mkdir -p "$logs"
declare -A pid_of=() start_of=() rc_of=() secs_of=()
children=()

# Ctrl-C or a CI timeout ends every suite's process group, not only make.
stop_all() {
  for p in "${children[@]}"; do kill -TERM -- "-$p" 2>/dev/null; done
  wait
  exit 130
}
trap stop_all INT TERM

finish() {  # $1: target whose job ended with status $2
  local t=$1
  rc_of[$t]=$2
  secs_of[$t]=$(( $(date +%s) - start_of[$t] ))
  echo "==> $t ended (exit ${rc_of[$t]}, $(( secs_of[$t] / 60 )) min $(( secs_of[$t] % 60 )) s): its output follows"
  cat "$logs/$t.log"
}

reap() {  # waits for one job to end, then prints its log
  local t done_pid rc
  wait -n -p done_pid "${pid_of[@]}"
  rc=$?
  for t in "${!pid_of[@]}"; do
    if [ "${pid_of[$t]}" = "$done_pid" ]; then
      unset "pid_of[$t]"; finish "$t" "$rc"; return
    fi
  done
}

targets=()
for t in "$@"; do
  if [ "$t" = --then ]; then
    while [ ${#pid_of[@]} -gt 0 ]; do reap; done
    continue
  fi
  targets+=("$t")
  while [ ${#pid_of[@]} -ge "$jobs_max" ]; do reap; done
  echo "==> $t started; its output goes to $logs/$t.log and is printed when it ends"
  start_of[$t]=$(date +%s)
  # `times` in the suite's own shell: the CPU of every process of the suite that was waited for (not
  # of the daemons it left to init, such as podman's conmon and the containers, or Ray's raylet).
  setsid bash -c 'make --no-print-directory "$1"; rc=$?; times >"$2"; exit $rc' _ "$t" "$logs/$t.cpu" \
    >"$logs/$t.log" 2>&1 &
  pid_of[$t]=$!
  children+=("$!")
done
while [ ${#pid_of[@]} -gt 0 ]; do reap; done

cpu_of() {  # "CPU 12 min 3 s": user + system of the suite's waited-for processes, from `times`
  local line ms=0 m sec frac
  line=$(sed -n 2p "$logs/$1.cpu" 2>/dev/null) || true
  [[ $line =~ ^[0-9]+m[0-9]+\.[0-9]{3}s\ [0-9]+m[0-9]+\.[0-9]{3}s$ ]] || { echo "CPU not recorded"; return; }
  for field in $line; do  # e.g. 1m2.345s; 10#: a leading zero is not octal
    m=${field%%m*}; sec=${field#*m}; frac=${sec#*.}; sec=${sec%%.*}; frac=${frac%s}
    ms=$(( ms + (10#$m * 60 + 10#$sec) * 1000 + 10#$frac ))
  done
  echo "CPU $(( ms / 60000 )) min $(( ms % 60000 / 1000 )) s"
}

echo
echo "==> summary (logs in $logs/; CPU counts a suite's processes that were waited for, not its daemons)"
failed=0
for t in "${targets[@]}"; do
  if [ "${rc_of[$t]}" = 0 ]; then status=passed; else status="FAILED (exit ${rc_of[$t]})"; failed=1; fi
  printf '    %-18s %-18s %3d min %2d s   %s\n' "$t" "$status" $(( secs_of[$t] / 60 )) $(( secs_of[$t] % 60 )) \
    "$(cpu_of "$t")"
  if [ "${rc_of[$t]}" != 0 ]; then
    # pytest's short summary, ansible's failed tasks, molecule's failed step: what to read first.
    grep -E '^(FAILED|ERROR) |^=+ .*(failed|error).* =+$|fatal: \[|failed=[1-9]|Executed: Failed|^make(\[[0-9]+\])?: \*\*\*' \
      "$logs/$t.log" | tail -n 40 | sed 's/^/      /'
  fi
done
exit $failed
