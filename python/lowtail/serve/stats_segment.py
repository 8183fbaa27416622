"""The worker's stats segment: a control block and a ring of per-call rows shared with its parent.

An anonymous ``memfd`` (nothing in /dev/shm to leak or sweep) created by the parent, inherited by the
spawned worker and mapped by both. The worker writes rows and counters on its own core; the parent reads
them and computes percentiles on its own CPU, so reporting costs the inference core nothing.

Layout (little-endian; every word has exactly one writer):

    offset  size  field             writer   meaning
    0       8     magic             parent   b"LTWSTAT2"
    8       8     capacity          parent   rows in the ring
    16      8     ncols             parent   len(call_stats.RAW_FIELDS)
    24      8     stop_requested    parent   1: finish the current batch and exit
    64      8     count             worker   rows written so far; row k lives at k % capacity
    72      8     worker_pid        worker
    80      8     state             worker   0 starting, 1 serving, 2 stopped, 3 failed, 4 standby
    88      8     heartbeat_ns      worker   CLOCK_MONOTONIC at the last loop turn that checked in
    96      8     threads           worker   threads in the worker process (refreshed when idle)
    104     8     samples           worker   samples served
    112     8     failed_requests   worker   requests failed by the worker (malformed, engine error)
    120     8     slow_calls        worker   calls that logged slow_infer
    128     8     engine_cpu_ns     worker   sum of process CPU time inside infer()
    136     8     engine_thread_ns  worker   sum of the serving thread's CPU time inside infer()
    144     8     sched_fifo        worker   1 while SCHED_FIFO is in use around inference
    152     8     fifo_switches     worker   scheduling-policy changes so far (SchedFifo.switches)
    160     8     fifo_cooldowns    worker   SCHED_FIFO holds cut short by the RT-budget limit
    168     8     takeover_ns       worker   a standby: CLOCK_MONOTONIC when it took the worker lock (0: not)
    4096    8*capacity*ncols  rows  worker   int64 raw rows, see call_stats.RAW_FIELDS

The parent's word sits on its own cache line. Publication of a row is "write the row, then store
count + 1" (x86-64 keeps stores in order); the reader keeps only rows that cannot have been
overwritten while it copied them. The rows hold what the worker measured (its clock stamps and
counters), not the columns readers see: ``read_calls`` derives those (``call_stats.derive_calls``), so
the worker's hot path stores one row with one ``pack_into`` and computes nothing.
"""

from __future__ import annotations

import mmap
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, NamedTuple

import numpy as np

from lowtail.errors import LowtailError
from lowtail.serve.call_stats import RAW_FIELDS, derive_calls

# The worker's stores convert Python ints with the platform's C long where it is 8 bytes (Linux on
# 64-bit): CPython 3.11 converts a long long through its generic byte-array routine, ~4x the
# instructions per value (``benchmarks/worker-instructions.py``: 29 values a row and ~6 words a call).
# Same bytes in the segment: the native byte order, int64.
WORD: Literal["l", "q"] = "l" if struct.calcsize("l") == 8 else "q"

MAGIC = int.from_bytes(b"LTWSTAT2", "little")  # 2: raw int64 rows (1 held derived float64 rows)
HEADER_BYTES = 4096

CAPACITY, NCOLS, STOP = 1, 2, 3
COUNT, PID, STATE, HEARTBEAT, THREADS, SAMPLES, FAILED, SLOW, ENGINE_CPU, ENGINE_THREAD, FIFO = range(8, 19)
FIFO_SWITCHES, FIFO_COOLDOWNS, TAKEOVER_NS = 19, 20, 21
STARTING, SERVING, STOPPED, FAILED_STATE, STANDBY = 0, 1, 2, 3, 4
STATE_NAMES = {
    STARTING: "starting",
    SERVING: "serving",
    STOPPED: "stopped",
    FAILED_STATE: "failed",
    STANDBY: "standby",
}


class StatsSegmentError(LowtailError, RuntimeError):
    """The stats segment is not one this version wrote (wrong magic or shape)."""


@dataclass(frozen=True)
class CallBatch:
    """Rows read since a cursor: ``rows`` (n, ncols), the next cursor, and rows lost to overwrite.

    ``read_calls`` gives derived rows (``call_stats.CALL_FIELDS``), ``read_raw`` the raw ones."""

    rows: np.ndarray
    cursor: int
    lost: int


class RowPacker(NamedTuple):
    """``StatsSegment.row_packer``: row k goes at ``first + (k % capacity) * width`` of ``buffer``."""

    pack: Callable[..., None]
    buffer: mmap.mmap
    first: int
    capacity: int
    width: int


class StatsSegment:
    def __init__(self, fd: int, owner: bool) -> None:
        self.fd = fd
        self.owner = owner
        size = os.fstat(fd).st_size
        self._mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        self.header = np.ndarray((HEADER_BYTES // 8,), dtype=np.int64, buffer=self._mm)
        # The same words for the worker's hot path: a memoryview item store is ~3x cheaper than numpy's.
        self.words = memoryview(self._mm)[:HEADER_BYTES].cast(WORD)
        if int(self.header[0]) != MAGIC or int(self.header[NCOLS]) != len(RAW_FIELDS):
            self._unmap()
            raise StatsSegmentError(f"fd {fd}: not a lowtail worker stats segment of this version")
        cap = int(self.header[CAPACITY])
        self.raw = np.ndarray((cap, len(RAW_FIELDS)), dtype=np.int64, buffer=self._mm, offset=HEADER_BYTES)

    @classmethod
    def create(cls, capacity: int = 65536) -> StatsSegment:
        if capacity < 16:
            raise ValueError(f"capacity={capacity}: expected >= 16 rows")
        fd = os.memfd_create("lowtail-worker-stats", os.MFD_CLOEXEC)
        size = HEADER_BYTES + 8 * capacity * len(RAW_FIELDS)
        os.ftruncate(fd, size)
        with mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
            head = np.ndarray((4,), dtype=np.int64, buffer=mm)
            head[:] = (MAGIC, capacity, len(RAW_FIELDS), 0)
            del head
        return cls(fd, owner=True)

    @classmethod
    def attach(cls, fd: int) -> StatsSegment:
        return cls(fd, owner=False)

    @property
    def capacity(self) -> int:
        return int(self.raw.shape[0])

    def row_packer(self) -> RowPacker:
        """How the worker writes raw call row ``k`` (``RAW_FIELDS`` order) in its ring place, with one
        ``struct.pack_into`` and no call around it: ``pack(buffer, first + (k % capacity) * width,
        *values)``. ~1.7 us cheaper per call than assigning a tuple to a numpy row (measured in the
        worker loop's ``record_us`` stage, best of 5 on the KVM guest: 3.7 vs 5.4 us), and a closure
        around it cost another 0.25 us warm. Native int64 words (``WORD``)."""
        width = 8 * len(RAW_FIELDS)
        return RowPacker(
            struct.Struct(f"@{len(RAW_FIELDS)}{WORD}").pack_into, self._mm, HEADER_BYTES, self.capacity, width
        )

    def word(self, index: int) -> int:
        return int(self.header[index])

    def read_calls(self, since: int = 0) -> CallBatch:
        """Rows written at or after cursor ``since`` that are still intact, derived (``CALL_FIELDS``)."""
        got = self.read_raw(since)
        return CallBatch(rows=derive_calls(got.rows), cursor=got.cursor, lost=got.lost)

    def read_raw(self, since: int = 0) -> CallBatch:
        """Raw rows (``RAW_FIELDS``, int64) written at or after cursor ``since`` that are still intact."""
        cap = self.capacity
        c1 = int(self.header[COUNT])
        start = max(since, c1 - cap)
        idx = np.arange(start, c1) % cap
        rows = self.raw[idx].copy()
        c2 = int(self.header[COUNT])
        # A row k may be overwritten once the writer starts row k + cap, i.e. once count >= k + cap.
        first_safe = max(start, c2 - cap + 1)
        rows = rows[first_safe - start :]
        return CallBatch(rows=rows, cursor=c1, lost=first_safe - since if first_safe > since else 0)

    def _unmap(self) -> None:
        if hasattr(self, "words"):
            self.words.release()
        for name in ("header", "raw", "words"):
            if hasattr(self, name):
                delattr(self, name)
        self._mm.close()

    def close(self) -> None:
        if self._mm.closed:
            return
        self._unmap()
        if self.owner:
            os.close(self.fd)
