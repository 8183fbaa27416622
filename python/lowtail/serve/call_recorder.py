"""The worker's bookkeeping after each answered batch: its call row, counters and stats words.

``serve()`` (``lowtail.serve.worker_main``) takes the clock stamps of one call on the hot path and
hands them here, once per call: the scheduler counters when the call was sampled or descheduled, the
``CallRow`` set field by field by name and stored in the stats ring in ``CALL_FIELDS`` order, the
served/sampled counters, the ``slow_infer`` line, and the SCHED_FIFO words. What this costs is
measured too (``record_us``, stored in the next call's row). Imported after pinning (numpy).
"""

from __future__ import annotations

import logging
import time

from lowtail.serve.call_stats import (
    SLOW_INFER_FORMAT,
    CallRow,
    ThreadCounters,
    call_values,
    is_slow,
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

# The stamps (ns) the serving loop takes per call, in its order, as indices into one list (``stamps()``),
# as ``lowtail.shm.layout`` names the queue's words: T0 claim returned, TH0/C0 thread/process CPU, M0
# before SCHED_FIFO enter, F0 after it, K0 inputs checked, ET0/EC0/E0 before infer(), E1/ET1/EC1 after
# it, A0/A1 around complete(), F1 after the SCHED_FIFO leave, TH1/C1/T1 the end. C0/EC0/EC1/C1 are read
# only on sampled calls (0 otherwise). The last two are not clocks: WK the ns complete() spent in the
# futex-wake system calls of parked samplers and WN the lanes it woke (``QueueWorker.wakes`` before and
# after), last so that the loop sets both as ``st[WK:]``.
(T0, TH0, C0, M0, F0, K0, ET0, EC0, E0, E1, ET1, EC1, A0, A1, F1, TH1, C1, T1, WK, WN) = range(20)
N_STAMPS = 20


def stamps() -> list[int]:
    """The list one serving loop fills per call and hands to ``CallRecorder.record``."""
    return [0] * N_STAMPS


class CallRecorder:
    """Records the calls of one serving loop into its stats segment (worker-private state)."""

    __slots__ = (
        "_counters", "_cpu", "_every", "_fifo", "_hero", "_iv_last", "_rd_last", "_record_ns", "_row",
        "_slow_cpu_ms", "_slow_total_ms", "_words", "_write", "count", "sampled", "threads",
    )  # fmt: skip

    def __init__(
        self,
        stats: StatsSegment,
        fifo: SchedFifo,
        *,
        hero: str,
        cpu: int,
        threads: int,
        slow_engine_cpu_ms: float,
        slow_total_ms: float,
        stats_every: int,
    ) -> None:
        self._words = stats.words
        self._write = stats.row_writer()
        self._fifo = fifo
        self._hero, self._cpu = hero, cpu
        self._slow_cpu_ms, self._slow_total_ms = slow_engine_cpu_ms, slow_total_ms
        self._every = stats_every
        self._counters = ThreadCounters()  # opened here: the thread that serves is the one it reads
        self._rd_last, self._iv_last = self._counters.run_delay_ns(), self._counters.nivcsw()
        self._record_ns = 0  # the cost of recording the previous call, reported in the next row
        self._row = CallRow()
        self.count = 0  # calls recorded
        self.sampled = True  # the next call reads the process CPU clock (every stats_every-th call)
        self.threads = threads  # the worker's threads, refreshed by the loop when idle (slow_infer line)

    def record(self, waits_ns: list[int], claimed_ns: int, n: int, st: list[int]) -> None:
        """One answered call of ``n`` samples from the requests that waited ``waits_ns``.

        ``st``: the call's stamps, indexed by ``T0`` ... ``T1`` (above). ``claimed_ns`` is the poll that
        took the first request.
        """
        t0, th0, c0, m0, f0, k0, et0, ec0, e0, e1, et1, ec1, a0, a1, f1, th1, c1, t1, wk, wn = st
        clock = time.monotonic_ns
        sampled = self.sampled
        wall_ns = t1 - t0
        thread_ns = th1 - th0
        cpu_ns = c1 - c0 if sampled else thread_ns
        engine_ns, engine_thread_ns = e1 - e0, et1 - et0
        engine_cpu_ns = ec1 - ec0 if sampled else engine_thread_ns
        if sampled or wall_ns - thread_ns > DESCHEDULED_NS:
            r0 = clock()
            counters = self._counters
            rd, iv = counters.run_delay_ns(), counters.nivcsw()
            rd_delta, iv_delta = rd - self._rd_last, iv - self._iv_last
            self._rd_last, self._iv_last = rd, iv
            read_ns = clock() - r0
        else:
            rd_delta = iv_delta = read_ns = 0
        claim_ns = t0 - claimed_ns
        record_ns = self._record_ns
        wall = wall_ns / 1e6
        cpu_ms = cpu_ns / 1e6
        r = self._row
        r.t_end_s = t1 / 1e9
        r.wall_ms = wall
        r.cpu_ms = cpu_ms
        r.thread_cpu_ms = thread_ns / 1e6
        r.deschedule_ms = wall - cpu_ms if wall_ns > cpu_ns else 0.0
        r.engine_wall_ms = engine_ns / 1e6
        r.engine_cpu_ms = engine_cpu_ns / 1e6
        r.engine_thread_cpu_ms = engine_thread_ns / 1e6
        r.run_delay_ms = rd_delta / 1e6
        r.nivcsw = iv_delta
        r.batch = n
        r.slots = len(waits_ns)
        r.queue_wait_ms = max(waits_ns) / 1e6
        r.claim_us = claim_ns / 1e3
        r.check_us = (k0 - f0) / 1e3
        r.fifo_us = ((f0 - m0) + (f1 - a1)) / 1e3
        r.answer_us = (a1 - a0) / 1e3
        r.measure_us = ((m0 - t0) + (e0 - k0) + (a0 - e1) + (t1 - f1) + read_ns) / 1e3
        r.record_us = record_ns / 1e3
        r.overhead_us = (overhead_ns := claim_ns + wall_ns - engine_ns + read_ns + record_ns) / 1e3
        r.wake_us, r.woken, r.overhead_less_wakes_us = wk / 1e3, wn, (overhead_ns - wk) / 1e3
        h = self._words
        h[HEARTBEAT] = t1
        row = call_values(r)
        self._write(self.count, row)
        self.count += 1
        self.sampled = self.count % self._every == 0
        h[COUNT] = self.count
        h[SAMPLES] += n
        if sampled:  # the isolation ratio compares like with like: both clocks of the sampled calls
            h[ENGINE_CPU] += engine_cpu_ns
            h[ENGINE_THREAD] += engine_thread_ns
        fifo = self._fifo
        if is_slow(row, self._slow_cpu_ms, self._slow_total_ms):
            h[SLOW] += 1
            log.warning(
                SLOW_INFER_FORMAT, *slow_infer_args(self._hero, self._cpu, row, fifo.available, self.threads)
            )
        if not fifo.available and h[FIFO]:
            h[FIFO] = 0
        h[FIFO_SWITCHES] = fifo.switches
        h[FIFO_COOLDOWNS] = fifo.cooldowns
        self._record_ns = clock() - t1 - read_ns

    def close(self) -> None:
        self._counters.close()
