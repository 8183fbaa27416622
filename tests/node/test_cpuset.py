"""Where leases may run: the cgroup's cpuset (v1 and v2), never the daemon's own affinity mask.

Two kinds of evidence. Fixture trees (``/proc/<pid>/cgroup``, ``mountinfo`` and the cpuset files, laid
out as the kernel does, cgroup-v1.rst / cgroup-v2.rst "cpuset") for shapes this machine is not: a
KubeRay pod on a 2 x EPYC 9634 host, cgroup v2, a cgroup namespace. Real cgroups and real processes for
the rule that matters under ``lowtail-ray.service``: a process born with a narrow affinity mask (systemd's
``CPUAffinity=``) may move a child onto any CPU of its cpuset, and onto none outside it (cpuset(7):
``sched_setaffinity`` masks are filtered to the cpuset's CPUs, EINVAL when nothing is left).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

from lowtail.actors.allocator import AllocatorConfig, build_allocator
from lowtail.node import cpulist
from lowtail.node.cpuset import cgroup_cpuset
from lowtail.node.lease import PlanNotFound, PoolMismatch, locate_plan
from lowtail.node.plan import make_plan
from lowtail.node.topology import read_topology
from tests.fixtures.machines import MACHINES, write_machine
from tests.fixtures.plans import tiny_plan

V1_CPUSET = Path("/sys/fs/cgroup/cpuset")
REPO = Path(__file__).resolve().parents[2]


def write_cgroup_tree(root: Path, version: str, path: str, files: dict[str, str], ns_root: str = "/") -> Path:
    """A process's view of its cgroups: ``proc/cgroup``, ``proc/mountinfo`` and the files under ``fs``.

    ``files`` maps paths relative to the hierarchy's mount point to their contents; ``ns_root`` is the
    mount's root field (a cgroup namespace or a bind mount of a subtree shows paths below it).
    """
    proc, fs = root / "proc", root / "fs"
    proc.mkdir(parents=True)
    if version == "v1":
        (proc / "cgroup").write_text(f"4:memory:/x\n3:cpuset,cpu:{path}\n0::/\n")
        mount = "35 25 0:30 {root} /sys/fs/cgroup/cpuset rw,nosuid - cgroup cgroup rw,cpu,cpuset\n"
    else:
        (proc / "cgroup").write_text(f"0::{path}\n")
        mount = "35 25 0:30 {root} /sys/fs/cgroup rw,nosuid shared:9 - cgroup2 cgroup2 rw,nsdelegate\n"
    (proc / "mountinfo").write_text(
        "22 1 8:1 / / rw,relatime - ext4 /dev/sda1 rw\n" + mount.format(root=ns_root)
    )
    base = fs / ("sys/fs/cgroup/cpuset" if version == "v1" else "sys/fs/cgroup")
    for rel, text in files.items():
        f = base / rel.lstrip("/")
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text)
    return root


def test_cgroup_v1_cpuset_is_the_process_cgroups_effective_cpus(tmp_path: Path) -> None:
    pod = "/kubepods/pod1234/cri-abc"
    write_cgroup_tree(
        tmp_path,
        "v1",
        pod,
        {
            "cpuset.effective_cpus": "0-167\n",
            f"{pod}/cpuset.cpus": "2-9\n",
            f"{pod}/cpuset.effective_cpus": "2-5\n",
        },
    )
    got = cgroup_cpuset(tmp_path / "proc", tmp_path / "fs")
    assert got is not None
    assert got.cpus == cpulist.parse("2-5")  # effective, not the configured 2-9
    assert got.source.endswith(f"{pod}/cpuset.effective_cpus")


def test_cgroup_v2_cpuset_comes_from_the_nearest_ancestor_with_the_controller(tmp_path: Path) -> None:
    # cpuset.cpus.effective exists only where the cpuset controller is enabled (cgroup-v2.rst).
    write_cgroup_tree(
        tmp_path,
        "v2",
        "/system.slice/lowtail-ray.service",
        {
            "cpuset.cpus.effective": "0-7\n",
            "system.slice/cpuset.cpus.effective": "0-3\n",
            "system.slice/lowtail-ray.service/cgroup.procs": "1\n",
        },
    )
    got = cgroup_cpuset(tmp_path / "proc", tmp_path / "fs")
    assert got is not None
    assert got.cpus == cpulist.parse("0-3")
    assert got.source.endswith("system.slice/cpuset.cpus.effective")


def test_cgroup_namespace_paths_are_relative_to_the_mount_root(tmp_path: Path) -> None:
    # Inside a pod's cgroup namespace /proc/self/cgroup says "/" and the mount's root is "/"; with a
    # bind-mounted subtree the root field names it and the path below it is what counts.
    write_cgroup_tree(
        tmp_path,
        "v2",
        "/kubepods/pod9/c1",
        {"cpuset.cpus.effective": "2-5\n", "c1/cpuset.cpus.effective": "3\n"},
        ns_root="/kubepods/pod9",
    )
    got = cgroup_cpuset(tmp_path / "proc", tmp_path / "fs")
    assert got is not None and got.cpus == frozenset({3})


def test_no_cpuset_hierarchy_means_no_restriction_known(tmp_path: Path) -> None:
    write_cgroup_tree(tmp_path, "v1", "/a", {})
    (tmp_path / "proc/mountinfo").write_text("22 1 8:1 / / rw - ext4 /dev/sda1 rw\n")
    assert cgroup_cpuset(tmp_path / "proc", tmp_path / "fs") is None


def test_this_process_cpuset_is_what_the_kernel_reports() -> None:
    got = cgroup_cpuset()
    assert got is not None, "this machine mounts a cpuset hierarchy (v1 or v2)"
    assert got.cpus == cpulist.parse(Path(got.source).read_text())
    assert frozenset(os.sched_getaffinity(0)) <= got.cpus


# --- a pod on a 2 x EPYC 9634 host --------------------------------------------------------------------


@pytest.fixture
def epyc_host(tmp_path: Path) -> Path:
    write_machine(tmp_path / "host", MACHINES["epyc9634_2s"])
    return tmp_path / "host"


def host_plan_file(host: Path, housekeeping: str, out: Path) -> Path:
    topo = read_topology(host / "sys", host / "proc")
    plan = make_plan(topo, housekeeping)
    out.write_text(json.dumps(plan.to_dict()))
    return out


def pod_tree(root: Path, cpuset: str) -> Path:
    return write_cgroup_tree(root, "v2", "/", {"cpuset.cpus.effective": cpuset + "\n"})


def test_pod_leases_the_host_plans_isolated_cpus_within_its_cpuset(
    epyc_host: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Non-default housekeeping: 2 CPUs per socket, so 2-5 are isolated on the host. A plan computed
    # inside the pod ("auto": a whole L3 group of 7 cores per socket) would call 2-5 housekeeping.
    plan = host_plan_file(epyc_host, "0-1,84-85", tmp_path / "plan.json")
    monkeypatch.setenv("LOWTAIL_PLAN", str(plan))
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    pod = pod_tree(tmp_path / "pod", "2-5")
    cfg = AllocatorConfig(state_dir=str(tmp_path / "state"))
    alloc = build_allocator("n1", cfg, proc_root=str(pod / "proc"), fs_root=str(pod / "fs"))
    assert alloc.pool == cpulist.parse("2-5")
    assert alloc.acquire("infer:h:0").cpu in cpulist.parse("2-5")


def test_pod_whose_cpuset_misses_the_plans_isolated_cpus_fails_naming_both_sets(
    epyc_host: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    plan = host_plan_file(epyc_host, "auto", tmp_path / "plan.json")  # housekeeping 0-6,84-90
    monkeypatch.setenv("LOWTAIL_PLAN", str(plan))
    pod = pod_tree(tmp_path / "pod", "2-5")
    cfg = AllocatorConfig(state_dir=str(tmp_path / "state"))
    with pytest.raises(PoolMismatch) as e:
        build_allocator("n1", cfg, proc_root=str(pod / "proc"), fs_root=str(pod / "fs"))
    msg = str(e.value)
    assert "7-83,91-167" in msg  # the plan's isolated CPUs
    assert "2-5" in msg and "cpuset.cpus.effective" in msg  # the pod's cpuset and where it was read
    assert str(plan) in msg


def test_pod_without_the_host_plan_refuses_to_compute_its_own(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("LOWTAIL_PLAN", raising=False)
    monkeypatch.setenv("KUBERNETES_SERVICE_HOST", "10.0.0.1")
    monkeypatch.setattr("lowtail.node.lease.DEFAULT_PLAN_PATH", tmp_path / "absent.json")
    with pytest.raises(PlanNotFound, match="LOWTAIL_PLAN"):
        locate_plan()


# --- real processes under a narrow affinity mask in a wider cpuset ----------------------------------------

# The pinned worker's first step (lowtail.serve.pinning), in a process of its own as the worker is.
PIN = (
    "import json, os, sys\n"
    "from lowtail.serve.pinning import pin_thread_to_cpu\n"
    "pin_thread_to_cpu(int(sys.argv[1]))\n"
    "ran_on = int(open('/proc/self/stat').read().rsplit(')', 1)[1].split()[36])\n"
    "print(json.dumps({'affinity': sorted(os.sched_getaffinity(0)), 'ran_on': ran_on}))\n"
)

CHILD = textwrap.dedent(
    """
    import json, os, subprocess, sys
    from lowtail.actors.allocator import AllocatorConfig, build_allocator
    from lowtail.node.lease import LeaseError
    from lowtail.node.cpuset import cgroup_cpuset

    plan, state, pin = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
    out = {"mask": sorted(os.sched_getaffinity(0)), "cpuset": sorted(cgroup_cpuset().cpus)}
    try:
        alloc = build_allocator("n", AllocatorConfig(state_dir=state, plan=plan))
        lease = alloc.acquire("infer:h:0", pid=os.getpid())
        out["lease"] = lease.cpu
        worker = subprocess.run([sys.executable, "-c", pin, str(lease.cpu)], capture_output=True, text=True)
        out["worker"] = json.loads(worker.stdout) if worker.returncode == 0 else worker.stderr[-500:]
    except LeaseError as e:
        out["lease_error"] = f"{type(e).__name__}: {e}"
    print(json.dumps(out))
    """
)


@pytest.fixture
def v1_cpuset_cgroup() -> Iterator[Path]:
    """A real cgroup-v1 cpuset of its own (removed afterwards); tests set its CPUs."""
    if not os.access(V1_CPUSET, os.W_OK) or not (V1_CPUSET / "cpuset.cpus").exists():
        pytest.skip("needs a writable cgroup-v1 cpuset hierarchy at /sys/fs/cgroup/cpuset (root)")
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("needs 2 CPUs: one for the narrow mask, one to pin onto")
    cg = V1_CPUSET / f"lowtail-test-{os.getpid()}"
    cg.mkdir()
    (cg / "cpuset.mems").write_text((V1_CPUSET / "cpuset.mems").read_text())
    try:
        yield cg
    finally:
        cg.rmdir()  # empty again: the child has exited


def run_confined(cg: Path, mask: set[int], plan: dict[str, object], state: Path) -> dict[str, object]:
    """Run CHILD as a daemon under ``CPUAffinity=`` would: born with ``mask``, a member of cgroup ``cg``."""

    def enter() -> None:
        (cg / "tasks").write_text(str(os.getpid()))
        os.sched_setaffinity(0, mask)

    env = {**os.environ, "PYTHONPATH": f"{REPO / 'python'}:{REPO}"}
    done = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(plan), str(state), PIN],
        preexec_fn=enter,
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_daemon_confined_to_housekeeping_leases_and_pins_its_worker_on_an_isolated_cpu(
    v1_cpuset_cgroup: Path, tmp_path: Path
) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    hk, iso = cpus[0], cpus[1]
    (v1_cpuset_cgroup / "cpuset.cpus").write_text(f"{hk},{iso}")
    plan = tiny_plan(isolated=str(iso), housekeeping=str(hk), l3=(f"{hk},{iso}",)).to_dict()
    out = run_confined(v1_cpuset_cgroup, {hk}, plan, tmp_path / "state")
    assert out["mask"] == [hk]
    assert out["cpuset"] == [hk, iso]
    assert out.get("lease") == iso, out
    assert out["worker"] == {"affinity": [iso], "ran_on": iso}


def test_cpuset_without_isolated_cpus_fails_at_start_and_the_kernel_refuses_the_pin(
    v1_cpuset_cgroup: Path, tmp_path: Path
) -> None:
    cpus = sorted(os.sched_getaffinity(0))
    hk, iso = cpus[0], cpus[1]
    (v1_cpuset_cgroup / "cpuset.cpus").write_text(str(hk))
    plan = tiny_plan(isolated=str(iso), housekeeping=str(hk), l3=(f"{hk},{iso}",)).to_dict()
    out = run_confined(v1_cpuset_cgroup, {hk}, plan, tmp_path / "state")
    assert out["cpuset"] == [hk]
    err = str(out["lease_error"])
    assert err.startswith("PoolMismatch") and f"CPUs {iso} " in err and f"allowed here {hk} " in err
    # The same rule in the kernel: a thread cannot be pinned outside its cpuset.
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through its exit status
        code = 3
        try:
            (v1_cpuset_cgroup / "tasks").write_text(str(os.getpid()))
            os.sched_setaffinity(0, {iso})
        except OSError as e:
            code = 0 if e.errno == 22 else 4
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "pinning outside the cpuset must fail with EINVAL"
