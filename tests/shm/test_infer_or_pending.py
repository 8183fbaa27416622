"""``QueueClient.infer_or_pending``: ``infer``'s one core call with a wait that can be resumed. The
outputs when a clean answer came within the wait, else the request's ``Pending``; whatever happens
after publication is the Pending's (its ``finish`` raises it), whatever it raises was raised with
nothing published. The actors' ``InferenceClient.infer`` builds its failover on exactly that split.

A worker thread of this process serves (the core call releases the GIL while it spins or parks).
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from lowtail.shm import native
from lowtail.shm.client import Pending
from lowtail.shm.layout import HW_DOORBELLS
from lowtail.shm.queue import InferenceQueue, LaneBusy, QueueClient, QueueWorker, RequestFailed
from tests.shm.test_infer_native import CONFIG
from tests.shm.test_infer_native import _native_client as _client

pytestmark = pytest.mark.skipif(not native.available(), reason=native.implementation().reason)

ENGINE_NS = 123_456  # what the worker reports as its engine call's time: read back exactly
X = {"x": np.ones((2, 4), np.float32)}
REFUSED = 7.0  # a request whose first value is this is answered with an error


def _model(x: np.ndarray[Any, Any]) -> dict[str, np.ndarray[Any, Any]]:
    return {"y": x * 2.0 + 1.0}


@contextlib.contextmanager
def _serving(desc: Any, go: threading.Event | None = None) -> Iterator[None]:
    """A Python worker thread; with ``go`` it claims nothing until ``go`` is set."""
    stop = threading.Event()
    worker = QueueWorker.attach(desc)

    def serve() -> None:
        while not stop.is_set():
            if go is not None and not go.wait(0.01):
                continue
            b = worker.claim(0.02)
            if b is None:
                continue
            with b:
                x = b.inputs["x"]
                if x.flat[0] == REFUSED:
                    b.fail("refused by the test's model")
                else:
                    b.complete(_model(x), engine_ns=ENGINE_NS)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(10)
        assert not thread.is_alive(), "the worker thread did not stop"
        worker.close()


@pytest.fixture
def queue() -> Iterator[InferenceQueue]:
    with InferenceQueue.create(CONFIG) as q:
        yield q


def _outputs(got: dict[str, Any] | Pending) -> dict[str, Any]:
    return got.finish(5.0) if isinstance(got, Pending) else got


@pytest.mark.parametrize("spin_us", [0, 200])
def test_an_answer_within_the_wait_is_the_outputs_with_its_timing(
    queue: InferenceQueue, spin_us: int
) -> None:
    with _serving(queue.descriptor), _client(queue.descriptor, spin_us) as c:
        np.testing.assert_array_equal(_outputs(c.infer_or_pending(X, 5.0))["y"], _model(X["x"])["y"])
        calls: list[int] = []
        round_trip = c._round_trip
        c._round_trip = lambda *a: calls.append(1) or round_trip(*a)
        c._pred.predicted_ns = 0  # no sleep first (that is ``start``'s way)
        got = c.infer_or_pending(X, 5.0)
        assert type(got) is dict and calls == [1]  # one core call
        np.testing.assert_array_equal(got["y"], _model(X["x"])["y"])
        t = c.last_request_timing
        assert t.engine_s == ENGINE_NS / 1e9 and t.batch_size == 2
        assert 0 <= t.queue_wait_s <= t.round_trip_s and t.client_overhead_s >= 0 and t.ready_to_return_s >= 0
        c.start(X).finish(5.0)
        assert c.last_request_timing == t  # the call's own stamps, not a later wait's


def test_no_answer_within_the_wait_is_a_pending_that_resumes(queue: InferenceQueue) -> None:
    """The wait ends with the request unclaimed: a Pending, still in flight, whose ``finish`` gets the
    answer once the worker runs; or which ``withdraw`` takes back, never to be run."""
    go = threading.Event()
    with _serving(queue.descriptor, go), _client(queue.descriptor) as c:
        go.set()
        _outputs(c.infer_or_pending(X, 5.0))  # the plan is made
        go.clear()
        time.sleep(0.05)  # the worker thread is in its ``go.wait`` now
        t0 = time.monotonic()
        got = c.infer_or_pending(X, 0.05)
        assert isinstance(got, Pending) and not got.done()
        assert time.monotonic() - t0 < 5.0  # bounded by the wait, not the finish's timeout
        x2 = {"x": np.full((2, 4), 3.0, np.float32)}
        taken_back = c.infer_or_pending(x2, 0.0)
        assert isinstance(taken_back, Pending) and taken_back.withdraw()
        go.set()
        np.testing.assert_array_equal(got.finish(5.0)["y"], _model(X["x"])["y"])
        np.testing.assert_array_equal(_outputs(c.infer_or_pending(X, 5.0))["y"], _model(X["x"])["y"])


@pytest.mark.parametrize("spin_us", [0, 1_000_000], ids=["parked", "spinning"])
def test_an_error_answer_is_raised_by_the_pending_and_counted_once(
    queue: InferenceQueue, spin_us: int
) -> None:
    """An answer that is an error comes back as the Pending (published: never raised by the call),
    whose ``finish`` raises it; counted where the core call found it, not again at once."""
    with _serving(queue.descriptor), _client(queue.descriptor, spin_us) as c:
        _outputs(c.infer_or_pending(X, 5.0))
        c._pred.predicted_ns = 0
        counts = c._counts
        before = {k: getattr(counts, k) for k in ("immediate", "spinning", "parked")}
        got = c.infer_or_pending({"x": np.full((2, 4), REFUSED, np.float32)}, 5.0)
        assert isinstance(got, Pending) and got.done()
        with pytest.raises(RequestFailed, match="refused by the test's model"):
            got.finish(5.0)
        after = {k: getattr(counts, k) for k in before}
        found = "spinning" if spin_us else "parked"
        assert after == {**before, found: before[found] + 1}, (before, after)
        np.testing.assert_array_equal(_outputs(c.infer_or_pending(X, 5.0))["y"], _model(X["x"])["y"])


def test_a_full_lane_raises_with_nothing_published(queue: InferenceQueue) -> None:
    with _client(queue.descriptor) as c:
        held = [c.start(X) for _ in range(CONFIG.slots_per_lane)]
        head = int(c._q[HW_DOORBELLS + c.lane])
        with pytest.raises(LaneBusy):
            c.infer_or_pending(X, 0.01)
        assert int(c._q[HW_DOORBELLS + c.lane]) == head
        with _serving(queue.descriptor):
            for p in held:
                np.testing.assert_array_equal(p.finish(5.0)["y"], _model(X["x"])["y"])


def test_the_python_path_returns_starts_pending(queue: InferenceQueue) -> None:
    with native.use(False):
        c = QueueClient.attach(queue.descriptor, 0)
    with _serving(queue.descriptor), c:
        got = c.infer_or_pending(X, 5.0)
        assert isinstance(got, Pending)
        np.testing.assert_array_equal(got.finish(5.0)["y"], _model(X["x"])["y"])
