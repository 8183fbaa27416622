"""Pin a thread to one CPU and raise its scheduling priority, with detection and logged fallbacks.

Standard library only: the worker calls this before importing numpy or OpenVINO, because threads those
libraries create inherit the mask of the thread that creates them, and OpenVINO sizes its thread pool
from the affinity mask it sees at its first compile (OpenVINO's CPU plugin; it ignores CFS quota,
openvino#37838).

Everything here acts on the calling thread (Linux keeps affinity, nice and scheduling policy per thread)
and is inherited by threads created afterwards, which is why the worker does it first.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lowtail.errors import LowtailError
from lowtail.shm.libc import LIBC

log = logging.getLogger(__name__)

PR_SET_TIMERSLACK = 29
PR_GET_TIMERSLACK = 30


class CpuAffinityError(LowtailError, RuntimeError):
    """The thread could not be pinned to the CPU it was leased (offline, outside the cpuset, ...)."""


def pin_thread_to_cpu(cpu: int) -> None:
    """Pin the calling thread to ``cpu`` and check that the kernel kept exactly that mask."""
    if not isinstance(cpu, int) or cpu < 0:
        raise CpuAffinityError(f"cpu={cpu!r}: expected a CPU number >= 0")
    try:
        os.sched_setaffinity(0, {cpu})
    except OSError as e:
        allowed = sorted(os.sched_getaffinity(0))
        raise CpuAffinityError(
            f"cannot pin to CPU {cpu} ({e.strerror}); this thread may run on CPUs {allowed}"
        ) from None
    actual = os.sched_getaffinity(0)
    if actual != {cpu}:
        raise CpuAffinityError(f"asked for CPU {cpu}, the kernel kept {sorted(actual)}")


@dataclass(frozen=True)
class NiceResult:
    requested: int
    achieved: int
    error: str | None


def raise_priority(nice: int = -20) -> NiceResult:
    """Set the calling thread's nice value; where not permitted keep the current one and say why."""
    try:
        os.setpriority(os.PRIO_PROCESS, 0, nice)  # who=0: the calling thread on Linux
        error = None
    except OSError as e:
        error = f"setpriority({nice}) failed: {e.strerror}"
        log.warning(
            "nice %d not permitted (%s); staying at nice %d",
            nice,
            e.strerror,
            os.getpriority(os.PRIO_PROCESS, 0),
        )
    return NiceResult(requested=nice, achieved=os.getpriority(os.PRIO_PROCESS, 0), error=error)


def raise_threads_priority(nice: int = -20) -> NiceResult:
    """``raise_priority`` for the calling thread, then the same nice value for every other thread of
    this process (threads created afterwards inherit their creator's). Ray's gRPC and event-loop
    threads exist before any actor code runs and receive the actor's calls: left at Ray's nice 15 they
    would hand a call to a thread at -20 only when nothing at -20 wants their CPU."""
    result = raise_priority(nice)
    if result.error is None:
        for tid in os.listdir("/proc/self/task"):
            with contextlib.suppress(OSError):  # a thread that just exited
                os.setpriority(os.PRIO_PROCESS, int(tid), nice)
    return result


def thread_nices() -> list[int]:
    """The nice value of each thread of this process (field 19 of /proc/self/task/<tid>/stat)."""
    nices = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                stat = f.read()
        except OSError:
            continue  # a thread that just exited
        nices.append(int(stat[stat.rindex(")") + 2 :].split()[16]))
    return nices


def enter_idle_class() -> str | None:
    """Put the calling thread in SCHED_IDLE (it runs only when its CPU has nothing else); the error, if any.

    A standby worker compiles and parks on the CPU its primary serves from: in SCHED_IDLE its start-up
    takes only the primary's idle time. Threads it creates afterwards (OpenVINO's) inherit the class.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
    except OSError as e:
        return f"sched_setscheduler(SCHED_IDLE) failed: {e.strerror}"
    return None


def leave_idle_class(nice: int) -> str | None:
    """Every thread of the process back to SCHED_OTHER at ``nice``; the first error, if any.

    Leaving SCHED_IDLE needs CAP_SYS_NICE or RLIMIT_NICE (sched(7)), which is why a standby enters it only
    after it was allowed its nice value. Threads are set one by one: a policy is per thread on Linux.
    """
    error = None
    for name in os.listdir("/proc/self/task"):
        tid = int(name)
        try:
            os.sched_setscheduler(tid, os.SCHED_OTHER, os.sched_param(0))
            os.setpriority(os.PRIO_PROCESS, tid, nice)
        except ProcessLookupError:
            continue  # a thread that just exited
        except OSError as e:
            error = error or f"thread {tid}: back to SCHED_OTHER nice {nice} failed: {e.strerror}"
    return error


def _libc() -> ctypes.CDLL:
    return LIBC


def set_timer_slack_ns(ns: int = 1) -> int:
    """Set the calling thread's timer slack (default 50 us) and return the value read back.

    With the default slack a 0.5 ms sleep or futex timeout really lasts ~0.57 ms.
    """
    libc = _libc()
    if libc.prctl(PR_SET_TIMERSLACK, ctypes.c_ulong(ns), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        log.warning("PR_SET_TIMERSLACK %d ns failed: %s", ns, os.strerror(err))
    return int(libc.prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0))


# RT throttling: the kernel stops every SCHED_FIFO task of a CPU (or of an RT cgroup) once they ran
# sched_rt_runtime_us of a sched_rt_period_us; the 400-470 ms p999 deschedule in the predecessor's write-up
# was exactly that (500000 of 1000000). A worker that holds SCHED_FIFO through back-to-back batches would be
# stopped for the rest of every period. So SchedFifo keeps a credit of SCHED_FIFO time that grows at
# ``budget - RT_MARGIN`` of wall time (capped at RT_BURST_NS) and is spent 1:1 in SCHED_FIFO; at zero the
# worker runs as SCHED_OTHER (on its isolated core that loses nothing) until half the burst is back. Any
# window T then holds at most RT_BURST_NS + (budget - margin) * T of SCHED_FIFO, plus what one batch
# overruns between two checks: 920 ms + 10% of a batch per second at the default 95%.
RT_MARGIN = 0.05
RT_BURST_NS = 20_000_000
PROC_RT = "/proc/sys/kernel"


def _rt_pair(runtime_path: str, period_path: str) -> float | None:
    """runtime/period from two files; None when unreadable or unlimited (runtime -1)."""
    try:
        with open(runtime_path) as f:
            runtime = int(f.read())
        with open(period_path) as f:
            period = int(f.read())
    except (OSError, ValueError):
        return None
    if runtime < 0 or period <= 0:
        return None
    return runtime / period


def rt_budget_share(
    proc_rt: str = PROC_RT, cgroup_file: str = "/proc/self/cgroup", cgroup_root: str = "/sys/fs/cgroup"
) -> float | None:
    """The share of each RT period SCHED_FIFO may run here, or None when unlimited.

    The smaller of the global budget and, with RT group scheduling (cgroup v1 ``cpu`` controller), the
    calling process's cgroup budget. cgroup v2 has no RT budget of its own.
    """
    shares = [_rt_pair(f"{proc_rt}/sched_rt_runtime_us", f"{proc_rt}/sched_rt_period_us")]
    try:
        with open(cgroup_file) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        fields = line.split(":", 2)
        if len(fields) != 3:
            continue  # not "id:controllers:path": nothing to read from it
        _, controllers, path = fields
        if "cpu" in controllers.split(",") and path not in ("", "/"):
            for mount in (controllers, "cpu", "cpu,cpuacct"):
                d = f"{cgroup_root}/{mount}{path}"
                if os.path.exists(f"{d}/cpu.rt_runtime_us"):
                    shares.append(_rt_pair(f"{d}/cpu.rt_runtime_us", f"{d}/cpu.rt_period_us"))
                    break
    known = [x for x in shares if x is not None]
    return min(known) if known else None


class SchedFifo:
    """SCHED_FIFO around inference, SCHED_OTHER otherwise, only where the kernel permits it.

    ``detect()`` tries once (FIFO then straight back to OTHER). Where it fails (no CAP_SYS_NICE,
    RLIMIT_RTPRIO 0, a cgroup without an RT budget) the fallback is logged once and ``enter``/``leave``
    do nothing: a worker never fails because of its priority. A later failure (for example the RT budget
    removed at run time) disables it with one more log line. Switching back to SCHED_OTHER keeps the
    nice value, so the nice -20 fallback still holds between inferences.

    ``enter`` is cheap when already in SCHED_FIFO (no system call), so a caller may call it per batch.
    Where the RT budget is limited it keeps a credit of SCHED_FIFO time (see RT_BURST_NS): short idle
    gaps do not reset it and a batch longer than any slice is charged in full; when it is spent,
    ``enter`` switches to SCHED_OTHER and stays there until half the burst is back. The check runs at
    ``enter``, i.e. per batch, so the credit can overrun by one batch.
    """

    def __init__(
        self,
        priority: int = 1,
        budget_share: float | None = None,
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.priority = priority
        self.available = False
        self.active = False  # SCHED_FIFO now (enter/leave are idempotent: no syscall when unchanged)
        self.reason = "not detected yet"
        self.cooldowns = 0  # times the spent credit kept the thread in SCHED_OTHER (diagnostics, tests)
        self._cooling = False
        self.switches = 0  # policy changes made (two system calls per batch in the "call" scope)
        self._fifo = os.sched_param(priority)
        self._other = os.sched_param(0)
        self._clock = clock
        self.budget_share = budget_share
        # The share of wall time SCHED_FIFO may take; None: the RT budget is unlimited.
        self.duty = None if budget_share is None else budget_share - RT_MARGIN
        self._credit = float(RT_BURST_NS)
        self._at = clock()  # when the credit was last brought up to date

    def _account(self, now: int) -> None:
        assert self.duty is not None
        dt = now - self._at
        self._at = now
        credit = self._credit + self.duty * dt - (dt if self.active else 0)
        self._credit = credit if credit < RT_BURST_NS else float(RT_BURST_NS)

    def detect(self) -> bool:
        if self.duty is not None and self.duty <= 0:
            self.available = False
            self.reason = (
                f"the RT budget is {self.budget_share:.0%} of each period: too small to hold "
                f"SCHED_FIFO without being throttled"
            )
            log.warning("SCHED_FIFO unused, using nice only: %s", self.reason)
            return False
        try:
            os.sched_setscheduler(0, os.SCHED_FIFO, self._fifo)
            os.sched_setscheduler(0, os.SCHED_OTHER, self._other)
        except OSError as e:
            self.available = False
            self.reason = f"sched_setscheduler(SCHED_FIFO, {self.priority}) failed: {e.strerror}"
            log.warning("SCHED_FIFO unavailable, using nice only: %s", self.reason)
            return False
        self.available = True
        self.reason = "permitted"
        return True

    def enter(self) -> None:
        if not self.available:
            return
        if self.duty is not None:
            self._account(self._clock())
            if self._credit <= 0 or (not self.active and self._credit < RT_BURST_NS / 2):
                # Spent, or not yet half back: SCHED_OTHER before the kernel throttles us.
                if not self._cooling:
                    self._cooling = True
                    self.cooldowns += 1
                self.leave()
                return
            self._cooling = False
        if not self.active:
            self._switch(True)

    def leave(self) -> None:
        if self.active:
            if self.duty is not None:
                self._account(self._clock())  # charge the stretch in SCHED_FIFO
            self._switch(False)

    def _switch(self, fifo: bool) -> None:
        try:
            if fifo:
                os.sched_setscheduler(0, os.SCHED_FIFO, self._fifo)
            else:
                os.sched_setscheduler(0, os.SCHED_OTHER, self._other)
            self.active = fifo
            self.switches += 1
        except OSError as e:
            self._give_up(e)

    def _give_up(self, e: OSError) -> None:
        self.available = False
        self.active = os.sched_getscheduler(0) == os.SCHED_FIFO
        self.reason = f"sched_setscheduler failed at run time: {e.strerror}"
        log.warning("SCHED_FIFO disabled: %s", self.reason)


def start_pinned(proc: Any, cpu: int) -> None:
    """``proc.start()`` with the child born on ``cpu``; the calling thread's mask is restored.

    A spawned child inherits the mask of the thread that forks it, so it is on its CPU before its first
    instruction, including whatever multiprocessing imports before the target runs (the parent's
    ``__main__``); the target pins itself again and verifies.
    """
    saved = os.sched_getaffinity(0)
    try:
        try:
            os.sched_setaffinity(0, {cpu})
        except OSError as e:
            raise CpuAffinityError(
                f"cannot start a process on CPU {cpu} ({e.strerror}); allowed CPUs: {sorted(saved)}"
            ) from None
        proc.start()
    finally:
        os.sched_setaffinity(0, saved)
