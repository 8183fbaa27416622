"""An answer is never lost, never read after it is freed, and never left unanswered.

Each test drives the queue through its public API with real processes and real signals, on every queue
implementation (``queue_impl``); the exhaustion cases run on a tmpfs the test mounts (``tmpfs``).
"""

from __future__ import annotations

import errno
import os
import queue
import signal
import time
from collections.abc import Callable, Iterator
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lowtail.shm import segments
from tests.shm.helpers import echo_server, hold_then_close_then_read, impl_module, wide_answer_server


def _x(tag: float, rows: int = 2) -> dict[str, np.ndarray[Any, Any]]:
    return {"x": np.full((rows, 4), tag, np.float32)}


class Served:
    """A queue in ``shm_dir`` and a ``wide_answer_server`` process answering it."""

    def __init__(self, ctx: BaseContext, impl: str, shm_dir: Path, width: int, **cfg: Any) -> None:
        q = impl_module(impl)
        self.q, self.ctx, self.impl, self.width = q, ctx, impl, width
        conf = {"lanes": 2, "slots_per_lane": 2, "request_bytes": 4096, "response_bytes": 4096}
        conf.update(cfg)
        self.queue = q.InferenceQueue.create(q.QueueConfig(coalesce_us=0, shm_dir=str(shm_dir), **conf))
        self.desc = self.queue.descriptor
        self.proc: Any = None

    def start(self) -> None:
        ready = self.ctx.Queue()
        self.proc = self.ctx.Process(
            target=wide_answer_server, args=(self.impl, self.desc, self.width, ready)
        )
        self.proc.start()
        ready.get(timeout=60)

    def stop(self, sig: int = signal.SIGTERM) -> None:
        if self.proc is not None and self.proc.is_alive():
            os.kill(self.proc.pid, sig)
        if self.proc is not None:
            self.proc.join(30)

    def close(self) -> None:
        self.stop(signal.SIGKILL)
        self.queue.close()


@pytest.fixture
def served(ctx: BaseContext, queue_impl: str) -> Iterator[Callable[..., Served]]:
    made: list[Served] = []

    def make(
        shm_dir: Path | str = segments.SHM_DIR, width: int = 8, start: bool = True, **cfg: Any
    ) -> Served:
        s = Served(ctx, queue_impl, Path(shm_dir), width, **cfg)
        made.append(s)
        if start:
            s.start()
        return s

    try:
        yield make
    finally:
        for s in made:
            s.close()


# -- zero-copy views outlive the client that took them --------------------------------------------------


@pytest.mark.parametrize("width", [8, 4096], ids=["inline", "ndarray-segment"])
def test_a_zero_copy_answer_kept_past_close_stays_mapped_and_keeps_its_lane(
    served: Callable[..., Served], ctx: BaseContext, queue_impl: str, width: int
) -> None:
    s = served(width=width)
    out, read, drop = ctx.Queue(), ctx.Event(), ctx.Event()
    child = ctx.Process(target=hold_then_close_then_read, args=(queue_impl, s.desc, 3.0, out, read, drop))
    child.start()
    try:
        kind, lane = out.get(timeout=30)
        assert kind == "closed"
        read.set()
        try:
            got = out.get(timeout=30)
        except queue.Empty:
            child.join(5)
            raise AssertionError(f"the reader died: exit code {child.exitcode} (-11: SIGSEGV)") from None
        assert got == ("read", 3.0 * 2 * width, (2, width))
        # Its array still reads the answer slots of that lane: a new client must get another lane.
        with s.q.QueueClient.attach(s.desc) as other:
            assert other.lane != lane
            assert other.infer(_x(5.0), 10)["y"][0, 0] == 5.0
        drop.set()
        assert out.get(timeout=30) == ("dropped", lane)
        child.join(30)
        assert child.exitcode == 0
        # The last view gone, the lane is free again: both lanes can be taken.
        with s.q.QueueClient.attach(s.desc) as a, s.q.QueueClient.attach(s.desc) as b:
            assert {a.lane, b.lane} == {0, 1}
    finally:
        read.set()
        drop.set()
        child.join(10)
        if child.is_alive():
            child.kill()
            child.join()


# -- an answer whose worker goes -------------------------------------------------------------------------


@pytest.mark.parametrize("how", ["close", "sigkill-and-sweep"])
def test_an_answer_whose_ndarray_slot_went_with_its_worker_is_answer_lost_never_segment_not_found(
    served: Callable[..., Served], tmpfs: Callable[..., Path], how: str
) -> None:
    shm = tmpfs()
    s = served(shm, width=4096)
    with s.q.QueueClient.attach(s.desc) as c:
        p = c.start(_x(2.0))
        deadline = time.monotonic() + 30
        while not p.done():
            assert time.monotonic() < deadline, "no answer"
            time.sleep(0.001)
        if how == "close":
            s.stop(signal.SIGTERM)  # a graceful close unlinks its pool
        else:
            s.stop(signal.SIGKILL)
            segments.sweep_dead(str(shm))  # what any sweep does (a standby's idle claim, shm gc)
        with pytest.raises(s.q.QueueError) as e:
            p.finish(10)
        # It ran: its caller must not send it again. SegmentNotFound is what a failover counts as a
        # lost attachment (and retries elsewhere).
        assert type(e.value).__name__ == "AnswerLost", f"{type(e.value).__name__}: {e.value}"
        assert not isinstance(e.value, s.q.SegmentNotFound)
        assert "ran" in str(e.value)


# -- an answer that cannot be written --------------------------------------------------------------------


def _fill_inodes(d: Path) -> list[Path]:
    made = []
    for i in range(100_000):
        f = d / f"filler-{i}"
        try:
            f.touch()
        except OSError as e:
            assert e.errno == errno.ENOSPC, e
            return made
        made.append(f)
    raise AssertionError(f"{d} never ran out of inodes")


def test_an_answer_that_cannot_be_written_fails_alone_and_the_rest_of_its_batch_is_answered(
    served: Callable[..., Served], tmpfs: Callable[..., Path]
) -> None:
    shm = tmpfs(inodes=64)
    # 1 row x 256 float32 fits the 4096-byte answer region; 8 rows need an ndarray segment (a new file).
    s = served(shm, width=256, start=False, max_batch_samples=64, max_batch_slots=4, min_batch_samples=1)
    with s.q.QueueClient.attach(s.desc) as big, s.q.QueueClient.attach(s.desc) as small:
        assert (big.lane, small.lane) == (0, 1)  # the worker answers lane 0's request first
        fillers = _fill_inodes(shm)
        try:
            pb, ps = big.start(_x(1.0, rows=8)), small.start(_x(2.0, rows=1))
            s.start()  # one claim takes both: one merged batch
            with pytest.raises(s.q.RequestFailed, match=r"(?i)no space|ENOSPC"):
                pb.finish(10)
            assert ps.finish(10)["y"].tolist() == [[2.0] * 256]
        finally:
            for f in fillers:
                f.unlink()
        # Nothing stays in flight: the lane's two slots serve again, and the wide answer fits now.
        for k in range(4):
            assert big.infer(_x(float(k), rows=8), 10)["y"][7, 255] == float(k)


# -- the sweep of dead owners' slots stays off the claim path ---------------------------------------------


def _dead_pid(ctx: BaseContext) -> int:
    p = ctx.Process(target=time.sleep, args=(0,))
    p.start()
    p.join()
    assert p.pid is not None
    return p.pid


def test_the_sweep_of_dead_slots_is_incremental_so_one_idle_claim_never_scans_them_all(
    ctx: BaseContext, tmpfs: Callable[..., Path], queue_impl: str
) -> None:
    q = impl_module(queue_impl)
    shm = tmpfs(inodes=30_000)
    with q.InferenceQueue.create(q.QueueConfig(lanes=1, slots_per_lane=1, shm_dir=str(shm))) as queue:
        d = segments.private_dir(str(shm))
        pid, ns = _dead_pid(ctx), segments.pid_namespace()
        n = 20_000
        for i in range(n):
            (d / f"lowtail.nd.{ns}.{pid}.{i:012x}").touch()

        def left() -> int:
            return sum(1 for e in os.listdir(d) if e.startswith(f"lowtail.nd.{ns}.{pid}."))

        with q.QueueWorker.attach(queue.descriptor) as w:
            assert w.claim(timeout_s=0.001) is None  # idle: its sweep runs now
            first = n - left()
            assert 0 < first < n, f"one idle claim swept {first} of {n} dead slots: expected a bounded step"
            deadline = time.monotonic() + 120
            while left():
                assert time.monotonic() < deadline, f"{left()} dead slots left after 120 s of idle claims"
                for _ in range(100):  # (listing the directory to count costs more than a step)
                    assert w.claim(timeout_s=0.001) is None


# -- what a departed client leaves -----------------------------------------------------------------------


def _used_bytes(d: Path) -> int:
    st = os.statvfs(d)
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def test_a_cleanly_closed_clients_request_slots_are_not_pinned_by_the_worker(
    tmpfs: Callable[..., Path], queue_impl: str
) -> None:
    q = impl_module(queue_impl)
    shm = tmpfs(size="64m")
    cfg = q.QueueConfig(lanes=2, slots_per_lane=2, request_bytes=4096, response_bytes=4096, shm_dir=str(shm))
    with q.InferenceQueue.create(cfg) as queue, q.QueueWorker.attach(queue.descriptor) as w:
        before = _used_bytes(shm)
        with q.QueueClient.attach(queue.descriptor) as c:
            t = c.submit({"x": np.ones((64, 1024), np.float32)})  # 256 KiB: in an ndarray segment of its own
            b = w.claim(5)
            assert b is not None
            with b:
                b.complete({"y": b.inputs["x"][:, :1].copy()})
            assert c.wait(t, 5)["y"].shape == (64, 1)
            assert _used_bytes(shm) - before >= 256 << 10
        assert w.claim(timeout_s=0.001) is None  # idle: what departed clients left is let go
        assert _used_bytes(shm) - before < 64 << 10, "the closed client's unlinked slot is still pinned"


def test_a_refused_release_can_be_retried_inside_its_except(served: Callable[..., Served]) -> None:
    s = served()
    with s.q.QueueClient.attach(s.desc) as c:
        held = c.wait(c.submit(_x(1.0)), 10, copy=False)
        y = held["y"]
        try:
            held.release()
        except s.q.QueueError:
            del y
            held.release()  # the refused call's traceback must not keep the answer referenced
        assert held.released


# -- the worker-pid word is a hint, not the truth --------------------------------------------------------


def test_a_zeroed_worker_pid_word_does_not_hide_the_death_of_the_worker_that_claimed_a_request(
    ctx: BaseContext, queue_impl: str
) -> None:
    q = impl_module(queue_impl)
    with q.InferenceQueue.create(q.QueueConfig(lanes=2, slots_per_lane=2, coalesce_us=0)) as queue:
        desc = queue.descriptor
        worker = ctx.Process(target=echo_server, args=(desc, None, 60.0, 30.0))  # type: ignore[attr-defined]
        worker.start()
        try:
            with q.QueueClient.attach(desc) as c:
                t = c.submit(_x(1.0))
                deadline = time.monotonic() + 30
                while queue.snapshot().counts["PROCESSING"] == 0:
                    assert time.monotonic() < deadline, "the worker never claimed the request"
                    time.sleep(0.005)
                m = q._attach(desc)  # any client maps the header: it may write the worker-pid word
                try:
                    m.q[q.H_WORKER_PID >> 3] = 0
                finally:
                    m.close()
                os.kill(worker.pid, signal.SIGKILL)
                with pytest.raises(q.WorkerDied):
                    c.wait(t, 10)
        finally:
            worker.kill()
            worker.join()
