"""cfs_throttle and affinity: fixture cgroup v1/v2/hybrid trees, then the real cgroup v1 of this machine.

The live tests create a cgroup under /sys/fs/cgroup/cpu (v1, this machine) with a CFS quota and put a
busy loop in it, and start a child with a narrower affinity than its cpuset; each skips with the reason
when the machine cannot do it.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from lowtail.validation.cgroup import (
    Target,
    check_affinity,
    check_cfs_throttle,
    cpu_stat_of,
    find_cgroup,
    proc_cgroups,
)
from lowtail.validation.check import Status

V2_STAT = "usage_usec 9000000\nuser_usec 8000000\nsystem_usec 1000000\nnr_periods 400\n"
POD = "/kubepods.slice/kubepods-pod1.slice/cri-containerd-abc.scope"


def _write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text + "\n")


def v2_node(
    tmp: Path,
    *,
    quota: str = "max 100000",
    stat: str = "nr_throttled 0\nthrottled_usec 0",
    allowed: str = "4-7",
) -> tuple[Path, Path]:
    """A cgroup v2 node: pid 4242 in a container scope with cpuset 4-7."""
    proc, cg = tmp / "proc", tmp / "sys/fs/cgroup"
    _write(
        tmp,
        {
            "proc/4242/cgroup": f"0::{POD}",
            "proc/4242/status": f"Name:\tpython\nCpus_allowed:\tf0\nCpus_allowed_list:\t{allowed}",
            "sys/fs/cgroup/cgroup.controllers": "cpuset cpu io memory pids",
            f"sys/fs/cgroup{POD}/cpu.max": quota,
            f"sys/fs/cgroup{POD}/cpu.stat": V2_STAT + stat,
            f"sys/fs/cgroup{POD}/cpuset.cpus.effective": "4-7",
            "sys/fs/cgroup/kubepods.slice/cpu.max": "max 100000",
        },
    )
    return proc, cg


def v1_node(tmp: Path, *, quota: int = -1, throttled: int = 0, cpuset: str = "2-3") -> tuple[Path, Path]:
    """A cgroup v1 node with cpu,cpuacct co-mounted (and the usual cpu symlink), pid 77 in /ray."""
    proc, cg = tmp / "proc", tmp / "sys/fs/cgroup"
    _write(
        tmp,
        {
            "proc/77/cgroup": "4:cpuset:/ray\n3:cpu,cpuacct:/ray\n1:name=systemd:/ray\n0::/ray",
            "proc/77/status": "Name:\traylet\nCpus_allowed_list:\t2-3",
            "sys/fs/cgroup/cpu,cpuacct/ray/cpu.cfs_quota_us": str(quota),
            "sys/fs/cgroup/cpu,cpuacct/ray/cpu.cfs_period_us": "100000",
            "sys/fs/cgroup/cpu,cpuacct/ray/cpu.stat": (
                f"nr_periods 50\nnr_throttled {throttled}\nthrottled_time {throttled * 2_000_000}"
            ),
            "sys/fs/cgroup/cpuset/ray/cpuset.effective_cpus": cpuset,
            "sys/fs/cgroup/unified/cgroup.controllers": "",
        },
    )
    (cg / "cpu").symlink_to("cpu,cpuacct")
    return proc, cg


# ---- cfs_throttle on fixtures ----
def test_a_v2_container_without_quota_and_never_throttled_passes(tmp_path: Path) -> None:
    proc, cg = v2_node(tmp_path)
    c = check_cfs_throttle(proc, cg, Target(4242, "pid 4242"), frozenset(range(4, 8)))
    assert c.status is Status.PASS, c
    assert c.data["version"] == 2 and c.data["quota"] == []


def test_a_throttled_v2_cpu_stat_fails_with_its_figures(tmp_path: Path) -> None:
    proc, cg = v2_node(tmp_path, stat="nr_throttled 37\nthrottled_usec 812345")
    c = check_cfs_throttle(proc, cg, Target(4242, "pid 4242"), frozenset(range(4, 8)))
    assert c.status is Status.FAIL
    assert c.data["nr_throttled"] == 37 and c.data["throttled_ms"] == pytest.approx(812.345)
    assert "throttled 37 times (812.345 ms)" in c.reason


def test_a_quota_on_an_exclusive_cpu_container_fails_and_names_the_kubelet_fix(tmp_path: Path) -> None:
    proc, cg = v2_node(tmp_path, quota="400000 100000")
    c = check_cfs_throttle(proc, cg, Target(4242, "pid 4242"), frozenset(range(4, 8)))
    assert c.status is Status.FAIL
    assert "DisableCPUQuotaWithExclusiveCPUs" in c.reason and "cpu-quota.crio.io" in c.reason
    assert c.data["quota"][0]["quota_us"] == 400000


def test_a_quota_on_shared_cpus_only_warns(tmp_path: Path) -> None:
    proc, cg = v2_node(tmp_path, quota="400000 100000")
    c = check_cfs_throttle(proc, cg, Target(4242, "pid 4242"), frozenset({8, 9}))
    assert c.status is Status.WARN and "not yet throttled" in c.reason


def test_a_quota_on_a_parent_cgroup_counts_too(tmp_path: Path) -> None:
    proc, cg = v2_node(tmp_path)
    (cg / "kubepods.slice/cpu.max").write_text("200000 100000\n")
    c = check_cfs_throttle(proc, cg, Target(4242, "pid 4242"), frozenset(range(4, 8)))
    assert c.status is Status.FAIL
    assert c.data["quota"][0]["dir"].endswith("kubepods.slice")


def test_v1_throttled_time_is_read_in_nanoseconds(tmp_path: Path) -> None:
    proc, cg = v1_node(tmp_path, throttled=5)
    c = check_cfs_throttle(proc, cg, Target(77, "pid 77"), frozenset({2, 3}))
    assert c.status is Status.FAIL
    assert c.data["version"] == 1 and c.data["throttled_ms"] == pytest.approx(10.0)


def test_v1_quota_without_throttling_on_exclusive_cpus_fails(tmp_path: Path) -> None:
    proc, cg = v1_node(tmp_path, quota=50000)
    c = check_cfs_throttle(proc, cg, Target(77, "pid 77"), frozenset({2, 3}))
    assert c.status is Status.FAIL and "50000/100000" in c.reason


def test_only_throttling_inside_the_window_fails_when_a_start_is_known(tmp_path: Path) -> None:
    proc, cg = v1_node(tmp_path, throttled=5)
    before = cpu_stat_of(proc, cg, Target(77, "pid 77"))
    c = check_cfs_throttle(proc, cg, Target(77, "pid 77"), frozenset(), before=before, window_s=3.0)
    assert c.status is Status.PASS and c.data["nr_throttled"] == 0, c
    (cg / "cpu,cpuacct/ray/cpu.stat").write_text("nr_periods 60\nnr_throttled 6\nthrottled_time 12000000\n")
    c = check_cfs_throttle(proc, cg, Target(77, "pid 77"), frozenset(), before=before, window_s=3.0)
    assert c.status is Status.FAIL and c.data["nr_throttled"] == 1 and "during the probes" in c.reason


def test_a_process_in_another_cgroup_namespace_is_skipped_with_the_reason(tmp_path: Path) -> None:
    proc, cg = v2_node(tmp_path)
    (proc / "4242/cgroup").write_text("0::/elsewhere\n")
    c = check_cfs_throttle(proc, cg, Target(4242, "pid 4242"), frozenset())
    assert c.status is Status.SKIP and "another cgroup namespace" in c.reason


def test_hybrid_hosts_use_the_v1_controller_not_the_empty_unified_tree(tmp_path: Path) -> None:
    proc, cg = v1_node(tmp_path)
    found = find_cgroup(cg, proc_cgroups(proc, 77), "cpu")
    assert (
        found is not None and found.version == 1 and found.dir.resolve() == (cg / "cpu,cpuacct/ray").resolve()
    )


# ---- affinity on fixtures ----
def test_affinity_equal_to_the_cpuset_passes(tmp_path: Path) -> None:
    proc, cg = v2_node(tmp_path)
    c = check_affinity(proc, cg, Target(4242, "pid 4242"), live=False)
    assert c.status is Status.PASS, c


def test_affinity_narrower_than_the_cpuset_fails_naming_both_sets(tmp_path: Path) -> None:
    proc, cg = v2_node(tmp_path, allowed="0-1")
    (cg / POD.lstrip("/") / "cpuset.cpus.effective").write_text("0-1,4-7\n")
    c = check_affinity(proc, cg, Target(4242, "pid 4242"), live=False)
    assert c.status is Status.FAIL
    assert "may run only on 0-1 but its cgroup grants 0-1,4-7 (4-7 unused)" in c.reason
    assert "runc#4858" in c.reason


def test_a_worker_pinned_to_its_own_lease_is_not_an_inheritance_bug(tmp_path: Path) -> None:
    proc, cg = v1_node(tmp_path)
    (proc / "77/status").write_text("Cpus_allowed_list:\t3\n")
    assert check_affinity(proc, cg, Target(77, "pid 77"), live=False).status is Status.FAIL
    c = check_affinity(proc, cg, Target(77, "pid 77", frozenset({3})), live=False)
    assert c.status is Status.PASS and "leased CPUs 3" in " ".join(c.evidence)


def test_a_v1_cpuset_is_read_from_effective_cpus(tmp_path: Path) -> None:
    proc, cg = v1_node(tmp_path, cpuset="0-3")
    c = check_affinity(proc, cg, Target(77, "pid 77"), live=False)
    assert c.status is Status.FAIL and c.data["cpuset"] == "0-3" and c.data["allowed"] == "2-3"


# ---- live: this machine's cgroups ----
CPU_V1 = Path("/sys/fs/cgroup/cpu")
QUOTA_US = 1000
LIVE = (Path("/proc"), Path("/sys/fs/cgroup"))


def _busy(affinity: set[int] | None = None, nice: int | None = None) -> subprocess.Popen[bytes]:
    pin = f"os.sched_setaffinity(0, {affinity!r})\n" if affinity else ""
    if nice is not None:  # where permitted: a loaded host must not starve it below its quota
        pin += f"try:\n    os.setpriority(os.PRIO_PROCESS, 0, {nice})\nexcept OSError:\n    pass\n"
    return subprocess.Popen([sys.executable, "-c", f"import os\n{pin}while True:\n    pass\n"])


@pytest.fixture
def quota_cgroup() -> Iterator[Path]:
    """A v1 cpu cgroup with a 1% quota (the kernel's minimum, 1 ms a 100 ms period), removed afterwards
    (its tasks must be gone first). A busy loop at nice -20 uses it up in every period even on a host
    at load 28, where a 10% quota went unused and the loop was never throttled."""
    if not (CPU_V1 / "cpu.cfs_quota_us").exists():
        pytest.skip(f"no cgroup v1 cpu controller at {CPU_V1} with CFS bandwidth on this machine")
    d = CPU_V1 / f"lowtail-test-{uuid.uuid4().hex[:8]}"
    try:
        d.mkdir()
    except OSError as e:
        pytest.skip(f"cannot create a cgroup under {CPU_V1}: {e}")
    try:
        (d / "cpu.cfs_quota_us").write_text(str(QUOTA_US))
        yield d
    finally:
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                d.rmdir()
                break
            except OSError:
                time.sleep(0.05)


def test_a_busy_loop_under_a_real_cpu_quota_is_caught_throttling(quota_cgroup: Path) -> None:
    p = _busy(nice=-20)
    try:
        target = Target(p.pid, f"busy loop pid {p.pid}")
        (quota_cgroup / "cgroup.procs").write_text(str(p.pid))
        before = cpu_stat_of(*LIVE, target)
        time.sleep(0.6)
        c = check_cfs_throttle(*LIVE, target, frozenset(), before=before, window_s=0.6)
    finally:
        p.kill()
        p.wait()
    assert c.status is Status.FAIL, c
    assert c.data["nr_throttled"] >= 1 and c.data["throttled_ms"] > 0
    assert c.data["quota"][0]["quota_us"] == QUOTA_US


def test_a_quota_cgroup_where_nothing_runs_only_warns(quota_cgroup: Path) -> None:
    p = subprocess.Popen(["sleep", "30"])
    try:
        (quota_cgroup / "cgroup.procs").write_text(str(p.pid))
        c = check_cfs_throttle(*LIVE, Target(p.pid, "sleep"), frozenset())
    finally:
        p.kill()
        p.wait()
    assert c.status is Status.WARN and c.data["nr_throttled"] == 0, c


def test_the_validator_reports_the_throttling_of_a_pid_through_the_cli(
    quota_cgroup: Path, tmp_path: Path
) -> None:
    p = _busy(nice=-20)
    try:
        (quota_cgroup / "cgroup.procs").write_text(str(p.pid))
        out = tmp_path / "r.json"
        cli = [str(Path(sys.executable).parent / "lowtail"), "validate", "--no-progress", "--json", str(out)]
        r = subprocess.run(
            [*cli, "--only", "cfs_throttle,timer", "--samples", "300", "--pid", str(p.pid)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        p.kill()
        p.wait()
    assert r.returncode == 1, r.stdout + r.stderr
    check = {c["name"]: c for c in json.loads(out.read_text())["checks"]}["cfs_throttle"]
    assert check["status"] == "fail" and "during the probes" in check["data"]["window"]
    assert "cfs_throttle" in r.stdout and "FAIL" in r.stdout


def test_a_child_started_with_narrower_affinity_than_its_cpuset_fails() -> None:
    cpus = os.sched_getaffinity(0)
    if len(cpus) < 2:
        pytest.skip("needs two CPUs to start a child on fewer CPUs than its cpuset")
    if not shutil.which("taskset"):
        pytest.skip("taskset (util-linux) is not installed")
    child = subprocess.Popen(["taskset", "-c", str(max(cpus)), "sleep", "30"])
    try:
        deadline = time.monotonic() + 5
        while Path(f"/proc/{child.pid}/comm").read_text().strip() != "sleep" and time.monotonic() < deadline:
            time.sleep(0.01)  # taskset execs sleep once the mask is set
        narrow = check_affinity(*LIVE, Target(child.pid, f"pid {child.pid}"), live=True)
        own = check_affinity(*LIVE, Target(os.getpid(), "pytest"), live=True)
    finally:
        child.kill()
        child.wait()
    if narrow.status is Status.SKIP:
        pytest.skip(f"no cpuset controller here: {narrow.reason}")
    assert narrow.status is Status.FAIL, narrow
    assert narrow.data["allowed"] == str(max(cpus)) and "OCI runtime" in narrow.evidence[-1]
    assert own.status is Status.PASS, own


def test_compare_shows_the_new_checks_before_and_after_a_fix(tmp_path: Path) -> None:
    """A pod with a quota it was throttled by and an inherited affinity, then the same pod fixed."""
    from lowtail.cli.main import main
    from lowtail.validation.compare import compare, load_report, render_table
    from tests.fixtures.machines import MACHINES, write_machine

    reports = {}
    for name, quota, allowed in (("before", "400000 100000", "0-1"), ("after", "max 100000", "4-7")):
        root = tmp_path / name
        stat = (
            "nr_throttled 9\nthrottled_usec 45000" if name == "before" else "nr_throttled 0\nthrottled_usec 0"
        )
        sys_root, proc_root = write_machine(root, MACHINES["epyc_1s_nps1"])
        v2_node(root, quota=quota, stat=stat, allowed=allowed)
        (root / "proc/self").symlink_to("4242")
        reports[name] = root / f"{name}.json"
        main(
            [
                "validate",
                "--sysfs-root",
                str(sys_root),
                "--procfs-root",
                str(proc_root),
                "--only",
                "cfs_throttle,affinity",
                "--cpus",
                "4-7",
                "--no-progress",
                "--json",
                str(reports[name]),
            ]
        )
    cmp = compare(load_report(reports["before"]), load_report(reports["after"]))
    rows = {r["name"]: (r["before"]["status"], r["after"]["status"]) for r in cmp["checks"]}
    assert rows == {"affinity": ("fail", "pass"), "cfs_throttle": ("fail", "pass")}
    table = render_table(cmp)
    assert "cfs_throttle" in table and "9 throttled, 45.000 ms" in table
