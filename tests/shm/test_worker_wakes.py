"""The worker reports what waking parked clients cost it (``QueueWorker.wakes``, and each
``Batch.complete`` its own), on both hot paths: a lane whose client is parked is woken once per answer
and counted with the time its system call took; a lane whose client is not parked costs no wake and
counts nothing."""

from __future__ import annotations

import numpy as np
import pytest

from lowtail.shm.layout import L_PARKED
from lowtail.shm.queue import InferenceQueue, QueueClient, QueueConfig, QueueWorker

pytestmark = pytest.mark.usefixtures("queue_impl")


def _request(i: int) -> dict[str, np.ndarray]:
    return {"x": np.full((1, 4), i, np.float32)}


def test_a_parked_lane_is_woken_once_and_counted_and_a_spinning_one_is_not() -> None:
    cfg = QueueConfig(lanes=2, slots_per_lane=2, coalesce_us=0)
    with (
        InferenceQueue.create(cfg) as q,
        QueueWorker.attach(q.descriptor, idle_us=0) as w,
        QueueClient.attach(q.descriptor) as a,
        QueueClient.attach(q.descriptor) as b,
    ):
        assert w.wakes() == (0, 0)
        # Not parked: the answer finds no one to wake.
        t = a.submit(_request(1))
        batch = w.claim(1.0)
        assert batch is not None
        assert batch.complete({"y": batch.inputs["x"] * 2}) == (0, 0)  # what this complete() woke
        assert a.wait(t)["y"][0, 0] == 2
        assert w.wakes() == (0, 0)
        # Both clients parked (their flags set as park() sets them): one batch of two answers wakes
        # each lane once, and the time of the two system calls is counted.
        ta, tb = a.submit(_request(3)), b.submit(_request(5))
        for c in (a, b):
            c._m.q[c._m.geo.lane(c.lane, L_PARKED)] = 1
        batch = w.claim(1.0)
        assert batch is not None and len(batch) == 2
        # complete() returns its own wakes: the serving loop reads them there, not from the totals
        assert batch.complete({"y": batch.inputs["x"] * 2}) == w.wakes()
        ns, woken = w.wakes()
        assert woken == 2 and ns > 0
        # A failed request wakes its parked client too.
        t2 = a.submit(_request(7))
        batch = w.claim(1.0)
        assert batch is not None
        batch.fail("refused by the test")
        assert w.wakes()[1] == 3 and w.wakes()[0] >= ns
        for c in (a, b):
            c._m.q[c._m.geo.lane(c.lane, L_PARKED)] = 0
        assert a.wait(ta)["y"][0, 0] == 6 and b.wait(tb)["y"][0, 0] == 10
        with pytest.raises(Exception, match="refused by the test"):
            a.wait(t2)
