"""What the firmware does behind the kernel's back, and the BIOS settings Linux can see.

    {sys}/devices/system/cpu/cpuN/cpuidle/stateK/{name,latency,disable}   idle states offered (latency: us)
    {sys}/devices/system/cpu/cpuN/power/pm_qos_resume_latency_us         per-CPU limit (0: none, n/a: poll)
    {sys}/devices/system/cpu/amd_pstate/status                          active | passive | guided
    {sys}/devices/system/cpu/cpufreq/boost, cpuN/cpufreq/{boost,scaling_driver}
    {sys}/devices/system/cpu/smt/{control,active}
    {sys}/kernel/tracing (or kernel/debug/tracing)                      the hwlat tracer
    /dev/cpu/N/msr                                                       MSR_SMI_COUNT (0x34, Intel only)

Sources: Documentation/admin-guide/pm/cpuidle.rst (states, ``disable``, PM QoS),
Documentation/admin-guide/pm/amd-pstate.rst (status), Documentation/trace/hwlat_detector.rst (the tracer
and its output), rt-tests ``hwlatdetect`` (which drives the same files), turbostat (MSR 0x34).
"""

from __future__ import annotations

import logging
import os
import re
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowtail.node import cpulist
from lowtail.node.plan import Plan
from lowtail.node.topology import Topology
from lowtail.render.progress import Progress
from lowtail.validation.check import Check, Limits, Status, graded, skip

log = logging.getLogger(__name__)

# Exit latency of the deepest idle state an isolated CPU may enter, in us: C1/haltpoll wake in ~1 us;
# EPYC's C2 (ACPI C2, 400 us on Zen 2/3 per acpi_idle) is what tuned and the Node Tuning Operator keep off
# isolated CPUs.
CSTATE_LIMITS = Limits(10.0, 100.0)
# hwlat gaps in ms: hwlatdetect's default threshold is 10 us; anything above it is an SMI or firmware.
HWLAT_LIMITS = Limits(0.01, 0.1)
MSR_SMI_COUNT = 0x34


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


# ---- C-states ------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class IdleState:
    name: str
    latency_us: int
    disabled: bool


def idle_states(cpu_dir: Path) -> list[IdleState]:
    out = []
    root = cpu_dir / "cpuidle"
    for d in sorted(root.glob("state[0-9]*"), key=lambda p: int(p.name[5:])):
        lat = _read(d / "latency")
        out.append(IdleState(_read(d / "name") or d.name, int(lat or 0), _read(d / "disable") == "1"))
    return out


def usable_states(states: list[IdleState], qos: str | None) -> list[IdleState]:
    """The states the governor may pick under the per-CPU resume-latency limit (cpuidle.rst: a state
    whose exit latency exceeds the limit is skipped; "n/a" allows only polling)."""
    allowed = [s for s in states if not s.disabled]
    if qos == "n/a":
        return [s for s in allowed if s.name.upper() == "POLL"]
    if qos and qos.isdigit() and int(qos) > 0:
        return [s for s in allowed if s.latency_us < int(qos)]
    return allowed


def check_cstates(sys_root: Path, cpus: frozenset[int], limits: Limits = CSTATE_LIMITS) -> Check:
    name = "cstates"
    cpu_root = sys_root / "devices/system/cpu"
    driver = _read(cpu_root / "cpuidle/current_driver") or "none"
    worst_lat = -1
    worst: dict[str, Any] = {}
    evidence = [f"{cpu_root / 'cpuidle/current_driver'}: {driver}"]
    per_cpu = {}
    for cpu in sorted(cpus):
        cpu_dir = cpu_root / f"cpu{cpu}"
        states = idle_states(cpu_dir)
        qos = _read(cpu_dir / "power/pm_qos_resume_latency_us")
        usable = usable_states(states, qos)
        deepest = max(usable, key=lambda s: s.latency_us, default=None)
        lat = deepest.latency_us if deepest else 0
        per_cpu[str(cpu)] = {
            "usable": [f"{s.name} ({s.latency_us} us)" for s in usable],
            "pm_qos_resume_latency_us": qos,
        }
        if lat > worst_lat:
            worst_lat = lat
            worst = {"cpu": cpu, "state": deepest.name if deepest else "-", "qos": qos}
    if not cpus:
        return skip(name, "no CPUs to look at")
    for cpu_name, d in list(per_cpu.items())[:8]:
        usable_text = ", ".join(d["usable"] or ["none (no cpuidle states: idle=poll or no driver)"])
        evidence.append(
            f"CPU {cpu_name}: usable {usable_text}; "
            f"pm_qos_resume_latency_us {d['pm_qos_resume_latency_us'] or '-'}"
        )
    if len(per_cpu) > 8:
        evidence.append(f"... {len(per_cpu) - 8} more CPUs in data.per_cpu")
    why = (
        f"CPU {worst.get('cpu')} may enter {worst.get('state')} ({worst_lat} us exit latency): limit it on "
        "the isolated CPUs (pm_qos_resume_latency_us, processor.max_cstate=1, or the BIOS C-state setting)"
    )
    what = "exit latency of the deepest state an isolated CPU may enter"
    data = {"driver": driver, "per_cpu": per_cpu}
    return graded(
        name, max(worst_lat, 0), limits, unit="us", what=what, evidence=evidence, why=why, data=data
    )


# ---- BIOS settings: SMT, NPS, P-state mode, boost ----------------------------------------------------------
HARDWARE_HINTS = {
    "sockets": "a socket missing or disabled",
    "numa_per_socket": "the BIOS NPS setting (NPS1/NPS2/NPS4)",
    "smt": "the BIOS SMT setting",
    "l3_per_socket": "the BIOS 'L3 as NUMA'/CCD settings and the CPU model",
}


def hardware_facts(topo: Topology) -> dict[str, Any]:
    sockets = max(len(topo.sockets), 1)
    return {
        "sockets": len(topo.sockets),
        "numa_per_socket": len(topo.numa_nodes) // sockets,
        "smt": topo.threads_per_core > 1,
        "l3_per_socket": len(topo.l3_groups) // sockets,
    }


def _boost(cpu_root: Path, cpus: frozenset[int]) -> str:
    glob = _read(cpu_root / "cpufreq/boost")
    if glob is not None:
        return {"1": "on", "0": "off"}.get(glob, glob) + " (cpufreq/boost)"
    per = {_read(cpu_root / f"cpu{c}/cpufreq/boost") for c in cpus} - {None}
    if per:
        return "/".join(sorted({"1": "on", "0": "off"}.get(v or "", v or "") for v in per)) + " (per policy)"
    return "not exposed"


def _firmware_facts(cpu_root: Path, topo: Topology, cpus: frozenset[int]) -> dict[str, Any]:
    """The topology's hardware facts with the P-state mode, cpufreq driver, SMT control and boost."""
    some = min(cpus) if cpus else 0
    return hardware_facts(topo) | {
        "smt_control": _read(cpu_root / "smt/control"),
        "amd_pstate": _read(cpu_root / "amd_pstate/status"),
        "scaling_driver": _read(cpu_root / f"cpu{some}/cpufreq/scaling_driver"),
        "boost": _boost(cpu_root, cpus),
    }


def _hardware_mismatches(
    facts: Mapping[str, Any], expected: Mapping[str, Any]
) -> tuple[list[str], list[str]]:
    """Each expected BIOS-visible fact that differs, and the setting to change for it."""
    problems: list[str] = []
    fixes: list[str] = []
    for key, want in expected.items():
        if key not in HARDWARE_HINTS:
            continue
        if want is not None and facts[key] != want:
            problems.append(f"{key} is {facts[key]!r}, expected {want!r} (check {HARDWARE_HINTS[key]})")
            fixes.append(f"change {HARDWARE_HINTS[key]} so {key} is {want!r}")
    return problems, fixes


def _pstate_not_in_effect(wanted_mode: str, facts: Mapping[str, Any], cmdline: str) -> tuple[str, str, str]:
    """(problem, fix, pending) when the plan's amd_pstate mode is not in effect: a problem if the kernel
    booted with it, else pending until the next boot."""
    pstate, driver = facts["amd_pstate"], facts["scaling_driver"]
    have = f"amd_pstate is {pstate or 'not loaded'} ({driver or 'no cpufreq driver'})"
    if f"amd_pstate={wanted_mode}" in cmdline.split():
        # Booted with it and still not in effect: the firmware offers no CPPC (BIOS "CPPC" setting).
        return (
            f"{have} although the kernel booted with amd_pstate={wanted_mode}: CPPC is off in the BIOS",
            "enable CPPC in the BIOS (the kernel already asks for amd_pstate)",
            "",
        )
    return (
        "",
        f"add amd_pstate={wanted_mode} to the kernel command line (the plan's kernel arguments, "
        "roles/lowtail_kernel) and reboot",
        f"{have}; the plan asks amd_pstate={wanted_mode}, not on this boot's command line yet",
    )


def check_firmware(
    sys_root: Path,
    topo: Topology,
    plan: Plan,
    cpus: frozenset[int],
    expected: Mapping[str, Any],
    *,
    cmdline: str = "",
) -> Check:
    """Fail on BIOS settings that differ from what the plan assumes; warn when the P-state mode is only
    missing because the node has not booted with the plan's arguments yet (kernel_args reports that)."""
    name = "firmware"
    facts = _firmware_facts(sys_root / "devices/system/cpu", topo, cpus)
    evidence = [f"{k}: {v if v is not None else 'not exposed'}" for k, v in facts.items()]
    problems, fixes = _hardware_mismatches(facts, expected)
    wanted_mode = next((a.partition("=")[2] for a in plan.kernel_args if a.startswith("amd_pstate=")), None)
    pending = ""
    pending_fix = ""
    if wanted_mode and topo.vendor == "AuthenticAMD" and facts["amd_pstate"] != wanted_mode:
        problem, fix, pending = _pstate_not_in_effect(wanted_mode, facts, cmdline)
        if problem:
            problems.append(problem)
            fixes.append(fix)
        else:
            pending_fix = fix
        evidence.append(f"amd_pstate: plan {wanted_mode}, in effect {facts['amd_pstate'] or '-'}")
    threshold = "SMT/NPS/sockets/L3 as lowtail_expected_hardware; amd_pstate mode as the plan's kernel args"
    if expected:
        evidence.append(f"expected: {dict(expected)}")
    data: dict[str, Any] = {"facts": facts, "expected": dict(expected)}
    # One fix per cause, each naming what to change where (a BIOS setting, the kernel command line).
    data["fixes"] = fixes + ([pending_fix] if pending_fix and not problems else [])
    if problems:
        return Check(
            name,
            Status.FAIL,
            f"{len(problems)} mismatch(es)",
            threshold,
            evidence,
            "; ".join(problems),
            data=data,
        )
    if pending:
        return Check(name, Status.WARN, "P-state mode pending", threshold, evidence, pending, data=data)
    value = "as expected" if expected or wanted_mode else "nothing expected (no lowtail_expected_hardware)"
    return Check(name, Status.PASS, value, threshold, evidence, data=data)


# ---- hardware latency: the hwlat tracer and the SMI counter ------------------------------------------------
HWLAT_LINE = re.compile(r"\[(\d+)\].*?inner/outer\(us\):\s*(\d+)/(\d+)(?:.*?count:(\d+))?")


@dataclass(frozen=True)
class Gap:
    cpu: int
    inner_us: int
    outer_us: int
    count: int  # gaps above the threshold within one width (kernels >= 5.11), else 1

    @property
    def us(self) -> int:
        return max(self.inner_us, self.outer_us)


def parse_hwlat(text: str) -> list[Gap]:
    return [
        Gap(int(m[1]), int(m[2]), int(m[3]), int(m[4] or 1))
        for line in text.splitlines()
        if not line.startswith("#") and (m := HWLAT_LINE.search(line))
    ]


def find_tracefs(sys_root: Path) -> Path | None:
    for d in (sys_root / "kernel/tracing", sys_root / "kernel/debug/tracing"):
        if (d / "available_tracers").exists():
            return d
    return None


def _mask(cpus: frozenset[int]) -> str:
    """tracing_cpumask format: hex words of 32 bits, comma separated, most significant first."""
    value = sum(1 << c for c in cpus)
    words = [f"{(value >> (32 * i)) & 0xFFFFFFFF:08x}" for i in range(max(cpus) // 32, -1, -1)]
    return ",".join(words)


def read_smi_count(dev_root: Path, cpu: int) -> int | None:
    try:
        fd = os.open(dev_root / f"cpu/{cpu}/msr", os.O_RDONLY)
    except OSError:
        return None
    try:
        raw = os.pread(fd, 8, MSR_SMI_COUNT)
        return int(struct.unpack("<Q", raw)[0] & 0xFFFFFFFF) if len(raw) == 8 else None
    except OSError:
        return None
    finally:
        os.close(fd)


def _hwlat_unavailable(sys_root: Path, tracefs: Path | None) -> str:
    """Why the hwlat tracer cannot run here (empty: it can)."""
    if tracefs is None:
        return (
            f"tracefs is not mounted at {sys_root}/kernel/tracing (mount -t tracefs nodev "
            "/sys/kernel/tracing, as hwlatdetect does)"
        )
    if "hwlat" not in (_read(tracefs / "available_tracers") or "").split():
        return f"the kernel has no hwlat tracer ({tracefs}/available_tracers; CONFIG_HWLAT_TRACER)"
    if (_read(tracefs / "current_tracer") or "nop") != "nop":
        return (
            f"{tracefs}/current_tracer is {_read(tracefs / 'current_tracer')}: "
            "someone else is tracing; not taking it over"
        )
    return ""


def _trace_hwlat(tracefs: Path, settings: Mapping[str, str], duration_s: float, bar: Progress) -> list[Gap]:
    """Run the tracer with ``settings`` for ``duration_s``; every setting it touched is restored."""
    saved = {k: _read(tracefs / k) for k in (*settings, "tracing_on")}
    try:
        (tracefs / "trace").write_text("")
        log.debug("hwlat tracer at %s with %s for %g s", tracefs, settings, duration_s)
        for key, value in settings.items():
            (tracefs / key).write_text(value)
        (tracefs / "current_tracer").write_text("hwlat")
        (tracefs / "tracing_on").write_text("1")
        t0 = time.monotonic()
        while (elapsed := time.monotonic() - t0) < duration_s:
            bar.update(elapsed)
            time.sleep(min(0.5, duration_s - elapsed))
        return parse_hwlat(_read(tracefs / "trace") or "")
    finally:
        (tracefs / "current_tracer").write_text("nop")
        for key, old in saved.items():
            if old is not None:
                (tracefs / key).write_text(old)
        bar.finish()


def _smi_evidence(vendor: str, dev_root: Path, smi_cpu: int, smi0: int | None, smi1: int | None) -> str:
    if smi0 is not None and smi1 is not None:
        return f"MSR_SMI_COUNT on CPU {smi_cpu}: +{smi1 - smi0} SMIs during the run"
    if vendor == "AuthenticAMD":
        return "SMI count: AMD has no MSR_SMI_COUNT; count with `perf stat -e ls_smi_rx -a`"
    return f"SMI count: {dev_root}/cpu/{smi_cpu}/msr not readable (modprobe msr)"


def probe_hwlat(
    sys_root: Path,
    cpus: frozenset[int],
    vendor: str,
    *,
    duration_s: float,
    limits: Limits = HWLAT_LIMITS,
    dev_root: Path = Path("/dev"),
    progress: bool = True,
) -> Check:
    """Run the hwlat tracer on ``cpus`` for ``duration_s`` and restore every setting it touched."""
    name = "hwlat"
    tracefs = find_tracefs(sys_root)
    if why := _hwlat_unavailable(sys_root, tracefs):
        return skip(name, why, "probe")
    assert tracefs is not None
    smi_cpu = min(cpus)
    smi0 = read_smi_count(dev_root, smi_cpu) if vendor == "GenuineIntel" else None
    settings = {
        "tracing_thresh": str(max(1, round(limits.pass_max * 1000))),
        "tracing_cpumask": _mask(cpus),
        "hwlat_detector/width": "500000",  # hwlatdetect's defaults: sample 0.5 s of every 1 s
        "hwlat_detector/window": "1000000",
    }
    gaps = _trace_hwlat(tracefs, settings, duration_s, Progress(name, duration_s, enabled=progress))
    smi1 = read_smi_count(dev_root, smi_cpu) if smi0 is not None else None
    worst_us = max((g.us for g in gaps), default=0)
    evidence = [
        f"hwlat on CPUs {cpulist.format(cpus)} for {duration_s:g} s (width 0.5 s per 1 s window, "
        f"threshold {settings['tracing_thresh']} us): {len(gaps)} gaps above it"
    ]
    evidence += [
        f"CPU {g.cpu}: inner {g.inner_us} us / outer {g.outer_us} us (x{g.count})" for g in gaps[:10]
    ]
    evidence.append(_smi_evidence(vendor, dev_root, smi_cpu, smi0, smi1))
    return graded(
        name,
        worst_us / 1000,
        limits,
        unit="ms",
        what="longest gap",
        evidence=evidence,
        why=f"the CPUs stopped for {worst_us} us with interrupts off: SMIs or firmware (BIOS power and "
        "RAS settings, the fwupd refresh timer)",
        kind="probe",
        data={"gaps": len(gaps), "smi": None if smi1 is None or smi0 is None else smi1 - smi0},
    )
