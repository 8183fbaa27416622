"""cyclictest and oslat from rt-tests, run with explicit duration and CPUs, their ``--json`` parsed.

Always ``--default-system`` for cyclictest (otherwise it writes 0 to /dev/cpu_dma_latency for the run and
measures a machine that is not the one in production), and always ``-D``/``-c``/``-C`` for oslat (it
defaults to 1 s on every CPU). rt-tests' JSON has keys ending in a colon (``"cmdline:"``,
``"rt_test_version:"``): read them through ``_key``. Histogram buckets are microseconds.
"""

from __future__ import annotations

import contextlib
import json
import logging
import shlex
import shutil
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

from lowtail.errors import LowtailError
from lowtail.node import cpulist
from lowtail.node.process import end_child
from lowtail.render.progress import Progress
from lowtail.validation.check import (
    Check,
    Limits,
    Status,
    fmt,
    histogram_stats,
    merge_ladders,
    pooled_top,
    skip,
)

SHM_STATS = "/dev/shm/cyclictest"  # + pid: cyclictest's running statistics (rt-tests src/cyclictest)
log = logging.getLogger(__name__)
HIST_US = 1000  # cyclictest histogram range in us; later samples count as overflows at the maximum


class RtTestsError(LowtailError, RuntimeError):
    """rt-tests ran but failed, or wrote JSON we cannot read."""


def _key(doc: dict[str, Any], name: str) -> Any:
    """rt-tests 2.x writes some keys with a trailing colon; accept both spellings."""
    return doc.get(name, doc.get(name + ":"))


def cyclictest_cmd(
    cpus: frozenset[int],
    duration_s: float,
    main_cpu: int,
    json_path: Path,
    *,
    fifo: bool,
    interval_us: int = 200,
) -> list[str]:
    return [
        "cyclictest",
        f"--duration={max(1, round(duration_s))}",
        f"--affinity={cpulist.format(cpus)}",
        f"--threads={len(cpus)}",
        f"--mainaffinity={main_cpu}",
        f"--interval={interval_us}",
        f"--histogram={HIST_US}",
        f"--priority={95 if fifo else 0}",
        "--mlockall",
        "--quiet",
        "--default-system",
        f"--json={json_path}",
    ]


def oslat_cmd(cpus: frozenset[int], duration_s: float, main_cpu: int, json_path: Path) -> list[str]:
    return [
        "oslat",
        "-D",
        str(max(1, round(duration_s))),
        "-c",
        cpulist.format(cpus),
        "-C",
        str(main_cpu),
        "--quiet",
        f"--json={json_path}",
    ]


def parse_cyclictest(doc: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Per CPU: percentiles (ms) from the histogram, overflows ranked at the thread's maximum."""
    out: dict[int, dict[str, Any]] = {}
    for thread in (doc.get("thread") or {}).values():
        hist = thread.get("histogram") or {}
        counted = sum(int(v) for v in hist.values())
        cycles = int(thread.get("cycles", counted))
        stats = histogram_stats(hist, float(thread["max"]), overflow=max(0, cycles - counted), divisor=1000)
        stats["overflows"] = max(0, cycles - counted)
        stats["avg_us"] = thread.get("avg")
        stats["min_us"] = thread.get("min")
        out[int(thread["cpu"])] = stats
    if not out:
        raise RtTestsError("cyclictest JSON has no thread results")
    return out


def parse_oslat(doc: dict[str, Any]) -> dict[int, dict[str, Any]]:
    """Per CPU: percentiles (ms) of oslat's loop-to-loop gaps; its last bucket includes overflows."""
    out: dict[int, dict[str, Any]] = {}
    for thread in (doc.get("thread") or {}).values():
        hist = thread.get("histogram") or {}
        stats = histogram_stats(hist, float(thread["max"]), divisor=1000)
        stats["duration_s"] = thread.get("duration")
        stats["freq_mhz"] = thread.get("freq")
        out[int(thread["cpu"])] = stats
    if not out:
        raise RtTestsError("oslat JSON has no thread results")
    return out


def _run(cmd: list[str], json_path: Path, duration_s: float, progress: Progress) -> dict[str, Any]:
    log.debug("running %s", shlex.join(cmd))
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        t0 = time.monotonic()
        while proc.poll() is None:
            progress.update(min(duration_s, time.monotonic() - t0))
            time.sleep(0.2)
        out, err = proc.communicate()
    finally:
        _stop(proc)
    if proc.returncode != 0:
        raise RtTestsError(f"{cmd[0]} exited with {proc.returncode}: {(err or out).strip()[-500:]}")
    try:
        doc: dict[str, Any] = json.loads(json_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise RtTestsError(f"{cmd[0]} wrote no readable JSON at {json_path}: {e}") from None
    return doc


def _stop(proc: subprocess.Popen[str]) -> None:
    """End an rt-tests run cut short (Ctrl-C, an error) and remove what it leaves behind.

    cyclictest keeps its running statistics in ``/dev/shm/cyclictest<pid>`` and unlinks it in its SIGINT
    and SIGTERM handler: ask with SIGTERM first, so it cleans up itself, and only then SIGKILL; the
    segment of a killed run is removed here."""
    end_child(proc)
    for stream in (proc.stdout, proc.stderr):
        if stream:
            stream.close()
    with contextlib.suppress(FileNotFoundError):
        Path(f"{SHM_STATS}{proc.pid}").unlink()


def _grade(name: str, doc: dict[str, Any], per_cpu: dict[int, dict[str, Any]], limits: Limits) -> Check:
    evidence = [f"{_key(doc, 'cmdline')} (rt-tests {_key(doc, 'rt_test_version')})"]
    for cpu, s in sorted(per_cpu.items()):
        s["status"] = str(limits.grade(s["max"]))
        evidence.append(
            f"cpu{cpu}: n={s['n']} p50={fmt(s['p50'])} p99={fmt(s['p99'])} p99.9={fmt(s['p999'])} "
            f"max={fmt(s['max'])} ms"
        )
    worst_cpu = max(per_cpu, key=lambda c: per_cpu[c]["max"])
    w = per_cpu[worst_cpu]
    value = w["max"]
    status = limits.grade(value)
    return Check(
        name=name,
        status=status,
        value=value,
        unit="ms",
        threshold="max per CPU: " + limits.describe("ms"),
        evidence=evidence,
        reason="" if status is Status.PASS else f"max {fmt(value)} ms on CPU {worst_cpu} (n={w['n']})",
        kind="probe",
        data={
            "metric": "max",
            "limits_ms": [limits.pass_max, limits.warn_max],
            "worst_cpu": worst_cpu,
            "cpus": cpulist.format(per_cpu),
            "per_cpu": {str(c): s for c, s in per_cpu.items()},
            "all": {"ladder_worst_cpu": merge_ladders(per_cpu), **pooled_top(per_cpu)},
        },
    )


def probe_rt_test(
    name: str,
    cpus: frozenset[int],
    *,
    duration_s: float,
    main_cpu: int,
    limits: Limits,
    fifo: bool,
    progress_enabled: bool = True,
) -> Check:
    if shutil.which(name) is None:
        return skip(name, f"{name} not installed (apt install rt-tests)", kind="probe")
    with tempfile.TemporaryDirectory(prefix="lowtail-rt-") as tmp:
        path = Path(tmp) / f"{name}.json"
        if name == "cyclictest":
            cmd = cyclictest_cmd(cpus, duration_s, main_cpu, path, fifo=fifo)
        else:
            cmd = oslat_cmd(cpus, duration_s, main_cpu, path)
        progress = Progress(f"{name} cpus {cpulist.format(cpus)}", duration_s, enabled=progress_enabled)
        doc = _run(cmd, path, duration_s, progress)
        progress.finish()
    per_cpu = parse_cyclictest(doc) if name == "cyclictest" else parse_oslat(doc)
    check = _grade(name, doc, per_cpu, limits)
    check.histograms = histograms(doc)
    return check


def histograms(doc: dict[str, Any]) -> dict[int, list[tuple[float, int]]]:
    """Per CPU, rt-tests' histogram as (ms, count), with cyclictest's overflows counted at the maximum:
    the plot then runs to the value the check is graded on."""
    out: dict[int, list[tuple[float, int]]] = {}
    for thread in (doc.get("thread") or {}).values():
        hist = thread.get("histogram") or {}
        pairs = [(int(k) / 1000, int(v)) for k, v in hist.items() if int(v) > 0]
        counted = sum(c for _, c in pairs)
        overflow = max(0, int(thread.get("cycles", counted)) - counted)
        peak = float(thread["max"]) / 1000
        if overflow:
            pairs.append((peak, overflow))
        elif pairs and not any(v >= peak for v, _ in pairs):
            # The maximum is a sample counted in the last bucket (oslat's holds its overflows): move it
            # to where it lies, so the plot runs to it and n stays the run's n.
            top = max(range(len(pairs)), key=lambda i: pairs[i][0])
            value, count = pairs[top]
            pairs[top] = (value, count - 1)
            pairs = [p for p in pairs if p[1] > 0] + [(peak, 1)]
        out[int(thread["cpu"])] = sorted(pairs)
    return out
