"""InferenceClient failover across a hero's replicas, with real queues and real pinned workers (no Ray).

Two replicas (a queue and an OpenVINO worker each) behind one client, as a sampler's client of a hero
with two inference actors sees them. A replica whose worker is SIGKILLed is skipped by round robin at
once (start() never waits for it), requests it had not claimed are moved to the other replica exactly
once, and what its worker had claimed fails WorkerDied: nothing answered twice, nothing lost silently.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading
import time
from collections.abc import Iterator
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lowtail.actors.endpoint import Endpoint, EndpointDown
from lowtail.actors.inference_client import InferenceClient, PendingInference, RequestLost, wait_first
from lowtail.serve.model import example_inputs
from lowtail.serve.worker_process import WorkerConfig, WorkerProcess
from lowtail.shm.queue import InferenceQueue, QueueConfig, QueueDescriptor, QueueTimeout, WorkerDied
from tests.serve.conftest import SMALL_SPEC

CPU = max(os.sched_getaffinity(0))
# "start() does not wait for a down replica": the waits ruled out are the 30 s request timeout and a
# restart (seconds); 5 s leaves room for a preempted test process on a loaded host. Not a latency figure.
START_LIMIT_S = 5.0


QUEUE = QueueConfig(lanes=4, slots_per_lane=4, request_bytes=16384, response_bytes=16384)


class Replica:
    def __init__(self, model: Path, index: int, config: QueueConfig = QUEUE) -> None:
        self.queue = InferenceQueue.create(config)
        self.model = model
        self.index = index
        self.worker = self._start()
        self.endpoint = Endpoint(
            f"lowtail-test-{index}",
            f"infer:t:{index}",
            "node-a",
            CPU,
            0,
            self.queue.descriptor,
            self.worker.pid,
        )

    def _start(self) -> WorkerProcess:
        w = WorkerProcess.start(self.queue.descriptor, CPU, self.model, WorkerConfig(name=f"t.{self.index}"))
        w.wait_ready(120)
        return w

    def restart(self) -> None:
        self.worker.stop()
        self.worker = self._start()

    def close(self) -> None:
        self.worker.stop()
        self.queue.close()


@pytest.fixture
def replicas(small_model: Path) -> Iterator[list[Replica]]:
    rs = [Replica(small_model, i) for i in range(2)]
    try:
        yield rs
    finally:
        for r in rs:
            r.close()


def x_of(k: int) -> dict[str, np.ndarray]:
    return example_inputs(SMALL_SPEC.features, 1, seed=k)


def test_a_replica_whose_worker_died_is_skipped_at_once_and_start_never_waits(
    replicas: list[Replica],
) -> None:
    a, b = replicas
    with InferenceClient([a.endpoint, b.endpoint], node_id="node-a", timeout_s=30) as client:
        for k in range(4):
            client.infer(x_of(k))
        a.worker.kill()
        a.worker._proc.join(10)
        for k in range(20):
            t0 = time.monotonic()
            p = client.start(x_of(k))
            assert time.monotonic() - t0 < START_LIMIT_S
            assert p.target == 1  # b: the down replica is skipped, not waited for
            out = client.finish(p)
            assert out["value"].shape == (1, 1)
            assert p.timing is None or p.timing.round_trip_s > 0
        status = client.status()
        assert not status[0]["serving"] and status[1]["serving"]
        a.restart()  # its worker is back on the same queue: round robin uses it again
        targets = {client.start(x_of(k)).target for k in range(4)}
        assert targets == {0, 1}


def test_single_replica_without_a_worker_waits_for_it_bounded_by_the_timeout(
    replicas: list[Replica],
) -> None:
    a, _ = replicas
    a.worker.kill()
    a.worker._proc.join(10)
    with InferenceClient([a.endpoint], node_id="node-a", timeout_s=30) as client:
        t0 = time.monotonic()
        p = client.start(x_of(0))  # published: the restarted worker will serve it
        assert time.monotonic() - t0 < START_LIMIT_S
        assert not p.done()
        a.restart()
        assert client.finish(p)["value"].shape == (1, 1)


def test_requests_unclaimed_on_a_dead_replica_move_once_claimed_ones_fail(replicas: list[Replica]) -> None:
    a, b = replicas
    with InferenceClient([a.endpoint, b.endpoint], node_id="node-a", timeout_s=30) as client:
        client.infer(x_of(0))  # both attached and warm
        client.infer(x_of(1))
        os.kill(a.worker.pid, signal.SIGSTOP)  # a holds its requests: some claimed, the rest queued
        pending: list[PendingInference] = []
        while len([p for p in pending if p.target == 0]) < 4:
            pending.append(client.start(x_of(len(pending))))
        time.sleep(0.2)
        claimed = a.queue.snapshot().counts["PROCESSING"]
        os.kill(a.worker.pid, signal.SIGKILL)
        os.kill(a.worker.pid, signal.SIGCONT)
        answered = failed = 0
        for p in pending:
            try:
                out = client.finish(p)
                assert out["value"].shape == (1, 1)
                answered += 1
            except WorkerDied:
                failed += 1
        assert failed == claimed  # exactly what the dead worker held
        assert answered == len(pending) - claimed  # every other one answered, once
        assert client.moved == 4 - claimed
        assert all(p.target == 1 for p in pending if p.moved)


def test_every_replica_down_raises_endpoint_down_with_a_retry_and_no_wait(replicas: list[Replica]) -> None:
    a, b = replicas
    with InferenceClient([a.endpoint, b.endpoint], node_id="node-a", timeout_s=30) as client:
        for t in client._targets:
            client._lose(t, "test: lost")
            t.retry_at = time.monotonic() + 60  # no re-resolve due
        t0 = time.monotonic()
        with pytest.raises(EndpointDown) as info:
            client.start(x_of(0))
        assert time.monotonic() - t0 < START_LIMIT_S
        assert info.value.retry_in_s > 0


def test_done_and_wait_first(replicas: list[Replica]) -> None:
    a, b = replicas
    with InferenceClient([a.endpoint, b.endpoint], node_id="node-a", timeout_s=30) as client:
        os.kill(a.worker.pid, signal.SIGSTOP)
        try:
            stuck = client.start(x_of(0))
            assert stuck.target == 0
            quick = client.start(x_of(1))
            assert wait_first([stuck, quick], timeout_s=30) is quick
            assert quick.done() and not stuck.done()
            client.finish(quick)
        finally:
            os.kill(a.worker.pid, signal.SIGCONT)
        assert wait_first([stuck], timeout_s=30) is stuck
        client.finish(stuck)


def test_timings_on_the_handle_and_the_clients_series(replicas: list[Replica]) -> None:
    a, b = replicas
    with InferenceClient([a.endpoint, b.endpoint], node_id="node-a", timeout_s=30) as client:
        for k in range(6):
            p = client.start(x_of(k))
            assert p.timing is None  # only after finish
            client.finish(p)
            t = p.timing
            assert t is not None and t.batch_size >= 1
            assert t.queue_wait_s >= 0 and t.engine_s > 0 and t.client_overhead_s >= 0
            assert t.queue_wait_s + t.engine_s <= t.round_trip_s
        series, samples = client.take_series()
        assert samples == 6 and {len(v) for v in series.values()} == {6}
        assert set(series) == {"rpc_elapsed_ms", "queue_wait_ms", "infer_exec_ms", "client_overhead_ms"}
        # ``infer``: one core call per request (both queues have the layout's plan), timed as finish times
        calls: list[int] = []
        for t in client._targets:
            t.client._round_trip = lambda *a, f=t.client._round_trip: calls.append(1) or f(*a)
            t.client._pred.predicted_ns = 0  # no sleep first
        for k in range(6):
            assert client.infer(x_of(k))["value"].shape == (1, 1)
        series, samples = client.take_series()
        assert len(calls) == 6 and samples == 6 and {len(v) for v in series.values()} == {6}
        assert all(v > 0 for v in series["infer_exec_ms"])
        assert all(
            q + e <= r
            for q, e, r in zip(
                series["queue_wait_ms"], series["infer_exec_ms"], series["rpc_elapsed_ms"], strict=True
            )
        )
        assert [t.in_flight for t in client._targets] == [0, 0]


def test_infer_moves_a_request_its_one_call_left_unclaimed_once(replicas: list[Replica]) -> None:
    """``infer``'s one call returns unanswered (its replica's worker is stopped); the worker dies
    before it claims the request: ``infer`` moves it to the other replica, once, and answers."""
    a, b = replicas
    with InferenceClient([a.endpoint, b.endpoint], node_id="node-a", timeout_s=30) as client:
        client.infer(x_of(0))  # both attached and warm
        client.infer(x_of(1))
        os.kill(a.worker.pid, signal.SIGSTOP)
        time.sleep(0.2)  # stopped outside a claim: it claims nothing published from now on
        client._next_target = lambda: 0  # type: ignore[method-assign]  # (stopped, it still serves)
        got: list[Any] = []
        thread = threading.Thread(target=lambda: got.append(client.infer(x_of(2))), daemon=True)
        thread.start()
        time.sleep(0.2)  # the one call has returned: ``finish`` waits in failover-check slices
        assert thread.is_alive() and a.queue.snapshot().counts["READY"] == 1
        os.kill(a.worker.pid, signal.SIGKILL)
        os.kill(a.worker.pid, signal.SIGCONT)
        thread.join(30)
        assert not thread.is_alive() and got and got[0]["value"].shape == (1, 1)
        assert client.moved == 1 and [t.in_flight for t in client._targets] == [0, 0]


def test_zero_copy_outputs_are_views_refused_after_release(
    replicas: list[Replica], small_model: Path
) -> None:
    from lowtail.shm.queue import QueueError

    a, b = replicas
    with InferenceClient([a.endpoint, b.endpoint], node_id="node-a", timeout_s=30) as client:
        x = x_of(3)
        p = client.start(x)
        out = client.finish(p, copy=False)
        value = out["value"]
        assert not value.flags.writeable and not value.flags.owndata  # a view of the answer
        expected = value.copy()
        with pytest.raises(QueueError, match="still referenced"):
            p.release()  # an array taken from them is alive: the slot stays held
        del value
        p.release()
        with pytest.raises(QueueError, match="released"):
            out["value"]
        assert np.array_equal(client.infer(x)["value"], expected)  # the slot is reused safely


def queue_owner(conn: Connection) -> None:
    """An inference actor's part in a crash: it creates the queue, reports its descriptor and, when
    asked, its slots per state; killed, it leaves the queue behind (orphaned), as a crashed actor does."""
    queue = InferenceQueue.create(QUEUE)
    conn.send_bytes(queue.descriptor.to_bytes())
    while True:
        conn.recv()
        conn.send(dict(queue.snapshot().counts))


class OrphanReplica:
    """A replica whose inference actor can crash: its queue is created by a child process (the actor's
    part, ``queue_owner``) and served by a pinned worker this process starts."""

    def __init__(self, model: Path) -> None:
        ctx = multiprocessing.get_context("fork")
        self.conn, child = ctx.Pipe()
        self.owner = ctx.Process(target=queue_owner, args=(child,), daemon=True)
        self.owner.start()
        self.desc = QueueDescriptor.from_bytes(self.conn.recv_bytes())
        self.worker = WorkerProcess.start(self.desc, CPU, model, WorkerConfig(name="t.orphan"))
        self.worker.wait_ready(120)
        self.endpoint = Endpoint(
            "lowtail-test-orphan", "infer:t:9", "node-a", CPU, 0, self.desc, self.worker.pid
        )

    def claimed(self) -> int:
        self.conn.send("counts")
        return int(self.conn.recv().get("PROCESSING", 0))

    def crash_actor(self) -> None:
        """The actor dies (its queue stays, orphaned); its worker is left as it is."""
        os.kill(self.owner.pid, signal.SIGKILL)
        self.owner.join(10)

    def kill_worker(self) -> None:
        os.kill(self.worker.pid, signal.SIGKILL)
        os.kill(self.worker.pid, signal.SIGCONT)
        self.worker._proc.join(10)

    def close(self) -> None:
        self.worker.stop()
        self.owner.kill()
        self.owner.join(10)
        self.desc.path.unlink(missing_ok=True)


@pytest.fixture
def orphan(small_model: Path) -> Iterator[OrphanReplica]:
    r = OrphanReplica(small_model)
    try:
        yield r
    finally:
        r.close()


def test_requests_of_a_replica_whose_actor_died_wait_for_the_other_replicas_restart(
    replicas: list[Replica], orphan: OrphanReplica
) -> None:
    """The other replica is down too (its worker restarts, its actor lives): the requests the dead
    actor's queue held unclaimed move there and are served by the restarted worker, not lost."""
    a, _ = replicas
    with InferenceClient([a.endpoint, orphan.endpoint], node_id="node-a", timeout_s=60) as client:
        client.infer(x_of(0))  # both attached and warm
        client.infer(x_of(1))
        a.worker.kill()  # replica 0: no worker until restarted; its actor (this process) lives
        a.worker._proc.join(10)
        os.kill(orphan.worker.pid, signal.SIGSTOP)
        pending = [client.start(x_of(k)) for k in range(QUEUE.slots_per_lane)]
        assert all(p.target == 1 for p in pending)  # the only serving replica
        time.sleep(0.2)
        claimed = orphan.claimed()
        orphan.crash_actor()  # the actor dies first, as in a crash; its queue stays
        orphan.kill_worker()
        failed, lost, waiting = 0, 0, []
        for p in pending:  # no worker serves anywhere now: each one fails, is lost or waits
            try:
                client.finish(p, timeout_s=0.5)
                raise AssertionError("answered while no worker serves")
            except WorkerDied:
                failed += 1
            except RequestLost:
                lost += 1
            except QueueTimeout:
                waiting.append(p)
        assert (lost, failed) == (0, claimed)
        assert len(waiting) == len(pending) - claimed
        assert all(p.moved and p.target == 0 for p in waiting)
        a.restart()
        for p in waiting:
            assert client.finish(p)["value"].shape == (1, 1)  # each answered once, by replica 0
        assert client.moved == len(waiting)


def test_a_worker_dying_while_finish_looks_at_its_dead_actors_queue_loses_nothing(
    replicas: list[Replica], orphan: OrphanReplica, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The actor is dead, its frozen worker still holds the queue: a waiting finish sees it serving
    (nothing to move), and the worker dies right then. The request is moved on its next look, not
    failed RequestLost (the race the bench's actor kill hit once in ~1,500 requests)."""
    a, _ = replicas
    with InferenceClient([a.endpoint, orphan.endpoint], node_id="node-a", timeout_s=60) as client:
        client.infer(x_of(0))
        client.infer(x_of(1))
        os.kill(orphan.worker.pid, signal.SIGSTOP)
        p = client.start(x_of(2))
        while p.target != 1:
            client.finish(p)
            p = client.start(x_of(2))
        time.sleep(0.2)
        assert orphan.claimed() == 0  # frozen before this request came: unclaimed
        orphan.crash_actor()
        move = InferenceClient._move
        killed: list[bool] = []

        def move_then_the_worker_dies(self: InferenceClient, q: PendingInference) -> bool:
            moved = move(self, q)
            if not killed:
                assert not moved  # it looked while the frozen worker held the queue
                orphan.kill_worker()
                killed.append(True)
            return moved

        monkeypatch.setattr(InferenceClient, "_move", move_then_the_worker_dies)
        out = client.finish(p)
        assert killed and out["value"].shape == (1, 1)
        assert p.moved and p.target == 0 and client.moved == 1


def test_zero_copy_outputs_of_a_replica_dropped_after_its_actor_died_stay_readable(
    replicas: list[Replica], orphan: OrphanReplica
) -> None:
    """The everyday form of a client closed under its zero-copy outputs: the replica whose answer a
    sampler holds loses its actor, the client drops that attachment, and the held array still reads."""
    a, _ = replicas
    with InferenceClient([orphan.endpoint, a.endpoint], node_id="node-a", timeout_s=30) as client:
        p = client.start(x_of(0))
        assert p.target == 0
        value = client.finish(p, copy=False)["value"]
        expected = value.copy()
        orphan.crash_actor()
        orphan.kill_worker()
        for k in range(3):  # round robin comes back to the orphan, finds its actor gone, drops it
            assert client.infer(x_of(1 + k))["value"].shape == (1, 1)
        assert client.status()[0]["broken"] is not None
        assert np.array_equal(value, expected)  # read after the drop: still the answer, no fault
