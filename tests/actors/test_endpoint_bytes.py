"""An endpoint crosses a file as checked JSON, never as a pickle."""

from __future__ import annotations

import json

import pytest

from lowtail.actors.endpoint import BadEndpoint, Endpoint
from lowtail.shm.queue import InferenceQueue, QueueConfig


def test_an_endpoint_round_trips_through_its_bytes() -> None:
    with InferenceQueue.create(QueueConfig(lanes=1, slots_per_lane=1)) as q:
        ep = Endpoint("a", "infer:h:0", "node", 1, 0, q.descriptor, 123)
        assert Endpoint.from_bytes(ep.to_bytes()) == ep


@pytest.mark.parametrize(
    ("mutate", "why"),
    [
        (lambda d: d.update(cpu="1"), "cpu='1': expected int"),
        (lambda d: d.update(cpu=True), "cpu=True: expected int"),
        (lambda d: d.pop("owner"), "keys"),
        (lambda d: d.update(descriptor="{}"), "endpoint descriptor: "),
    ],
)
def test_bytes_that_are_not_an_endpoint_name_the_field(mutate, why) -> None:  # type: ignore[no-untyped-def]
    with InferenceQueue.create(QueueConfig(lanes=1, slots_per_lane=1)) as q:
        doc = json.loads(Endpoint("a", "infer:h:0", "node", 1, 0, q.descriptor, 123).to_bytes())
    mutate(doc)
    with pytest.raises(BadEndpoint, match=why.replace("(", r"\(")):
        Endpoint.from_bytes(json.dumps(doc).encode())


def test_a_pickle_is_not_an_endpoint() -> None:
    with pytest.raises(BadEndpoint, match="not JSON"):
        Endpoint.from_bytes(b"\x80\x04\x95")
