"""Withdraw raced against the worker's claim, with real processes: every request runs at most once, and
its client always knows whether it did (True: never; False: its answer, or RequestWithdrawn: never)."""

from __future__ import annotations

import time
from multiprocessing.context import BaseContext
from typing import Any

import numpy as np
import pytest

from lowtail.shm.errors import RequestWithdrawn
from lowtail.shm.queue import (
    InferenceQueue,
    LaneBusy,
    QueueClient,
    QueueConfig,
    QueueDescriptor,
    QueueWorker,
)

# Every test here runs on both hot paths: the Python reference and the native core.
pytestmark = pytest.mark.usefixtures("queue_impl")

ROUNDS = 3000  # at least; more (up to MAX_ROUNDS) until both sides of the race happened often enough
MAX_ROUNDS = 12000
BOTH_SIDES = 20  # withdrawn and answered, each more than this


def recording_worker(desc: QueueDescriptor, stop: Any, out: Any, run_s: float) -> None:
    """Answer every request with its own tag and report every tag it ran."""
    ran: list[int] = []
    end = time.monotonic() + run_s
    with QueueWorker.attach(desc, idle_us=1_000_000) as w:  # spins between requests: claims at once
        while time.monotonic() < end and not stop.is_set():
            b = w.claim(timeout_s=0.05)
            if b is None:
                continue
            x = b.inputs["x"]
            ran.extend(int(v) for v in x[:, 0])
            b.complete({"tag": x[:, :1].copy()})
        out.put((ran, w.withdrawn))


def test_withdraw_against_claim_runs_every_request_at_most_once(ctx: BaseContext) -> None:
    cfg = QueueConfig(lanes=1, slots_per_lane=4, coalesce_us=0, request_bytes=4096, response_bytes=4096)
    rng = np.random.default_rng(0)
    # Log-uniform from 1 us to 5 ms: around the worker's claim however busy the host (a few us after
    # the doorbell on an idle one, milliseconds when the worker's CPU is shared).
    delays_ns = np.exp(rng.uniform(np.log(1e3), np.log(5e6), MAX_ROUNDS)).astype(np.int64)
    with InferenceQueue.create(cfg) as server:
        out, stop = ctx.Queue(), ctx.Event()  # type: ignore[attr-defined]
        worker = ctx.Process(target=recording_worker, args=(server.descriptor, stop, out, 300.0))  # type: ignore[attr-defined]
        worker.start()
        withdrawn, answered, refused = set(), set(), set()
        try:
            with QueueClient.attach(server.descriptor) as c:
                c.infer({"x": np.full((1, 2), -1, np.float32)}, timeout_s=30)  # the worker is up
                # A loaded host can tilt the race to one side (a client preempted between its submit
                # and its withdraw loses it): more rounds until both sides happened, not a verdict.
                rounds = 0
                for i in range(MAX_ROUNDS):
                    if i >= ROUNDS and len(withdrawn) > BOTH_SIDES and len(answered) > BOTH_SIDES:
                        break
                    rounds = i + 1
                    x = {"x": np.full((1, 2), i, np.float32)}
                    while True:
                        try:
                            t = c.submit(x)
                            break
                        except LaneBusy:  # withdrawn slots come back once the worker passed them
                            time.sleep(0.0001)
                    until = time.monotonic_ns() + int(delays_ns[i])
                    while time.monotonic_ns() < until:
                        pass
                    if c.withdraw(t):
                        withdrawn.add(i)
                        continue
                    try:
                        got = c.wait(t, timeout_s=30)
                    except RequestWithdrawn:
                        refused.add(i)  # claimed, then seen withdrawn by the worker: not run
                        continue
                    assert int(got["tag"][0, 0]) == i  # its own answer
                    answered.add(i)
                # The worker passes the last withdrawn requests (their slots come back FREE): waited
                # for, not slept for, so a worker starved on a loaded host still counts them all.
                deadline = time.monotonic() + 30
                while server.snapshot().counts.get("FREE", 0) < cfg.slots and time.monotonic() < deadline:
                    time.sleep(0.01)
                stop.set()
                ran, worker_withdrawn = out.get(timeout=60)
        finally:
            stop.set()
            worker.join(60)
            if worker.is_alive():
                worker.kill()
        ran_set = set(ran) - {-1}
        assert len(ran) - 1 == len(ran_set)  # nothing ran twice
        assert ran_set == answered  # every answer came from a run, every run was answered
        assert not ran_set & withdrawn and not ran_set & refused  # withdrawn: never run
        assert len(withdrawn) + len(answered) + len(refused) == rounds
        assert worker_withdrawn == len(withdrawn) + len(refused)  # the worker skipped exactly those
        # Both sides of the race happened (not a test of one branch only).
        assert len(withdrawn) > BOTH_SIDES and len(answered) > BOTH_SIDES, (
            len(withdrawn), len(answered), len(refused), rounds
        )  # fmt: skip
