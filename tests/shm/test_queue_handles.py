"""What a client can do with a request in flight: withdraw it, read its timing, hold its answer zero-copy,
poll it, and wait for the first of several. One process, the worker driven by hand: every step is exact."""

from __future__ import annotations

import gc
import time

import numpy as np
import pytest

from lowtail.shm.client import HeldOutputs, RequestTiming, wait_first
from lowtail.shm.queue import (
    InferenceQueue,
    LaneBusy,
    QueueClient,
    QueueError,
    QueueTimeout,
    QueueWorker,
)
from tests.shm.helpers import echo, filled

# -- withdraw ----------------------------------------------------------------------------------------


def test_an_unclaimed_request_withdrawn_is_never_run_and_its_slot_comes_back(server: InferenceQueue) -> None:
    with QueueClient.attach(server.descriptor) as c, QueueWorker.attach(server.descriptor) as w:
        t = c.submit(filled(1.0))
        assert c.withdraw(t) is True  # not claimed: ours again, to send elsewhere
        with pytest.raises(QueueError, match="already waited for or withdrawn"):
            c.withdraw(t)
        assert w.claim(timeout_s=0.05) is None  # the worker took it, saw the mark, answered it unrun
        assert w.withdrawn == 1
        # Both slots serve again: the withdrawn one returned once the worker passed it.
        tickets = [c.submit(filled(2.0)), c.submit(filled(3.0))]
        b = w.claim(timeout_s=1)
        assert b is not None and len(b) == 2
        b.complete(echo(b.inputs["x"]))
        for t2, tag in zip(tickets, (2.0, 3.0), strict=True):
            np.testing.assert_array_equal(c.wait(t2, 1)["twice"], np.full((2, 4), tag * 2 + 1, np.float32))


def test_a_claimed_request_cannot_be_withdrawn_and_is_answered(server: InferenceQueue) -> None:
    with QueueClient.attach(server.descriptor) as c, QueueWorker.attach(server.descriptor) as w:
        p = c.start(filled(5.0))
        b = w.claim(timeout_s=1)
        assert b is not None
        assert p.withdraw() is False  # claimed first: it runs, wait for its answer
        b.complete(echo(b.inputs["x"]))
        assert p.finish(1)["twice"][0, 0] == 11.0
        assert w.withdrawn == 0


# -- timing ------------------------------------------------------------------------------------------


def test_timing_names_every_part_of_the_request_and_adds_up(server: InferenceQueue) -> None:
    with QueueClient.attach(server.descriptor) as c, QueueWorker.attach(server.descriptor) as w:
        p = c.start(filled(1.0, rows=3))
        assert p.timing is None  # nothing until the answer is taken
        time.sleep(0.002)  # queued ~2 ms before the claim
        b = w.claim(timeout_s=1)
        assert b is not None
        e0 = time.monotonic_ns()
        time.sleep(0.003)  # the "engine"
        engine_ns = time.monotonic_ns() - e0
        b.complete(echo(b.inputs["x"]), engine_ns=engine_ns, deschedule_ns=1_234_567)
        answered_ns = time.monotonic_ns()
        time.sleep(0.002)  # the caller comes back late: not part of the round trip
        p.finish(1)
        t = p.timing
        assert isinstance(t, RequestTiming) and t is not None
        assert t.queue_wait_s >= 0.002
        assert t.engine_s == engine_ns / 1e9 and t.batch_size == 3
        assert t.call_deschedule_s == pytest.approx(0.001234567, abs=1e-6)  # carried in microseconds
        assert t.queue_wait_s + t.engine_s <= t.round_trip_s
        assert t.ready_to_return_s >= 0.002  # the answer waited for the caller
        assert t.round_trip_s * 1e9 <= answered_ns - p.ticket.submit_ns  # ...and the round trip did not
        assert 0 < t.client_overhead_s < t.ready_to_return_s
        with pytest.raises(AttributeError):
            t.engine_s = 0.0  # type: ignore[misc]  # frozen and slotted


def test_an_error_answer_has_timing_without_call_figures(server: InferenceQueue) -> None:
    with QueueClient.attach(server.descriptor) as c, QueueWorker.attach(server.descriptor) as w:
        p = c.start(filled(1.0))
        b = w.claim(timeout_s=1)
        assert b is not None
        b.fail("no")
        with pytest.raises(QueueError, match="no"):
            p.finish(1)
        assert p.timing is not None and p.timing.engine_s == 0 and p.timing.batch_size == 0


# -- zero-copy outputs -------------------------------------------------------------------------------


def _answered(c: QueueClient, w: QueueWorker, tag: float) -> object:
    p = c.start(filled(tag))
    b = w.claim(timeout_s=1)
    assert b is not None
    b.complete(echo(b.inputs["x"]))
    return p


@pytest.mark.parametrize("rows", [2, 40_000])  # inline in the answer slot, and an ndarray segment (1.3 MB)
def test_zero_copy_outputs_hold_the_slot_and_refuse_release_while_referenced(
    server: InferenceQueue, rows: int
) -> None:
    with QueueClient.attach(server.descriptor) as c, QueueWorker.attach(server.descriptor) as w:
        p = c.start(filled(4.0, rows))
        b = w.claim(timeout_s=1)
        assert b is not None
        b.complete(echo(b.inputs["x"]))
        out = p.finish(1, copy=False)
        assert isinstance(out, HeldOutputs) and set(out) == {"twice", "rowsum"}
        twice = out["twice"]
        assert twice.shape == (rows, 4) and (twice == 9.0).all()
        with pytest.raises(ValueError, match="read-only"):
            twice[0, 0] = 0
        part = twice[1:]  # a view of a view: keeps the slot held too
        del twice
        gc.collect()
        # The held slot is not reused: one slot left, then the lane is full.
        other = c.start(filled(1.0))
        with pytest.raises(LaneBusy):
            c.start(filled(1.0))
        with pytest.raises(QueueError, match="still referenced"):
            p.release()
        assert (part == 9.0).all()  # still the answer it was
        del part
        p.release()
        assert out.released
        with pytest.raises(QueueError, match="released"):
            out["twice"]
        ob = w.claim(timeout_s=1)
        assert ob is not None
        ob.complete(echo(ob.inputs["x"]))
        other.finish(1)
        c.start(filled(1.0))  # the released slot is usable again
        c.start(filled(1.0))


def test_zero_copy_outputs_dropped_without_release_free_their_slot(server: InferenceQueue) -> None:
    with QueueClient.attach(server.descriptor) as c, QueueWorker.attach(server.descriptor) as w:
        for tag in (1.0, 2.0, 3.0):  # three answers held and dropped through a 2-slot lane
            p = _answered(c, w, tag)
            with p.finish(1, copy=False) as out:  # type: ignore[attr-defined]
                assert float(out["twice"][0, 0]) == tag * 2 + 1
            assert out.released
        p = _answered(c, w, 7.0)
        kept = p.finish(1, copy=False)["rowsum"]  # type: ignore[attr-defined]
        del p  # no reference cycle: freed at once, no gc.collect() needed
        q = _answered(c, w, 8.0)  # the other slot
        q.finish(1)  # type: ignore[attr-defined]
        r = _answered(c, w, 9.0)  # reuses the free slot, never the one ``kept`` reads
        r.finish(1)  # type: ignore[attr-defined]
        assert (kept == 28.0).all()
        del kept
        both = [
            c.start(filled(10.0)),
            c.start(filled(11.0)),
        ]  # both slots again: nothing reads the dropped answer
        b = w.claim(timeout_s=1)
        assert b is not None and len(b) == 2
        b.complete(echo(b.inputs["x"]))
        assert [float(p.finish(1)["twice"][0, 0]) for p in both] == [21.0, 23.0]


# -- done, wait_first --------------------------------------------------------------------------------


def test_done_polls_and_wait_first_returns_the_first_answered(server: InferenceQueue) -> None:
    with (
        QueueClient.attach(server.descriptor) as a,
        QueueClient.attach(server.descriptor) as b,
        QueueWorker.attach(server.descriptor) as w,
    ):
        pa, pb = a.start(filled(1.0)), b.start(filled(2.0))
        assert not pa.done() and not pb.done()
        with pytest.raises(QueueTimeout, match="none of 2 requests"):
            wait_first([pa, pb], timeout_s=0.05)
        batch = w.claim(timeout_s=1)
        assert batch is not None and len(batch) == 2
        batch.fail_request(1, "second first")  # only b's answer is there
        assert wait_first([pa, pb], timeout_s=1) is pb and pb.done() and not pa.done()
        batch.complete(echo(batch.inputs["x"]))
        assert wait_first([pa], timeout_s=1) is pa and pa.done()
