"""InferenceClient bookkeeping when a caller gives up on a request (no Ray cluster needed).

Found by the two-node demo: a sampler whose request timed out (QueueTimeout) dropped it, the client kept
counting it in flight, and when the worker then died the broken attachment was never closed, so the
client never re-resolved its endpoint: the sampler got EndpointDown for good (0 answers, 0 errors).
"""

from __future__ import annotations

import numpy as np
import pytest

from lowtail.actors.endpoint import Endpoint
from lowtail.actors.inference_client import InferenceClient
from lowtail.shm.queue import InferenceQueue, QueueConfig, QueueTimeout, WorkerDied


def test_a_request_given_up_after_a_timeout_does_not_keep_a_lost_attachment_open() -> None:
    with InferenceQueue.create(QueueConfig(lanes=2, slots_per_lane=4, coalesce_us=0)) as q:
        ep = Endpoint("lowtail-test", "infer:test:0", "node-a", 0, 0, q.descriptor, 0)
        with InferenceClient([ep], node_id="node-a", timeout_s=0.05) as client:
            t = client._targets[0]
            p = client.start({"obs": np.zeros((1, 8), np.float32)})  # no worker: never answered
            with pytest.raises(QueueTimeout):
                client.finish(p)
            assert t.in_flight == 1  # a timeout alone leaves it to the caller: wait again, or give up
            client.abandon(p)
            assert t.in_flight == 0
            # The worker then dies: the attachment is dropped at once, so the next start re-resolves.
            client._lose(t, WorkerDied("worker 1234 is gone"))
            assert t.client is None and t.broken is not None
            client.abandon(p)  # twice, or after the attachment is gone: a no-op
            assert t.in_flight == 0
