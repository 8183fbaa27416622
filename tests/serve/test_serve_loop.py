"""The serving loop itself (``worker_main.serve``) on a stand-in queue and engine, with the real recorder
and stats segment: what each call writes, when the loop returns, and that its bytecode gets specialized."""

from __future__ import annotations

import contextlib
import dis
import os
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from lowtail.serve import stats_segment as ws
from lowtail.serve import worker_main
from lowtail.serve.call_recorder import new_recorder
from lowtail.serve.call_stats import RAW_FIELDS
from lowtail.serve.config import WorkerConfig
from lowtail.serve.pinning import SchedFifo
from lowtail.serve.stats_segment import StatsSegment
from lowtail.shm import native

COL = {name: i for i, name in enumerate(RAW_FIELDS)}


class _Batch:
    """A claimed batch of one 2-sample request, as ``QueueWorker.claim`` returns it."""

    def __init__(self) -> None:
        self.inputs = {"obs": np.ones((2, 3), np.float32)}
        self.layout = "layout"
        self.sizes = [2]
        self.queue_wait_ns = [1_000]
        self.claimed_ns = time.monotonic_ns()
        self.failed = 0
        self.answered: tuple[Any, ...] | None = None

    def __enter__(self) -> _Batch:
        return self

    def __exit__(self, *exc: object) -> None:
        return None

    def __len__(self) -> int:
        return 1

    def fail(self, message: str) -> None:
        self.failed = len(self.sizes)

    def complete(self, outputs: Any, *, engine_ns: int, deschedule_ns: int) -> tuple[int, int]:
        self.answered = (outputs, engine_ns, deschedule_ns)
        return 1_234, 1  # the futex wakes' ns and lanes


class _Engine:
    """Answers every call; sets the loop's stop flag after ``calls`` of them."""

    precision = "f32"

    def __init__(self, calls: int) -> None:
        self.calls, self.left = 0, calls
        self.outputs = {"act": np.zeros((2, 4), np.float32)}

    def check(self, inputs: Any, layout: object = None) -> int:
        return 2

    def infer(self, inputs: Any, checked_batch: int = 0) -> dict[str, np.ndarray]:
        self.calls += 1
        if self.calls == self.left:
            worker_main._stop["signalled"] = True
        return self.outputs


class _Queue:
    def __init__(self) -> None:
        self.batches: list[_Batch] = []

    def claim(self, timeout_s: float) -> _Batch:
        self.batches.append(_Batch())
        return self.batches[-1]


def _serve(calls: int, monkeypatch: pytest.MonkeyPatch, scope: str = "work") -> tuple[np.ndarray, _Queue]:
    """Run ``serve()`` for ``calls`` calls; the raw rows it recorded and the stand-in queue."""
    monkeypatch.setitem(worker_main._stop, "signalled", False)
    stats, queue, fifo = StatsSegment.create(calls + 16), _Queue(), SchedFifo()
    fifo.reason = "not used by this test"
    config = WorkerConfig(name="t", fifo_scope=scope, slow_engine_cpu_ms=1e9, slow_total_ms=1e9)
    try:
        ready = {"threads": 1, "nice": {"achieved": 0}}
        worker_main.serve(qworker=queue, engine=_Engine(calls), stats=stats, fifo=fifo, cpu=0,  # type: ignore[arg-type]
                          config=config, ready=ready, ppid=os.getppid())  # fmt: skip
        assert stats.word(ws.COUNT) == calls and stats.word(ws.SAMPLES) == 2 * calls
        return stats.read_raw(0).rows, queue
    finally:
        stats.close()


@pytest.mark.parametrize("recorder", ["python", "native"])
@pytest.mark.parametrize("scope", ["work", "call"])
def test_every_call_is_one_row_with_the_wakes_complete_returned(
    monkeypatch: pytest.MonkeyPatch, scope: str, recorder: str
) -> None:
    with native.use(recorder == "native"):  # the recorder serve() makes (new_recorder)
        rows, queue = _serve(5, monkeypatch, scope)
    assert rows.shape == (5, len(RAW_FIELDS)) and len(queue.batches) == 5
    assert (rows[:, COL["wk"]] == 1_234).all() and (rows[:, COL["wn"]] == 1).all()
    assert (rows[:, COL["batch"]] == 2).all() and (rows[:, COL["slots"]] == 1).all()
    for row, batch in zip(rows, queue.batches, strict=True):
        assert batch.answered is not None and batch.answered[1] == row[COL["e1"]] - row[COL["e0"]]
        # the deschedule every answer carries: wall less thread CPU from the claim to the answer
        assert batch.answered[2] == row[COL["a0"]] - row[COL["t0"]] - row[COL["et1"]] + row[COL["th0"]]
    stamps = ["t0", "m0", "f0", "k0", "e0", "e1", "a0", "a1", "f1", "t1"]  # the wall stamps, in order
    assert (np.diff(rows[:, [COL[s] for s in stamps]], axis=1) >= 0).all()
    if scope == "work":  # no SCHED_FIFO call after the answer: that half of fifo_us is 0, not a clock read
        assert (rows[:, COL["f1"]] == rows[:, COL["a1"]]).all()


@contextlib.contextmanager
def _loop(engine: Any, ppid: int, queue: _Queue | None = None) -> Iterator[tuple[Any, _Queue, StatsSegment]]:
    """``_serve_batches``' state over a stand-in queue and ``engine``, with a real recorder and stats."""
    stats, queue, fifo = StatsSegment.create(64), queue or _Queue(), SchedFifo()
    fifo.reason = "not used by this test"
    rec = new_recorder(stats, fifo, hero="t", cpu=0, threads=1, slow_engine_cpu_ms=1e9, slow_total_ms=1e9,
                       stats_every=16)  # fmt: skip
    try:
        yield worker_main._Loop(
            claim=queue.claim, claim_timeout=0.01, drop_when_idle=True, engine=engine, fifo=fifo,
            h=stats.words, malformed=ValueError, next_check=time.monotonic_ns(), per_call=False, ppid=ppid,
            rec=rec, st=[0] * 20,
        ), queue, stats  # fmt: skip
    finally:
        rec.close()  # first: the native recorder holds the stats mapping
        stats.close()


def test_the_loop_returns_within_its_budget_and_false_once_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(worker_main._stop, "signalled", False)
    with _loop(_Engine(10**6), os.getppid()) as (loop, _, stats):
        assert worker_main._serve_batches(loop, 3) is True and stats.word(ws.COUNT) == 3
        assert loop.next_check > 0  # the housekeeping time carries over to the next entry
        stats.header[ws.STOP] = 1
        assert worker_main._serve_batches(loop, 3) is False and stats.word(ws.COUNT) == 3


class _FailingEngine(_Engine):
    def __init__(self, where: str) -> None:
        super().__init__(10**6)
        self.where = where

    def check(self, inputs: Any, layout: object = None) -> int:
        if self.where == "check":
            raise ValueError("inputs do not fit the model")
        return 2

    def infer(self, inputs: Any, checked_batch: int = 0) -> dict[str, np.ndarray]:
        raise RuntimeError("the engine failed")


class _RefusingBatch(_Batch):
    """``complete()`` refuses the outputs (as for outputs of another batch size): fails, then raises."""

    def complete(self, outputs: Any, *, engine_ns: int, deschedule_ns: int) -> tuple[int, int]:
        self.fail("worker outputs must share the batch's leading dimension")
        raise ValueError("worker outputs must share the batch's leading dimension")


class _RefusingQueue(_Queue):
    def claim(self, timeout_s: float) -> _Batch:
        self.batches.append(_RefusingBatch())
        return self.batches[-1]


@pytest.mark.parametrize("recorder", ["python", "native"])
@pytest.mark.parametrize("where", ["check", "infer", "complete"])
def test_a_loop_failing_every_batch_still_leaves_once_its_parent_is_gone(
    monkeypatch: pytest.MonkeyPatch, where: str, recorder: str
) -> None:
    """Every batch fails (malformed inputs, the engine raises, its outputs refused) under constant load:
    the loop still checks its parent on the housekeeping period and ends when it is gone (it skipped
    the check)."""
    monkeypatch.setitem(worker_main._stop, "signalled", False)
    engine, refusing = (
        (_Engine(10**6), _RefusingQueue()) if where == "complete" else (_FailingEngine(where), None)
    )
    with (
        native.use(recorder == "native"),
        _loop(engine, -1, refusing) as (loop, queue, _),
    ):  # -1: never the parent
        assert worker_main._serve_batches(loop, 1000) is False
        assert 1 <= len(queue.batches) < 1000 and all(b.failed == 1 for b in queue.batches)


@pytest.mark.parametrize("recorder", ["python", "native"])
def test_a_busy_loop_checks_its_parent_at_most_twice_a_second(
    monkeypatch: pytest.MonkeyPatch, recorder: str
) -> None:
    """Under constant load (claims never empty) the parent is checked once per housekeeping period, not
    per call: ``getppid`` is a system call."""
    monkeypatch.setitem(worker_main._stop, "signalled", False)
    checks: list[int] = []
    monkeypatch.setattr(worker_main, "_orphaned", lambda ppid: checks.append(time.monotonic_ns()) or False)
    with native.use(recorder == "native"), _loop(_Engine(10**6), os.getppid()) as (loop, _, stats):
        start = time.monotonic_ns()
        while time.monotonic_ns() - start < 1.2e9:
            worker_main._serve_batches(loop, 64)
        elapsed, calls = time.monotonic_ns() - start, stats.word(ws.COUNT)
    assert calls > 100 and 1 <= len(checks) <= elapsed // worker_main.HOUSEKEEPING_NS + 1, (
        calls,
        len(checks),
    )


@pytest.mark.skipif(sys.version_info[:2] != (3, 11), reason="CPython 3.11's specialization names")
def test_the_loops_bytecode_is_specialized_once_it_served_a_few_hundred_calls(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CPython 3.11 specializes a function only after 8 calls of it: a loop that never returns runs
    generic bytecode for ever. The loop returns every ``BATCHES_PER_ENTRY`` batches so it is. On the
    Python path, whose stamps are the list stores looked for (the core's recorder takes them itself)."""
    with native.use(False):
        _serve(600, monkeypatch)  # past 8 entries of the loop
    ops = {i.opname for i in dis.get_instructions(worker_main._serve_batches, adaptive=True)}
    assert "STORE_SUBSCR_LIST_INT" in ops, sorted(ops)
