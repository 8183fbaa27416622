"""Run a validation: choose the CPUs, run the selected static checks and probes, summarise.

Which CPUs the probes measure (``--cpus`` overrides):
  * the running kernel isolates CPUs (``/sys/devices/system/cpu/isolated`` is not empty): the plan's
    isolated CPUs, where inference workers will run; if the kernel isolated other CPUs than the plan
    says, the ``isolation`` check fails and the probes still measure the plan's CPUs;
  * the running kernel isolates nothing (a node not yet rebooted into its plan, or a VM): every online
    CPU but CPU 0, which keeps the validator, the IRQs nobody moved, and the rest of the system.
The plan's "isolated" is a wish; the kernel's isolated list is what is in effect.
"""

from __future__ import annotations

import contextlib
import datetime
import importlib.metadata
import os
import platform
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowtail import __version__
from lowtail.errors import LowtailError
from lowtail.node import cpulist
from lowtail.node.lease import Lease
from lowtail.node.plan import Plan, PlanError, load_plan, make_plan
from lowtail.node.process import boot_id
from lowtail.node.topology import Topology
from lowtail.render.progress import Progress
from lowtail.render.schema import stamp
from lowtail.shm.errors import QueueError
from lowtail.validation.cgroup import CpuStat, Target, allowed_cpus, check_cfs_throttle, cpu_stat_of
from lowtail.validation.check import Check, Limits, Status, skip, worst
from lowtail.validation.core_to_core import probe_core_to_core
from lowtail.validation.firmware import HWLAT_LIMITS, probe_hwlat
from lowtail.validation.probes import DEFAULT_LIMITS, ProbeError, ProbeOptions, probe_deschedule, probe_timer
from lowtail.validation.rttests import RtTestsError, probe_rt_test
from lowtail.validation.runtime_probes import probe_inference, probe_numa, probe_shm_rtt
from lowtail.validation.static import STATIC_CHECKS, Context, Sources, try_fifo
from lowtail.validation.threads import DEFAULT_LIMITS as LEASED_LIMITS
from lowtail.validation.threads import Sampler, check_leased_threads, read_leases

PROBES: tuple[str, ...] = (
    "deschedule",
    "timer",
    "cyclictest",
    "oslat",
    "shm_rtt",
    "inference",
    "numa",
    "hwlat",
    "core_to_core",
    "leased_threads",
)
# Judged over the whole run: cpu.stat is read before the first probe and after the last.
WINDOWED: tuple[str, ...] = ("cfs_throttle",)
ALL_CHECKS: tuple[str, ...] = (*STATIC_CHECKS, *WINDOWED, *PROBES)
# Every limit --threshold can set (ms; cstates in us of exit latency, leased_threads in ms per second).
THRESHOLDS: dict[str, Limits] = {
    **DEFAULT_LIMITS,
    "hwlat": HWLAT_LIMITS,
    "leased_threads": LEASED_LIMITS,
}
DEFAULT_SAMPLES = 10_000  # per CPU: the p99.9 rests on 10 samples beyond it
DEFAULT_DURATION_S = 10.0
QUICK_SAMPLES = 3_000  # just above what a p99.9 verdict needs (lowtail.validation.evidence: 2,995)
QUICK_DURATION_S = 3.0
# Probes --rounds repeats: those graded on one number from samples (not the windows that watch the whole
# run, nor numa's placement).
ROUND_PROBES: tuple[str, ...] = ("deschedule", "timer", "cyclictest", "oslat", "shm_rtt", "inference")
OUTLIER_Z = 3.5  # the modified z-score (median and MAD) beyond which a round is an outlier


class ValidationError(LowtailError, RuntimeError):
    """The validation could not run (bad options, unreadable plan): exit status 2."""


@dataclass(frozen=True)
class Options:
    src: Sources = field(default_factory=Sources)
    topo: Topology | None = None
    plan_path: Path | None = None
    housekeeping: str = "auto"  # for the computed plan
    only: tuple[str, ...] = ()
    cpus: frozenset[int] | None = None
    samples: int | None = None
    quick: bool = False
    allow_virtual: bool = False
    limits: dict[str, Limits] = field(default_factory=dict)
    duration_s: float | None = None
    shm_bytes: int = 0
    progress: bool = True
    target_pid: int | None = None  # checks 1 and 2 look at this process (default: the validator)
    actor: str | None = None  # ... or at the lease owner with this name or Ray actor id
    expected_hardware: dict[str, Any] = field(default_factory=dict)
    no_probes: bool = False  # static checks only (check mode: measure nothing)
    rounds: int = 1  # each probe this many times, the spread reported


@dataclass
class Report:
    host: dict[str, Any]
    checks: list[Check]
    summary: dict[str, Any]
    settings: dict[str, Any] = field(default_factory=dict)  # what the probes were asked to do

    def to_dict(self) -> dict[str, Any]:
        return {
            **stamp("validate"),
            "host": self.host,
            "settings": self.settings,
            "checks": [c.to_dict() for c in self.checks],
            "summary": self.summary,
        }

    @property
    def failed(self) -> bool:
        return bool(self.summary["status"] == "fail")

    @property
    def interrupted(self) -> bool:
        return bool(self.summary.get("interrupted"))


def parse_only(text: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in ALL_CHECKS]
    if unknown or not names:
        raise ValidationError(
            f"--only {text!r}: unknown check(s) {', '.join(unknown) or '(none given)'}; "
            f"expected names from: {', '.join(ALL_CHECKS)}"
        )
    return names


def select_cpus(topo: Topology, plan: Plan, requested: frozenset[int] | None) -> tuple[frozenset[int], str]:
    if requested is not None:
        bad = requested - topo.online
        if bad or not requested:
            raise ValidationError(
                f"--cpus {cpulist.format(requested) or '(empty)'}: CPUs {cpulist.format(bad) or '-'} are not "
                f"online; online CPUs are {cpulist.format(topo.online)}"
            )
        return requested, "--cpus"
    if topo.isolated:
        absent = plan.isolated - topo.online
        if absent:
            raise ValidationError(
                f"the plan isolates CPUs {cpulist.format(absent)} that are not online here "
                f"(online: {cpulist.format(topo.online)}): a plan of another machine?"
            )
        return plan.isolated, "the plan's isolated CPUs (the running kernel isolates CPUs)"
    rest = topo.online - {0}
    if not rest:
        return topo.online, "CPU 0 (the only online CPU)"
    return rest, "all online CPUs but CPU 0 (the running kernel isolates none)"


def resolve_target(opts: Options) -> Target | None:
    """The process named by --pid or --actor (None: the validator itself), with the CPUs it leased."""
    if opts.target_pid is None and opts.actor is None:
        return None
    leases, why = read_leases(opts.src.lease_state)
    if opts.actor is not None:
        found = [
            lease
            for lease in leases
            if opts.actor in (lease.owner, lease.actor_id) or lease.owner.endswith(":" + opts.actor)
        ]
        if not found or found[0].pid is None:
            owners = ", ".join(lease.owner for lease in leases) or why or "none"
            raise ValidationError(
                f"--actor {opts.actor!r}: no lease owner or Ray actor id of that name with a pid in "
                f"{opts.src.lease_state}; lease owners: {owners}"
            )
        pid = found[0].pid
        described = f"{found[0].owner} (pid {pid})"
    else:
        assert opts.target_pid is not None
        pid = opts.target_pid
        if allowed_cpus(opts.src.proc_root, pid) is None:
            raise ValidationError(
                f"--pid {pid}: no such process under {opts.src.proc_root} (expected a pid of this node's "
                "pid namespace)"
            )
        described = f"pid {pid}"
    leased = frozenset(lease.cpu for lease in leases if lease.pid == pid)
    return Target(pid, described, leased)


def _versions() -> dict[str, str]:
    out = {"lowtail": __version__, "python": platform.python_version()}
    for dist in ("numpy", "openvino", "ray", "matplotlib", "tensorboardX"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[dist] = importlib.metadata.version(dist)
    return out


def host_info(src: Sources, topo: Topology, plan: Plan, plan_source: str) -> dict[str, Any]:
    def read(path: Path) -> str:
        try:
            return path.read_text().strip()
        except OSError:
            return ""

    return {
        "hostname": socket.gethostname() if src.live else f"fixture:{src.sys_root}",
        "kernel": src.kernel_release if src.live else "",
        "cmdline": read(src.proc_root / "cmdline"),
        "cpu_model": topo.model_name,
        "vendor": topo.vendor,
        "cpus": len(topo.cpus),
        "sockets": len(topo.sockets),
        "numa_nodes": len(topo.numa_nodes),
        "l3_groups": len(topo.l3_groups),
        "threads_per_core": topo.threads_per_core,
        "virtual": [f.code for f in topo.findings],
        "kernel_isolated": cpulist.format(topo.isolated),
        "kernel_nohz_full": cpulist.format(topo.nohz_full),
        "plan": plan.to_dict(),
        "plan_source": plan_source,
        "versions": _versions(),
        "time": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "live": src.live,
    }


def _fifo_permitted() -> bool:
    return try_fifo() is None


def _main_cpu(topo: Topology, cpus: frozenset[int]) -> int:
    rest = topo.online - cpus
    return min(rest) if rest else min(topo.online)


def _probe_runners(opts: ProbeOptions, fifo_ok: Callable[[], bool]) -> dict[str, Callable[[], Check]]:
    return {
        "deschedule": lambda: probe_deschedule(opts),
        "timer": lambda: probe_timer(opts),
        "cyclictest": lambda: probe_rt_test(
            "cyclictest",
            opts.cpus,
            duration_s=opts.duration_s,
            main_cpu=opts.main_cpu,
            limits=opts.limit("cyclictest"),
            fifo=fifo_ok(),
            progress_enabled=opts.progress,
        ),
        "oslat": lambda: probe_rt_test(
            "oslat",
            opts.cpus,
            duration_s=opts.duration_s,
            main_cpu=opts.main_cpu,
            limits=opts.limit("oslat"),
            fifo=False,
            progress_enabled=opts.progress,
        ),
        "shm_rtt": lambda: probe_shm_rtt(opts),
        "inference": lambda: probe_inference(opts),
        "numa": lambda: probe_numa(opts),
    }


def _leased_sampler(src: Sources) -> tuple[Sampler | None, list[Lease], str]:
    """Start sampling every thread on the leased CPUs; it runs through the other probes."""
    leases, why = read_leases(src.lease_state, boot_id())
    if not leases:
        return None, [], why
    sampler = Sampler(src.proc_root, frozenset(lease.cpu for lease in leases))
    sampler.start()
    return sampler, leases, ""


def _leased_check(
    sampler: Sampler | None,
    leases: list[Lease],
    why: str,
    limits: Limits,
    *,
    min_window_s: float,
    progress: bool,
    nohz_full: frozenset[int],
) -> Check:
    """Stop the sampler (after at least ``min_window_s`` of sampling) and judge what it saw."""
    if sampler is None:
        return skip("leased_threads", why, "probe")
    bar = Progress("leased_threads", min_window_s, enabled=progress)
    t0 = time.monotonic()
    while (waited := time.monotonic() - t0) < min_window_s - sampler.window_s:
        bar.update(waited)
        time.sleep(0.2)
    bar.finish()
    sampler.stop()
    return check_leased_threads(sampler, leases, [os.getpid()], limits, nohz_full)


def repeat(probe: Callable[[], Check], rounds: int) -> Check:
    """Run a probe ``rounds`` times; report the median round, with every round's value, their mean and
    standard deviation, and the rounds that lie far from the rest (as hyperfine reports a benchmark)."""
    runs = [probe() for _ in range(rounds)]
    graded = [c for c in runs if isinstance(c.value, int | float) and c.status is not Status.SKIP]
    if len(graded) < 2:
        return runs[-1]
    order = sorted(range(len(graded)), key=lambda i: float(graded[i].value))
    median_i = order[len(order) // 2]
    values = [float(c.value) for c in graded]
    median = statistics.median(values)
    mad = statistics.median(abs(v - median) for v in values)
    # 0.6745: the MAD of a normal distribution in standard deviations (Iglewicz and Hoaglin).
    outliers = [i + 1 for i, v in enumerate(values) if mad > 0 and 0.6745 * abs(v - median) / mad > OUTLIER_Z]
    mean, sd = statistics.fmean(values), statistics.stdev(values)
    check = graded[median_i]
    unit = check.unit or ""
    line = (
        f"{len(values)} rounds: {', '.join(f'{v:.4g}' for v in values)} {unit}; mean {mean:.4g} ± {sd:.4g} "
        f"{unit} (range {min(values):.4g} to {max(values):.4g}); reported: round {median_i + 1}, the median"
    )
    if outliers:
        which = f"round{'s' if len(outliers) > 1 else ''} {', '.join(map(str, outliers))}"
        line += f"; warning: {which} far from the others (something else ran then?)"
    check.evidence.insert(0, line)
    check.data["rounds"] = {
        "values": values,
        "mean": mean,
        "sd": sd,
        "min": min(values),
        "max": max(values),
        "reported": median_i + 1,
        "outliers": outliers,
    }
    return check


def summarize(
    checks: list[Check], cpus: frozenset[int], elapsed_s: float, interrupted: bool = False
) -> dict[str, Any]:
    order = (Status.PASS, Status.WARN, Status.FAIL, Status.SKIP)
    counts = {str(s): sum(1 for c in checks if c.status is s) for s in order}
    status = worst(c.status for c in checks if c.status is not Status.SKIP) or Status.SKIP
    if interrupted and status is Status.PASS:
        status = Status.WARN  # a run cut short has not shown that the node passes
    summary: dict[str, Any] = {
        "status": str(status),
        "interrupted": interrupted,
        "counts": counts,
        "failed": [c.name for c in checks if c.status is Status.FAIL],
        "warned": [c.name for c in checks if c.status is Status.WARN],
        "skipped": {c.name: c.reason for c in checks if c.status is Status.SKIP},
        "probe_cpus": cpulist.format(cpus),
        "elapsed_s": round(elapsed_s, 2),
    }
    for c in checks:
        if c.name == "deschedule" and c.status is not Status.SKIP:
            worst_cpu = str(c.data["worst_cpu"])
            s = c.data["per_cpu"][worst_cpu]
            summary["headline"] = {
                "p999_deschedule_ms": c.value,
                "cpu": int(worst_cpu),
                "n": s["n"],
                "max_ms": s["max"],
                "status": str(c.status),
            }
    return summary


def _topology_and_plan(opts: Options) -> tuple[Topology, Plan, str]:
    """The machine as read (or given) and the plan to judge it by, with where the plan came from."""
    from lowtail.node.topology import TopologyError, read_topology

    try:
        topo = opts.topo or read_topology(opts.src.sys_root, opts.src.proc_root)
    except (TopologyError, cpulist.CpuListError) as e:
        raise ValidationError(str(e)) from None
    try:
        if opts.plan_path is not None:
            return topo, load_plan(opts.plan_path), str(opts.plan_path)
        plan = make_plan(topo, opts.housekeeping)
        return topo, plan, f"computed from this topology (housekeeping {opts.housekeeping})"
    except PlanError as e:
        raise ValidationError(str(e)) from None


def _settings(opts: Options, names: tuple[str, ...]) -> dict[str, Any]:
    """What the probes are asked to do, as the report states it."""
    return {
        "checks": list(names),
        "samples_per_cpu": opts.samples or (QUICK_SAMPLES if opts.quick else DEFAULT_SAMPLES),
        "duration_s": opts.duration_s or (QUICK_DURATION_S if opts.quick else DEFAULT_DURATION_S),
        "quick": opts.quick,
        "rounds": opts.rounds,
        "limits_ms": {k: [v.pass_max, v.warn_max] for k, v in {**THRESHOLDS, **opts.limits}.items()},
    }


def _run_probe(name: str, runner: Callable[[], Check], rounds: int) -> Check:
    """One probe (``rounds`` times where the spread means something); one that cannot run fails alone."""
    try:
        if rounds > 1 and name in ROUND_PROBES:
            return repeat(runner, rounds)
        return runner()
    except (ProbeError, RtTestsError, QueueError, OSError) as e:
        # One probe that cannot run (e.g. move_pages refused by a container's seccomp
        # profile) fails alone; the others and the report still come out.
        return Check(name, Status.FAIL, None, "", [str(e)], reason=f"probe could not run: {e}", kind="probe")


def _probe_options(
    opts: Options, topo: Topology, cpus: frozenset[int], settings: dict[str, Any], limits: dict[str, Limits]
) -> ProbeOptions:
    return ProbeOptions(
        cpus=cpus,
        samples=settings["samples_per_cpu"],
        duration_s=settings["duration_s"],
        main_cpu=_main_cpu(topo, cpus),
        limits=limits,
        progress=opts.progress,
        proc_root=opts.src.proc_root,
    )


def _run_probes(
    opts: Options,
    topo: Topology,
    plan: Plan,
    cpus: frozenset[int],
    *,
    probe_names: list[str],
    settings: dict[str, Any],
    checks: list[Check],
) -> None:
    """Run the probes in order, appending each verdict to ``checks`` as it comes (an interrupt keeps
    those), with the validator kept off the CPUs it measures."""
    limits = {**THRESHOLDS, **opts.limits}
    popts = _probe_options(opts, topo, cpus, settings, limits)
    runners = _probe_runners(popts, _fifo_permitted)
    runners["hwlat"] = lambda: probe_hwlat(
        opts.src.sys_root,
        cpus,
        topo.vendor,
        duration_s=popts.duration_s,
        limits=limits["hwlat"],
        progress=opts.progress,
    )
    runners["core_to_core"] = lambda: probe_core_to_core(topo, plan, progress=opts.progress)
    saved = os.sched_getaffinity(0)
    housekeeping = topo.online - cpus
    sampler: Sampler | None = None
    try:
        # Keep the validator itself (progress, pipes) off the CPUs it measures.
        if housekeeping:
            os.sched_setaffinity(0, housekeeping)
        if "leased_threads" in probe_names:
            sampler, leases, why = _leased_sampler(opts.src)
            runners["leased_threads"] = lambda: _leased_check(
                sampler,
                leases,
                why,
                limits["leased_threads"],
                min_window_s=popts.duration_s,
                progress=opts.progress,
                nohz_full=topo.nohz_full,
            )
        for name in probe_names:
            checks.append(_run_probe(name, runners[name], opts.rounds))
    finally:
        if sampler is not None:
            sampler.stop()  # a probe raised before leased_threads was judged: no thread left behind
        os.sched_setaffinity(0, saved)


def _skip_interrupted(checks: list[Check], order: list[str]) -> None:
    """Ctrl-C: what ran is kept; the check that was running and those after it say so."""
    done = {c.name for c in checks}
    pending = [n for n in order if n not in done]
    for i, name in enumerate(pending):
        why = "interrupted while it ran: no verdict" if i == 0 else "not run: interrupted"
        checks.append(skip(name, why, "probe" if name in PROBES else "static"))


def _cfs_throttle(
    opts: Options, target: Target, plan: Plan, before: CpuStat | None, t_before: float
) -> Check:
    """Judged over the whole run: cpu.stat now against ``before``, read when the checks began."""
    window = time.monotonic() - t_before if before is not None else None
    return check_cfs_throttle(
        opts.src.proc_root, opts.src.cgroup_root, target, plan.isolated, before=before, window_s=window
    )


def run(opts: Options) -> Report:
    t0 = time.monotonic()
    topo, plan, plan_source = _topology_and_plan(opts)
    cpus, how = select_cpus(topo, plan, opts.cpus)
    names = opts.only or ALL_CHECKS
    if opts.no_probes:
        names = tuple(n for n in names if n not in PROBES)
    ctx = Context(
        src=opts.src,
        topo=topo,
        plan=plan,
        cpus=cpus,
        allow_virtual=opts.allow_virtual,
        shm_bytes=opts.shm_bytes,
        target=resolve_target(opts),
        expected_hardware=opts.expected_hardware,
    )
    host = host_info(opts.src, topo, plan, plan_source)
    host["probe_cpus"] = {"cpus": cpulist.format(cpus), "chosen_as": how}
    settings = _settings(opts, names)
    target = ctx.cgroup_target
    throttle_before = cpu_stat_of(opts.src.proc_root, opts.src.cgroup_root, target) if opts.src.live else None
    t_before = time.monotonic()
    checks: list[Check] = []
    # leased_threads last: its sampler watches the leased CPUs while every other probe runs.
    probe_names = sorted((n for n in names if n in PROBES), key=lambda n: n == "leased_threads")
    interrupted = False
    try:
        for name in names:
            if name in STATIC_CHECKS:
                checks.append(STATIC_CHECKS[name](ctx))
        if probe_names and not opts.src.live:
            checks += [
                skip(n, "static checks read a fixture tree; probes measure only the running machine", "probe")
                for n in probe_names
            ]
        elif probe_names:
            _run_probes(opts, topo, plan, cpus, probe_names=probe_names, settings=settings, checks=checks)
    except KeyboardInterrupt:
        # The probe's children are gone (each probe ends its own on the way out).
        interrupted = True
        _skip_interrupted(checks, [n for n in names if n in STATIC_CHECKS] + probe_names)
    if "cfs_throttle" in names:
        checks.append(_cfs_throttle(opts, target, plan, throttle_before, t_before))
    summary = summarize(checks, cpus, time.monotonic() - t0, interrupted)
    return Report(host=host, checks=checks, summary=summary, settings=settings)
