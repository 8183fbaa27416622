"""Latency probes on the selected CPUs: deschedule, timer wake-up, and the grading they share.

Each probe starts one measuring process per CPU (``probe_process``), all at once, each pinned to its CPU
before it measures; the caller sits on a housekeeping CPU meanwhile (see ``runner``). Samples come back
in nanoseconds and are graded in milliseconds, on the worst CPU's p99.9: a node is as good as its worst
inference core.
"""

from __future__ import annotations

import json
import logging
import os
import selectors
import shlex
import subprocess
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowtail.errors import LowtailError
from lowtail.node import cpulist
from lowtail.render.progress import Progress
from lowtail.validation.check import (
    Check,
    Limits,
    Status,
    fmt,
    merge_ladders,
    pooled_top,
    tail_stats,
    worst_cpu_interval,
)
from lowtail.validation.evidence import beyond, min_samples, shortfall
from lowtail.validation.intervals import block_maxima, fmt_interval, upper_median
from lowtail.validation.static import read_steal

log = logging.getLogger(__name__)


class ProbeError(LowtailError, RuntimeError):
    """A probe process failed or reported something unreadable."""


# Defaults in ms. deschedule: 0.1 / 1 ms (an isolated CPU measures about 0.02 ms, a throttled RT budget
# 400-470 ms). Timer wake-up through Python and ctypes costs a few us by itself, hence the same scale.
DEFAULT_LIMITS: dict[str, Limits] = {
    "deschedule": Limits(0.1, 1.0),
    "timer": Limits(0.1, 1.0),
    "cyclictest": Limits(0.05, 0.2),
    "oslat": Limits(0.05, 0.2),
    "shm_rtt": Limits(0.1, 1.0),
    "inference": Limits(0.1, 1.0),
}


@dataclass(frozen=True)
class ProbeOptions:
    cpus: frozenset[int]
    samples: int = 10_000
    iteration_us: float = 100.0  # compute per deschedule sample
    interval_us: float = 200.0  # timer period
    duration_s: float = 10.0  # cyclictest / oslat
    main_cpu: int = 0  # where the main threads of rt-tests sit (a housekeeping CPU)
    limits: Mapping[str, Limits] = field(default_factory=lambda: dict(DEFAULT_LIMITS))
    progress: bool = True
    proc_root: Path = Path("/proc")

    def limit(self, name: str) -> Limits:
        return self.limits.get(name, DEFAULT_LIMITS[name])


def run_pinned(
    kind: str, cpus: frozenset[int], samples: int, extra: list[str], progress: Progress | None
) -> dict[int, dict[str, Any]]:
    """Run ``probe_process KIND`` on every CPU at once; return each CPU's result."""
    procs: dict[int, subprocess.Popen[str]] = {}
    results: dict[int, dict[str, Any]] = {}
    done: dict[int, int] = {}
    sel = selectors.DefaultSelector()
    try:
        for cpu in sorted(cpus):
            cmd = [sys.executable, "-m", "lowtail.validation.probe_process", kind, "--cpu", str(cpu)]
            cmd += ["--samples", str(samples), *extra]
            log.debug("running %s", shlex.join(cmd))
            p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            procs[cpu] = p
            assert p.stdout is not None
            sel.register(p.stdout, selectors.EVENT_READ, cpu)
            done[cpu] = 0
        open_pipes = len(procs)
        while open_pipes:
            for key, _ in sel.select(timeout=1.0):
                cpu = key.data
                line = key.fileobj.readline()  # type: ignore[union-attr]
                if not line:
                    sel.unregister(key.fileobj)
                    open_pipes -= 1
                    continue
                try:
                    msg = json.loads(line)
                except json.JSONDecodeError:
                    raise ProbeError(f"{kind} probe on CPU {cpu} wrote {line[:200]!r}") from None
                if "progress" in msg:
                    done[cpu] = int(msg["progress"])
                    if progress:
                        progress.update(sum(done.values()))
                elif "result" in msg:
                    results[cpu] = msg["result"]
        for cpu, p in procs.items():
            rc = p.wait()
            if rc != 0 or cpu not in results:
                err = p.stderr.read() if p.stderr else ""
                raise ProbeError(f"{kind} probe on CPU {cpu} exited with status {rc}: {err.strip()[-500:]}")
    finally:
        sel.close()
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
            for stream in (p.stdout, p.stderr):
                if stream:
                    stream.close()
    return results


def _grade_cpu(
    cpu: int, xs: list[float], limits: Limits, extra: Callable[[int], tuple[dict[str, Any], str]] | None
) -> tuple[dict[str, Any], str]:
    """One CPU's tail statistics with its own status, and its evidence line."""
    stats = tail_stats(xs, over=limits.pass_max)
    note = ""
    if extra is not None:
        more, note = extra(cpu)
        stats.update(more)
    cpu_status = limits.grade(stats["p999"])
    if cpu_status is Status.PASS and shortfall(stats["n"], 0.999):
        cpu_status = Status.WARN
    stats["status"] = str(cpu_status)
    line = (
        f"cpu{cpu}: n={stats['n']} p50={fmt(stats['p50'])} p99={fmt(stats['p99'])} "
        f"p99.9={fmt(stats['p999'])} max={fmt(stats['max'])} ms, {stats['over']} over "
        f"{limits.pass_max:g} ms, p99.9 rests on {beyond(stats['n'], 0.999)} beyond it{note}"
    )
    return stats, line


def _pooled(
    per_cpu_ms: Mapping[int, list[float]], per_cpu: dict[int, dict[str, Any]], limits: Limits
) -> dict[str, Any]:
    """Statistics over every CPU's samples together."""
    everything = [x for xs in per_cpu_ms.values() for x in xs]
    overall = {**tail_stats(everything, over=limits.pass_max), **pooled_top(per_cpu)}
    pooled = sorted((m for xs in per_cpu_ms.values() for m in block_maxima(xs)), reverse=True)
    overall["block_p50"] = upper_median(pooled)  # exact here: every CPU's samples are at hand
    overall["ladder_worst_cpu"] = merge_ladders(per_cpu)
    return overall


def _fewest_samples(per_cpu: dict[int, dict[str, Any]], limits: Limits) -> tuple[str, str]:
    """Every CPU is graded, so the CPU with the fewest samples decides whether the p99.9 is evidence:
    its shortfall (empty: enough) and the note that says so."""
    fewest = min(per_cpu, key=lambda c: per_cpu[c]["n"])
    short = shortfall(per_cpu[fewest]["n"], 0.999)
    if not short:
        return "", ""
    return short, (
        f"{short} (CPU {fewest}: its p99.9 rests on {beyond(per_cpu[fewest]['n'], 0.999)} "
        f"samples beyond it; {per_cpu[fewest]['over']} samples over {limits.pass_max:g} ms)"
    )


def grade(
    name: str,
    per_cpu_ms: Mapping[int, list[float]],
    limits: Limits,
    what: str,
    extra: Callable[[int], tuple[dict[str, Any], str]] | None = None,
) -> Check:
    """Grade per-CPU samples (ms) on the worst CPU's p99.9; percentiles with n and max for each CPU."""
    per_cpu: dict[int, dict[str, Any]] = {}
    evidence = []
    for cpu, xs in sorted(per_cpu_ms.items()):
        per_cpu[cpu], line = _grade_cpu(cpu, xs, limits, extra)
        evidence.append(line)
    worst_cpu = max(per_cpu, key=lambda c: per_cpu[c]["p999"])
    value = per_cpu[worst_cpu]["p999"]
    status = limits.grade(value)
    overall = _pooled(per_cpu_ms, per_cpu, limits)
    ci = worst_cpu_interval({c: sorted(xs) for c, xs in per_cpu_ms.items()})
    evidence.append(
        f"worst CPU's p99.9 {fmt(value)} ms, 95% interval {fmt_interval(ci)} (order statistics; "
        "'open': too few samples to bound it from above)"
    )
    w = per_cpu[worst_cpu]
    reason = ""
    if status is not Status.PASS:
        reason = f"{what} p99.9 {fmt(value)} ms on CPU {worst_cpu} (n={w['n']}, max {fmt(w['max'])} ms)"
    short, note = _fewest_samples(per_cpu, limits)
    if short:
        if status is Status.PASS:
            status = Status.WARN
        # The cause first: a value over the limit is the finding, the sample count only a footnote.
        reason = "; ".join(x for x in (reason, note) if x)
    return Check(
        name=name,
        status=status,
        value=round(value, 6),
        unit="ms",
        threshold="p99.9 per CPU: " + limits.describe("ms"),
        evidence=evidence,
        reason=reason,
        kind="probe",
        data={
            "metric": "p999",
            "ci": ci,
            "limits_ms": [limits.pass_max, limits.warn_max],
            "min_samples": min_samples(0.999),
            "enough_samples": not short,
            "worst_cpu": worst_cpu,
            "cpus": cpulist.format(per_cpu_ms),
            "per_cpu": {str(c): s for c, s in per_cpu.items()},
            "all": overall,
        },
        samples={c: list(xs) for c, xs in per_cpu_ms.items()},
    )


def _steal_delta(before: dict[str, tuple[int, int]], after: dict[str, tuple[int, int]], cpu: int) -> int:
    key = f"cpu{cpu}"
    if key not in before or key not in after:
        return 0
    return after[key][0] - before[key][0]


def probe_deschedule(opts: ProbeOptions) -> Check:
    progress = Progress(
        f"deschedule cpus {cpulist.format(opts.cpus)}", opts.samples * len(opts.cpus), enabled=opts.progress
    )
    steal0 = read_steal(opts.proc_root)
    results = run_pinned(
        "deschedule", opts.cpus, opts.samples, ["--iteration-us", str(opts.iteration_us)], progress
    )
    steal1 = read_steal(opts.proc_root)
    progress.finish()
    tick_ms = 1000.0 / os.sysconf("SC_CLK_TCK")

    def extra(cpu: int) -> tuple[dict[str, Any], str]:
        r = results[cpu]
        sched = r.get("sched", {})
        run_delay_ms = sched.get("run_delay_ns", 0) / 1e6
        nonvol = sched.get("nonvoluntary_ctxt_switches", 0)
        steal_ms = _steal_delta(steal0, steal1, cpu) * tick_ms
        total_desched = sum(r["samples_ns"]) / 1e6
        more = {
            "run_delay_ms": round(run_delay_ms, 3),
            "deschedule_total_ms": round(total_desched, 3),
            "nonvoluntary_switches": nonvol,
            "steal_ms": round(steal_ms, 3),
            "wall_ms": round(r["wall_ns"] / 1e6, 3),
            "loops_per_sample": r["loops"],
        }
        note = (
            f"; total {total_desched:.2f} ms descheduled vs run_delay +{run_delay_ms:.2f} ms, "
            f"{nonvol} involuntary switches, steal +{steal_ms:.0f} ms"
        )
        return more, note

    per_cpu_ms = {cpu: [x / 1e6 for x in r["samples_ns"]] for cpu, r in results.items()}
    check = grade("deschedule", per_cpu_ms, opts.limit("deschedule"), "deschedule", extra)
    check.evidence.insert(
        0,
        f"pinned compute loop of ~{opts.iteration_us:g} us per sample; deschedule = wall - thread CPU "
        "per sample; run_delay from /proc/thread-self/schedstat",
    )
    return check


def probe_timer(opts: ProbeOptions) -> Check:
    progress = Progress(
        f"timer cpus {cpulist.format(opts.cpus)}", opts.samples * len(opts.cpus), enabled=opts.progress
    )
    results = run_pinned("timer", opts.cpus, opts.samples, ["--interval-us", str(opts.interval_us)], progress)
    progress.finish()

    def extra(cpu: int) -> tuple[dict[str, Any], str]:
        sched = results[cpu].get("sched", {})
        nonvol = sched.get("nonvoluntary_ctxt_switches", 0)
        return {"nonvoluntary_switches": nonvol}, f"; {nonvol} involuntary switches"

    per_cpu_ms = {cpu: [x / 1e6 for x in r["samples_ns"]] for cpu, r in results.items()}
    check = grade("timer", per_cpu_ms, opts.limit("timer"), "timer wake-up latency", extra)
    check.evidence.insert(
        0,
        f"clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME) every {opts.interval_us:g} us, timer slack 1 ns, "
        "latency = wake-up time - deadline",
    )
    return check
