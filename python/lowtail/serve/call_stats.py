"""Per-call inference metrics, the ``slow_infer`` line and windowed percentiles.

Per call the worker records wall time, process CPU time and thread CPU time, and the predecessor system's
deschedule = max(0, wall - process CPU): time the call was runnable or waiting but not
running. The kernel's own view is recorded next to it: the growth of ``run_delay`` (ns spent runnable
but waiting for a CPU, /proc/thread-self/schedstat field 2) and of involuntary context switches. When
the cause is CPU contention deschedule ~ run_delay growth; preemption by a hypervisor is counted as CPU
time by the guest and shows in neither (pair it with steal time).

What a read costs decides how often it is made (measured on the 2-vCPU KVM guest, best of 5, see
docs/benchmarks.md): CLOCK_MONOTONIC/perf_counter 0.05 us (vDSO), the thread CPU clock 1.5 us, the
process CPU clock 2.9 us (it sums every thread), schedstat pread 5.5 us, getrusage 2.2 us. So per call
the worker reads the wall and thread CPU clocks; the process CPU clock and the two scheduler counters
are read on every ``stats_every``-th call (``sampled``) and on every call whose wall - thread CPU shows
it was descheduled. On the other calls ``cpu_ms`` is the thread's CPU time (an isolated worker has one
busy thread: the sampled calls' process/thread ratio, checked by ``WorkerProcess.isolation``, proves it)
and run_delay/nivcsw growth is carried to the next row that reads them, so their sums stay exact and a
descheduled call carries its own growth.

The hot path only reads clocks and counters and stores one row; percentiles are computed with numpy at
report time over a fixed-size ring (``CallRing`` in ``lowtail.serve.stats_segment`` for the worker,
``LatencyWindow`` here for anyone else).
"""

from __future__ import annotations

import operator
import os
import resource
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

# Re-exported ("as" form, for mypy): the worker's reports and the serve benchmark name it metrics.Percentiles.
from lowtail.telemetry.percentiles import Percentiles as Percentiles  # noqa: PLC0414


@dataclass(slots=True, init=False)
class CallRow:
    """One row per handled batch, stored as float64 in this field order (the layout of the shared ring).

    The fields are the one list of the row's names: ``CALL_FIELDS`` is read from them, the worker sets
    each by name and packs them in ``CALL_FIELDS`` order (``call_values``), and readers index by
    ``COL[name]``, so a field cannot be added, dropped or moved in one place only. A field the worker
    never sets has no value (no default): packing the row raises AttributeError on the first call.
    """

    t_end_s: float  # CLOCK_MONOTONIC at the end of the call
    wall_ms: float  # claim returned -> results written back
    cpu_ms: float  # process CPU time over the same interval on sampled calls, else the thread's (see below)
    thread_cpu_ms: float  # the serving thread's CPU time over the same interval
    deschedule_ms: float  # max(0, wall - cpu_ms): the predecessor system's formula
    engine_wall_ms: float  # model execution only (the exporters' infer_exec_ms)
    engine_cpu_ms: float  # as cpu_ms, inside infer()
    engine_thread_cpu_ms: float
    run_delay_ms: float  # growth of schedstat run_delay since the previous read (see below)
    nivcsw: float  # growth of involuntary context switches since the previous read
    batch: float  # samples in the engine call (the exporters' batch_size)
    slots: float  # requests merged into it
    queue_wait_ms: float  # the longest publish -> claim wait among its requests
    # Where the worker's time goes beyond infer() (``lowtail bench serve --breakdown``), in us:
    claim_us: float  # the poll that took the first request -> claim() returned: decode, merge, coalescing
    check_us: float  # checking the inputs against the model
    fifo_us: float  # the SCHED_FIFO enter/leave system calls
    answer_us: float  # Batch.complete: split, copy outputs back, publish, wake parked samplers
    measure_us: float  # reading clocks and scheduler counters inside the call
    record_us: float  # writing the previous call's row and counters (measured there, stored here)
    overhead_us: float  # the sum of the six above: the worker's cost per call beyond infer()
    # The futex wakes of parked samplers, reported on their own (the first wake of a halted vCPU costs
    # the waker tens of us: the scheduler's price, not the worker's); after overhead_us, so the columns
    # before keep their places:
    wake_us: float  # of answer_us: the futex-wake system calls that woke parked samplers
    woken: float  # the lanes those wakes woke
    overhead_less_wakes_us: float  # overhead_us - wake_us: the worker's own cost per call


CALL_FIELDS: tuple[str, ...] = tuple(f.name for f in fields(CallRow))
# The row's values in CALL_FIELDS order, for the ring's writer (one C-level call, no Python loop).
call_values: Callable[[CallRow], tuple[float, ...]] = operator.attrgetter(*CALL_FIELDS)
COL = {name: i for i, name in enumerate(CALL_FIELDS)}


# The predecessor system's format, with the kernel's counters appended after its fields.
SLOW_INFER_FORMAT = (
    "slow_infer hero=%s cpu=%d slots=%d total_batch=%d "
    "engine_cpu_ms=%.1f engine_thread_cpu_ms=%.1f engine_wait_ms=%.1f "
    "wall_ms=%.1f deschedule_ms=%.1f "
    "sched_fifo=%s affinity=process_isolated threads=%d run_delay_ms=%.1f nivcsw=%d"
)


class ThreadCounters:
    """The calling thread's scheduler counters, cheap enough for every call.

    The schedstat file stays open and is re-read with pread (seq_file regenerates it at offset 0);
    open it in the thread it describes, since /proc/thread-self resolves at open time. Involuntary
    switches come from getrusage(RUSAGE_THREAD), the same counter (task->nivcsw) that
    /proc/thread-self/status prints as nonvoluntary_ctxt_switches, without formatting ~1.5 kB of text.
    """

    def __init__(self) -> None:
        self._fd = os.open("/proc/thread-self/schedstat", os.O_RDONLY | os.O_CLOEXEC)

    def run_delay_ns(self) -> int:
        return int(os.pread(self._fd, 96, 0).split()[1])

    @staticmethod
    def nivcsw() -> int:
        return resource.getrusage(resource.RUSAGE_THREAD).ru_nivcsw

    def close(self) -> None:
        os.close(self._fd)


def status_nonvoluntary_switches(path: str = "/proc/thread-self/status") -> int:
    """nonvoluntary_ctxt_switches from a status file (the slow, textual source of ``nivcsw``)."""
    with open(path) as f:
        for line in f:
            if line.startswith("nonvoluntary_ctxt_switches:"):
                return int(line.split()[1])
    raise ValueError(f"{path}: no nonvoluntary_ctxt_switches line")


def percentiles(values: Iterable[float] | np.ndarray) -> Percentiles:
    """n, mean, p50/p99/p99.9 (nearest rank), max: one definition shared with the exporters.

    A p99.9 of fewer than ~3,000 samples is an anecdote; the count travels with it.
    """
    return Percentiles.of(np.asarray(values, dtype=np.float64).ravel())


def summarize(rows: np.ndarray, fields: Sequence[str] | None = None) -> dict[str, Percentiles]:
    """Percentiles per field of call rows shaped (n, len(CALL_FIELDS))."""
    names = fields or [f for f in CALL_FIELDS if f != "t_end_s"]
    return {f: percentiles(rows[:, COL[f]]) for f in names}


def slow_infer_args(
    hero: str, cpu: int, row: Sequence[float], sched_fifo: bool, threads: int
) -> tuple[Any, ...]:
    """Arguments for ``log.warning(SLOW_INFER_FORMAT, *args)`` from one call row."""
    r = row
    return (
        hero,
        cpu,
        int(r[COL["slots"]]),
        int(r[COL["batch"]]),
        r[COL["engine_cpu_ms"]],
        r[COL["engine_thread_cpu_ms"]],
        r[COL["queue_wait_ms"]],
        r[COL["wall_ms"]],
        r[COL["deschedule_ms"]],
        sched_fifo,
        threads,
        r[COL["run_delay_ms"]],
        int(r[COL["nivcsw"]]),
    )


def is_slow(row: Sequence[float], engine_cpu_ms: float, total_ms: float) -> bool:
    return row[COL["engine_cpu_ms"]] > engine_cpu_ms or row[COL["wall_ms"]] > total_ms


class LatencyWindow:
    """The last ``capacity`` values of one quantity; percentiles on demand (for clients and probes)."""

    def __init__(self, capacity: int = 30_000) -> None:
        if capacity < 1:
            raise ValueError(f"capacity={capacity}: expected >= 1")
        self._buf = np.zeros(capacity, dtype=np.float64)
        self._count = 0

    def add(self, value: float) -> None:
        self._buf[self._count % self._buf.size] = value
        self._count += 1

    @property
    def count(self) -> int:
        """Values added since creation or the last ``clear`` (may exceed the capacity)."""
        return self._count

    def values(self) -> np.ndarray:
        return self._buf[: min(self._count, self._buf.size)].copy()

    def percentiles(self) -> Percentiles:
        return percentiles(self.values())

    def clear(self) -> None:
        self._count = 0


def percentiles_dict(p: Mapping[str, Percentiles]) -> dict[str, dict[str, float]]:
    return {k: v.to_dict() for k, v in p.items()}
