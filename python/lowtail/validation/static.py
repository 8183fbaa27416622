"""Static checks: is the node configured the way the plan says, and can it be trusted at all.

Everything is read under configurable roots, so a fixture tree can stand in for any machine:

    {proc}/cmdline                                       kernel arguments in effect
    {sys}/devices/system/cpu/{isolated,nohz_full}        what the running kernel isolated
    {proc}/sys/kernel/sched_rt_{runtime,period}_us       the RT budget (500000 throttles; default 950000)
    {proc}/sys/kernel/numa_balancing                     automatic NUMA balancing
    {proc}/irq/N/{effective_affinity_list,smp_affinity_list}
    {sys}/devices/system/cpu/cpuN/cpufreq/scaling_governor
    {sys}/kernel/mm/transparent_hugepage/enabled
    {proc}/stat                                          steal time per CPU
    kernel config: /boot/config-$(uname -r), else {proc}/config.gz   CONFIG_RT_GROUP_SCHED
    /dev/shm (statvfs), kubelet config.yaml and cpu_manager_state   when present

Each check returns a ``Check``; none raises for a missing file (a missing file is evidence, or a skip).
"""

from __future__ import annotations

import gzip
import json
import os
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lowtail.node import cpulist
from lowtail.node.plan import Plan
from lowtail.node.topology import Topology
from lowtail.validation.cgroup import Target, check_affinity
from lowtail.validation.check import Check, Status, skip
from lowtail.validation.firmware import check_cstates, check_firmware
from lowtail.validation.threads import LEASE_STATE

# The kernel default: 950000 of 1000000 us.
RT_RUNTIME_DEFAULT_SHARE = 0.95
# QueueConfig's defaults (lowtail.shm.control): 16 lanes x 16 slots x (36 KiB request + 12 KiB response).
SHM_BYTES_PER_WORKER = 16 * 16 * (36864 + 12288)


@dataclass(frozen=True)
class Sources:
    """Where the static checks read. Defaults are the running machine."""

    sys_root: Path = Path("/sys")
    proc_root: Path = Path("/proc")
    kernel_config: Path | None = None  # None: /boot/config-<release>, then {proc}/config.gz
    shm_path: Path = Path("/dev/shm")
    kubelet_config: Path = Path("/var/lib/kubelet/config.yaml")
    kubelet_state: Path = Path("/var/lib/kubelet/cpu_manager_state")
    kernel_release: str = field(default_factory=lambda: os.uname().release)
    lease_state: Path = LEASE_STATE  # the lease allocator's state file (read only)

    @property
    def cgroup_root(self) -> Path:
        return self.sys_root / "fs/cgroup"

    @property
    def live(self) -> bool:
        """True when the roots are this machine's own /sys and /proc (probes and syscalls make sense)."""
        return self.sys_root.resolve() == Path("/sys") and self.proc_root.resolve() == Path("/proc")


@dataclass(frozen=True)
class Context:
    src: Sources
    topo: Topology
    plan: Plan
    cpus: frozenset[int]  # the CPUs probes run on
    allow_virtual: bool = False
    shm_bytes: int = 0  # what the runtime needs in /dev/shm; 0: one default queue per isolated CPU
    # The process the cgroup checks look at (None: the validator itself) and the BIOS layout expected.
    target: Target | None = None
    expected_hardware: Mapping[str, Any] = field(default_factory=dict)

    @property
    def cgroup_target(self) -> Target:
        if self.target is not None:
            return self.target
        pid: int | str = os.getpid() if self.src.live else "self"
        return Target(pid, f"the validator itself (pid {pid})")


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except (FileNotFoundError, PermissionError, NotADirectoryError):
        return None


def _cpus(text: str | None) -> frozenset[int]:
    return frozenset() if text in (None, "", "(null)") else cpulist.parse(text or "")


# ---- topology / virtualization -------------------------------------------------------------------
def check_topology(ctx: Context) -> Check:
    topo = ctx.topo
    evidence = [
        f"{len(topo.cpus)} CPUs, {len(topo.sockets)} sockets, {len(topo.numa_nodes)} NUMA nodes, "
        f"{len(topo.l3_groups)} L3 groups, {topo.threads_per_core} threads/core ({topo.model_name})"
    ]
    evidence += [f"{f.code}{' (deceptive)' if f.deceptive else ''}: {f.detail}" for f in topo.findings]
    if not topo.findings:
        return Check("topology", Status.PASS, "bare metal", "no sign of virtualization", evidence)
    value = "deceptive VM topology" if topo.deceptive else "virtual machine"
    if ctx.allow_virtual:
        return Check(
            "topology",
            Status.WARN,
            value,
            "no sign of virtualization (allow-virtual: a VM warns)",
            evidence,
            reason="running in a VM, allowed by --allow-virtual: hypervisor preemption is invisible to "
            "the guest and its placement hints are not real",
        )
    return Check(
        "topology",
        Status.FAIL,
        value,
        "no sign of virtualization (--allow-virtual turns this into a warning)",
        evidence,
        reason="a VM: vCPU preemption by the hypervisor is counted as CPU time and the guest's "
        "core/L3/NUMA placement is not real",
    )


# ---- kernel arguments ----------------------------------------------------------------------------
def _cpulist_valued(value: str) -> tuple[str, frozenset[int]] | None:
    """Split 'managed_irq,1-3' into ('managed_irq', {1,2,3}) so equal CPU sets compare equal."""
    flags = []
    cpus: set[int] = set()
    for part in value.split(","):
        if part and (part[0].isdigit()):
            try:
                cpus |= cpulist.parse(part)
            except cpulist.CpuListError:
                return None
        else:
            flags.append(part)
    return ",".join(sorted(flags)), frozenset(cpus)


def _arg_matches(want: str, have: dict[str, str]) -> bool:
    key, sep, value = want.partition("=")
    if key not in have:
        return False
    if not sep:
        return True
    got = have[key]
    if got == value:
        return True
    a, b = _cpulist_valued(value), _cpulist_valued(got)
    return a is not None and a == b


def parse_cmdline(text: str) -> dict[str, str]:
    """Kernel arguments as key -> value (the last occurrence wins, as for most kernel parameters).

    Stops at a bare ``--``: what follows belongs to init, not to the kernel.
    """
    out: dict[str, str] = {}
    for token in text.split():
        if token == "--":
            break
        key, _, value = token.partition("=")
        out[key] = value
    return out


def check_kernel_args(ctx: Context) -> Check:
    path = ctx.src.proc_root / "cmdline"
    text = _read(path)
    if text is None:
        return skip("kernel_args", f"cannot read {path}")
    have = parse_cmdline(text)
    missing = [arg for arg in ctx.plan.kernel_args if not _arg_matches(arg, have)]
    evidence = [f"{path}: {text}"]
    if not missing:
        return Check(
            "kernel_args",
            Status.PASS,
            f"{len(ctx.plan.kernel_args)} of {len(ctx.plan.kernel_args)} in effect",
            "every argument of the plan",
            evidence,
        )
    for arg in missing:
        key = arg.partition("=")[0]
        evidence.append(f"missing {arg}" + (f" (in effect: {key}={have[key]})" if key in have else ""))
    return Check(
        "kernel_args",
        Status.FAIL,
        f"{len(ctx.plan.kernel_args) - len(missing)} of {len(ctx.plan.kernel_args)} in effect",
        "every argument of the plan",
        evidence,
        reason=f"{len(missing)} plan arguments not on the running kernel's command line (reboot pending, "
        "or the bootloader drop-in was not applied)",
        data={"missing": missing},
    )


def check_isolation(ctx: Context) -> Check:
    cpu_root = ctx.src.sys_root / "devices/system/cpu"
    iso = _cpus(_read(cpu_root / "isolated"))
    nohz = _cpus(_read(cpu_root / "nohz_full"))
    want = ctx.plan.isolated
    evidence = [
        f"plan isolated: {cpulist.format(want)}",
        f"{cpu_root / 'isolated'}: {cpulist.format(iso) or '(none)'}",
        f"{cpu_root / 'nohz_full'}: {cpulist.format(nohz) or '(none)'}",
    ]
    problems = []
    if iso != want:
        problems.append(f"isolated is {cpulist.format(iso) or 'empty'}, plan says {cpulist.format(want)}")
    if nohz != want:
        problems.append(f"nohz_full is {cpulist.format(nohz) or 'empty'}, plan says {cpulist.format(want)}")
    value = {"isolated": cpulist.format(iso), "nohz_full": cpulist.format(nohz)}
    if not problems:
        return Check("isolation", Status.PASS, value, "isolated == nohz_full == plan", evidence)
    return Check(
        "isolation", Status.FAIL, value, "isolated == nohz_full == plan", evidence, reason="; ".join(problems)
    )


# ---- scheduler -----------------------------------------------------------------------------------
def check_rt_budget(ctx: Context) -> Check:
    base = ctx.src.proc_root / "sys/kernel"
    runtime_s, period_s = _read(base / "sched_rt_runtime_us"), _read(base / "sched_rt_period_us")
    if runtime_s is None or period_s is None:
        return skip("rt_budget", f"cannot read {base}/sched_rt_runtime_us and sched_rt_period_us")
    try:
        runtime, period = int(runtime_s), int(period_s)
    except ValueError:
        return Check(
            "rt_budget",
            Status.FAIL,
            f"{runtime_s}/{period_s}",
            "",
            [f"unparsable values in {base}"],
            reason=f"sched_rt_runtime_us={runtime_s!r}, sched_rt_period_us={period_s!r}: expected integers",
        )
    threshold = f"sched_rt_runtime_us = -1 or >= {RT_RUNTIME_DEFAULT_SHARE:.0%} of the period"
    evidence = [f"sched_rt_runtime_us={runtime}", f"sched_rt_period_us={period}"]
    fair = _fair_server(ctx.src.sys_root)
    if fair:
        evidence.append(fair)
    if runtime == -1:
        evidence.append(
            "unlimited RT budget (tuned realtime): run stalld so starved kernel threads still run"
        )
        return Check("rt_budget", Status.PASS, "unlimited", threshold, evidence)
    share = runtime / period if period > 0 else 0.0
    value = f"{runtime}/{period} ({share:.0%})"
    if share >= RT_RUNTIME_DEFAULT_SHARE:
        return Check("rt_budget", Status.PASS, value, threshold, evidence)
    return Check(
        "rt_budget",
        Status.FAIL,
        value,
        threshold,
        evidence,
        reason=f"SCHED_FIFO threads are throttled after {runtime} us of every {period} us; the "
        "predecessor system measured p99.9 deschedule of 400-470 ms at 500000 (0.02 ms at 950000)",
    )


def _fair_server(sys_root: Path) -> str:
    """On kernels with the fair server (>= 6.12) it reserves time for normal tasks per CPU: evidence only."""
    d = sys_root / "kernel/debug/sched/fair_server/cpu0"
    runtime, period = _read(d / "runtime"), _read(d / "period")
    if runtime is None or period is None:
        return ""
    return f"fair server cpu0: runtime {runtime} ns per {period} ns"


def check_numa_balancing(ctx: Context) -> Check:
    path = ctx.src.proc_root / "sys/kernel/numa_balancing"
    text = _read(path)
    nodes = len(ctx.topo.numa_nodes)
    if text is None:
        return Check(
            "numa_balancing", Status.PASS, "absent", "0", [f"{path} absent: CONFIG_NUMA_BALANCING is off"]
        )
    evidence = [f"{path}: {text}", f"{nodes} NUMA node(s)"]
    if text == "0":
        return Check("numa_balancing", Status.PASS, 0, "0", evidence)
    if nodes == 1:
        evidence.append("one NUMA node: balancing has nothing to migrate")
        return Check("numa_balancing", Status.PASS, text, "0", evidence)
    return Check(
        "numa_balancing",
        Status.FAIL,
        text,
        "0",
        evidence,
        reason="automatic NUMA balancing unmaps pages to sample accesses (hinting faults) and migrates "
        "pages and tasks: latency spikes on pinned workers whose memory is already bound",
    )


def check_irq_affinity(ctx: Context) -> Check:
    irq_root = ctx.src.proc_root / "irq"
    iso = ctx.plan.isolated
    if not irq_root.is_dir():
        return skip("irq_affinity", f"{irq_root} absent")
    offenders: list[str] = []
    total = 0
    for d in sorted((p for p in irq_root.iterdir() if p.name.isdigit()), key=lambda p: int(p.name)):
        text = _read(d / "effective_affinity_list")
        if text is None:
            text = _read(d / "smp_affinity_list")
        if text is None:
            continue
        total += 1
        try:
            hit = _cpus(text) & iso
        except cpulist.CpuListError:
            offenders.append(f"irq {d.name}: unparsable affinity {text!r}")
            continue
        if hit:
            offenders.append(f"irq {d.name}: {text} (isolated {cpulist.format(hit)})")
    threshold = f"no IRQ may fire on isolated CPUs {cpulist.format(iso)}"
    if total == 0:
        return skip("irq_affinity", f"no readable affinity under {irq_root}")
    value = f"{len(offenders)} of {total} IRQs on isolated CPUs"
    if not offenders:
        return Check("irq_affinity", Status.PASS, value, threshold, [f"{total} IRQs read under {irq_root}"])
    shown = offenders[:10] + ([f"... and {len(offenders) - 10} more"] if len(offenders) > 10 else [])
    return Check(
        "irq_affinity",
        Status.FAIL,
        value,
        threshold,
        shown,
        reason="interrupts land on isolated CPUs (irqaffinity= and irqbalance's banned list not in effect)",
        data={"irqs": len(offenders)},
    )


def check_governor(ctx: Context) -> Check:
    cpu_root = ctx.src.sys_root / "devices/system/cpu"
    found: dict[str, set[int]] = {}
    for cpu in sorted(ctx.plan.isolated):
        gov = _read(cpu_root / f"cpu{cpu}/cpufreq/scaling_governor")
        if gov is not None:
            found.setdefault(gov, set()).add(cpu)
    if not found:
        return skip(
            "governor", "no cpufreq on the isolated CPUs: the firmware or the hypervisor sets the frequency"
        )
    evidence = [f"{gov}: CPUs {cpulist.format(cpus)}" for gov, cpus in sorted(found.items())]
    others = sorted(g for g in found if g != "performance")
    value = ",".join(sorted(found))
    if not others:
        return Check("governor", Status.PASS, value, "performance on isolated CPUs", evidence)
    return Check(
        "governor",
        Status.WARN,
        value,
        "performance on isolated CPUs",
        evidence,
        reason=f"governor {', '.join(others)}: ramp-up after idle adds latency to the first requests",
    )


def check_thp(ctx: Context) -> Check:
    path = ctx.src.sys_root / "kernel/mm/transparent_hugepage/enabled"
    text = _read(path)
    if text is None:
        return skip("thp", f"{path} absent")
    chosen = next((w[1:-1] for w in text.split() if w.startswith("[")), text)
    evidence = [f"{path}: {text}"]
    if chosen == "never":
        return Check("thp", Status.PASS, chosen, "never", evidence)
    status = Status.WARN if chosen == "madvise" else Status.FAIL
    return Check(
        "thp",
        status,
        chosen,
        "never",
        evidence,
        reason="khugepaged collapses and direct compaction stall threads on page faults",
    )


def try_fifo() -> str | None:
    """Try SCHED_FIFO priority 1 on a short-lived thread; None on success, else the error."""
    result: list[str | None] = []

    def attempt() -> None:
        try:
            # pid 0 is the calling thread: the process and the caller keep their own policy.
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
            result.append(None)
        except OSError as e:
            result.append(f"{type(e).__name__}: {e}")

    t = threading.Thread(target=attempt, name="lowtail-fifo-probe")
    t.start()
    t.join()
    return result[0] if result else "the probe thread did not report"


def check_sched_fifo(ctx: Context) -> Check:
    if not ctx.src.live:
        return skip(
            "sched_fifo", "reading a fixture tree: SCHED_FIFO can only be tried on the running kernel"
        )
    error = try_fifo()
    if error is None:
        return Check(
            "sched_fifo",
            Status.PASS,
            "permitted",
            "SCHED_FIFO settable",
            ["sched_setscheduler(SCHED_FIFO, 1) succeeded on a short-lived thread"],
        )
    return Check(
        "sched_fifo",
        Status.FAIL,
        "refused",
        "SCHED_FIFO settable",
        [f"sched_setscheduler(SCHED_FIFO, 1) on a short-lived thread: {error}"],
        reason="workers cannot raise their priority (needs CAP_SYS_NICE and, with CONFIG_RT_GROUP_SCHED, "
        "an RT budget in the cgroup)",
    )


def _kernel_config(src: Sources) -> tuple[str, str] | None:
    if src.kernel_config is not None:
        candidates = [src.kernel_config]
    elif src.live:
        candidates = [Path("/boot") / f"config-{src.kernel_release}", src.proc_root / "config.gz"]
    else:  # a fixture tree: never the build config of the kernel this validator happens to run on
        candidates = [src.proc_root / "config.gz"]
    for path in candidates:
        try:
            raw = path.read_bytes()
        except (FileNotFoundError, PermissionError):
            continue
        text = gzip.decompress(raw).decode() if raw[:2] == b"\x1f\x8b" else raw.decode()
        return str(path), text
    return None


def check_rt_group_sched(ctx: Context) -> Check:
    found = _kernel_config(ctx.src)
    if found is None:
        where = ctx.src.kernel_config or (
            f"/boot/config-{ctx.src.kernel_release} or {ctx.src.proc_root}/config.gz"
            if ctx.src.live
            else f"{ctx.src.proc_root}/config.gz (a fixture tree: pass --kernel-config)"
        )
        return skip("rt_group_sched", f"no kernel config at {where}")
    path, text = found
    opts = dict(
        line.split("=", 1) for line in text.splitlines() if line.startswith("CONFIG_") and "=" in line
    )
    value = opts.get("CONFIG_RT_GROUP_SCHED", "n")
    evidence = [f"{path}: CONFIG_RT_GROUP_SCHED={value}"]
    if value != "y":
        return Check("rt_group_sched", Status.PASS, "n", "CONFIG_RT_GROUP_SCHED off", evidence)
    # Kernels >= 6.16 can ship it compiled in but disabled, switchable with rt_group_sched= at boot.
    cmd = parse_cmdline(_read(ctx.src.proc_root / "cmdline") or "")
    disabled = opts.get("CONFIG_RT_GROUP_SCHED_DEFAULT_DISABLED") == "y"
    if "rt_group_sched" in cmd:
        disabled = cmd["rt_group_sched"] in ("0", "n", "off")
        evidence.append(f"rt_group_sched={cmd['rt_group_sched']} on the command line")
    if disabled:
        evidence.append("RT group scheduling compiled in but disabled at boot")
        return Check("rt_group_sched", Status.PASS, "y (disabled)", "CONFIG_RT_GROUP_SCHED off", evidence)
    return Check(
        "rt_group_sched",
        Status.FAIL,
        "y",
        "CONFIG_RT_GROUP_SCHED off",
        evidence,
        reason="SCHED_FIFO is impossible in a non-root cgroup (a pod) unless the cgroup is given an RT "
        "budget (cgroup v1 cpu.rt_runtime_us defaults to 0; cgroup v2 has none); boot with "
        "rt_group_sched=0 or a kernel without it",
    )


def check_queue_core(ctx: Context) -> Check:
    """Which implementation of the queue's hot path this installation runs: the native core, or the
    Python path (a warning: it works, at a higher round trip and worker cost per call: about 10% and 20%
    in docs/benchmarks.md's runs of the native core's second step)."""
    from lowtail.shm import native

    impl = native.implementation()
    evidence = [f"implementation: {impl}", f"layout digest of this package: {native.layout_digest()}"]
    if impl.name == "native":
        return Check("queue_core", Status.PASS, "native", "the native core loads", evidence)
    return Check(
        "queue_core",
        Status.WARN,
        "python",
        "the native core loads",
        evidence,
        f"the queue runs its Python path: {impl.reason}",
    )


# ---- memory, steal, kubelet ----------------------------------------------------------------------
def check_dev_shm(ctx: Context) -> Check:
    need = ctx.shm_bytes or SHM_BYTES_PER_WORKER * max(1, len(ctx.plan.isolated))
    try:
        st = os.statvfs(ctx.src.shm_path)
    except OSError as e:
        return Check(
            "dev_shm", Status.FAIL, None, f">= {need} bytes", [str(e)], reason=f"{ctx.src.shm_path}: {e}"
        )
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    mib = 1 << 20
    threshold = f"size and free >= {need / mib:.1f} MiB"
    evidence = [
        f"{ctx.src.shm_path}: size {size / mib:.1f} MiB, free {free / mib:.1f} MiB",
        f"needed {need / mib:.1f} MiB ("
        + (
            "--shm-bytes)"
            if ctx.shm_bytes
            else f"{len(ctx.plan.isolated)} isolated CPUs x one default queue of "
            f"{SHM_BYTES_PER_WORKER / mib:.1f} MiB)"
        ),
    ]
    value = f"{free / mib:.0f} MiB free of {size / mib:.0f} MiB, need {need / mib:.1f} MiB"
    if size < need:
        return Check(
            "dev_shm",
            Status.FAIL,
            value,
            threshold,
            evidence,
            data={"size": size, "free": free, "needed": need},
            reason="/dev/shm is smaller than the queues need (raise its size, or the pod's emptyDir "
            "sizeLimit)",
        )
    if free < need:
        return Check(
            "dev_shm",
            Status.WARN,
            value,
            threshold,
            evidence,
            data={"size": size, "free": free, "needed": need},
            reason="not enough free space now: stale segments? (lowtail sweeps its own)",
        )
    return Check(
        "dev_shm", Status.PASS, value, threshold, evidence, data={"size": size, "free": free, "needed": need}
    )


def read_steal(proc_root: Path) -> dict[str, tuple[int, int]]:
    """``{"cpu": (steal, total), "cpu3": ...}`` in USER_HZ ticks from /proc/stat."""
    text = _read(proc_root / "stat") or ""
    out: dict[str, tuple[int, int]] = {}
    for line in text.splitlines():
        parts = line.split()
        if not parts or not parts[0].startswith("cpu"):
            continue
        nums = [int(x) for x in parts[1:]]
        # user nice system idle iowait irq softirq steal guest guest_nice; guest is inside user.
        steal = nums[7] if len(nums) > 7 else 0
        out[parts[0]] = (steal, sum(nums[:8]))
    return out


STEAL_LIMITS = (0.001, 0.01)  # share of CPU time: pass <= 0.1 %, warn <= 1 %


def check_steal(ctx: Context) -> Check:
    stat = read_steal(ctx.src.proc_root)
    if "cpu" not in stat:
        return skip("steal", f"cannot read {ctx.src.proc_root / 'stat'}")
    # Per probe CPU when /proc/stat has per-CPU lines, else the all-CPU line.
    rows = {f"cpu{c}": stat[f"cpu{c}"] for c in sorted(ctx.cpus) if f"cpu{c}" in stat} or {"cpu": stat["cpu"]}
    share = {name: (s / t if t else 0.0) for name, (s, t) in rows.items()}
    worst_name = max(share, key=share.__getitem__)
    top = share[worst_name]
    per_cpu = [
        f"{name}: steal {s} of {t} ticks since boot ({share[name]:.3%})" for name, (s, t) in rows.items()
    ]
    evidence = [f"worst {worst_name}: {share[worst_name]:.3%}", *per_cpu[:16]]
    threshold = f"pass <= {STEAL_LIMITS[0]:.1%}, warn <= {STEAL_LIMITS[1]:.0%} of CPU time since boot"
    value = round(top * 100, 4)
    if top <= STEAL_LIMITS[0]:
        status = Status.PASS
    elif top <= STEAL_LIMITS[1]:
        status = Status.WARN
    else:
        status = Status.FAIL
    reason = "" if status is Status.PASS else "the hypervisor ran something else on these vCPUs"
    return Check("steal", status, value, threshold, evidence, reason=reason, unit="%")


def check_kubelet(ctx: Context) -> Check:
    path = ctx.src.kubelet_config
    text = _read(path)
    if text is None:
        return skip("kubelet", f"no kubelet configuration at {path}")
    try:
        cfg = yaml.safe_load(text) or {}
    except yaml.YAMLError as e:
        return Check("kubelet", Status.FAIL, None, "", [f"{path}: {e}"], reason=f"{path} is not YAML")
    if not isinstance(cfg, dict):
        return Check("kubelet", Status.FAIL, None, "", [f"{path}"], reason=f"{path} is not a mapping")
    hk = cpulist.format(ctx.plan.housekeeping)
    wants: list[tuple[str, Callable[[Any], bool], str]] = [
        ("cpuManagerPolicy", lambda v: v == "static", "static"),
        (
            "reservedSystemCPUs",
            lambda v: isinstance(v, str) and _cpus(v) == ctx.plan.housekeeping,
            hk,
        ),
        ("topologyManagerPolicy", lambda v: v in ("single-numa-node", "restricted"), "single-numa-node"),
        ("memoryManagerPolicy", lambda v: v == "Static", "Static"),
    ]
    evidence, problems = [], []
    for key, ok, want in wants:
        got = cfg.get(key)
        evidence.append(f"{key}: {got!r}")
        if not ok(got):
            problems.append(f"{key} is {got!r}, expected {want!r}")
    state_text = _read(ctx.src.kubelet_state)
    if state_text is not None:
        try:
            state = json.loads(state_text)
            evidence.append(
                f"{ctx.src.kubelet_state}: policyName={state.get('policyName')!r}, "
                f"defaultCpuSet={state.get('defaultCpuSet')!r}, "
                f"{len(state.get('entries') or {})} pods with exclusive CPUs"
            )
            if state.get("policyName") != cfg.get("cpuManagerPolicy"):
                problems.append(
                    f"cpu_manager_state policy {state.get('policyName')!r} differs from the configuration "
                    f"{cfg.get('cpuManagerPolicy')!r}: kubelet crash-loops until the state file is removed"
                )
        except json.JSONDecodeError:
            problems.append(f"{ctx.src.kubelet_state} is not JSON")
    threshold = "static CPU manager, reserved = housekeeping, NUMA-aligned managers"
    if not problems:
        return Check("kubelet", Status.PASS, "as planned", threshold, evidence)
    return Check(
        "kubelet", Status.FAIL, f"{len(problems)} problem(s)", threshold, evidence, "; ".join(problems)
    )


STATIC_CHECKS: dict[str, Callable[[Context], Check]] = {
    "topology": check_topology,
    "kernel_args": check_kernel_args,
    "isolation": check_isolation,
    "rt_budget": check_rt_budget,
    "numa_balancing": check_numa_balancing,
    "irq_affinity": check_irq_affinity,
    "governor": check_governor,
    "thp": check_thp,
    "sched_fifo": check_sched_fifo,
    "rt_group_sched": check_rt_group_sched,
    "dev_shm": check_dev_shm,
    "queue_core": check_queue_core,
    "steal": check_steal,
    "kubelet": check_kubelet,
    "affinity": lambda ctx: check_affinity(
        ctx.src.proc_root, ctx.src.cgroup_root, ctx.cgroup_target, ctx.src.live
    ),
    "cstates": lambda ctx: check_cstates(ctx.src.sys_root, ctx.cpus),
    "firmware": lambda ctx: check_firmware(
        ctx.src.sys_root,
        ctx.topo,
        ctx.plan,
        ctx.cpus,
        ctx.expected_hardware,
        cmdline=_read(ctx.src.proc_root / "cmdline") or "",
    ),
}
