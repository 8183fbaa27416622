"""The measuring side of the probes: one process per CPU, pinned before it does anything else.

Run as ``python -m lowtail.validation.probe_process {deschedule|timer} --cpu N --samples N ...``. It writes
JSON lines to stdout: ``{"progress": k}`` now and then, and one final ``{"result": {...}}`` with the raw
samples in nanoseconds. Only the standard library is imported, so the measured process is small and
nothing else (numpy's thread pools, OpenVINO) shares its CPU.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import signal
import sys
import time
from typing import Any

from lowtail.shm.libc import LIBC

PROGRESS_EVERY = 500
PR_SET_TIMERSLACK = 29
CLOCK_MONOTONIC = 1
TIMER_ABSTIME = 1


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def thread_sched() -> dict[str, int]:
    """The scheduler's view of this thread: CPU time, time spent runnable but waiting, switches.

    /proc/thread-self/schedstat is ``sum_exec_runtime run_delay pcount`` in ns; status has the
    voluntary/nonvoluntary context switch counters.
    """
    out: dict[str, int] = {}
    try:
        with open("/proc/thread-self/schedstat") as f:
            cpu_ns, run_delay_ns, _ = (int(x) for x in f.read().split())
        out.update(cpu_ns=cpu_ns, run_delay_ns=run_delay_ns)
    except (OSError, ValueError):
        pass
    try:
        with open("/proc/thread-self/status") as f:
            for line in f:
                if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                    key, _, value = line.partition(":")
                    out[key.strip()] = int(value)
    except (OSError, ValueError):
        pass
    return out


def _delta(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before[k] for k in before if k in after}


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj, separators=(",", ":")) + "\n")
    sys.stdout.flush()


def calibrate(iteration_us: float) -> int:
    """Loop count whose thread CPU time is about ``iteration_us`` (the median of a few tries)."""
    n = 1000
    tries = []
    for _ in range(7):
        c0 = time.thread_time_ns()
        acc = 0
        for k in range(n):
            acc ^= k
        tries.append(max(1, time.thread_time_ns() - c0))
    per_loop = sorted(tries)[len(tries) // 2] / n
    return max(10, int(iteration_us * 1000 / per_loop))


def run_deschedule(samples: int, iteration_us: float) -> dict[str, Any]:
    """Per iteration of a fixed compute loop: wall time minus this thread's CPU time (deschedule_ms,
    with thread CPU instead of process CPU so other threads cannot hide it)."""
    loops = calibrate(iteration_us)
    wall_clock, cpu_clock = time.perf_counter_ns, time.thread_time_ns
    out: list[int] = []
    append = out.append
    before = thread_sched()
    t0 = wall_clock()
    for i in range(samples):
        w0 = wall_clock()
        c0 = cpu_clock()
        acc = 0
        for k in range(loops):
            acc ^= k
        c1 = cpu_clock()
        w1 = wall_clock()
        d = (w1 - w0) - (c1 - c0)
        append(d if d > 0 else 0)
        if i % PROGRESS_EVERY == PROGRESS_EVERY - 1:
            _emit({"progress": i + 1})
    wall = wall_clock() - t0
    return {
        "samples_ns": out,
        "loops": loops,
        "wall_ns": wall,
        "sched": _delta(before, thread_sched()),
    }


def run_timer(samples: int, interval_us: float) -> dict[str, Any]:
    """Wake-up latency of clock_nanosleep(TIMER_ABSTIME) at a fixed interval, timer slack 1 ns.

    Absolute deadlines on a fixed grid: a late wake-up does not shift the next deadline, so a stall is
    counted once per missed period rather than hidden (no coordinated omission).
    """
    libc = LIBC
    # The default 50 us slack would be measured as latency; workers set 1 ns too.
    libc.prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(1), 0, 0, 0)
    sleep = libc.clock_nanosleep
    sleep.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.POINTER(_Timespec), ctypes.c_void_p]
    interval = int(interval_us * 1000)
    now = time.clock_gettime_ns
    ts = _Timespec()
    ref = ctypes.byref(ts)
    out: list[int] = []
    append = out.append
    before = thread_sched()
    target = now(time.CLOCK_MONOTONIC) + interval
    for i in range(samples):
        ts.tv_sec, ts.tv_nsec = divmod(target, 1_000_000_000)
        sleep(CLOCK_MONOTONIC, TIMER_ABSTIME, ref, None)
        late = now(time.CLOCK_MONOTONIC) - target
        append(late if late > 0 else 0)
        target += interval
        if late > interval:  # skip the deadlines already missed, counting the stall once
            target += (late // interval) * interval
        if i % PROGRESS_EVERY == PROGRESS_EVERY - 1:
            _emit({"progress": i + 1})
    return {"samples_ns": out, "interval_ns": interval, "sched": _delta(before, thread_sched())}


def main(argv: list[str] | None = None) -> int:
    # Ctrl-C reaches the whole process group: the measuring child ends at once and quietly (no
    # KeyboardInterrupt traceback); the validator reports what it had and ends the others.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    p = argparse.ArgumentParser(prog="probe_process")
    p.add_argument("kind", choices=["deschedule", "timer"])
    p.add_argument("--cpu", type=int, required=True)
    p.add_argument("--samples", type=int, required=True)
    p.add_argument("--iteration-us", type=float, default=100.0)
    p.add_argument("--interval-us", type=float, default=200.0)
    args = p.parse_args(argv)
    # Pin first: everything after this line, including the imports json already did, runs on the CPU.
    os.sched_setaffinity(0, {args.cpu})
    if args.kind == "deschedule":
        result = run_deschedule(args.samples, args.iteration_us)
    else:
        result = run_timer(args.samples, args.interval_us)
    result["cpu"] = args.cpu
    result["affinity"] = sorted(os.sched_getaffinity(0))
    _emit({"result": result})
    return 0


if __name__ == "__main__":
    sys.exit(main())
