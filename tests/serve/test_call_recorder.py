"""The worker's per-call bookkeeping: one row per answered batch, every value in the column of its name,
from the Python recorder (the reference) and the native core's alike (``recorder_impl``)."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Iterator
from dataclasses import fields
from typing import Any

import numpy as np
import pytest

from lowtail.serve import call_recorder, call_stats
from lowtail.serve import stats_segment as ws
from lowtail.serve.call_recorder import new_recorder
from lowtail.serve.call_stats import CALL_FIELDS, COL, RAW_FIELDS, CallRow, derive_calls
from lowtail.serve.pinning import SchedFifo
from lowtail.serve.stats_segment import StatsSegment
from lowtail.shm import native
from lowtail.shm.queue import BatchClosed, InferenceQueue, QueueClient, QueueConfig, QueueWorker


@pytest.fixture(params=["python", "native"])
def recorder_impl(request: pytest.FixtureRequest) -> Iterator[str]:
    """Which recorder ``new_recorder`` makes (the native core's where it is built, as ``queue_impl``)."""
    if request.param == "native":
        _need_native()
    with native.use(request.param == "native"):
        yield str(request.param)


def _need_native() -> None:
    if not native.available():
        pytest.skip(f"the native core is not available: {native.implementation().reason}")


def _named(**stamps: int) -> list[int]:
    """A stamp list for a recorder's ``record`` from the stamps' names (the rest 0)."""
    st = call_recorder.stamps()
    for name, value in stamps.items():
        st[getattr(call_stats, name.upper())] = value
    return st


def test_call_fields_are_the_call_rows_fields_and_the_raw_rows_are_the_rings_columns() -> None:
    assert tuple(f.name for f in fields(CallRow)) == CALL_FIELDS
    assert {name: i for i, name in enumerate(CALL_FIELDS)} == COL
    # every stamp index names its place in the raw row, and the stamps come first (the loop's list)
    for i, name in enumerate(call_stats.STAMPS):
        assert getattr(call_stats, name.upper()) == i == RAW_FIELDS.index(name)
    assert len(call_recorder.stamps()) == call_stats.N_STAMPS
    stats = StatsSegment.create(capacity=16)
    try:
        assert stats.word(ws.NCOLS) == len(RAW_FIELDS) and stats.raw.shape == (16, len(RAW_FIELDS))
    finally:
        stats.close()
    with pytest.raises(ValueError, match=rf"expected \(n, {len(RAW_FIELDS)}\)"):
        derive_calls(np.zeros((1, len(CALL_FIELDS))))


def test_derived_columns_from_known_stamps() -> None:
    """Two raw rows with round stamps, one sampled and one not (and descheduled), and every column as
    computed by hand from them."""
    raw = {
        # ns: the call from 1_000_000 to 1_100_000 (100 us); infer() 1_010_000 -> 1_070_000 (60 us)
        "t0": 1_000_000, "m0": 1_001_000, "f0": 1_002_000, "k0": 1_005_000, "e0": 1_010_000,
        "e1": 1_070_000, "a0": 1_071_000, "a1": 1_091_000, "f1": 1_093_000, "t1": 1_100_000,
        "th0": 500, "th1": 500 + 90_000, "et0": 7_000, "et1": 7_000 + 58_000,
        "c0": 40_000, "c1": 40_000 + 95_000, "ec0": 80_000, "ec1": 80_000 + 59_000,
        "wk": 12_000, "wn": 1,
        "batch": 16, "slots": 2, "wait_ns": 2_500_000, "claimed_ns": 996_000, "run_delay_ns": 3_000_000,
        "nivcsw": 4, "read_ns": 1_500, "record_ns": 2_500, "sampled": 1,
    }  # fmt: skip
    rows = np.array([[raw[f] for f in RAW_FIELDS], [raw[f] for f in RAW_FIELDS]], np.int64)
    unsampled = rows[1]
    for name in ("c0", "c1", "ec0", "ec1", "sampled"):  # not read on a call that was not sampled
        unsampled[RAW_FIELDS.index(name)] = 0
    unsampled[RAW_FIELDS.index("th1")] = 500 + 10_000  # on the CPU for 10 of its 100 us
    got = derive_calls(rows)
    assert got.dtype == np.float64 and got.shape == (2, len(CALL_FIELDS))
    sampled_row = {name: float(got[0, i]) for name, i in COL.items()}
    # overhead: claim 4 us + the wall's 100 beyond infer()'s 60 + read 1.5 + record 2.5 = 48 us
    expected = {
        "t_end_s": 0.0011, "wall_ms": 0.1, "cpu_ms": 0.095, "thread_cpu_ms": 0.09, "deschedule_ms": 0.005,
        "engine_wall_ms": 0.06, "engine_cpu_ms": 0.059, "engine_thread_cpu_ms": 0.058, "run_delay_ms": 3.0,
        "nivcsw": 4, "batch": 16, "slots": 2, "queue_wait_ms": 2.5, "claim_us": 4.0, "check_us": 3.0,
        "fifo_us": 1.0 + 2.0, "answer_us": 20.0, "measure_us": 1.0 + 5.0 + 1.0 + 7.0 + 1.5, "record_us": 2.5,
        "overhead_us": 48.0, "wake_us": 12.0, "woken": 1, "overhead_less_wakes_us": 36.0,
    }  # fmt: skip
    assert set(expected) == set(CALL_FIELDS)
    assert sampled_row == pytest.approx(expected)
    # not sampled: the thread's clock stands in for the process's, and the wall beyond it is deschedule
    assert got[1, COL["cpu_ms"]] == got[1, COL["thread_cpu_ms"]] == pytest.approx(0.01)
    assert got[1, COL["deschedule_ms"]] == pytest.approx(0.09)
    assert got[1, COL["engine_cpu_ms"]] == pytest.approx(0.058)
    # a process clock that ran ahead of the wall (another thread) is no negative deschedule
    rows[0, RAW_FIELDS.index("c1")] = 40_000 + 150_000
    assert derive_calls(rows)[0, COL["deschedule_ms"]] == 0
    assert derive_calls(rows[:0]).shape == (0, len(CALL_FIELDS))


def _stamps(base: int, steps_ns: list[int]) -> list[int]:
    """Clock stamps ``base + cumsum(steps)``: every interval of the call a distinct length."""
    out, t = [], base
    for step in steps_ns:
        t += step
        out.append(t)
    return out


@pytest.mark.usefixtures("recorder_impl")
def test_the_recorded_row_puts_every_stage_in_the_column_of_its_name() -> None:
    stats = StatsSegment.create(capacity=16)
    fifo = SchedFifo()
    fifo.reason = "not used by this test"
    rec = new_recorder(stats, fifo, hero="h", cpu=0, threads=1, slow_engine_cpu_ms=1e9, slow_total_ms=1e9,
                       stats_every=1000)  # fmt: skip
    try:
        assert rec.sampled  # the first call of every stats_every reads the process clock and counters
        rows = []
        for call in range(2):
            sampled = rec.sampled
            base = time.monotonic_ns() - 1_000_000_000
            # wall-clock stamps in the hot path's order (serve() in worker_main), 1..19 us apart
            t0, m0, f0, k0, e0, e1, a0, a1, f1, t1 = _stamps(base, [1000 * (i + 1) for i in range(10)])
            th0, th1 = 5_000, 5_000 + (t1 - t0) - 3_000  # thread CPU: 3 us less than the wall
            et0, et1 = 20_000, 20_000 + (e1 - e0) - 500
            c0, c1 = (70_000, 70_000 + (t1 - t0) - 2_000) if sampled else (0, 0)
            ec0, ec1 = (90_000, 90_000 + (e1 - e0) - 700) if sampled else (0, 0)
            claimed_ns, waits, n = t0 - 4_321, [1_500_000, 2_500_000], 7
            wk, wn = 2_345 * call, 2 * call  # the futex wakes inside complete(): none in the first call
            rec.record(
                waits,
                claimed_ns,
                n,
                [t0, th0, c0, m0, f0, k0, et0, ec0, e0, e1, et1, ec1, a0, a1, f1, th1, c1, t1, wk, wn],
            )
            got = stats.read_calls(call).rows
            assert got.shape == (1, len(CALL_FIELDS))
            row = {name: float(got[0, COL[name]]) for name in CALL_FIELDS}
            rows.append(row)
            wall_ns, engine_ns = t1 - t0, e1 - e0
            cpu_ns = c1 - c0 if sampled else th1 - th0
            expected = {
                "t_end_s": t1 / 1e9,
                "wall_ms": wall_ns / 1e6,
                "cpu_ms": cpu_ns / 1e6,
                "thread_cpu_ms": (th1 - th0) / 1e6,
                "deschedule_ms": (wall_ns - cpu_ns) / 1e6,
                "engine_wall_ms": engine_ns / 1e6,
                "engine_cpu_ms": ((ec1 - ec0) if sampled else (et1 - et0)) / 1e6,
                "engine_thread_cpu_ms": (et1 - et0) / 1e6,
                "batch": n,
                "slots": 2,
                "queue_wait_ms": 2.5,
                "claim_us": 4.321,
                "check_us": (k0 - f0) / 1e3,
                "fifo_us": ((f0 - m0) + (f1 - a1)) / 1e3,
                "answer_us": (a1 - a0) / 1e3,
                "wake_us": wk / 1e3,
                "woken": wn,
            }
            for name, value in expected.items():
                assert row[name] == pytest.approx(value), name
            stamped_measure_us = ((m0 - t0) + (e0 - k0) + (a0 - e1) + (t1 - f1)) / 1e3
            read_us = row["measure_us"] - stamped_measure_us  # reading the scheduler counters
            if sampled:
                assert read_us > 0 and row["run_delay_ms"] >= 0 and row["nivcsw"] >= 0
            else:  # not sampled and not descheduled (wall - thread CPU is 3 us): no counter read
                assert read_us == pytest.approx(0) and row["run_delay_ms"] == row["nivcsw"] == 0
            assert row["overhead_us"] == pytest.approx(
                (4_321 + wall_ns - engine_ns) / 1e3 + read_us + row["record_us"]
            )
            # the wakes are reported on their own and the overhead without them beside it
            assert row["overhead_less_wakes_us"] == pytest.approx(row["overhead_us"] - wk / 1e3)
            assert set(expected) | {
                "run_delay_ms",
                "nivcsw",
                "measure_us",
                "record_us",
                "overhead_us",
                "overhead_less_wakes_us",
            } == set(CALL_FIELDS)
        assert rows[0]["record_us"] == 0 and rows[1]["record_us"] > 0  # the first call's, in the second row
        assert stats.word(ws.COUNT) == 2 and stats.word(ws.SAMPLES) == 14
        assert (
            stats.word(ws.ENGINE_CPU) == 6_000 - 700 and stats.word(ws.ENGINE_THREAD) == 6_000 - 500
        )  # sampled only
        assert stats.word(ws.SLOW) == 0 and stats.word(ws.HEARTBEAT) > 0
    finally:
        rec.close()
        stats.close()


@pytest.mark.usefixtures("recorder_impl")
def test_a_slow_call_is_counted_and_logged_with_its_row(caplog: pytest.LogCaptureFixture) -> None:
    stats = StatsSegment.create(capacity=16)
    fifo = SchedFifo()
    rec = new_recorder(stats, fifo, hero="h", cpu=3, threads=1, slow_engine_cpu_ms=1e9, slow_total_ms=0.001,
                       stats_every=1)  # fmt: skip
    try:
        t0 = time.monotonic_ns() - 1_000_000
        s = _stamps(t0, [1000] * 9)
        with caplog.at_level("WARNING"):
            st = _named(t0=t0, m0=s[0], f0=s[1], k0=s[2], e0=s[3], e1=s[4], et1=100, a0=s[5], a1=s[6],
                        f1=s[7], th1=8000, c1=9000, t1=s[8])  # fmt: skip
            rec.record([1000], t0, 1, st)
        assert stats.word(ws.SLOW) == 1
        assert "slow_infer hero=h cpu=3 slots=1 total_batch=1" in caplog.text
    finally:
        rec.close()
        stats.close()


@pytest.mark.parametrize("submit_ns", [(1 << 64) - 1, 1 << 63, 0])
@pytest.mark.usefixtures("recorder_impl")
def test_a_submit_stamp_a_client_wrote_at_any_u64_is_recorded_clamped(submit_ns: int) -> None:
    """A request's submit stamp is a word its client writes: any u64. Its wait (the claim's clock less
    that stamp, negative for a stamp from the future) is recorded within 0..2^63 - 1, and the call is
    counted like any other."""
    stats = StatsSegment.create(capacity=16)
    fifo = SchedFifo()
    rec = new_recorder(stats, fifo, hero="h", cpu=0, threads=1, slow_engine_cpu_ms=1e9, slow_total_ms=1e9,
                       stats_every=1000)  # fmt: skip
    try:
        t0 = time.monotonic_ns()
        s = _stamps(t0, [1000] * 9)
        st = _named(t0=t0, m0=s[0], f0=s[1], k0=s[2], e0=s[3], e1=s[4], et1=100, a0=s[5], a1=s[6],
                    f1=s[7], th1=8000, c1=9000, t1=s[8])  # fmt: skip
        rec.record([t0 - submit_ns], t0, 1, st)
        assert stats.word(ws.COUNT) == 1
        wait_ms = stats.read_calls(0).rows[0, COL["queue_wait_ms"]]
        assert 0 <= wait_ms <= ((1 << 63) - 1) / 1e6
        if submit_ns == 0:
            assert wait_ms == t0 / 1e6  # an honest range is recorded as it is
    finally:
        rec.close()
        stats.close()


# What only the clock or the scheduler decides: the rest of a row is the same from either recorder.
_TIMED = ("run_delay_ns", "nivcsw", "read_ns", "record_ns")
_WORDS = ("COUNT", "HEARTBEAT", "SAMPLES", "SLOW", "ENGINE_CPU", "ENGINE_THREAD", "FIFO", "FIFO_SWITCHES",
          "FIFO_COOLDOWNS")  # fmt: skip


def _random_calls(rng: np.random.Generator, calls: int) -> list[tuple[list[int], int, int, list[int]]]:
    """``record``'s arguments for a stream of calls: stamps in the loop's order with random gaps, some
    slow or descheduled, batches of 1-16 requests whose waits include forged submit stamps (any u64)."""
    out = []
    t = time.monotonic_ns()
    for _ in range(calls):
        st = call_recorder.stamps()
        for i in range(call_stats.N_STAMPS - 2):
            t += int(rng.integers(0, 40_000 if rng.random() < 0.9 else 3_000_000))
            st[i] = t
        st[call_stats.TH0], st[call_stats.ET0] = int(rng.integers(0, 1 << 40)), int(rng.integers(0, 1 << 40))
        wall = st[call_stats.T1] - st[call_stats.T0]
        # half on the CPU all along (not descheduled: no counter read unless sampled), half not
        on_cpu = wall - int(rng.integers(0, 20_000)) if rng.random() < 0.5 else int(rng.integers(0, 200_000))
        st[call_stats.TH1] = st[call_stats.TH0] + on_cpu
        st[call_stats.ET1] = st[call_stats.ET0] + int(rng.integers(0, 2_000_000))
        st[call_stats.WK], st[call_stats.WN] = int(rng.integers(0, 50_000)), int(rng.integers(0, 4))
        waits = [t - int(s) for s in rng.integers(0, 1 << 63, size=int(rng.integers(1, 17)), dtype=np.uint64)]
        if rng.random() < 0.1:
            waits[0] = t - ((1 << 64) - 1)  # a submit stamp from the far future: below int64
        out.append((waits, t - int(rng.integers(0, 9_000)), int(rng.integers(1, 64)), st))
    return out


def _untimed(line: str) -> str:
    """A slow_infer line without the scheduler's counters (``_TIMED``)."""
    return re.sub(r" run_delay_ms=\S+ nivcsw=\S+", "", line)


def test_the_native_recorder_writes_the_reference_rows_words_and_slow_lines(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The native core's recorder against the reference over one random stream (300 calls across the
    ring's wrap, the sampled rhythm, slow and descheduled calls, SCHED_FIFO lost midway): every value
    that is not a clock's or the scheduler's is the same, and so are the header words and log lines."""
    _need_native()
    calls = _random_calls(np.random.default_rng(35), 300)
    got = {}
    for impl in ("python", "native"):
        stats, fifo = StatsSegment.create(capacity=64), SchedFifo()
        stats.words[ws.FIFO] = 1
        with native.use(impl == "native"):
            rec = new_recorder(stats, fifo, hero="h", cpu=2, threads=5, slow_engine_cpu_ms=1.5,
                               slow_total_ms=2.5, stats_every=7)  # fmt: skip
        assert type(rec).__module__ == ("lowtail_native" if impl == "native" else call_recorder.__name__)
        caplog.clear()
        try:
            with caplog.at_level("WARNING"):
                rows, sampled = [], []
                for k, (waits, claimed_ns, n, st) in enumerate(calls):
                    fifo.available, fifo.switches, fifo.cooldowns = k < 150, 2 * k, k // 3
                    sampled.append(rec.sampled)
                    rec.record(waits, claimed_ns, n, st)
                    rows.append(stats.raw[k % 64].copy())
                    if k == 200:
                        rec.threads = 9  # the loop refreshes it when idle: the slow lines name it
            assert rec.count == 300
            got[impl] = (np.array(rows), sampled, [stats.word(getattr(ws, w)) for w in _WORDS],
                         [_untimed(r.getMessage()) for r in caplog.records])  # fmt: skip
        finally:
            rec.close()
            stats.close()
    (py_rows, py_sampled, py_words, py_lines), (nat_rows, nat_sampled, nat_words, nat_lines) = got.values()
    same = [i for i, f in enumerate(RAW_FIELDS) if f not in _TIMED]
    assert (py_rows[:, same] == nat_rows[:, same]).all()
    # the counters read on the same calls (sampled or descheduled), and some calls not
    read = RAW_FIELDS.index("read_ns")
    assert ((py_rows[:, read] > 0) == (nat_rows[:, read] > 0)).all()
    assert 30 < (nat_rows[:, read] == 0).sum() < 270
    assert py_sampled == nat_sampled and py_words == nat_words
    assert 10 < len(py_lines) < 300 and py_lines == nat_lines and "threads=9" in py_lines[-1]
    assert py_words[_WORDS.index("FIFO")] == 0  # lost at call 150


def test_the_native_recorder_refuses_a_ring_it_does_not_write() -> None:
    """Made from what Python describes, checked once: another row layout, a header word past the
    header, or a ring past the mapping is refused with what was expected."""
    _need_native()
    core = native.core()
    assert core is not None
    stats = StatsSegment.create(capacity=16)
    _, buffer, first, cap, width = stats.row_packer()
    words = dict(call_recorder._WORDS)
    args = {"threads": 1, "slow_cpu_ns": 1, "slow_total_ns": 1, "descheduled_ns": 1, "stats_every": 1}
    fifo = SchedFifo()
    try:
        fields = list(RAW_FIELDS)
        with pytest.raises(ValueError, match="this core writes"):
            core.CallRecorder(buffer, first, cap, width, fields[::-1], words, fifo, print, **args)
        for past in (512, 1 << 61):  # 2^61 words: 2^64 bytes, which would wrap to the header's start
            with pytest.raises(ValueError, match=f"header word slow = {past} lies past the header"):
                core.CallRecorder(
                    buffer, first, cap, width, fields, words | {"slow": past}, fifo, print, **args
                )
        with pytest.raises(ValueError, match="a ring of 17 rows"):
            core.CallRecorder(buffer, first, cap + 1, width, fields, words, fifo, print, **args)
        rec = core.CallRecorder(buffer, first, cap, width, fields, words, fifo, print, **args)
        rec.close()
        assert rec.closed
        with pytest.raises(ValueError, match="closed"):
            rec.record([1], 0, 1, call_recorder.stamps())
    finally:
        stats.close()


@pytest.mark.usefixtures("recorder_impl")
def test_a_log_handler_may_read_the_recorder_while_a_slow_call_is_logged() -> None:
    """The slow_infer line is logged after the call's row and counters: a handler that reads the
    recorder then sees the call counted (the native recorder is not held while it logs)."""
    stats, fifo = StatsSegment.create(capacity=16), SchedFifo()
    rec = new_recorder(stats, fifo, hero="h", cpu=0, threads=1, slow_engine_cpu_ms=1e9, slow_total_ms=0.001,
                       stats_every=1)  # fmt: skip
    seen: list[tuple[int, int]] = []

    class Reader(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            seen.append((rec.count, rec.threads))

    handler = Reader(logging.WARNING)
    logging.getLogger(call_recorder.__name__).addHandler(handler)
    try:
        t0 = time.monotonic_ns()
        rec.record([1000], t0, 1, _named(t0=t0, t1=t0 + 5_000_000, th1=4_000_000))
        assert seen == [(1, 1)] and stats.word(ws.SLOW) == 1 and stats.word(ws.COUNT) == 1
    finally:
        logging.getLogger(call_recorder.__name__).removeHandler(handler)
        rec.close()
        stats.close()


@pytest.mark.usefixtures("recorder_impl")
def test_a_log_handler_that_closes_the_recorder_and_its_stats_fails_that_record_alone() -> None:
    """A handler that closes the recorder and unmaps the stats while the slow call is logged: the
    record raises (the native core writes no word after it, never into the unmapped pages)."""
    stats, fifo = StatsSegment.create(capacity=16), SchedFifo()
    rec = new_recorder(stats, fifo, hero="h", cpu=0, threads=1, slow_engine_cpu_ms=1e9, slow_total_ms=0.001,
                       stats_every=1)  # fmt: skip
    closed: list[bool] = []

    class Closer(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            rec.close()
            stats.close()
            closed.append(True)

    handler = Closer(logging.WARNING)
    logging.getLogger(call_recorder.__name__).addHandler(handler)
    try:
        t0 = time.monotonic_ns()
        with pytest.raises(ValueError, match=r"closed|released"):
            rec.record([1000], t0, 1, _named(t0=t0, t1=t0 + 5_000_000, th1=4_000_000))
        assert closed == [True]
    finally:
        logging.getLogger(call_recorder.__name__).removeHandler(handler)
        if not closed:
            rec.close()
            stats.close()


@pytest.mark.usefixtures("recorder_impl")
def test_thresholds_beyond_int64_ns_mean_nothing_is_slow() -> None:
    """A slow threshold of 1e300 ms (beyond int64 ns) is accepted by both recorders and never met."""
    stats, fifo = StatsSegment.create(capacity=16), SchedFifo()
    rec = new_recorder(stats, fifo, hero="h", cpu=0, threads=1, slow_engine_cpu_ms=1e300, slow_total_ms=1e300,
                       stats_every=1)  # fmt: skip
    try:
        t0 = time.monotonic_ns()
        rec.record([1000], t0, 1, _named(t0=t0, t1=t0 + 10**12, th1=4_000_000, et1=10**12))
        assert stats.word(ws.COUNT) == 1 and stats.word(ws.SLOW) == 0
    finally:
        rec.close()
        stats.close()


class _Batch:
    """What the native recorder's ``finish_call`` reads of a claimed batch: ``complete`` (each call
    kept with the clock it ran at; it returns its wakes' cost, or raises ``raises``), the requests'
    waits and the claim's clock."""

    def __init__(self, raises: BaseException | None = None) -> None:
        self.queue_wait_ns, self.claimed_ns, self.raises = [3_000, 9_000], 123, raises
        self.calls: list[tuple[object, int, int, int]] = []

    def complete(self, outputs: object, *, engine_ns: int, deschedule_ns: int) -> tuple[int, int]:
        self.calls.append((outputs, engine_ns, deschedule_ns, time.monotonic_ns()))
        if self.raises is not None:
            raise self.raises
        return 4_000, 2


def _native_recorder(stats: StatsSegment, fifo: SchedFifo) -> object:
    _need_native()
    with native.use(True):
        return new_recorder(stats, fifo, hero="h", cpu=0, threads=1, slow_engine_cpu_ms=1e9,
                            slow_total_ms=1e9, stats_every=1000)  # fmt: skip


def _before_infer() -> list[int]:
    """The stamps the loop takes before ``infer()`` (``t0`` ... ``e0``), from the clocks it reads."""
    t0, th0 = time.monotonic_ns(), time.thread_time_ns()
    return _named(t0=t0, th0=th0, c0=time.process_time_ns(), m0=t0 + 1, f0=t0 + 2, k0=t0 + 3,
                  et0=time.thread_time_ns(), ec0=time.process_time_ns(), e0=time.monotonic_ns())  # fmt: skip


@pytest.mark.parametrize("per_call", [False, True])
def test_the_native_finish_call_stamps_answers_and_records_the_rest_of_a_call(per_call: bool) -> None:
    """``finish_call``, the loop's code after ``infer()`` in one core call: each later stamp from its
    clock in the loop's order, ``complete`` given the engine time and deschedule those stamps make,
    SCHED_FIFO left between ``a1`` and ``f1`` only per call, and the row recorded as ``record`` would."""
    stats, fifo = StatsSegment.create(capacity=16), SchedFifo()
    left: list[int] = []
    fifo.leave = lambda: left.append(time.monotonic_ns())  # type: ignore[method-assign]
    rec: Any = _native_recorder(stats, fifo)
    try:
        batch, outputs, st = _Batch(), {"y": np.zeros(3)}, _before_infer()
        taken = list(st)
        rec.finish_call(batch, outputs, 5, st, per_call)
        end, end_thread = time.monotonic_ns(), time.thread_time_ns()
        row = dict(zip(RAW_FIELDS, stats.raw[0].tolist(), strict=True))
        assert st == taken  # the later stamps go into the row, not back into the loop's list
        assert [row[f] for f in call_stats.STAMPS[:9]] == taken[:9]
        ((got_outputs, engine_ns, deschedule_ns, answered_at),) = batch.calls
        assert got_outputs is outputs
        order = [row["e0"], row["e1"], row["a0"], answered_at, row["a1"], row["f1"], row["t1"], end]
        assert order == sorted(order)
        assert row["et0"] <= row["et1"] <= row["th1"] <= end_thread
        assert row["c0"] <= row["ec1"] <= row["c1"] and row["sampled"] == 1  # the first call is sampled
        assert engine_ns == row["e1"] - row["e0"]
        assert deschedule_ns == row["a0"] - row["t0"] - row["et1"] + row["th0"]
        if per_call:
            assert len(left) == 1 and row["a1"] <= left[0] <= row["f1"]
        else:
            assert left == [] and row["f1"] == row["a1"]
        assert (row["wk"], row["wn"], row["batch"], row["slots"]) == (4_000, 2, 5, 2)
        assert (row["wait_ns"], row["claimed_ns"]) == (9_000, 123)
        assert stats.word(ws.COUNT) == 1 and stats.word(ws.SAMPLES) == 5 and not rec.sampled
        rec.finish_call(_Batch(), outputs, 2, _before_infer(), per_call)  # not sampled: no process clock
        second = dict(zip(RAW_FIELDS, stats.raw[1].tolist(), strict=True))
        assert second["ec1"] == second["c1"] == second["sampled"] == 0 and stats.word(ws.COUNT) == 2
    finally:
        rec.close()
        stats.close()


def test_the_native_finish_call_records_nothing_for_a_batch_it_did_not_answer() -> None:
    """``complete`` raising propagates with no row written; stamps that are not the loop's list are
    refused before ``complete`` runs; a recorder closed since answers, then raises."""
    stats, fifo = StatsSegment.create(capacity=16), SchedFifo()
    rec: Any = _native_recorder(stats, fifo)
    try:
        failing = _Batch(raises=OSError("the answer's write failed"))
        with pytest.raises(OSError, match="the answer's write failed"):
            rec.finish_call(failing, {}, 1, _before_infer(), False)
        assert len(failing.calls) == 1 and stats.word(ws.COUNT) == 0 and rec.count == 0
        short = _Batch()
        with pytest.raises(ValueError, match=f"19 stamps: expected {call_stats.N_STAMPS}"):
            rec.finish_call(short, {}, 1, _before_infer()[:-1], False)
        assert short.calls == [] and rec.count == 0
        rec.close()
        late = _Batch()
        with pytest.raises(ValueError, match="closed"):
            rec.finish_call(late, {}, 1, _before_infer(), False)
        assert len(late.calls) == 1  # the answer was delivered; the bookkeeping refused
    finally:
        rec.close()
        stats.close()


def test_the_native_finish_call_leaves_sched_fifo_with_the_recorder_free() -> None:
    """``fifo.leave()`` may log, and a log handler may use the recorder: set its thread count, or close
    it. ``finish_call`` calls leave with the recorder not borrowed (it raised 'Already borrowed'), and
    a recorder closed there refuses the row after the answer, as ``record`` does."""
    stats, fifo = StatsSegment.create(capacity=16), SchedFifo()
    rec: Any = _native_recorder(stats, fifo)
    try:
        fifo.leave = lambda: setattr(rec, "threads", 7)  # type: ignore[method-assign]
        rec.finish_call(_Batch(), {}, 1, _before_infer(), True)
        assert rec.threads == 7 and rec.count == 1
        fifo.leave = rec.close  # type: ignore[method-assign]
        answered = _Batch()
        with pytest.raises(ValueError, match="closed"):
            rec.finish_call(answered, {}, 1, _before_infer(), True)
        assert len(answered.calls) == 1 and rec.closed
    finally:
        rec.close()
        stats.close()


class _Claimed:
    """A claimed batch as ``begin_call`` reads it where it is not a queue's ``Batch``: ``inputs``."""

    def __init__(self) -> None:
        self.inputs = {"obs": np.ones((2, 3), np.float32)}


def test_the_native_begin_call_and_start_engine_stamp_the_start_of_a_call() -> None:
    """``begin_call`` takes the stamps before the model's check as the loop does (``t0``, ``th0``,
    ``c0`` on a sampled call, ``m0``, ``fifo.enter()`` with the recorder free, ``f0``) and returns the
    batch's inputs; ``start_engine`` the ones between check and call (``k0``, ``et0``, ``ec0``,
    ``e0``). Stamps that are not the loop's list are refused before anything is stamped or entered."""
    stats, fifo = StatsSegment.create(capacity=16), SchedFifo()
    entered: list[int] = []
    rec: Any = _native_recorder(stats, fifo)

    def enter() -> None:
        rec.threads = 5  # the recorder is not borrowed while SCHED_FIFO is entered
        entered.append(time.monotonic_ns())

    fifo.enter = enter  # type: ignore[method-assign]
    try:
        batch, st = _Claimed(), call_recorder.stamps()
        start, start_thread = time.monotonic_ns(), time.thread_time_ns()
        assert rec.begin_call(batch, st) is batch.inputs
        between = time.monotonic_ns()
        rec.start_engine(st)
        end, end_thread = time.monotonic_ns(), time.thread_time_ns()
        s = {name: st[getattr(call_stats, name.upper())] for name in call_stats.STAMPS}
        order = [start, s["t0"], s["m0"], *entered, s["f0"], between, s["k0"], s["e0"], end]
        assert len(entered) == 1 and order == sorted(order) and rec.threads == 5
        assert start_thread <= s["th0"] <= s["et0"] <= end_thread
        assert 0 < s["c0"] <= s["ec0"] and rec.sampled  # the first call is sampled: the process clock
        assert all(s[name] == 0 for name in call_stats.STAMPS[9:])  # the rest is finish_call's
        rec.finish_call(_Batch(), {}, 2, st, False)
        assert not rec.sampled
        rec.begin_call(batch, st)
        rec.start_engine(st)
        assert st[call_stats.C0] == st[call_stats.EC0] == 0  # not sampled: no process clock
        short = [0] * (call_stats.N_STAMPS - 1)
        with pytest.raises(ValueError, match=f"19 stamps: expected {call_stats.N_STAMPS}"):
            rec.begin_call(batch, short)
        with pytest.raises(ValueError, match=f"19 stamps: expected {call_stats.N_STAMPS}"):
            rec.start_engine(short)
        assert short == [0] * (call_stats.N_STAMPS - 1) and len(entered) == 2
    finally:
        rec.close()
        stats.close()


def test_the_native_begin_call_reads_a_claimed_batchs_views_and_refuses_a_closed_batch() -> None:
    """A queue's open batch has its inputs read without the property (the very views it holds); an
    answered batch, and the batch of a closed worker, go to the property, which refuses them."""
    stats, fifo = StatsSegment.create(capacity=16), SchedFifo()
    rec: Any = _native_recorder(stats, fifo)
    st = call_recorder.stamps()
    try:
        with (
            native.use(True),
            InferenceQueue.create(
                QueueConfig(lanes=1, slots_per_lane=2, coalesce_us=0, max_batch_slots=1)
            ) as q,
            QueueClient.attach(q.descriptor) as client,
            QueueWorker.attach(q.descriptor) as worker,
        ):
            client.submit({"x": np.arange(16, dtype=np.float32).reshape(2, 8)})
            client.submit({"x": np.ones((1, 8), np.float32)})
            answered, orphaned = worker.claim(1.0), worker.claim(1.0)
            assert answered is not None and orphaned is not None
            got = rec.begin_call(answered, st)
            assert got is answered.inputs and got["x"].tolist() == np.arange(16).reshape(2, 8).tolist()
            answered.fail("answered")
            with pytest.raises(BatchClosed, match="already answered"):
                rec.begin_call(answered, st)
            worker.close()
            with pytest.raises(BatchClosed, match="worker was closed"):
                rec.begin_call(orphaned, st)
    finally:
        rec.close()
        stats.close()
