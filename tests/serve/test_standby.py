"""A hot standby worker: real worker processes, real OpenVINO, SIGKILL of the primary under 3 clients."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest

from lowtail.serve.model import example_inputs
from lowtail.serve.openvino_core import shared_core
from lowtail.serve.worker_process import WorkerConfig, WorkerProcess, WorkerStopped
from lowtail.shm.queue import InferenceQueue, Pending, QueueClient, QueueConfig, WorkerDied
from tests.serve.conftest import write_slow_model

CPU = max(os.sched_getaffinity(0))
WIDTH = 1024
SLOW_GEOMETRY = dict(request_bytes=266240, response_bytes=266240, max_batch_samples=64, min_batch_samples=1)


def _cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _wait_until(cond: object, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():  # type: ignore[operator]
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_a_standby_reports_ready_parks_without_cpu_and_stops_cleanly(small_model: Path) -> None:
    cfg = QueueConfig(
        lanes=2, slots_per_lane=2, request_bytes=16384, response_bytes=16384, min_batch_samples=1
    )
    with InferenceQueue.create(cfg) as queue:
        primary = WorkerProcess.start(queue.descriptor, CPU, small_model, WorkerConfig(name="p"))
        standby = WorkerProcess.start(
            queue.descriptor, CPU, small_model, WorkerConfig(name="p"), standby=True
        )
        try:
            assert primary.wait_ready(120)["role"] == "primary"
            info = standby.wait_ready(120)
            assert info["role"] == "standby" and info["affinity"] == [CPU]
            assert info["warm_up_s"] > 0  # every batch size ran once before it parked
            assert primary.serving() and not standby.serving()
            assert standby.took_over_ns == 0
            assert standby.report().state == "standby"
            # Compiled in SCHED_IDLE, parked back in SCHED_OTHER (a wake-up must not wait for an idle CPU).
            assert os.sched_getscheduler(standby.pid) == os.SCHED_OTHER
            with QueueClient.attach(queue.descriptor) as c:
                before, t_before = _cpu_s(standby.pid), time.monotonic()
                for _ in range(200):  # the primary serves; the standby stays parked
                    c.infer(example_inputs(64, 4), timeout_s=30)
                time.sleep(0.5)
                # A few wake-ups per second, no spinning: a share of the elapsed time (which grows with
                # the host's load), not an absolute figure; a spinning standby would use ~100% of it.
                share = (_cpu_s(standby.pid) - before) / (time.monotonic() - t_before)
                assert share <= 0.05, f"parked standby used {share:.1%} of a CPU"
            assert queue.snapshot().worker_pid == primary.pid
            t0 = time.monotonic()
            assert standby.stop(timeout_s=10) == 0  # it saw the stop word: no SIGTERM/SIGKILL needed
            assert time.monotonic() - t0 < 5
            assert not standby.serving()
            with pytest.raises(WorkerStopped, match="was stopped"):
                standby.calls()
            assert primary.serving()
        finally:
            standby.stop()
            assert primary.stop() == 0


def test_a_standby_without_a_live_primary_serves_at_once(small_model: Path) -> None:
    cfg = QueueConfig(
        lanes=2, slots_per_lane=2, request_bytes=16384, response_bytes=16384, min_batch_samples=1
    )
    with InferenceQueue.create(cfg) as queue:
        standby = WorkerProcess.start(queue.descriptor, CPU, small_model, standby=True)
        try:
            standby.wait_ready(120)
            _wait_until(standby.serving, 10, "a standby with no worker to wait for never served")
            with QueueClient.attach(queue.descriptor) as c:
                assert c.infer(example_inputs(64, 2), timeout_s=30)["value"].shape == (2, 1)
        finally:
            assert standby.stop() == 0


def _reference(xml: Path, xs: list[np.ndarray]) -> list[np.ndarray]:
    compiled = shared_core().compile_model(str(xml), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
    return [next(iter(compiled({"obs": x}).values())) for x in xs]


def test_killing_the_primary_fails_exactly_what_it_had_claimed_and_the_standby_serves_the_rest(
    tmp_path: Path,
) -> None:
    """Three clients with three requests each in flight on a ~0.1 s-per-batch model (one request per
    batch): the primary is frozen with one PROCESSING, then SIGKILLed. Exactly the requests it had
    claimed and not answered fail WorkerDied; every other one gets its own outputs (checked against
    OpenVINO run here), none twice, and the standby ran only those (its engine-call count)."""
    xml = write_slow_model(tmp_path / "slow")
    rng = np.random.default_rng(1)
    with InferenceQueue.create(QueueConfig(lanes=4, slots_per_lane=4, **SLOW_GEOMETRY)) as queue:
        cfg = WorkerConfig(name="hero", max_batch=64, warm_up=False)
        primary = WorkerProcess.start(queue.descriptor, CPU, xml, cfg)
        standby = WorkerProcess.start(queue.descriptor, CPU, xml, cfg, standby=True)
        clients = [QueueClient.attach(queue.descriptor) for _ in range(3)]
        try:
            primary.wait_ready(120)
            standby.wait_ready(120)
            for _ in range(20):
                xs = [rng.standard_normal((64, WIDTH), dtype=np.float32) for _ in range(9)]
                sent: list[tuple[QueueClient, Pending, np.ndarray]] = []
                for i, x in enumerate(xs):
                    c = clients[i % 3]
                    sent.append((c, c.start({"obs": x}), x))

                def claimed_or_done(sent: list[tuple[QueueClient, Pending, np.ndarray]] = sent) -> bool:
                    return queue.snapshot().counts["PROCESSING"] > 0 or all(p.done() for _, p, _ in sent)

                _wait_until(claimed_or_done, 30, "the primary never claimed a request")
                os.kill(primary.pid, signal.SIGSTOP)  # frozen: what we see now is what the kill hits
                snap = queue.snapshot()
                claimed = {
                    (lane.lane, s)
                    for lane in snap.lanes
                    for s, st in enumerate(lane.states)
                    if st == "PROCESSING"
                }
                if claimed and any(
                    not p.done() and (c.lane, p.ticket.slot) not in claimed for c, p, _ in sent
                ):
                    break  # claimed and unclaimed requests both in flight: the case to test
                os.kill(primary.pid, signal.SIGCONT)
                for _, p, _ in sent:
                    p.finish(timeout_s=60)
            else:
                pytest.fail("never froze the primary with claimed and unclaimed requests (20 tries)")
            calls_before_kill = standby.report().calls
            answered_by_primary = sum(p.done() for _, p, _ in sent)
            # The reference answers are computed while the primary is frozen, so the no-hang bound
            # below times the takeover, not a local OpenVINO compile on a loaded host.
            refs = _reference(xml, [x for _, _, x in sent])
            kill_ns = time.monotonic_ns()
            os.kill(primary.pid, signal.SIGKILL)
            died, served = [], []
            for (c, p, _), ref in zip(sent, refs, strict=True):
                key = (c.lane, p.ticket.slot)
                try:
                    out = p.finish(timeout_s=30)
                except WorkerDied:
                    died.append(key)
                    continue
                served.append(key)
                np.testing.assert_allclose(out["value"], ref, rtol=1e-5, atol=1e-6)  # its own answer
                with pytest.raises(Exception, match="already waited for"):
                    p.finish(timeout_s=1)  # nothing is answered twice
            assert sorted(died) == sorted(claimed)
            assert len(served) == 9 - len(claimed)
            assert (time.monotonic_ns() - kill_ns) / 1e9 < 60  # no hang (the milliseconds are a benchmark's)
            assert standby.serving() and queue.snapshot().worker_pid == standby.pid
            assert kill_ns < standby.took_over_ns < time.monotonic_ns()
            _wait_until(
                lambda: standby.report().calls - calls_before_kill >= 9 - len(claimed) - answered_by_primary,
                10,
                "the standby's call rows never appeared",
            )
            # It ran exactly the requests nobody had claimed: the claimed ones were not re-run.
            assert standby.report().calls - calls_before_kill == 9 - len(claimed) - answered_by_primary
            # And it keeps serving every client.
            for c in clients:
                assert c.infer({"obs": xs[0]}, timeout_s=30)["value"].shape == (64, WIDTH)
        finally:
            for c in clients:
                c.close()
            primary.stop()
            assert standby.stop() == 0
