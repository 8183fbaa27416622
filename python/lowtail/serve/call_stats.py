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

import os
import resource
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

# Re-exported ("as" form, for mypy): the worker's reports and the serve benchmark name it metrics.Percentiles.
from lowtail.telemetry.percentiles import Percentiles as Percentiles  # noqa: PLC0414


@dataclass(slots=True, init=False)
class CallRow:
    """One row per handled batch as every reader sees it: float64 columns in this field order.

    The fields are the one list of the row's names: ``CALL_FIELDS`` is read from them and readers index
    by ``COL[name]``. The worker does not compute them: on its hot path it stores what it measured (the
    raw row, ``RAW_FIELDS``, int64), and ``derive_calls`` computes these columns from raw rows for every
    reader at once, off the worker's core. It sets each column by name and refuses to return a row with
    a column missing or one not named here, so a field cannot be added or dropped in one place only.
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
    answer_us: float  # the answer (Batch.complete, or finish_call's own): copy outputs back, publish, wake
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
COL = {name: i for i, name in enumerate(CALL_FIELDS)}

# The raw row: what the serving loop measured for one call, stored as it is (int64) in the stats ring
# with one pack_into; ``derive_calls`` turns it into the CallRow columns when the ring is read.
# First the loop's clock stamps (ns), in the hot path's order (``serve()`` in worker_main fills them as
# one list, ``st``, indexed by the names below; on the native path the core's ``finish_call`` takes
# those from E1 on into the row itself): T0 claim returned, TH0/C0 thread/process CPU, M0 before
# SCHED_FIFO enter, F0 after it, K0 inputs checked, ET0/EC0/E0 before infer(), E1/ET1/EC1 after it,
# A0/A1 around the answer (complete(), or the core's own in finish_call), F1 after the SCHED_FIFO
# leave, TH1/C1/T1 the end. C0/EC0/EC1/C1 are read only on sampled calls (0 otherwise). WK and WN are
# not clocks: the ns the answer spent in the futex-wake system calls of parked samplers, and the lanes
# it woke (what complete() returns).
STAMPS: tuple[str, ...] = (
    "t0", "th0", "c0", "m0", "f0", "k0", "et0", "ec0", "e0", "e1", "et1", "ec1", "a0", "a1", "f1", "th1",
    "c1", "t1", "wk", "wn",
)  # fmt: skip
(T0, TH0, C0, M0, F0, K0, ET0, EC0, E0, E1, ET1, EC1, A0, A1, F1, TH1, C1, T1, WK, WN) = range(20)
N_STAMPS = len(STAMPS)
# Then what the recorder adds: samples and requests in the call, the longest publish -> claim wait, the
# poll that took the first request (CLOCK_MONOTONIC), the growth of run_delay (ns) and of involuntary
# switches since the last read (0 when not read), what reading them cost (ns), what recording the
# previous call cost (ns), and 1 when the call read the process CPU clock (sampled).
RAW_FIELDS: tuple[str, ...] = (
    *STAMPS, "batch", "slots", "wait_ns", "claimed_ns", "run_delay_ns", "nivcsw", "read_ns", "record_ns",
    "sampled",
)  # fmt: skip


def derive_calls(raw: np.ndarray) -> np.ndarray:
    """The CallRow columns (float64, ``CALL_FIELDS`` order) of raw rows shaped (n, len(RAW_FIELDS)).

    The one definition of every column from the worker's stamps, vectorised: the worker's hot path
    stores the stamps and the readers call this (``StatsSegment.read_calls``, the ``slow_infer`` line).
    """
    if raw.ndim != 2 or raw.shape[1] != len(RAW_FIELDS):
        raise ValueError(f"raw call rows of shape {raw.shape}: expected (n, {len(RAW_FIELDS)})")
    r = raw.astype(np.int64, copy=False).T
    t0, th0, c0, m0, f0, k0, et0, ec0, e0, e1, et1, ec1, a0, a1, f1, th1, c1, t1, wk, wn = r[:N_STAMPS]
    batch, slots, wait_ns, claimed_ns, run_delay_ns, nivcsw, read_ns, record_ns, sampled = r[N_STAMPS:]
    on = sampled != 0
    wall_ns, thread_ns, engine_ns, engine_thread_ns = t1 - t0, th1 - th0, e1 - e0, et1 - et0
    cpu_ns = np.where(on, c1 - c0, thread_ns)  # the process clock on sampled calls, else the thread's
    claim_ns = t0 - claimed_ns
    overhead_ns = claim_ns + wall_ns - engine_ns + read_ns + record_ns
    cols = {
        "t_end_s": t1 / 1e9,
        "wall_ms": wall_ns / 1e6,
        "cpu_ms": cpu_ns / 1e6,
        "thread_cpu_ms": thread_ns / 1e6,
        "deschedule_ms": np.where(wall_ns > cpu_ns, wall_ns - cpu_ns, 0) / 1e6,
        "engine_wall_ms": engine_ns / 1e6,
        "engine_cpu_ms": np.where(on, ec1 - ec0, engine_thread_ns) / 1e6,
        "engine_thread_cpu_ms": engine_thread_ns / 1e6,
        "run_delay_ms": run_delay_ns / 1e6,
        "nivcsw": nivcsw,
        "batch": batch,
        "slots": slots,
        "queue_wait_ms": wait_ns / 1e6,
        "claim_us": claim_ns / 1e3,
        "check_us": (k0 - f0) / 1e3,
        "fifo_us": ((f0 - m0) + (f1 - a1)) / 1e3,
        "answer_us": (a1 - a0) / 1e3,
        "measure_us": ((m0 - t0) + (e0 - k0) + (a0 - e1) + (t1 - f1) + read_ns) / 1e3,
        "record_us": record_ns / 1e3,
        "overhead_us": overhead_ns / 1e3,
        "wake_us": wk / 1e3,
        "woken": wn,
        "overhead_less_wakes_us": (overhead_ns - wk) / 1e3,
    }
    if cols.keys() != COL.keys():  # a column added to CallRow and not derived here, or the reverse
        raise ValueError(f"derived columns {sorted(cols.keys() ^ COL.keys())} differ from CallRow's")
    out = np.empty((raw.shape[0], len(CALL_FIELDS)), np.float64)
    for name, i in COL.items():
        out[:, i] = cols[name]
    return out


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
