"""Samplers through crashes: a worker SIGKILL and an inference-actor kill under 4 samplers, through Ray.

What is in flight at the crash is counted, not guessed: the worker is frozen (SIGSTOP) first, the samplers
block on their requests (two games each, async), and the queue's slots are counted. A killed worker
fails the requests it had claimed (PROCESSING: "may or may not have run", never retried); the ones still
waiting unclaimed (READY) are served by the restarted worker on the same queue. A killed inference
actor takes its queue with it: every unanswered request (WRITING, READY, PROCESSING) fails. The samplers
must report exactly that many failed requests, re-resolve the endpoint, and be answered again within a
generous bound, each on its own: nothing in the test helps them.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import Any

import ray

from lowtail.actors.allocator import AllocatorConfig, get_node_allocator
from lowtail.actors.inference import InferenceSpec, start_inference_actor, stop_actor
from lowtail.actors.sampler import EnvSpec, SamplerResult, SamplerSpec, start_sampler
from lowtail.shm.segments import list_segments
from tests.fixtures.ray_cluster import RayNodes
from tests.serve.conftest import SMALL_SPEC

SAMPLERS = 4
RUN_S = 14.0
KILL_AT_S = 3.0
RECOVERY_BOUND_S = 30.0  # "no hang", not latency: 8.4 s was seen for an actor restart at load average 30


def freeze_and_count(actor: Any, states: tuple[str, ...]) -> tuple[int, int]:
    """SIGSTOP the actor's worker while it processes a batch, let the samplers settle on their requests;
    returns (worker pid, requests in ``states``). Retried until the stop lands mid-batch."""
    pid = int(ray.get(actor.status.remote())["worker_pid"])
    deadline = time.monotonic() + 60
    while True:
        os.kill(pid, signal.SIGSTOP)
        if ray.get(actor.queue_counts.remote())["PROCESSING"] > 0:
            break
        os.kill(pid, signal.SIGCONT)
        assert time.monotonic() < deadline, "the worker never stopped mid-batch"
        time.sleep(0.003)
    time.sleep(0.5)  # every sampler is now parked on requests the frozen worker holds
    counts = ray.get(actor.queue_counts.remote())
    return pid, sum(int(counts[s]) for s in states)


def crash_actor_process(actor: Any, frozen_worker: int, timeout_s: float = 10.0) -> int:
    """SIGKILL an inference actor's process and its frozen worker together, as a crash of both would
    (Ray restarts the actor), and wait until the actor is gone (reaped). Returns the actor's pid.

    Both signals are sent back to back, the worker's first: the frozen worker must never run again.
    Killed alone first, the actor leaves its worker's process group orphaned, and the kernel then sends
    every stopped member SIGHUP and SIGCONT (POSIX, _exit(2)): the worker resumed and answered the
    requests the test had counted as claimed, so the count of lost requests was wrong. Killed alone
    first, the worker would be restarted by the actor's supervisor; back to back, the actor dies in
    the same instant, before any restart.
    """
    pid = int(ray.get(actor.ping.remote())["pid"])
    os.kill(frozen_worker, signal.SIGKILL)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout_s
    while os.path.exists(f"/proc/{pid}") and time.monotonic() < deadline:
        time.sleep(0.01)
    return pid


def run_samplers(
    ray_nodes: RayNodes, model: Path, alloc_cfg: AllocatorConfig, crash: Any
) -> tuple[list[SamplerResult], int]:
    # Without a standby: the worker restart path, one replica (test_failover has the standby's takeover).
    spec = InferenceSpec(hero="r", index=0, model_dir=str(model), allocator=alloc_cfg, standby=False)
    actor = start_inference_actor(spec, ray_nodes.head)
    samplers: list[Any] = []
    try:
        ep = ray.get(actor.endpoint.remote())
        env = EnvSpec(features=SMALL_SPEC.features, rows=4, step_us=50)
        for i in range(SAMPLERS):
            # timeout_s: a frozen worker must not turn in-flight requests into timeouts
            s = SamplerSpec(f"s{i}", env, allocator=alloc_cfg, timeout_s=60.0)
            samplers.append(start_sampler(s, [ep], ray_nodes.head))
        runs = [s.run.remote(RUN_S, "async", 2) for s in samplers]
        time.sleep(KILL_AT_S)
        in_flight = crash(actor)
        results: list[SamplerResult] = ray.get(runs, timeout=RUN_S + 60)
        return results, in_flight
    finally:
        for s in samplers:
            stop_actor(s)
        stop_actor(actor)


def check_recovered(results: list[SamplerResult], in_flight: int, errors: set[str]) -> None:
    failed = sum(sum(r.errors.values()) for r in results)
    assert in_flight >= 1
    assert failed == in_flight, [r.errors for r in results]
    assert set().union(*(r.errors for r in results)) <= errors
    for r in results:
        if r.errors:  # it lost requests: it was answered again by itself
            assert r.recovery_s and max(r.recovery_s) < RECOVERY_BOUND_S, r.recovery_s
        assert r.steps > 0 and r.waits < 1000, r  # answered, and backed off while down: no busy loop


def test_samplers_lose_only_their_in_flight_requests_when_the_worker_is_killed(
    ray_nodes: RayNodes, model: Path, alloc_cfg: AllocatorConfig
) -> None:
    def crash(actor: Any) -> int:
        pid, claimed = freeze_and_count(actor, ("PROCESSING",))
        os.kill(pid, signal.SIGKILL)  # the supervisor restarts the worker on the same queue
        return claimed

    results, in_flight = run_samplers(ray_nodes, model, alloc_cfg, crash)
    check_recovered(results, in_flight, {"WorkerDied"})
    assert all(r.reattached == 0 for r in results)  # the same queue: its restarted worker serves it


def test_samplers_lose_only_their_in_flight_requests_when_the_inference_actor_is_killed(
    ray_nodes: RayNodes, model: Path, alloc_cfg: AllocatorConfig
) -> None:
    pids: dict[str, int] = {}

    def crash(actor: Any) -> int:
        pid, in_flight = freeze_and_count(actor, ("WRITING", "READY", "PROCESSING"))
        pids["worker"] = pid
        pids["actor"] = crash_actor_process(actor, pid)  # Ray restarts it (max_restarts)
        return in_flight

    results, in_flight = run_samplers(ray_nodes, model, alloc_cfg, crash)
    check_recovered(results, in_flight, {"WorkerDied", "RequestLost"})
    assert all(r.reattached == 1 for r in results)  # the queue went with the actor: everyone re-resolved
    # the restarted actor took the same lease owner again and left no segment of the dead one behind
    assert not any(s.pid == pids["actor"] for s in list_segments())
    alloc = get_node_allocator(ray_nodes.head, alloc_cfg)
    assert [x.owner for x in ray.get(alloc.leases.remote())] == []  # all stopped and released
