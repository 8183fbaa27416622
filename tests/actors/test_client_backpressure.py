"""A full lane is the caller's backpressure, never a lost replica (real queue, real pinned worker, no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest

from lowtail.actors.endpoint import EndpointDown
from lowtail.actors.inference_client import InferenceClient
from lowtail.shm.queue import LaneBusy, QueueConfig
from tests.actors.test_client_failover import Replica, x_of


def test_lane_busy_reaches_the_caller_and_the_replica_keeps_serving(small_model: Path) -> None:
    r = Replica(
        small_model, 0, QueueConfig(lanes=2, slots_per_lane=2, request_bytes=16384, response_bytes=16384)
    )
    try:
        with InferenceClient([r.endpoint], node_id="node-a", timeout_s=30) as client:
            # Two zero-copy answers held: both slots of the client's lane are taken, by the caller.
            pending = [client.start(x_of(k)) for k in range(2)]
            held = [client.finish(p, copy=False) for p in pending]
            with pytest.raises(LaneBusy) as e:
                client.start(x_of(2))
            assert isinstance(e.value, EndpointDown)  # a caller that backs off on EndpointDown still does
            assert client.status()[0]["broken"] is None
            assert [h["value"].shape for h in held] == [(1, 1), (1, 1)]
            for p in pending:
                p.release()
            for k in range(3):
                assert "value" in client.infer(x_of(3 + k))  # still attached: no EndpointDown
            assert client.status()[0]["broken"] is None
    finally:
        r.close()
