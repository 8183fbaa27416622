"""leased_threads: who else ran on a leased CPU. Fixture /proc task trees for the verdicts, then a real
CPU hog on a CPU that a lease state file says is leased."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from subprocess import Popen

import pytest

from lowtail.node.lease import Lease
from lowtail.validation.check import Status
from lowtail.validation.threads import PF_KTHREAD, Sampler, check_leased_threads, read_leases
from tests.validation.conftest import PROBE_CPU

LEASED = 3
OWNER = Lease(owner="infer:hero1:actor0", cpu=LEASED, node=0, l3=0, pid=100)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _task(
    proc: Path,
    pid: int,
    tid: int,
    comm: str,
    *,
    ppid: int,
    cpu: int,
    ns: int,
    allowed: str,
    kthread: bool = False,
) -> None:
    rest = ["0"] * 50
    rest[0], rest[1], rest[6], rest[36] = "S", str(ppid), str(PF_KTHREAD if kthread else 0x400000), str(cpu)
    d = proc / str(pid) / "task" / str(tid)
    d.mkdir(parents=True, exist_ok=True)
    (d / "stat").write_text(f"{tid} ({comm}) {' '.join(rest)}\n")
    (d / "schedstat").write_text(f"{ns} 0 0\n")
    (d / "status").write_text(f"Name:\t{comm}\nCpus_allowed_list:\t{allowed}\n")


# (pid, tid, comm, ppid, allowed, kthread): the lease owner (actor) and its pinned worker, the validator
# and its probe child, Ray's raylet, a per-CPU ksoftirqd and an unbound RCU offload thread.
THREADS = [
    (100, 100, "ray::Infer", 1, "0-7", False),
    (101, 101, "lowtail-worker", 100, "3", False),
    (500, 500, "lowtail", 1, "0-7", False),
    (501, 501, "probe_process", 500, "3", False),
    (200, 201, "raylet", 1, "0-7", False),
    (30, 30, "ksoftirqd/3", 2, "3", True),
    (40, 40, "rcuop/1", 2, "0-7", True),
]


def _node(proc: Path, ran: dict[str, int], cpu_of: dict[str, int] | None = None) -> None:
    for pid, tid, comm, ppid, allowed, kt in THREADS:
        cpu = (cpu_of or {}).get(comm, LEASED)
        _task(proc, pid, tid, comm, ppid=ppid, cpu=cpu, ns=ran.get(comm, 0), allowed=allowed, kthread=kt)


def _sample(tmp: Path, ran_ms: dict[str, int], cpu_of: dict[str, int] | None = None) -> Sampler:
    """Two snapshots one second apart; between them each thread ran ran_ms on its CPU."""
    proc, clock = tmp / "proc", Clock()
    _node(proc, {})
    s = Sampler(proc, frozenset({LEASED}), clock=clock)
    s.tick()
    clock.t += 1.0
    _node(proc, {k: v * 1_000_000 for k, v in ran_ms.items()}, cpu_of)
    s.tick()
    return s


def test_a_foreign_thread_on_a_leased_cpu_fails_and_is_named(tmp_path: Path) -> None:
    ran = {
        "ray::Infer": 5,
        "lowtail-worker": 900,
        "probe_process": 50,
        "raylet": 40,
        "ksoftirqd/3": 2,
        "rcuop/1": 3,
    }
    c = check_leased_threads(_sample(tmp_path, ran), [OWNER], own_pids=[500], nohz_full=frozenset({LEASED}))
    assert c.status is Status.FAIL and c.value == 43.0, c
    cpu = c.data["leased_cpus"]["3"]
    assert [(t["comm"], t["pid"], t["ms"]) for t in cpu["top"]] == [
        ("raylet", 200, 40.0),
        ("rcuop/1", 40, 3.0),
    ]
    assert cpu["bound_kthreads_ms"] == 2.0 and cpu["owner"] == OWNER.owner
    assert "raylet[200/201] 40.00 ms" in c.evidence[1] and "ksoftirqd/3 2.00 ms" in c.evidence[1]


def test_only_the_owner_the_validator_and_per_cpu_kthreads_on_a_leased_cpu_pass(tmp_path: Path) -> None:
    ran = {"ray::Infer": 5, "lowtail-worker": 990, "probe_process": 300, "ksoftirqd/3": 4}
    c = check_leased_threads(_sample(tmp_path, ran), [OWNER], own_pids=[500], nohz_full=frozenset({LEASED}))
    assert c.status is Status.PASS and c.value == 0.0, c


def test_per_cpu_kthreads_count_on_a_leased_cpu_without_nohz_full(tmp_path: Path) -> None:
    c = check_leased_threads(_sample(tmp_path, {"ksoftirqd/3": 4}), [OWNER], own_pids=[500])
    assert c.status is Status.WARN and c.value == 4.0
    assert c.data["leased_cpus"]["3"]["top"][0]["comm"] == "ksoftirqd/3"


def test_threads_that_ran_on_other_cpus_are_not_charged(tmp_path: Path) -> None:
    c = check_leased_threads(_sample(tmp_path, {"raylet": 500}, {"raylet": 0}), [OWNER])
    assert c.status is Status.PASS, c


def test_a_little_foreign_time_warns_before_it_fails(tmp_path: Path) -> None:
    c = check_leased_threads(_sample(tmp_path, {"raylet": 5}), [OWNER], own_pids=[500])
    assert c.status is Status.WARN and c.value == 5.0


def test_without_a_lease_state_nothing_is_leased_and_the_reason_says_so(tmp_path: Path) -> None:
    leases, why = read_leases(tmp_path / "leases.json")
    assert leases == [] and "no lease state at" in why and "handed out no CPU" in why


def test_a_lease_state_of_another_boot_is_not_used(tmp_path: Path) -> None:
    state = tmp_path / "leases.json"
    state.write_text(json.dumps({"version": 1, "boot_id": "old-boot", "leases": [OWNER.to_dict()]}))
    assert read_leases(state)[0] == [OWNER]
    leases, why = read_leases(state, current_boot="this-boot")
    assert leases == [] and "another boot (old-boot)" in why


def _state(tmp: Path, cpu: int, pid: int) -> Path:
    state = tmp / "leases.json"
    lease = Lease(owner="infer:hero:a0", cpu=cpu, node=0, l3=0, pid=pid, actor_id="ab12")
    state.write_text(json.dumps({"version": 1, "boot_id": "", "leases": [lease.to_dict()]}))
    return state


def _validate(*args: str) -> subprocess.CompletedProcess[str]:
    cli = [str(Path(sys.executable).parent / "lowtail"), "validate", "--no-progress", *args]
    return subprocess.run(cli, capture_output=True, text=True, timeout=120, check=False)


def test_a_real_hog_on_a_leased_cpu_is_caught_by_the_validator(
    tmp_path: Path, hog: Callable[[int], Popen[bytes]]
) -> None:
    owner = subprocess.Popen(["sleep", "60"])
    try:
        state = _state(tmp_path, PROBE_CPU, owner.pid)
        intruder = hog(PROBE_CPU)
        out = tmp_path / "r.json"
        html = tmp_path / "r.html"
        r = _validate(
            *("--only", "leased_threads", "--duration", "1", "--lease-state", str(state)),
            *("--json", str(out), "--html", str(html)),
        )
    finally:
        owner.kill()
        owner.wait()
    assert r.returncode == 1, r.stdout + r.stderr
    check = json.loads(out.read_text())["checks"][0]
    assert check["name"] == "leased_threads" and check["status"] == "fail"
    top = check["data"]["leased_cpus"][str(PROBE_CPU)]["top"]
    # The hog is among the top offenders (other engineers' processes share this machine's CPUs too).
    assert intruder.pid in [t["pid"] for t in top], top
    page = html.read_text()  # the offenders' bar chart, embedded as a PNG
    assert "leased_threads: other threads on leased CPUs (fail" in page
    assert "data:image/png;base64,iVBORw0KGgo" in page


def test_the_actor_option_points_the_cgroup_checks_at_the_lease_owner(tmp_path: Path) -> None:
    owner = subprocess.Popen(["taskset", "-c", str(PROBE_CPU), "sleep", "60"])
    try:
        state = _state(tmp_path, PROBE_CPU, owner.pid)
        out = tmp_path / "r.json"
        r = _validate("--only", "affinity", "--actor", "a0", "--lease-state", str(state), "--json", str(out))
        unknown = _validate("--only", "affinity", "--actor", "nobody", "--lease-state", str(state))
    finally:
        owner.kill()
        owner.wait()
    check = json.loads(out.read_text())["checks"][0]
    # Pinned to exactly the CPU it leased: on purpose, not an inherited affinity.
    assert r.returncode == 0 and check["status"] == "pass", r.stdout + r.stderr
    assert f"infer:hero:a0 (pid {owner.pid})" in check["evidence"][0]
    assert (
        unknown.returncode == 2 and "--actor 'nobody'" in unknown.stderr and "infer:hero:a0" in unknown.stderr
    )


def test_a_pid_that_does_not_exist_is_a_usage_error() -> None:
    r = _validate("--only", "affinity", "--pid", str(2**22 + 7))
    assert r.returncode == 2 and f"--pid {2**22 + 7}: no such process" in r.stderr
    assert not os.path.exists(f"/proc/{2**22 + 7}")


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"leases": [{"cpu": ' + "9" * 5000 + "}]}", "digits"),
        ("[1]", "unreadable"),
        ('{"leases": [1]}', "unreadable"),
    ],
)
def test_a_hostile_lease_state_is_unreadable_with_its_reason_never_a_traceback(
    tmp_path: Path, content: str, why: str
) -> None:
    state = tmp_path / "leases.json"
    state.write_text(content)
    leases, reason = read_leases(state)
    assert leases == [] and str(state) in reason and why in reason
