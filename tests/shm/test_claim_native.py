"""The native path's claim (``QueueWorker._claim_native``) makes the common batch, one request with
nothing to hold or merge, in its own frame: that batch is the one ``Batch.__init__`` makes, and a claim
that ``_coalesce`` would hold (or any other) still goes through ``_coalesce``."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from lowtail.shm.queue import InferenceQueue, QueueClient, QueueConfig, QueueWorker
from lowtail.shm.server import Batch
from tests.shm.helpers import echo, filled


def _spy_coalesce(w: QueueWorker) -> list[int]:
    """The sizes of the claims that went through ``w._coalesce``."""
    calls: list[int] = []
    real = w._coalesce

    def spy(items: list[Any]) -> Batch:
        calls.append(len(items))
        return real(items)

    w._coalesce = spy  # type: ignore[method-assign]
    return calls


def _same_as_init(w: QueueWorker, batch: Batch) -> None:
    """``batch`` holds exactly what ``Batch.__init__`` makes of its requests."""
    ref = Batch(w, batch._items)
    for name in Batch.__slots__:
        got, want = getattr(batch, name), getattr(ref, name)
        assert type(got) is type(want), name
        assert got is want or got == want, (name, got, want)
    assert batch._inputs is ref._inputs and batch.layout is ref.layout


@pytest.mark.parametrize(
    ("rows", "coalesce_us", "max_slots", "held"),
    [
        (2, 0, 16, False),  # coalescing off
        (4, 200, 16, False),  # the request alone reaches min_batch_samples
        (3, 200, 16, True),  # under min_batch_samples: _coalesce decides whether to hold it
        (3, 200, 1, False),  # one slot per batch: never held
    ],
)
def test_a_claim_of_one_request_is_the_batch_init_makes_and_a_holdable_one_is_coalesced(
    queue_impl: str, rows: int, coalesce_us: int, max_slots: int, held: bool
) -> None:
    cfg = QueueConfig(
        lanes=2, slots_per_lane=2, coalesce_us=coalesce_us, max_batch_slots=max_slots, min_batch_samples=4
    )
    with (
        InferenceQueue.create(cfg) as q,
        QueueClient.attach(q.descriptor) as c,
        QueueWorker.attach(q.descriptor) as w,
    ):
        coalesced = _spy_coalesce(w)
        for k in range(3):  # the first request of a slot is decoded in Python, the next ones in the core
            t = c.submit(filled(float(k), rows))
            with w.claim(timeout_s=5.0) as batch:
                assert batch is not None and len(batch) == 1
                it = batch._items[0]
                _same_as_init(w, batch)
                assert w._outstanding == {it.g: it} and w._last_work_ns >= it.claim_ns
                batch.complete(echo(batch.inputs["x"]))
            assert not w._outstanding
            np.testing.assert_allclose(c.wait(t, timeout_s=5.0)["twice"], 2.0 * k + 1.0)
        # The Python path's claim always coalesces; the native one only what it may hold.
        assert coalesced == ([1, 1, 1] if queue_impl == "python" or held else []), coalesced


def test_the_native_claim_hands_carried_and_merged_requests_to_the_rest_of_claim(queue_impl: str) -> None:
    """Two lanes' requests of different layouts: one batch each, in claim order, on both paths."""
    cfg = QueueConfig(lanes=2, slots_per_lane=2, coalesce_us=0)
    with (
        InferenceQueue.create(cfg) as q,
        QueueClient.attach(q.descriptor) as c1,
        QueueClient.attach(q.descriptor) as c2,
        QueueWorker.attach(q.descriptor) as w,
    ):
        t1, t2 = c1.submit(filled(1.0, 2)), c2.submit({"x": np.full((2, 3), 2.0, np.float32)})
        sizes = []
        for _ in range(2):
            with w.claim(timeout_s=5.0) as batch:
                assert batch is not None and len(batch) == 1
                sizes.append(batch.inputs["x"].shape)
                batch.complete(echo(batch.inputs["x"]))
        assert sorted(sizes) == [(2, 3), (2, 4)]
        np.testing.assert_allclose(c1.wait(t1, timeout_s=5.0)["twice"], 3.0)
        np.testing.assert_allclose(c2.wait(t2, timeout_s=5.0)["twice"], 5.0)
        assert w.claim(timeout_s=0.0) is None
