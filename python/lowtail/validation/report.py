"""Render a validation report: a terminal table, JSON, and a self-contained HTML page with plots.

The HTML embeds its PNGs as base64 ``data:`` URIs, so the one file can be fetched from a node by
Ansible and opened anywhere.
"""

from __future__ import annotations

import json
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lowtail.render import html, style, table
from lowtail.validation import core_to_core, plots
from lowtail.validation.check import Check, Status, fmt
from lowtail.validation.runner import Report

STATUS_COLOR = {"pass": "#1a7f37", "warn": "#9a6700", "fail": "#cf222e", "skip": "#6e7781"}
HEAT_METRIC = {"deschedule": "p999", "timer": "p999", "shm_rtt": "p999", "cyclictest": "max", "oslat": "max"}


# What to do about a check that did not pass, in one line: the role or setting that fixes it.
FIXES: dict[str, str] = {
    "topology": "run on bare metal (or a VM exposing real sockets/NUMA); --allow-virtual accepts a VM",
    "kernel_args": "apply the plan's kernel arguments (roles/lowtail_kernel) and reboot",
    "isolation": "boot with the plan's isolcpus/nohz_full (roles/lowtail_kernel) and reboot",
    "rt_budget": "set kernel.sched_rt_runtime_us to 950000 or more (roles/lowtail_tuning)",
    "numa_balancing": "set kernel.numa_balancing=0 (roles/lowtail_tuning)",
    "irq_affinity": "move IRQs to housekeeping CPUs and ban the isolated ones in irqbalance "
    "(roles/lowtail_tuning)",
    "governor": "set the performance governor on isolated CPUs (roles/lowtail_tuning)",
    "thp": "set transparent_hugepage to never (roles/lowtail_tuning)",
    "sched_fifo": "grant CAP_SYS_NICE and an RT budget to the runtime (docs/validation.md)",
    "rt_group_sched": "boot without RT group scheduling limits (docs/validation.md)",
    "dev_shm": "enlarge /dev/shm (a memory-backed emptyDir in pods) to what the queues need",
    "queue_core": "install the lowtail-native wheel (make native; the wheelhouse carries it), or unset "
    "LOWTAIL_PURE_PYTHON",
    "steal": "move the node off an oversubscribed hypervisor: steal is CPU time taken by the host",
    "kubelet": "apply the kubelet settings (roles/lowtail_kubelet)",
    "affinity": "fix the runtime's CPU affinity: see the reason for the OCI runtime fix (docs/validation.md)",
    "cstates": "limit deep C-states on isolated CPUs (lowtail_kernel_cstate_limit, or PM QoS)",
    "firmware": "change what the reason names (a BIOS setting, or the plan's kernel arguments)",
    "cfs_throttle": "remove the CFS quota from exclusive-CPU containers (the reason names the way for "
    "your Kubernetes version)",
    "leased_threads": "move the named threads off the leased CPUs (their cgroup's cpuset or CPUAffinity)",
    "core_to_core": "recompute the plan on this machine (lowtail plan) so each worker's pool is its L3 "
    "group; a warn alone: the vCPUs' caches are not what the reported topology says",
    "hwlat": "firmware interrupts (SMIs) or a hypervisor stall the CPU: check BIOS power settings",
    "numa": "check the NUMA policy of the pod (memory manager Static, topology manager single-numa-node)",
}
PROBE_FIX = (
    "find what shares the CPU: leased_threads, irq_affinity, steal and the evidence (docs/validation.md)"
)
SAMPLES_FIX = "run again with --samples {n} or more (docs/validation.md: how many samples a p99.9 needs)"


def _fmt_value(c: dict[str, Any]) -> str:
    v = c.get("value")
    if v is None:
        return "-"
    text = ", ".join(f"{k}={fmt(x)}" for k, x in v.items()) if isinstance(v, dict) else fmt(v)
    return f"{text} {c.get('unit', '')}".strip()


def _why(c: dict[str, Any]) -> str:
    if c.get("reason"):
        return str(c["reason"])
    ev = [str(e) for e in c.get("evidence") or []]
    worst_cpu = (c.get("data") or {}).get("worst_cpu")
    if worst_cpu is not None:  # a probe that passed: its worst CPU's percentiles, with n and max
        line = next((e for e in ev if e.startswith(f"cpu{worst_cpu}:")), None)
        if line:
            return line
    return ev[0] if ev else ""


def _short_only(c: dict[str, Any], data: dict[str, Any]) -> bool:
    """Too few samples is the cause only when the value itself is within the pass limit: more samples
    will not make an 8 ms p99.9 pass a 0.1 ms limit."""
    limits = data.get("limits_ms")
    value = c.get("value")
    if data.get("enough_samples") is not False:
        return False
    if not (isinstance(limits, list) and limits and isinstance(value, int | float)):
        return True
    return float(value) <= float(limits[0])


def fix(c: dict[str, Any]) -> str:
    """The one-line fix of a check that did not pass: for its cause, not for its name."""
    data = c.get("data") or {}
    if _short_only(c, data):
        return SAMPLES_FIX.format(n=f"{data.get('min_samples', 0):,}")
    if data.get("fixes"):
        return "; ".join(str(f) for f in data["fixes"])
    if str(c.get("reason", "")).startswith("probe could not run"):
        return "see the reason: the probe itself could not run"
    return FIXES.get(c["name"], PROBE_FIX if c.get("kind") == "probe" else "see docs/validation.md")


def problems(report: dict[str, Any]) -> list[dict[str, Any]]:
    """Failed checks, then warned ones, each with its one-line reason and fix."""
    rank = {"fail": 0, "warn": 1}
    bad = [c for c in report["checks"] if c["status"] in rank]
    bad.sort(key=lambda c: rank[c["status"]])
    return [
        {"name": c["name"], "status": c["status"], "value": _fmt_value(c), "why": _why(c), "fix": fix(c)}
        for c in bad
    ]


def _headline(head: dict[str, Any]) -> str:
    return (
        f"headline: p99.9 deschedule {fmt(float(head['p999_deschedule_ms']))} ms on CPU {head['cpu']} "
        f"(n={head['n']}, max {fmt(float(head['max_ms']))} ms); the predecessor system: 400-470 ms on "
        "VMware with sched_rt_runtime_us=500000, 0.02 ms at 950000"
    )


def _result_line(s: dict[str, Any]) -> str:
    counts = ", ".join(f"{n} {k}" for k, n in s["counts"].items() if n)
    if s.get("interrupted"):
        return f"result: INTERRUPTED, partial: {s['status'].upper()} so far ({counts}); exit 130"
    return f"result: {s['status'].upper()} ({counts})"


def render_table(report: dict[str, Any], width: int | None = None) -> str:
    """The verdict and the deciding number first, then what needs attention, every check, and the
    verdict again at the end (where a scrolled terminal leaves the eye)."""
    width = width or table.terminal_width()
    s = report["summary"]
    h = report["host"]
    verdict = style.paint(_result_line(s), s["status"])
    head = s.get("headline")
    out = [verdict]
    if head:
        out += textwrap.wrap(_headline(head), width, subsequent_indent="  ")
    out += textwrap.wrap(
        f"lowtail validate on {h.get('hostname')} ({h.get('cpu_model')}, kernel {h.get('kernel') or '-'}), "
        f"probe CPUs {s.get('probe_cpus') or '-'}; figures in ms unless stated",
        width,
    )
    out.append("")
    bad = problems(report)
    if bad:
        rows = [[p["status"].upper(), p["name"], f"{p['why']}. Fix: {p['fix']}"] for p in bad]
        out += [
            table.render(["status", "check", "why, and the fix"], rows, title="Needs attention:", width=width)
        ]
        out.append("")
    rows = [[c["name"], c["status"].upper(), _fmt_value(c), _why(c)] for c in report["checks"]]
    out.append(
        table.render(["check", "status", "value", "why / evidence"], rows, title="All checks:", width=width)
    )
    out.append("")
    out.append(verdict)
    return "\n".join(out)


def render_junit(report: dict[str, Any]) -> str:
    """Each check a JUnit test case: fail a failure, skip skipped, warn passed with its reason shown."""
    from lowtail.render import junit

    outcome = {"pass": "passed", "warn": "passed", "fail": "failure", "skip": "skipped"}
    cases = []
    for c in report["checks"]:
        why = str(c.get("reason") or "")
        message = f"{c['status'].upper()} {_fmt_value(c)}: {why or _why(c)}".strip()
        if c["status"] == "fail":
            message += f". Fix: {fix(c)}"
        evidence = "\n".join(str(e) for e in c.get("evidence") or [])
        cases.append(junit.Case(c["name"], outcome[c["status"]], message, f"{message}\n{evidence}".strip()))
    host = str(report["host"].get("hostname"))
    return junit.render(
        "lowtail validate", f"lowtail.validate.{host}", cases, report["summary"].get("elapsed_s", 0)
    )


def write_json(report: Report, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report.to_dict(), indent=2) + "\n")


def _limits(c: Check) -> tuple[float, float] | None:
    lim = c.data.get("limits_ms")
    return (float(lim[0]), float(lim[1])) if lim else None


def _series(c: Check) -> dict[int, list[tuple[float, int]]]:
    if c.histograms:
        return c.histograms
    return {cpu: [(x, 1) for x in xs] for cpu, xs in c.samples.items() if xs}


def figures(checks: Sequence[Check]) -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = []
    heat: dict[str, dict[int, float]] = {}
    heat_limits: dict[str, tuple[float, float]] = {}
    for c in checks:
        if c.name == "leased_threads" and c.status is not Status.SKIP:
            title = f"leased_threads: other threads on leased CPUs ({c.status}, worst {fmt(c.value)} ms/s)"
            out.append((title, plots.offender_bars(c.data["leased_cpus"], c.data["window_s"], title)))
        if c.name == core_to_core.NAME and c.status is not Status.SKIP and c.data.get("matrix_ns"):
            out.append(core_to_core.figure(c))
        if c.kind != "probe" or c.status is Status.SKIP or "per_cpu" not in c.data:
            continue
        per_cpu = c.data["per_cpu"]
        metric = HEAT_METRIC.get(c.name, "p999")
        label = "p99.9" if metric == "p999" else metric
        heat[f"{c.name} {label}"] = {int(cpu): float(s[metric]) for cpu, s in per_cpu.items() if s.get("n")}
        lim = _limits(c)
        if lim:
            heat_limits[f"{c.name} {label}"] = lim
        series = _series(c)
        graded = "p99.9" if c.data.get("metric", "p999") == "p999" else "max"
        n = min((int(s["n"]) for s in per_cpu.values() if s.get("n")), default=0)
        peak = max((float(s["max"]) for s in per_cpu.values() if s.get("n")), default=0.0)
        title = f"{c.name}: {c.status.upper()}, graded on the worst CPU's {graded} = {fmt(c.value)} ms"
        title += f"; max {fmt(peak)} ms" if graded != "max" else ""
        title += f"; n={n} per CPU" if len(per_cpu) > 1 else f"; n={n}"
        if series:
            png = plots.latency_histogram(title, series, _limits(c), (graded, float(c.value or 0.0)))
        else:  # a report without samples (rebuilt from JSON): the quantile ladder
            ladders = {int(cpu): s["ladder"] for cpu, s in per_cpu.items() if s.get("ladder")}
            png = plots.latency_cdf(title, None, ladders, _limits(c))
        out.append((title, png))
    # Only when a probe measured several CPUs (shm_rtt's one client CPU is not a second): else the tables
    # say it all.
    if heat and max(len(row) for row in heat.values()) > 1:
        title = "Per-CPU tail: one colour scale per metric, its limits marked (ms)"
        out.append((title, plots.heat_strip(heat, "per-CPU tail (ms)", limits=heat_limits)))
    return out


def _flat(prefix: str, v: Any) -> list[tuple[str, str]]:
    """Host fields as table rows: nested objects as dotted keys, lists joined, never a Python repr."""
    if isinstance(v, dict):
        rows: list[tuple[str, str]] = []
        for k, x in v.items():
            rows += _flat(f"{prefix}.{k}" if prefix else str(k), x)
        return rows
    if isinstance(v, list):
        return [(prefix, ", ".join(str(x) for x in v) or "-")]
    return [(prefix, "-" if v in (None, "") else str(v))]


def render_html(report: Report) -> str:
    """The self-contained page (``validate.html.j2``): verdict, headline, checks, plots, host."""
    d = report.to_dict()
    checks = [
        {
            "name": c["name"],
            "status": c["status"],
            "value": _fmt_value(c),
            "threshold": c.get("threshold", ""),
            "why": _why(c),
            "evidence": [str(e) for e in c.get("evidence") or []],
        }
        for c in d["checks"]
    ]
    # The plan is long and already in the JSON.
    host_rows = _flat("", {k: v for k, v in d["host"].items() if k != "plan"})
    settings_rows = _flat("", d.get("settings") or {})
    return html.render(
        "validate.html.j2",
        colors=STATUS_COLOR,
        summary=d["summary"],
        headline=d["summary"].get("headline"),
        hostname=str(d["host"].get("hostname")),
        probe_cpus=str(d["summary"].get("probe_cpus")),
        host_rows=host_rows,
        settings_rows=settings_rows,
        problems=problems(d),
        headline_text=_headline(d["summary"]["headline"]) if d["summary"].get("headline") else "",
        checks=checks,
        images=[html.Image(alt, png) for alt, png in figures(report.checks)],
    )


def write_html(report: Report, path: str | Path) -> None:
    Path(path).write_text(render_html(report))
