"""The queue between real processes: many clients, killed clients, killed workers, idle CPU."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator
from multiprocessing.context import BaseContext
from typing import Any

import numpy as np
import psutil
import pytest

from lowtail.shm.queue import InferenceQueue, QueueClient, QueueConfig, QueueWorker, WorkerDied
from tests.shm import helpers

# Behaviour, not latency, on a shared host (precise figures belong in a benchmark with n): a freed lane
# within NO_HANG_S proves nothing waits for a timeout; under NO_SPIN_SHARE of a CPU proves a parked side
# is not spinning (a spinner uses ~100%; the design parks at ~0%).
NO_HANG_S = 10.0
NO_SPIN_SHARE = 0.25


def _cpus() -> list[int]:
    return sorted(os.sched_getaffinity(0))


@pytest.fixture
def server() -> Iterator[InferenceQueue]:
    with InferenceQueue.create(QueueConfig(lanes=8, slots_per_lane=4)) as s:
        yield s


def _stop(p: Any) -> None:
    if p.is_alive():
        p.terminate()
    p.join(10)
    assert p.exitcode is not None, f"process {p.pid} did not exit"


def test_many_clients_random_batches_each_answer_matches_its_request(
    ctx: BaseContext, server: InferenceQueue
) -> None:
    cpus = _cpus()
    worker = ctx.Process(target=helpers.echo_server, args=(server.descriptor, cpus[-1]))  # type: ignore[attr-defined]
    worker.start()
    out = ctx.Queue()  # type: ignore[attr-defined]
    clients = [
        ctx.Process(target=helpers.checking_client, args=(server.descriptor, seed, 150, out))  # type: ignore[attr-defined]
        for seed in range(1, 7)
    ]
    try:
        for c in clients:
            c.start()
        results = sorted(out.get(timeout=120) for _ in clients)
    finally:
        for c in clients:
            c.join(30)
        _stop(worker)
    assert results == [(seed, 150, 0) for seed in range(1, 7)]
    assert all(c.exitcode == 0 for c in clients)


def test_killed_client_lane_is_reclaimed_and_others_go_on(ctx: BaseContext) -> None:
    cfg = QueueConfig(lanes=2, slots_per_lane=2)
    with InferenceQueue.create(cfg) as s, QueueWorker.attach(s.descriptor) as w:
        ready = ctx.Queue()  # type: ignore[attr-defined]
        victim = ctx.Process(target=helpers.submit_and_hang, args=(s.descriptor, ready))  # type: ignore[attr-defined]
        victim.start()
        lane = ready.get(timeout=30)
        with QueueClient.attach(s.descriptor) as other:
            b = w.claim(timeout_s=1.0)  # the victim's request, now PROCESSING
            assert b is not None and b.lanes == [lane]
            assert s.snapshot().lanes[lane].states.count("PROCESSING") == 1
            old_gen = s.snapshot().lanes[lane].gen
            os.kill(victim.pid, signal.SIGKILL)
            victim.join(10)
            killed_at = time.monotonic()
            # Generous bound on a shared host: the kernel drops the OFD lock at exit, so the lane frees in
            # milliseconds; 10 s only proves it is not waiting for a timeout or a sweep (no hang).
            while s.snapshot().lanes[lane].alive:
                assert time.monotonic() - killed_at < NO_HANG_S, "lane still held 10 s after SIGKILL"
                time.sleep(0.005)
            assert w.reclaimable_lanes() == [lane]
            # A new client gets the dead client's lane (the only free one) with a new generation ...
            with QueueClient.attach(s.descriptor) as newcomer:
                assert newcomer.lane == lane and newcomer.generation == old_gen + 1
                assert time.monotonic() - killed_at < NO_HANG_S
                # ... the worker's late answer to the dead client is fenced off ...
                b.complete(helpers.echo(b.inputs["x"]))
                # ... and both the newcomer and the other client are served.
                for c in (newcomer, other):
                    t = c.submit({"x": np.full((3, 8), c.lane, np.float32)})
                    b2 = w.claim(timeout_s=1.0)
                    assert b2 is not None
                    b2.complete(helpers.echo(b2.inputs["x"]))
                    np.testing.assert_allclose(c.wait(t, 1.0)["twice"], np.full((3, 8), 2 * c.lane + 1))


# The waiting clients' timeout: the unclaimed requests wait it out (the test's duration), the claimed
# ones must fail long before it. Each wait starts at its client's submit, which can be seconds before the
# kill on a loaded host (the last client's start): 5 s let a claimed request time out first.
WAIT_S = 20.0


def test_killed_worker_waiting_clients_get_worker_died_within_timeout(ctx: BaseContext) -> None:
    cfg = QueueConfig(lanes=4, slots_per_lane=2)
    with InferenceQueue.create(cfg) as s:
        worker = ctx.Process(target=helpers.echo_server, args=(s.descriptor, None, 60.0, 30.0))  # type: ignore[attr-defined]
        worker.start()
        out = ctx.Queue()  # type: ignore[attr-defined]
        clients = [
            ctx.Process(target=helpers.wait_for_answer, args=(s.descriptor, WAIT_S, out))  # type: ignore[attr-defined]
            for _ in range(3)
        ]
        for c in clients:
            c.start()
        try:
            assert all(out.get(timeout=30)[0] == "submitted" for _ in clients)
            deadline = time.monotonic() + 10
            while s.snapshot().worker_pid != worker.pid or s.snapshot().counts["PROCESSING"] == 0:
                assert time.monotonic() < deadline, "worker never claimed"
                time.sleep(0.01)
            claimed = s.snapshot().counts["PROCESSING"]  # the worker sleeps in its 30 s "inference"
            killed_at = time.monotonic()
            os.kill(worker.pid, signal.SIGKILL)
            results = [out.get(timeout=WAIT_S + 30) for _ in clients]
        finally:
            for c in clients:
                c.join(10)
            _stop(worker)
        # What the dead worker had claimed fails at once; what it never claimed stays queued for the
        # next worker (at most once: a WorkerDied request is never run again), so its wait times out.
        died = [end - killed_at for m, _, end in results if m.startswith("WorkerDied: the worker (pid")]
        queued = [m for m, _, _ in results if m.startswith("QueueTimeout") and "unclaimed" in m]
        assert len(died) == claimed and len(queued) == len(clients) - claimed, results
        assert all(after < 5.0 for after in died)  # seconds after the kill, well before the timeout
        # A restarted worker answers what the dead one left PROCESSING; nothing stays stuck.
        with QueueWorker.attach(s.descriptor) as w2:
            assert w2.restarted_failed >= 1
            snap = s.snapshot()
            assert snap.counts["PROCESSING"] == 0 and snap.worker_alive


def test_restarted_worker_fails_orphans_with_worker_died(ctx: BaseContext) -> None:
    with (
        InferenceQueue.create(QueueConfig(lanes=1, slots_per_lane=2)) as s,
        QueueClient.attach(s.descriptor) as c,
    ):
        worker = ctx.Process(target=helpers.echo_server, args=(s.descriptor, None, 60.0, 30.0))  # type: ignore[attr-defined]
        worker.start()
        t = c.submit({"x": np.ones((1, 8), np.float32)})
        deadline = time.monotonic() + 10
        while s.snapshot().counts["PROCESSING"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(10)
        with QueueWorker.attach(s.descriptor) as w2:
            assert w2.restarted_failed == 1
        with pytest.raises(WorkerDied, match=f"worker restarted: the previous worker \\(pid {worker.pid}\\)"):
            c.wait(t, timeout_s=1.0)


def test_a_client_exiting_does_not_unlink_the_queue(ctx: BaseContext, server: InferenceQueue) -> None:
    """No resource tracker in the way: Python 3.11's would unlink segments an exiting attacher touched."""
    p = ctx.Process(target=helpers.attach_and_exit, args=(server.descriptor,))  # type: ignore[attr-defined]
    p.start()
    p.join(30)
    assert p.exitcode == 0
    assert server.descriptor.path.exists()
    with QueueClient.attach(server.descriptor):
        pass


def test_idle_worker_and_parked_client_do_not_spin(ctx: BaseContext, server: InferenceQueue) -> None:
    worker = ctx.Process(target=helpers.echo_server, args=(server.descriptor,))  # type: ignore[attr-defined]
    worker.start()
    out = ctx.Queue()  # type: ignore[attr-defined]
    waiter = ctx.Process(target=helpers.wait_for_answer, args=(server.descriptor, 3.0, out))  # type: ignore[attr-defined]
    try:
        with QueueClient.attach(server.descriptor) as c:
            c.infer({"x": np.ones((1, 8), np.float32)}, timeout_s=10)  # the worker is up and has worked
        time.sleep(0.1)  # past the worker's idle window (2 ms)
        wp = psutil.Process(worker.pid)
        t0, w0 = time.monotonic(), sum(wp.cpu_times()[:2])
        time.sleep(1.0)
        busy = (sum(wp.cpu_times()[:2]) - w0) / (time.monotonic() - t0)
        assert busy < NO_SPIN_SHARE, f"idle worker used {busy:.1%} of a CPU"
    finally:
        _stop(worker)
    # A client waiting on a queue whose worker is gone parks too (and times out cleanly).
    waiter.start()
    assert out.get(timeout=30)[0] == "submitted"
    time.sleep(0.1)
    cp = psutil.Process(waiter.pid)
    t0, c0 = time.monotonic(), sum(cp.cpu_times()[:2])
    time.sleep(1.0)
    busy = (sum(cp.cpu_times()[:2]) - c0) / (time.monotonic() - t0)
    message, _, _ = out.get(timeout=30)
    waiter.join(10)
    assert busy < NO_SPIN_SHARE, f"parked client used {busy:.1%} of a CPU"
    assert message.startswith("QueueTimeout"), message
