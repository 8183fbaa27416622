"""Where the inference process really runs: its cgroup's CFS quota and throttling, and its affinity.

Both checks look at one target process: ``--pid``, a lease owner named with ``--actor``, or (the default)
the validator itself, so ``lowtail validate`` run inside the inference pod or under the runtime's unit
checks exactly that place. Everything is read under configurable roots so fixture trees stand in for
cgroup v1, v2 and hybrid machines:

    {proc}/PID/cgroup              "ID:CONTROLLERS:PATH" lines (v2: "0::PATH")
    {proc}/PID/status              Cpus_allowed_list
    {cgroup}/[CONTROLLER/]PATH/    v2: cpu.max, cpu.stat (throttled_usec), cpuset.cpus.effective
                                   v1: cpu.cfs_quota_us, cpu.cfs_period_us, cpu.stat (throttled_time, ns),
                                       cpuset.effective_cpus

A v1 hierarchy is mounted per controller (``cpu``, or ``cpu,cpuacct`` with ``cpu`` a symlink); v2 is
either the whole of {cgroup} or, on a hybrid host, {cgroup}/unified. Source of the file formats:
Documentation/admin-guide/cgroup-v2.rst ("cpu.max", "cpu.stat") and
Documentation/scheduler/sched-bwc.rst (v1 "cpu.cfs_quota_us", "throttled_time").
"""

from __future__ import annotations

import os
import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowtail.errors import LowtailError
from lowtail.node import cpulist
from lowtail.validation.check import Check, Status, skip

# What an operator can do about a quota on an exclusive-CPU container, by Kubernetes version: from 1.33
# the kubelet leaves the quota off for containers with exclusive CPUs (feature gate
# DisableCPUQuotaWithExclusiveCPUs, kubernetes PR #127525); older versions offer only cpuCFSQuota: false
# (every pod loses its limit) or the CRI-O runtime-class annotation cpu-quota.crio.io: "disable".
QUOTA_REMEDY = (
    "Kubernetes >= 1.33 removes the quota of exclusive-CPU containers (feature gate "
    "DisableCPUQuotaWithExclusiveCPUs); older clusters: CRI-O runtime class with the annotation "
    'cpu-quota.crio.io: "disable", or kubelet cpuCFSQuota: false (drops every pod\'s CPU limit)'
)


class TargetError(LowtailError, ValueError):
    """The target process cannot be read (gone, or another pid namespace)."""


@dataclass(frozen=True)
class Cgroup:
    """One controller's directory for a process, and the hierarchy it belongs to."""

    version: int  # 1 or 2
    path: str  # the cgroup path as /proc/PID/cgroup names it
    dir: Path  # where its files are under the cgroup root
    mount: Path  # the hierarchy's root (ancestors stop here)

    def ancestors(self) -> list[Path]:
        """This directory and its parents up to the hierarchy's root, innermost first."""
        out = [self.dir]
        while out[-1] != self.mount and self.mount in out[-1].parents:
            out.append(out[-1].parent)
        return out


@dataclass(frozen=True)
class CpuStat:
    nr_periods: int
    nr_throttled: int
    throttled_us: float


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (FileNotFoundError, PermissionError, NotADirectoryError, ProcessLookupError):
        return None


def proc_cgroups(proc_root: Path, pid: int | str) -> dict[str, str]:
    """``{controller: path}`` from /proc/PID/cgroup; the v2 line is under the key ``""``."""
    text = _read(proc_root / str(pid) / "cgroup")
    if text is None:
        raise TargetError(f"cannot read {proc_root / str(pid) / 'cgroup'}: no such process here")
    out: dict[str, str] = {}
    for line in text.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if not controllers:
            out[""] = path
        for c in controllers.split(","):
            if c:
                out[c] = path
    return out


def find_cgroup(cgroup_root: Path, cgroups: dict[str, str], controller: str) -> Cgroup | None:
    """The directory holding ``controller``'s files for a process, v1 first (where it is mounted)."""
    if controller in cgroups:
        for name in sorted(os.listdir(cgroup_root)) if cgroup_root.is_dir() else ():
            if controller in name.split(","):
                mount = cgroup_root / name
                return Cgroup(1, cgroups[controller], mount / cgroups[controller].lstrip("/"), mount)
    if "" in cgroups:
        for mount in (cgroup_root, cgroup_root / "unified"):
            if (mount / "cgroup.controllers").exists():
                return Cgroup(2, cgroups[""], mount / cgroups[""].lstrip("/"), mount)
    return None


def read_quota(cg: Cgroup) -> list[tuple[Path, int, int]]:
    """``(dir, quota_us, period_us)`` for every level from ``cg`` up that sets a CFS quota."""
    out = []
    for d in cg.ancestors():
        if cg.version == 2:
            text = _read(d / "cpu.max")
            if text is None or text.split()[0] == "max":
                continue
            quota, _, period = text.partition(" ")
            out.append((d, int(quota), int(period or 100_000)))
        else:
            q = _read(d / "cpu.cfs_quota_us")
            if q is None or int(q) < 0:
                continue
            out.append((d, int(q), int(_read(d / "cpu.cfs_period_us") or 100_000)))
    return out


def read_cpu_stat(cg: Cgroup) -> CpuStat | None:
    text = _read(cg.dir / "cpu.stat")
    if text is None:
        return None
    kv = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            kv[key] = int(value)
    throttled_us = kv["throttled_usec"] if "throttled_usec" in kv else kv.get("throttled_time", 0) / 1000
    return CpuStat(kv.get("nr_periods", 0), kv.get("nr_throttled", 0), float(throttled_us))


def allowed_cpus(proc_root: Path, pid: int | str) -> frozenset[int] | None:
    text = _read(proc_root / str(pid) / "status")
    for line in (text or "").splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return cpulist.parse(line.split(":", 1)[1].strip())
    return None


def cpuset_effective(cg: Cgroup) -> tuple[Path, frozenset[int]] | None:
    """The cpuset in effect: the innermost level that has one (v2 lets a level leave it empty)."""
    names = ("cpuset.cpus.effective",) if cg.version == 2 else ("cpuset.effective_cpus", "cpuset.cpus")
    for d in cg.ancestors():
        for name in names:
            text = _read(d / name)
            if text:
                return d / name, cpulist.parse(text)
    return None


def runtime_version() -> str:
    """The OCI runtime on this node and its version, when one is on PATH (runc#4858 / crun#1315 fixed the
    inherited-affinity bug)."""
    found = []
    for tool in ("runc", "crun"):
        exe = shutil.which(tool)
        if exe is None:
            continue
        try:
            out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10, check=False)
        except (OSError, subprocess.TimeoutExpired):
            continue
        first = (out.stdout or out.stderr).strip().splitlines()
        found.append(first[0] if first else tool)
    return "; ".join(found)


@dataclass(frozen=True)
class Target:
    """The process the cgroup checks look at, and why it was chosen."""

    pid: int | str  # "self" reads the validator through /proc/self
    described: str
    leased_cpus: frozenset[int] = frozenset()  # CPUs a lease gives it: its own pinning is not inherited


def _cpu_cgroup(proc_root: Path, cgroup_root: Path, target: Target, name: str) -> Cgroup | Check:
    try:
        cgroups = proc_cgroups(proc_root, target.pid)
    except TargetError as e:
        return skip(name, f"{target.described}: {e}")
    controller = "cpu" if name == "cfs_throttle" else "cpuset"
    cg = find_cgroup(cgroup_root, cgroups, controller)
    if cg is None or not cg.dir.is_dir():
        where = f" ({cg.dir} is missing: another cgroup namespace?)" if cg else ""
        return skip(name, f"no {controller} controller for {target.described} under {cgroup_root}{where}")
    return cg


def _throttled_since(stat: CpuStat, before: CpuStat | None) -> CpuStat:
    """The counters over the window: since ``before``, or the cgroup's whole life without it."""
    if before is None:
        return stat
    return CpuStat(
        stat.nr_periods - before.nr_periods,
        stat.nr_throttled - before.nr_throttled,
        stat.throttled_us - before.throttled_us,
    )


def _throttle_problems(
    seen: CpuStat,
    span: str,
    quotas: list[tuple[Path, int, int]],
    allowed: frozenset[int],
    exclusive: frozenset[int],
) -> list[str]:
    """Any throttling in the window, and a quota over CPUs that are exclusive."""
    problems = []
    if seen.nr_throttled > 0:
        problems.append(f"throttled {seen.nr_throttled} times ({seen.throttled_us / 1000:.3f} ms) {span}")
    if quotas and bool(allowed) and allowed <= exclusive:
        problems.append(
            f"a CFS quota ({quotas[0][1]}/{quotas[0][2]} us) on CPUs {cpulist.format(allowed)} that are "
            f"exclusive: {QUOTA_REMEDY}"
        )
    return problems


def _throttle_data(
    cg: Cgroup, quotas: list[tuple[Path, int, int]], seen: CpuStat, span: str
) -> dict[str, Any]:
    return {
        "cgroup": cg.path,
        "version": cg.version,
        "quota": [{"dir": str(d), "quota_us": q, "period_us": p} for d, q, p in quotas],
        "nr_throttled": seen.nr_throttled,
        "throttled_ms": round(seen.throttled_us / 1000, 3),
        "nr_periods": seen.nr_periods,
        "window": span,
    }


def check_cfs_throttle(
    proc_root: Path,
    cgroup_root: Path,
    target: Target,
    exclusive: frozenset[int],
    *,
    before: CpuStat | None = None,
    window_s: float | None = None,
) -> Check:
    """Fail on a CFS quota over exclusive CPUs, or on any throttling in the window.

    ``before`` is cpu.stat at the start of the probes; without it (a fixture, or no probes ran) the
    window is the cgroup's whole life, and any throttling in it is evidence enough.
    """
    name = "cfs_throttle"
    cg = _cpu_cgroup(proc_root, cgroup_root, target, name)
    if isinstance(cg, Check):
        return cg
    quotas = read_quota(cg)
    stat = read_cpu_stat(cg)
    allowed = allowed_cpus(proc_root, target.pid) or frozenset()
    evidence = [f"target: {target.described}", f"cgroup v{cg.version} {cg.path} ({cg.dir})"]
    for d, q, p in quotas:
        evidence.append(f"quota at {d}: {q} us per {p} us period ({q / p:.2f} CPUs)")
    if not quotas:
        evidence.append("no CFS quota on this cgroup or its parents")
    if stat is None:
        return skip(name, f"{target.described}: cannot read {cg.dir / 'cpu.stat'}")
    seen = _throttled_since(stat, before)
    span = f"during the probes ({window_s:.1f} s)" if before is not None and window_s else "since creation"
    evidence.append(
        f"{cg.dir / 'cpu.stat'}: {seen.nr_throttled} of {seen.nr_periods} periods throttled, "
        f"{seen.throttled_us / 1000:.3f} ms throttled {span}"
    )
    data = _throttle_data(cg, quotas, seen, span)
    threshold = "no throttled period; no CFS quota on a cgroup whose CPUs are exclusive"
    value = f"{seen.nr_throttled} throttled, {seen.throttled_us / 1000:.3f} ms"
    if problems := _throttle_problems(seen, span, quotas, allowed, exclusive):
        return Check(name, Status.FAIL, value, threshold, evidence, "; ".join(problems), data=data)
    if quotas:
        return Check(
            name,
            Status.WARN,
            value,
            threshold,
            evidence,
            f"a CFS quota ({quotas[0][1]}/{quotas[0][2]} us) applies, not yet throttled; a burst above it "
            f"stalls the process until the next period. {QUOTA_REMEDY}",
            data=data,
        )
    return Check(name, Status.PASS, value, threshold, evidence, data=data)


def cpu_stat_of(proc_root: Path, cgroup_root: Path, target: Target) -> CpuStat | None:
    """cpu.stat of the target's cgroup now (taken before the probes, compared after)."""
    cg = _cpu_cgroup(proc_root, cgroup_root, target, "cfs_throttle")
    return None if isinstance(cg, Check) else read_cpu_stat(cg)


def check_affinity(proc_root: Path, cgroup_root: Path, target: Target, live: bool) -> Check:
    """Fail when the process may run on fewer CPUs than its cpuset grants (inherited CPUAffinity=)."""
    name = "affinity"
    cg = _cpu_cgroup(proc_root, cgroup_root, target, name)
    if isinstance(cg, Check):
        return cg
    allowed = allowed_cpus(proc_root, target.pid)
    if allowed is None:
        return skip(name, f"cannot read Cpus_allowed_list of {target.described}")
    found = cpuset_effective(cg)
    if found is None:
        return skip(name, f"no cpuset file for {target.described} under {cg.dir}")
    path, cpuset = found
    evidence = [
        f"target: {target.described}",
        f"{proc_root / str(target.pid) / 'status'}: Cpus_allowed_list {cpulist.format(allowed)}",
        f"{path}: {cpulist.format(cpuset)}",
    ]
    data = {"allowed": cpulist.format(allowed), "cpuset": cpulist.format(cpuset), "cpuset_file": str(path)}
    threshold = "Cpus_allowed_list == the cgroup's effective cpuset (or the CPUs the process leased)"
    value = f"{len(allowed)} of {len(cpuset)} CPUs"
    if allowed >= cpuset:
        return Check(name, Status.PASS, value, threshold, evidence, data=data)
    if target.leased_cpus and allowed <= target.leased_cpus:
        evidence.append(f"pinned to its leased CPUs {cpulist.format(target.leased_cpus)} on purpose")
        return Check(name, Status.PASS, value, threshold, evidence, data=data)
    runtime = runtime_version() if live else ""
    evidence.append(f"OCI runtime: {runtime or 'not found on PATH'}")
    data["runtime"] = runtime
    missing = cpuset - allowed
    return Check(
        name,
        Status.FAIL,
        value,
        threshold,
        evidence,
        f"{target.described} may run only on {cpulist.format(allowed)} but its cgroup grants "
        f"{cpulist.format(cpuset)} ({cpulist.format(missing)} unused): an affinity inherited from systemd "
        "CPUAffinity= through an OCI runtime without the fix (runc#4858, backports #4865/#4869; crun#1315)",
        data=data,
    )
