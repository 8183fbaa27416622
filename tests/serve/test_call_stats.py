from __future__ import annotations

import os
import re
import struct
import threading
import time

import numpy as np
import pytest

from lowtail.serve import call_stats as metrics
from lowtail.serve.call_stats import (
    CALL_FIELDS,
    SLOW_INFER_FORMAT,
    LatencyWindow,
    ThreadCounters,
    percentiles,
    slow_infer_args,
    status_nonvoluntary_switches,
)
from lowtail.serve.stats_segment import COUNT, StatsSegment, StatsSegmentError


def test_percentiles_carry_the_sample_count() -> None:
    values = np.arange(1, 10_001, dtype=np.float64)
    p = percentiles(values)
    assert p.n == 10_000
    assert p.p50 == 5000  # nearest rank: always a value that was observed
    assert p.p99 == 9900 and p.p999 == 9990
    assert p.mean == pytest.approx(5000.5)
    assert p.max == 10_000
    assert percentiles([]).n == 0 and np.isnan(percentiles([]).p999)


def test_latency_window_keeps_only_the_last_values() -> None:
    w = LatencyWindow(capacity=100)
    for v in range(250):
        w.add(float(v))
    assert w.count == 250
    assert sorted(w.values()) == [float(v) for v in range(150, 250)]
    assert w.percentiles().n == 100 and w.percentiles().max == 249
    w.clear()
    assert w.percentiles().n == 0


def spin(seconds: float) -> None:
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        pass


def test_run_delay_and_involuntary_switches_grow_under_contention_on_one_cpu() -> None:
    cpu = max(os.sched_getaffinity(0))
    result: dict[str, int] = {}

    def contended() -> None:
        os.sched_setaffinity(0, {cpu})
        c = ThreadCounters()
        rd0, iv0 = c.run_delay_ns(), c.nivcsw()
        spin(0.3)
        result["run_delay"] = c.run_delay_ns() - rd0
        result["nivcsw"] = c.nivcsw() - iv0
        c.close()

    def rival() -> None:
        os.sched_setaffinity(0, {cpu})
        spin(0.3)

    # A rival *process*: a thread would hold the GIL and the two would take turns by the GIL, not the CPU.
    pid = os.fork()
    if pid == 0:  # pragma: no cover - child
        try:
            rival()
        finally:
            os._exit(0)
    t = threading.Thread(target=contended)
    t.start()
    t.join()
    os.waitpid(pid, 0)
    assert result["run_delay"] > 10_000_000  # > 10 ms of the 300 ms spent waiting for the CPU
    assert result["nivcsw"] > 0


def test_nivcsw_is_the_counter_proc_status_prints() -> None:
    def check() -> None:
        before = status_nonvoluntary_switches()
        mid = ThreadCounters.nivcsw()
        after = status_nonvoluntary_switches()
        assert before <= mid <= after

    t = threading.Thread(target=check)
    t.start()
    t.join()


def test_slow_infer_line_has_the_predecessors_fields_in_order() -> None:
    row = [0.0] * len(CALL_FIELDS)
    col = metrics.COL
    row[col["wall_ms"]] = 250.0
    row[col["engine_cpu_ms"]] = 40.0
    row[col["engine_thread_cpu_ms"]] = 39.5
    row[col["deschedule_ms"]] = 205.0
    row[col["batch"]] = 12
    row[col["slots"]] = 3
    row[col["queue_wait_ms"]] = 1.5
    line = SLOW_INFER_FORMAT % slow_infer_args("h3", 5, row, False, 4)
    assert re.fullmatch(
        r"slow_infer hero=h3 cpu=5 slots=3 total_batch=12 engine_cpu_ms=40\.0 engine_thread_cpu_ms=39\.5 "
        r"engine_wait_ms=1\.5 wall_ms=250\.0 deschedule_ms=205\.0 sched_fifo=False affinity=process_isolated "
        r"threads=4 run_delay_ms=0\.0 nivcsw=0",
        line,
    )


def test_stats_ring_reader_keeps_only_intact_rows_and_counts_lost_ones() -> None:
    owner = StatsSegment.create(capacity=16)
    writer = StatsSegment.attach(owner.fd)  # a second mapping, as the worker has
    try:
        pack, buffer, row0, capacity, width = writer.row_packer()  # the worker's: one pack_into per row

        def write(k: int) -> None:
            pack(buffer, row0 + (k % capacity) * width, *[k] * len(metrics.RAW_FIELDS))
            writer.header[COUNT] = k + 1

        for k in range(10):
            write(k)
        first = owner.read_raw(0)
        assert first.rows[:, 0].tolist() == list(range(10)) and first.lost == 0
        for k in range(10, 40):
            write(k)
        second = owner.read_raw(first.cursor)
        # 30 rows were written since the cursor, the ring holds 16, and the newest slot may be mid-write.
        assert second.rows[:, 0].tolist() == list(range(25, 40))
        assert second.lost == 15 and second.cursor == 40
        derived = owner.read_calls(first.cursor)  # the same rows, as readers see them
        assert derived.rows.shape == (15, len(CALL_FIELDS)) and derived.lost == 15 and derived.cursor == 40
        assert derived.rows[:, metrics.COL["t_end_s"]].tolist() == [k / 1e9 for k in range(25, 40)]
    finally:
        writer.close()
        owner.close()
    with pytest.raises(OSError):
        os.fstat(owner.fd)  # the owner closed the memfd: nothing left behind


def test_stats_segment_rejects_a_foreign_fd(tmp_path: object) -> None:
    fd = os.memfd_create("not-stats")
    os.ftruncate(fd, 8192)
    try:
        with pytest.raises(StatsSegmentError, match="not a lowtail worker stats segment"):
            StatsSegment.attach(fd)
    finally:
        os.close(fd)


def test_the_workers_row_and_word_stores_are_the_int64_the_readers_read() -> None:
    """The worker packs rows and stores words as the platform's C long where it is 8 bytes (a cheaper
    conversion than long long's): the bytes must still be the int64 every reader maps, at both ends."""
    seg = StatsSegment.create(capacity=16)
    try:
        pack, buffer, row0, _, width = seg.row_packer()
        assert width == seg.raw.strides[0]
        values = [-(1 << 63), (1 << 63) - 1, 1_765_000_000_123_456_789, -1, 0]
        values += list(range(len(metrics.RAW_FIELDS) - len(values)))
        pack(buffer, row0 + 3 * width, *values)
        assert seg.raw[3].tolist() == values and not seg.raw[[2, 4]].any()  # its place, and only there
        seg.words[COUNT] = (1 << 63) - 1
        assert int(seg.header[COUNT]) == (1 << 63) - 1
        with pytest.raises(struct.error):  # beyond int64: refused, not wrapped
            pack(buffer, row0, *[1 << 63] * len(metrics.RAW_FIELDS))
    finally:
        seg.close()
