"""``InferenceClient.infer`` on the queue's one call (``QueueClient.infer_or_pending``): what the failover
rules say of a request holds when the call, not ``finish``, made its first wait.

Real queues and Python workers in forked processes, no model, no Ray: an "actor" is the process that
created a queue (its owner), and it dies with its worker as a killed inference actor does.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from lowtail.actors.endpoint import Endpoint
from lowtail.actors.inference_client import InferenceClient
from lowtail.shm import native
from lowtail.shm.queue import InferenceQueue, QueueDescriptor, QueueTimeout, QueueWorker, WorkerDied
from tests.shm.test_infer_native import CONFIG

pytestmark = pytest.mark.skipif(not native.available(), reason=native.implementation().reason)

X = {"x": np.ones((2, 4), np.float32)}
WARM = 3  # requests each worker answers before it does what the test has it do


def _owner(conn: Any) -> None:
    q = InferenceQueue.create(CONFIG)
    conn.send_bytes(q.descriptor.to_bytes())
    conn.recv()  # lives until killed (or the test closes the pipe)


def _worker(desc: bytes, owner_pid: int, then: str, go: Any) -> None:
    """Answers WARM requests, then: "die" claims the next and kills its owner and itself (an actor
    killed while its worker runs a request); "wait" claims nothing until ``go`` is set."""
    w = QueueWorker.attach(QueueDescriptor.from_bytes(desc))
    n = 0
    while True:
        if then == "wait" and n >= WARM and not go.wait(0.01):
            continue
        b = w.claim(0.02)
        if b is None:
            continue
        if then == "die" and n >= WARM:
            os.kill(owner_pid, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)
        with b:
            b.complete({"y": b.inputs["x"] * 2.0})
        n += 1


class Actor:
    """A queue's owner process and its worker process, as an inference actor and its worker."""

    def __init__(self, index: int, then: str) -> None:
        ctx = multiprocessing.get_context("fork")
        here, there = ctx.Pipe()
        self.go = ctx.Event()
        self.owner = ctx.Process(target=_owner, args=(there,), daemon=True)
        self.owner.start()
        self.conn = here
        raw = here.recv_bytes()
        self.desc = QueueDescriptor.from_bytes(raw)
        self.worker = ctx.Process(target=_worker, args=(raw, self.owner.pid, then, self.go), daemon=True)
        self.worker.start()
        self.endpoint = Endpoint(f"a{index}", f"infer:a:{index}", "node", 0, 0, self.desc, self.worker.pid)

    def kill(self) -> None:
        for p in (self.worker, self.owner):
            if p.is_alive():
                p.kill()
            p.join(10)

    def close(self) -> None:
        self.kill()
        self.conn.close()
        self.desc.path.unlink(missing_ok=True)


@pytest.fixture
def actors() -> Iterator[list[Actor]]:
    made: list[Actor] = []
    try:
        yield made
    finally:
        for a in made:
            a.close()


def _warm(client: InferenceClient, n: int) -> None:
    for _ in range(n):
        np.testing.assert_array_equal(client.infer(X)["y"], X["x"] * 2.0)
    for t in client._targets:
        if t.client is not None:
            t.client._pred.predicted_ns = 0  # no sleep first: the one call parks for the answer


@pytest.mark.parametrize("replicas", [1, 2])
def test_a_request_claimed_by_a_worker_that_died_with_its_actor_fails_worker_died(
    actors: list[Actor], replicas: int
) -> None:
    """The worker claims the request, then it and its actor die while the call waits: the request may
    have run, so ``WorkerDied`` ("not sent again"), never ``RequestLost`` (which a caller may resend).
    With two replicas the other's actor is gone already, so nothing could take it."""
    actors += [Actor(i, "die" if i == 0 else "answer") for i in range(replicas)]
    neighbour = Actor(9, "answer")  # another hero's actor, which a second sampler's client uses throughout
    actors.append(neighbour)
    with (
        InferenceClient([a.endpoint for a in actors[:replicas]], node_id="node", timeout_s=10.0) as client,
        InferenceClient([neighbour.endpoint], node_id="node", timeout_s=10.0) as other,
    ):
        _warm(client, WARM * replicas)
        _warm(other, 1)
        for a in actors[1:replicas]:
            a.kill()
        for _ in range(3):  # round robin passes the dead replica: the next request goes to actor 0
            try:
                client.infer(X)
            except WorkerDied as e:
                assert "may have run" in str(e) or "died" in str(e)
                break
        else:
            pytest.fail("no request went to the actor whose worker claims and dies")
        for k in range(5):  # the other hero's client did not notice
            y = {"x": np.full((2, 4), float(k), np.float32)}
            np.testing.assert_array_equal(other.infer(y)["y"], y["x"] * 2.0)
        assert other.status()[0]["serving"] and other.status()[0]["in_flight"] == 0


def test_a_timed_out_request_is_given_up_and_counts_no_more(actors: list[Actor]) -> None:
    """``infer`` times out (its worker claims nothing): the client abandons the request, which no caller
    holds, so it stops counting in flight; answered later, its slot serves the next request."""
    actors.append(Actor(0, "wait"))
    with InferenceClient([actors[0].endpoint], node_id="node", timeout_s=0.3) as client:
        _warm(client, WARM)
        t0 = time.monotonic()
        with pytest.raises(QueueTimeout):
            client.infer(X)
        assert time.monotonic() - t0 < 10.0
        assert client.status()[0]["in_flight"] == 0
        actors[0].go.set()
        client.timeout_s = 10.0
        for _ in range(
            CONFIG.slots_per_lane + 1
        ):  # the lane's every slot in turn: the abandoned one came back
            np.testing.assert_array_equal(client.infer(X)["y"], X["x"] * 2.0)
        assert client.status()[0]["in_flight"] == 0


def test_a_request_the_call_did_not_wait_for_gets_no_failover_check_first(actors: list[Actor]) -> None:
    """A client's first request has no plan yet: the call publishes it ``start``'s way and returns its
    Pending without a wait. The failover checks (a /proc read, fcntl calls) then run only past a normal
    round trip, as after ``start``, not at once."""
    actors.append(Actor(0, "answer"))
    with InferenceClient([actors[0].endpoint], node_id="node", timeout_s=10.0) as client:
        calls: list[int] = []
        checks = client._failed_over
        client._failed_over = lambda p, t: calls.append(1) or checks(p, t)  # type: ignore[method-assign]
        np.testing.assert_array_equal(client.infer(X)["y"], X["x"] * 2.0)
        assert calls == []
