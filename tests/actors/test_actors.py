"""Inference actors, the sampler client and sampler actors on the session's two-raylet Ray cluster.

Real Ray actors, real pinned OpenVINO workers, real shared-memory queues. This machine isolates one
CPU (plan: housekeeping 0, isolated 1), so the allocator runs with the demo override (pool 0-1, shared
CPUs); the strict pool is tested in test_lease.py and test_ray_lease.py.
"""

from __future__ import annotations

import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import ray

from lowtail.actors.allocator import AllocatorConfig, get_node_allocator
from lowtail.actors.endpoint import CrossNodeAttach, NoEndpoints
from lowtail.actors.inference import InferenceActorFailed, InferenceSpec, start_inference_actor, stop_actor
from lowtail.actors.inference_client import InferenceClient
from lowtail.actors.sampler import EnvSpec, SamplerSpec, start_sampler
from lowtail.serve.model import example_inputs, find_model_xml
from lowtail.serve.openvino_core import shared_core
from lowtail.serve.worker_process import WorkerConfig
from lowtail.shm.queue import QueueConfig, WorkerDied
from tests.fixtures.ray_cluster import RayNodes
from tests.serve.conftest import SMALL_SPEC, write_slow_model

FEATURES = SMALL_SPEC.features


def direct(model: Path, x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    compiled = shared_core().compile_model(
        str(find_model_xml(model)), "CPU", {"INFERENCE_PRECISION_HINT": "f32"}
    )
    return {k.get_any_name(): v for k, v in compiled(x).items()}


def wait_until(predicate: Any, timeout_s: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def infer_spec(model: Path, alloc: AllocatorConfig, index: int, **kw: Any) -> InferenceSpec:
    return InferenceSpec(hero="t", index=index, model_dir=str(model), allocator=alloc, **kw)


def test_sampler_outputs_through_actors_and_workers_equal_direct_inference(
    ray_nodes: RayNodes, model: Path, alloc_cfg: AllocatorConfig
) -> None:
    actors = [start_inference_actor(infer_spec(model, alloc_cfg, i), ray_nodes.head) for i in range(2)]
    sampler = None
    try:
        endpoints = ray.get([a.endpoint.remote() for a in actors])
        sampler = start_sampler(
            SamplerSpec("eq", EnvSpec(features=FEATURES), allocator=alloc_cfg), endpoints, ray_nodes.head
        )
        batches = [example_inputs(FEATURES, b, seed=b) for b in (1, 3, 8, 16, 5, 2)]
        for two_phase in (False, True):
            got = ray.get(sampler.infer_many.remote(batches, two_phase))
            for x, out in zip(batches, got, strict=True):
                ref = direct(model, x)
                assert set(out) == set(ref) == {"action", "move", "value"}
                for name in ref:
                    np.testing.assert_allclose(out[name], ref[name], rtol=1e-5, atol=1e-6)
        # round robin: both actors' workers served half of the 12 requests
        calls = [ray.get(a.report.remote())["report"]["calls"] for a in actors]
        assert all(c >= 1 for c in calls) and sum(calls) <= 12
        # the sampler pinned the thread that runs its methods to its leased CPU, near the first actor
        lease = ray.get(sampler.lease.remote())
        assert ray.get(sampler.affinity.remote()) == [lease.cpu]
        assert lease.owner == "sample:eq" and lease.placement in ("same-l3", "same-node")
    finally:
        if sampler is not None:
            stop_actor(sampler)
        for a in actors:
            stop_actor(a)


def test_inference_actor_places_its_queue_and_releases_everything_on_shutdown(
    ray_nodes: RayNodes, model: Path, alloc_cfg: AllocatorConfig
) -> None:
    actor = start_inference_actor(infer_spec(model, alloc_cfg, 0), ray_nodes.head)
    ep = ray.get(actor.endpoint.remote())
    status = ray.get(actor.status.remote())
    alloc = get_node_allocator(ray_nodes.head, alloc_cfg)
    lease = {x.owner: x for x in ray.get(alloc.leases.remote())}["infer:t:0"]
    assert (ep.node_id, ep.cpu, ep.numa_node) == (ray_nodes.head, lease.cpu, lease.node)
    assert ep.descriptor.config.numa_node == lease.node  # the queue is bound to the worker CPU's node
    assert status["worker_alive"] and status["ready"]["affinity"] in ([lease.cpu], str(lease.cpu))
    if len(os.sched_getaffinity(0)) > 1:
        assert lease.cpu not in status["actor_affinity"]  # the actor's own threads stay off the worker's CPU
    # Every thread at the spec's nice value, Ray's own included: at Ray's nice 15 the supervisor and the
    # threads that receive the clients' calls waited behind every thread at -20 on a shared CPU.
    assert status["actor_nice"]["requested"] == -20
    if status["actor_nice"]["error"] is None:
        assert status["actor_thread_nices"] == [-20], status["actor_thread_nices"]
    else:  # not permitted: nothing changed, and the status says so
        assert status["actor_thread_nices"] == [status["actor_nice"]["achieved"]]
    assert ep.descriptor.path.exists()
    counts = ray.get(actor.queue_counts.remote())
    assert counts["FREE"] == ep.descriptor.config.slots and counts["PROCESSING"] == 0
    stop_actor(actor)
    assert not ep.descriptor.path.exists()
    assert ray.get(alloc.leases.remote()) == []
    assert wait_until(lambda: not os.path.exists(f"/proc/{ep.worker_pid}"), 60)


def test_a_killed_worker_is_restarted_its_in_flight_request_fails_and_new_ones_are_served(
    ray_nodes: RayNodes, tmp_path: Path, alloc_cfg: AllocatorConfig
) -> None:
    # ~1 s a call: long enough that the kill below lands while the request is PROCESSING even when a Ray
    # call to the actor takes a few hundred ms on a loaded host.
    slow = write_slow_model(tmp_path / "slow", layers=1000).parent
    x = {"obs": np.random.default_rng(0).standard_normal((64, 1024), dtype=np.float32)}
    spec = infer_spec(
        slow,
        alloc_cfg,
        0,
        queue=QueueConfig(
            lanes=4,
            slots_per_lane=4,
            request_bytes=266240,
            response_bytes=266240,
            max_batch_samples=64,
            min_batch_samples=1,
        ),
        worker=WorkerConfig(name="victim", max_batch=64),
        standby=False,  # the restart path (the standby's takeover is test_failover's)
    )
    actor = start_inference_actor(spec, ray_nodes.head)
    try:
        ep = ray.get(actor.endpoint.remote())
        # 120 s: the answers after the kill wait for a restarted worker (spawn, imports, a 1000-layer
        # compile), which took more than 30 s beside make test's six parallel suites. A no-hang bound;
        # what a restart costs is bench failover's figure.
        with InferenceClient([ep], node_id=ray_nodes.head, timeout_s=120) as client:
            assert client.infer(x)["value"].shape == (64, 1024)
            # Asked first: the actor freezes and kills the worker as soon as it sees a request claimed.
            # Four in flight, ~1 s each and one per batch: the kill lands on one of them however late
            # Ray runs the call (one request alone could be answered before it on a loaded host).
            kill = actor.kill_worker.remote(while_processing=True, timeout_s=60.0)
            pendings = [client.start(x) for _ in range(4)]
            killed = ray.get(kill)
            claimed = ray.get(actor.kills.remote())[-1]["claimed"]
            died = 0
            for p in pendings:  # the others: answered before the kill, or by the restarted worker
                try:
                    assert client.finish(p)["value"].shape == (64, 1024)
                except WorkerDied:
                    died += 1
            assert died == claimed == 1, (died, claimed)
            last: dict[str, Any] = {}

            def restarted() -> bool:
                last.update(ray.get(actor.status.remote()))
                return bool(last["restarts"] == 1 and last["worker_alive"])

            assert wait_until(restarted), f"no restarted worker within 120 s: {last}"
            status = ray.get(actor.status.remote())
            assert status["worker_pid"] != killed and status["failed"] is None
            # the same queue and attachment, served by the restarted worker: nothing to re-resolve
            assert client.infer(x)["value"].shape == (64, 1024)
            assert client.reattached == 0
    finally:
        stop_actor(actor)


def test_a_worker_that_keeps_dying_is_given_up_with_a_clear_error(
    ray_nodes: RayNodes, model: Path, alloc_cfg: AllocatorConfig
) -> None:
    actor = start_inference_actor(infer_spec(model, alloc_cfg, 0, max_restarts_per_minute=1), ray_nodes.head)
    try:
        ray.get(actor.kill_worker.remote())
        assert wait_until(
            lambda: (s := ray.get(actor.status.remote()))["restarts"] == 1 and s["worker_alive"]
        )
        ray.get(actor.kill_worker.remote())
        assert wait_until(lambda: ray.get(actor.status.remote())["failed"] is not None)
        with pytest.raises(InferenceActorFailed, match=r"worker died 2 times in a minute .*not restarting"):
            ray.get(actor.endpoint.remote())
    finally:
        stop_actor(actor)
    alloc = get_node_allocator(ray_nodes.head, alloc_cfg)
    assert ray.get(alloc.leases.remote()) == []  # shutdown still released the lease


def test_a_killed_sampler_lease_is_reclaimed(
    ray_nodes: RayNodes, model: Path, alloc_cfg: AllocatorConfig
) -> None:
    actor = start_inference_actor(infer_spec(model, alloc_cfg, 0), ray_nodes.head)
    try:
        ep = ray.get(actor.endpoint.remote())
        sampler = start_sampler(SamplerSpec("doomed", allocator=alloc_cfg), [ep], ray_nodes.head)
        alloc = get_node_allocator(ray_nodes.head, alloc_cfg)
        owners = lambda: sorted(x.owner for x in ray.get(alloc.leases.remote()))  # noqa: E731
        assert owners() == ["infer:t:0", "sample:doomed"]
        ray.kill(sampler)  # no shutdown(): the process just dies
        assert wait_until(lambda: owners() == ["infer:t:0"])
    finally:
        stop_actor(actor)


def test_samplers_run_sync_and_two_phase_round_robin(
    ray_nodes: RayNodes, model: Path, alloc_cfg: AllocatorConfig
) -> None:
    actors = [start_inference_actor(infer_spec(model, alloc_cfg, i), ray_nodes.head) for i in range(2)]
    try:
        endpoints = ray.get([a.endpoint.remote() for a in actors])
        sampler = start_sampler(
            SamplerSpec("loop", EnvSpec(features=FEATURES, rows=4, step_us=50), allocator=alloc_cfg),
            endpoints,
            ray_nodes.head,
        )
        try:
            for mode in ("sync", "async"):
                r = ray.get(sampler.run.remote(0.5, mode, 2))
                assert r.steps > 0 and r.samples == 4 * r.steps and r.errors == {}
                assert len(r.rpc_ms) == r.steps
        finally:
            stop_actor(sampler)
        calls = [ray.get(a.report.remote())["report"]["calls"] for a in actors]
        assert min(calls) > 0  # both actors served the same sampler
    finally:
        for a in actors:
            stop_actor(a)


def test_attaching_across_nodes_is_a_clear_error_not_a_hang(
    ray_nodes: RayNodes, model: Path, alloc_cfg: AllocatorConfig
) -> None:
    actor = start_inference_actor(infer_spec(model, alloc_cfg, 0), ray_nodes.head)
    try:
        ep = ray.get(actor.endpoint.remote())
        with pytest.raises(CrossNodeAttach, match=f"not on this node \\({ray_nodes.other}\\)"):
            InferenceClient([ep], node_id=ray_nodes.other)
        with pytest.raises(NoEndpoints):
            InferenceClient([], node_id=ray_nodes.head)
        t0 = time.monotonic()
        with pytest.raises(CrossNodeAttach):  # the constructor's own error, not Ray's wrapper
            start_sampler(SamplerSpec("far", allocator=alloc_cfg), [ep], ray_nodes.other)
        assert time.monotonic() - t0 < 30
        # the far sampler released the lease it took on its own node before failing
        far_alloc = get_node_allocator(ray_nodes.other, alloc_cfg)
        assert ray.get(far_alloc.leases.remote()) == []
    finally:
        stop_actor(actor)


def test_each_node_has_its_own_allocator_and_inference_actors(
    ray_nodes: RayNodes, model: Path, alloc_cfg: AllocatorConfig
) -> None:
    a = start_inference_actor(infer_spec(model, alloc_cfg, 0), ray_nodes.head)
    b = start_inference_actor(infer_spec(model, alloc_cfg, 1), ray_nodes.other)
    try:
        ea, eb = ray.get([a.endpoint.remote(), b.endpoint.remote()])
        assert (ea.node_id, eb.node_id) == (ray_nodes.head, ray_nodes.other)
        for node, owner in ((ray_nodes.head, "infer:t:0"), (ray_nodes.other, "infer:t:1")):
            alloc = get_node_allocator(node, alloc_cfg)
            assert [x.owner for x in ray.get(alloc.leases.remote())] == [owner]
        # a client in the driver (head node) reaches the head's actor only
        with InferenceClient([ea], node_id=ray_nodes.head) as c:
            assert c.infer(example_inputs(FEATURES, 2))["value"].shape == (2, 1)
    finally:
        stop_actor(a)
        stop_actor(b)


def test_the_default_queue_carries_an_8_x_512_float32_batch_inline() -> None:
    from lowtail.actors.inference import default_queue_config
    from lowtail.shm.payload import validated_layout

    batch = {"obs": np.zeros((8, 512), np.float32)}
    assert validated_layout(batch).inline_end <= default_queue_config().request_bytes


def test_start_failures_surface_as_themselves_and_bad_specs_are_refused_at_construction(
    ray_nodes: RayNodes, tmp_path: Path, alloc_cfg: AllocatorConfig
) -> None:
    from lowtail.actors.inference import BadInferenceSpec
    from lowtail.serve.model import ModelNotFound

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(ModelNotFound):  # not Ray's ActorDiedError with the cause buried in it
        start_inference_actor(infer_spec(empty, alloc_cfg, 0), ray_nodes.head)
    alloc = get_node_allocator(ray_nodes.head, alloc_cfg)
    assert ray.get(alloc.leases.remote()) == []  # the failed constructor released its lease
    with pytest.raises(BadInferenceSpec, match=r"hero='h:0': expected letters"):
        InferenceSpec(hero="h:0", index=0, model_dir=str(empty))
    with pytest.raises(BadInferenceSpec, match=r"index=-1"):
        InferenceSpec(hero="h", index=-1, model_dir=str(empty))
    for nice in (-21, 20, 1.5, True):
        with pytest.raises(BadInferenceSpec, match=r"nice=.*: expected an integer from -20 to 19, or None"):
            InferenceSpec(hero="h", index=0, model_dir=str(empty), nice=nice)  # type: ignore[arg-type]
    assert InferenceSpec(hero="h", index=0, model_dir=str(empty), nice=None).nice is None


def test_the_hero_label_is_kept_with_a_custom_worker_config(tmp_path: Path) -> None:
    from lowtail.actors.inference import worker_config

    spec = InferenceSpec(hero="h3", index=1, model_dir=str(tmp_path), worker=WorkerConfig(max_batch=8))
    assert worker_config(spec).name == "h3.1" and worker_config(spec).max_batch == 8
    named = replace(spec, worker=WorkerConfig(name="fast"))
    assert worker_config(named).name == "h3.1.fast"


def test_several_inference_actors_start_in_parallel(
    ray_nodes: RayNodes, model: Path, alloc_cfg: AllocatorConfig
) -> None:
    from lowtail.actors.inference import start_inference_actors

    actors = start_inference_actors([infer_spec(model, alloc_cfg, i, standby=False) for i in range(3)])
    try:
        owners = sorted(ray.get(a.status.remote())["owner"] for a in actors)
        assert owners == ["infer:t:0", "infer:t:1", "infer:t:2"]
    finally:
        for a in actors:
            stop_actor(a)


def test_actors_emit_no_ray_deprecation_warning(
    ray_nodes: RayNodes, model: Path, alloc_cfg: AllocatorConfig
) -> None:
    stop_actor(start_inference_actor(infer_spec(model, alloc_cfg, 0, standby=False), ray_nodes.head))
    logs = Path(os.environ["RAY_TMPDIR"])  # the session cluster's (conftest): every actor's stderr
    hits = [
        line
        for f in logs.rglob("worker-*.err")
        for line in f.read_text(errors="replace").splitlines()
        if "DeprecationWarning" in line
    ]
    assert hits == []
