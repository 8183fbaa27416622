"""Ray sees the leases: lease holders request the CPU they pin, as CPU and lowtail_isolated_cpu.

The session's cluster declares ``lowtail_isolated_cpu`` per node as lowtail-ray.service does. This
machine runs the demo override (pool 0-1 shared by 8 owners), so each lease is 1/8 of each resource;
with isolated CPUs to spare it is 1 of each. ``ray.available_resources()`` is the public, cluster-wide
view; the raylets report changes within a heartbeat, hence the waits.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
import ray

from lowtail.actors.allocator import AllocatorConfig, get_node_allocator
from lowtail.actors.inference import ISOLATED_RESOURCE, InferenceSpec, start_inference_actor, stop_actor
from lowtail.actors.sampler import EnvSpec, SamplerSpec, start_sampler
from tests.fixtures.ray_cluster import RayNodes
from tests.serve.conftest import SMALL_SPEC


def available() -> tuple[float, float]:
    free = ray.available_resources()
    return round(free.get("CPU", 0.0), 4), round(free.get(ISOLATED_RESOURCE, 0.0), 4)


def settles_at(expected: tuple[float, float], timeout_s: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if available() == expected:
            return True
        time.sleep(0.1)
    return False


def test_while_leases_are_held_rays_available_cpu_and_isolated_cpu_reflect_them(
    ray_nodes: RayNodes, model: Path, alloc_cfg: AllocatorConfig
) -> None:
    # The base is the cluster's totals: every holder but a lease asks for 0 CPU. An earlier test's lease
    # may still show as held for a heartbeat after its actor stopped; reading available() here once took
    # that as the base, and the two leases below then looked like one (7.75, not 7.625, of 8).
    totals = ray.cluster_resources()
    base_cpu, base_iso = round(totals.get("CPU", 0.0), 4), round(totals.get(ISOLATED_RESOURCE, 0.0), 4)
    assert settles_at((base_cpu, base_iso)), f"held before the test: {available()} of {(base_cpu, base_iso)}"
    per_lease = 1.0 / alloc_cfg.share
    actors: list[Any] = []
    try:
        actors.append(
            start_inference_actor(
                InferenceSpec(hero="res", index=0, model_dir=str(model), allocator=alloc_cfg), ray_nodes.head
            )
        )
        ep = ray.get(actors[0].endpoint.remote())
        sampler_spec = SamplerSpec("res", EnvSpec(features=SMALL_SPEC.features), allocator=alloc_cfg)
        actors.append(start_sampler(sampler_spec, [ep], ray_nodes.head))
        held = round(2 * per_lease, 4)
        assert settles_at((round(base_cpu - held, 4), round(base_iso - held, 4))), available()
        alloc = get_node_allocator(ray_nodes.head, alloc_cfg)
        assert sorted(x.owner for x in ray.get(alloc.leases.remote())) == ["infer:res:0", "sample:res"]
    finally:
        for a in reversed(actors):
            stop_actor(a)
    assert settles_at((base_cpu, base_iso)), available()  # given back with the leases


@ray.remote(num_cpus=0)
class Hog:
    """Holds every lowtail_isolated_cpu of its node, as leases of other owners would."""

    def ready(self) -> bool:
        return True


def test_a_lease_holder_ray_cannot_place_is_reported_and_removed_not_left_pending(
    ray_nodes: RayNodes, alloc_cfg: AllocatorConfig
) -> None:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    from lowtail.actors.inference import InferenceActorFailed

    base = available()
    hog = Hog.options(  # type: ignore[attr-defined]
        resources={ISOLATED_RESOURCE: 4},
        scheduling_strategy=NodeAffinitySchedulingStrategy(ray_nodes.other, soft=False),
    ).remote()
    try:
        assert ray.get(hog.ready.remote(), timeout=60)
        spec = SamplerSpec("starved", EnvSpec(features=SMALL_SPEC.features), allocator=alloc_cfg)
        t0 = time.monotonic()
        with pytest.raises(
            InferenceActorFailed, match=r"sampler starved on node .* did not start within 5 s"
        ):
            start_sampler(spec, [], ray_nodes.other, start_timeout_s=5)
        assert time.monotonic() - t0 < 60
    finally:
        ray.kill(hog)
    assert settles_at(base), available()  # the pending sampler was removed with its request
