"""The worker's poll finds work by doorbell changes and leftovers only: nothing may be missed or repeated."""

from __future__ import annotations

import numpy as np

from lowtail.shm.queue import InferenceQueue, QueueClient, QueueConfig, QueueWorker


def test_every_request_of_many_lanes_is_claimed_once_across_full_batches() -> None:
    # 200 of 256 lanes publish before the worker attaches (their doorbells never move again), then
    # batches of at most 16 slots leave lanes with work that the next polls must still find.
    cfg = QueueConfig(lanes=256, slots_per_lane=2, request_bytes=512, response_bytes=512, max_batch_slots=16)
    with InferenceQueue.create(cfg) as queue:
        clients = [QueueClient.attach(queue.descriptor) for _ in range(200)]
        try:
            x = [{"x": np.full((1, 4), i, dtype=np.float32)} for i in range(200)]
            tickets = [(c, c.submit(x[i])) for i, c in enumerate(clients)]
            seen: list[float] = []
            with QueueWorker.attach(queue.descriptor) as worker:
                while len(seen) < 200:
                    batch = worker.claim(timeout_s=2)
                    assert batch is not None, f"{200 - len(seen)} requests were never claimed"
                    assert len(batch) <= 16
                    seen += [float(v) for v in batch.inputs["x"][:, 0]]
                    batch.complete({"y": batch.inputs["x"] * 2})
                assert worker.claim(timeout_s=0.05) is None  # nothing left, nothing claimed twice
            assert sorted(seen) == [float(i) for i in range(200)]
            for i, (c, t) in enumerate(tickets):
                np.testing.assert_array_equal(c.wait(t, timeout_s=1)["y"], np.full((1, 4), 2 * i))
        finally:
            for c in clients:
                c.close()
