"""A reproducible co-tenant for benchmarks: one busy loop at normal priority pinned on each given CPU.

Stands for the other work of a shared host (a sampler's environment step, a neighbour's job): every
time a measured process sleeps, the CPU goes to the busy loop, and waking the measured process means
preempting it (CFS wake-up preemption; at nice -20 against nice 0 the loop gets about 1% of a CPU the
measured process wants, sched-nice-design in the kernel docs). Started before and stopped after the
measurement; each loop exits on its stop flag, its deadline, or the death of the process that started
it (PR_SET_PDEATHSIG and a parent check), so none outlives its benchmark.
"""

from __future__ import annotations

import contextlib
import ctypes
import multiprocessing as mp
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

PR_SET_PDEATHSIG = 1  # linux/prctl.h
MAX_S = 4 * 3600.0  # no benchmark runs this long: a bound, not a duration


def _busy(cpu: int, parent: int, flag: Any, ready: Any, max_s: float) -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.sched_setaffinity(0, {cpu})
    with contextlib.suppress(PermissionError):  # normal priority whatever the parent's was
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, 0, 0)
    ready.release()
    deadline = time.monotonic() + max_s
    n = 0
    while flag.value == 0:
        n += 1
        if n % 100_000 == 0 and (os.getppid() != parent or time.monotonic() > deadline):
            return


@contextlib.contextmanager
def co_tenants(cpus: list[int], max_s: float = MAX_S) -> Iterator[list[int]]:
    """Run a busy loop on each of ``cpus`` for the duration of the block; yields their pids."""
    ctx = mp.get_context("spawn")
    flag = ctx.RawValue("i", 0)
    ready = ctx.Semaphore(0)
    procs = [ctx.Process(target=_busy, args=(cpu, os.getpid(), flag, ready, max_s)) for cpu in cpus]
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # deaf to the group's Ctrl-C: stopped below
    try:
        for p in procs:
            p.start()
        signal.signal(signal.SIGINT, old)
        for _ in procs:
            if not ready.acquire(timeout=60):
                raise RuntimeError(f"co-tenant on CPUs {cpus}: a busy loop did not start in 60 s")
        yield [p.pid for p in procs if p.pid is not None]
    finally:
        signal.signal(signal.SIGINT, old)
        flag.value = 1
        for p in procs:
            if p.pid is not None:
                p.join(10)
                if p.is_alive():
                    p.kill()
                    p.join(5)
