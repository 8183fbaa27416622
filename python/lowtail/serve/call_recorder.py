"""The worker's bookkeeping after each answered batch: its raw call row, counters and stats words.

``serve()`` (``lowtail.serve.worker_main``) takes the clock stamps of one call on the hot path and
hands them here, once per call: the scheduler counters when the call was sampled or descheduled, the
raw row (the stamps as taken, ``call_stats.RAW_FIELDS``) stored in the stats ring with one pack_into,
the served/sampled counters, the ``slow_infer`` check (integer comparisons; its line is derived only for
a slow call), and the SCHED_FIFO words. Every column readers see is derived from the raw rows when they
read them (``call_stats.derive_calls``), not here. What recording costs is measured too (``record_ns``,
stored in the next call's row). This module's ``CallRecorder`` is the reference and the Python path's
recorder; on the native path the core's (``lowtail_native.CallRecorder``, ``native/src/recorder.rs``)
does the same in one call, and ``new_recorder`` picks the one the queue's hot path uses. Imported after
pinning (numpy).
"""

from __future__ import annotations

import logging
import time
from typing import Any, TypedDict, Unpack

from lowtail.serve.call_stats import (
    EC0,
    EC1,
    ET0,
    ET1,
    N_STAMPS,
    RAW_FIELDS,
    SLOW_INFER_FORMAT,
    T0,
    T1,
    TH0,
    TH1,
    ThreadCounters,
    derive_calls,
    slow_infer_args,
)
from lowtail.serve.pinning import SchedFifo
from lowtail.serve.stats_segment import (
    COUNT,
    ENGINE_CPU,
    ENGINE_THREAD,
    FIFO,
    FIFO_COOLDOWNS,
    FIFO_SWITCHES,
    HEARTBEAT,
    SAMPLES,
    SLOW,
    StatsSegment,
)

log = logging.getLogger(__name__)

# A call whose wall - thread CPU exceeds this was descheduled: read the scheduler counters for it.
DESCHEDULED_NS = 20_000


class RecorderOptions(TypedDict):
    """What a recorder is made with, beside its stats segment and SchedFifo: the worker's name and CPU
    and thread count (its ``slow_infer`` line), the slow thresholds, and how often a call is sampled."""

    hero: str
    cpu: int
    threads: int
    slow_engine_cpu_ms: float
    slow_total_ms: float
    stats_every: int


def _ns(ms: float) -> int:
    """A threshold in ms as whole ns, within int64 (the native recorder's; beyond it nothing is slow)."""
    return max(-(1 << 63), min(int(ms * 1e6), (1 << 63) - 1))


def stamps() -> list[int]:
    """The list one serving loop fills per call (indexed by ``call_stats.T0`` ... ``WN``) and hands to
    its recorder's ``record`` (``new_recorder``'s: this module's or the native core's, whose
    ``begin_call``, ``start_engine`` and ``finish_call`` take the stamps themselves)."""
    return [0] * N_STAMPS


class CallRecorder:
    """Records the calls of one serving loop into its stats segment (worker-private state)."""

    __slots__ = (
        "_cap", "_counters", "_cpu", "_descheduled_ns", "_every", "_fifo", "_first", "_hero", "_iv_last",
        "_pack", "_raw", "_rd_last", "_record_ns", "_ring", "_samples", "_slow_cpu_ns", "_slow_total_ns",
        "_width", "_words", "count", "sampled", "threads",
    )  # fmt: skip

    def __init__(self, stats: StatsSegment, fifo: SchedFifo, **o: Unpack[RecorderOptions]) -> None:
        self._words = stats.words
        self._pack, self._ring, self._first, self._cap, self._width = stats.row_packer()
        self._raw = stats.raw
        self._fifo = fifo
        self._hero, self._cpu = o["hero"], o["cpu"]
        # as whole ns: the slow check compares the stamps' differences (int with int: an int against a
        # float costs several times the comparison), no row derived on the hot path
        self._slow_cpu_ns, self._slow_total_ns = _ns(o["slow_engine_cpu_ms"]), _ns(o["slow_total_ms"])
        self._descheduled_ns = DESCHEDULED_NS
        self._samples = 0  # samples served: kept here, so the word is stored, not read back and added
        self._every = o["stats_every"]
        self._counters = ThreadCounters()  # opened here: the thread that serves is the one it reads
        self._rd_last, self._iv_last = self._counters.run_delay_ns(), self._counters.nivcsw()
        self._record_ns = 0  # the cost of recording the previous call, reported in the next row
        self.count = 0  # calls recorded
        self.sampled = True  # the next call reads the process CPU clock (every stats_every-th call)
        self.threads = o["threads"]  # the worker's threads, refreshed by the loop when idle (slow_infer line)

    def record(self, waits_ns: list[int], claimed_ns: int, n: int, st: list[int]) -> None:
        """One answered call of ``n`` samples from the requests that waited ``waits_ns``.

        ``st``: the call's stamps, indexed by ``call_stats.T0`` ... ``WN``. ``claimed_ns`` is the poll
        that took the first request. Stored raw: nothing is derived here but what the checks need.
        """
        clock = time.monotonic_ns
        sampled = self.sampled
        t1 = st[T1]
        wall_ns = t1 - st[T0]
        if sampled or wall_ns - (st[TH1] - st[TH0]) > self._descheduled_ns:
            r0 = clock()
            counters = self._counters
            rd, iv = counters.run_delay_ns(), counters.nivcsw()
            rd_delta, iv_delta = rd - self._rd_last, iv - self._iv_last
            self._rd_last, self._iv_last = rd, iv
            read_ns = clock() - r0
        else:
            rd_delta = iv_delta = read_ns = 0
        k = self.count
        # A wait is the claim's clock less a submit stamp the client wrote (any u64): a stamp from the
        # future reads as no wait, so a forged one cannot overflow the ring's int64 column. One request
        # (served xN's every call) without max()'s call.
        wait = waits_ns[0] if len(waits_ns) == 1 else max(waits_ns)
        self._pack(self._ring, self._first + k % self._cap * self._width, *st, n, len(waits_ns),
                   wait if wait > 0 else 0, claimed_ns, rd_delta, iv_delta, read_ns, self._record_ns,
                   sampled)  # fmt: skip
        h = self._words
        h[HEARTBEAT] = t1
        self.count = count = k + 1
        self.sampled = count % self._every == 0
        h[COUNT] = count
        h[SAMPLES] = self._samples = self._samples + n
        engine_cpu_ns = engine_thread_ns = st[ET1] - st[ET0]
        if sampled:  # the isolation ratio compares like with like: both clocks of the sampled calls
            engine_cpu_ns = st[EC1] - st[EC0]
            h[ENGINE_CPU] += engine_cpu_ns
            h[ENGINE_THREAD] += engine_thread_ns
        if engine_cpu_ns > self._slow_cpu_ns or wall_ns > self._slow_total_ns:
            self._slow(k)
        fifo = self._fifo
        if not fifo.available and h[FIFO]:
            h[FIFO] = 0
        h[FIFO_SWITCHES] = fifo.switches
        h[FIFO_COOLDOWNS] = fifo.cooldowns
        self._record_ns = clock() - t1 - read_ns

    def _slow(self, k: int) -> None:
        """Call ``k`` was slow: counted, and logged with its derived row (the ``slow_infer`` line)."""
        self._words[SLOW] += 1
        log_slow(self._raw, k, hero=self._hero, cpu=self._cpu, fifo=self._fifo, threads=self.threads)

    def close(self) -> None:
        self._counters.close()


def log_slow(raw: Any, k: int, *, hero: str, cpu: int, fifo: SchedFifo, threads: int) -> None:
    """The ``slow_infer`` line of call ``k``, from its raw row in the ring ``raw``."""
    row = derive_calls(raw[k % len(raw)][None])[0]
    log.warning(SLOW_INFER_FORMAT, *slow_infer_args(hero, cpu, row, fifo.available, threads))


# The header words the recorder writes, by the names the native core takes them under.
_WORDS = {
    "count": COUNT, "heartbeat": HEARTBEAT, "samples": SAMPLES, "slow": SLOW, "engine_cpu": ENGINE_CPU,
    "engine_thread": ENGINE_THREAD, "fifo": FIFO, "fifo_switches": FIFO_SWITCHES,
    "fifo_cooldowns": FIFO_COOLDOWNS,
}  # fmt: skip


def new_recorder(stats: StatsSegment, fifo: SchedFifo, **o: Unpack[RecorderOptions]) -> Any:
    """The serving loop's recorder: the native core's ``CallRecorder`` when the queue's hot path is
    native (``lowtail.shm.native.core()``), else this module's, the reference. Both take ``record``'s
    arguments, write the same rows and words, and log the same ``slow_infer`` line. Made in the thread
    that serves (it reads that thread's scheduler counters)."""
    from lowtail.shm import native

    core = native.core()
    if core is None:
        return CallRecorder(stats, fifo, **o)
    _, buffer, first, cap, width = stats.row_packer()
    raw, hero, cpu = stats.raw, o["hero"], o["cpu"]
    return core.CallRecorder(
        buffer, first, cap, width, list(RAW_FIELDS), _WORDS, fifo,
        lambda k, threads: log_slow(raw, k, hero=hero, cpu=cpu, fifo=fifo, threads=threads),
        threads=o["threads"], slow_cpu_ns=_ns(o["slow_engine_cpu_ms"]), slow_total_ns=_ns(o["slow_total_ms"]),
        descheduled_ns=DESCHEDULED_NS, stats_every=o["stats_every"],
    )  # fmt: skip
