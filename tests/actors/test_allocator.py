"""The per-node allocator actor on a two-raylet cluster: placement, node-locality, reclaim, restart."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from lowtail.actors.allocator import (
    NAMESPACE,
    AllocatorConfig,
    AllocatorMismatch,
    AllocatorStartFailed,
    AllocatorUnavailable,
    WrongNode,
    allocator_name,
    get_node_allocator,
    ping,
    stop_node_allocator,
)
from lowtail.node.lease import LeaseExhausted
from tests.fixtures.plans import tiny_plan
from tests.fixtures.ray_cluster import RayNodes


@pytest.fixture
def config(tmp_path: Path, ray_nodes: RayNodes) -> Iterator[AllocatorConfig]:
    """A small fake plan (the allocator pins nothing itself) and a private state dir; stopped after."""
    cfg = AllocatorConfig(
        state_dir=str(tmp_path), plan=tiny_plan("1-4").to_dict(), reclaim_interval_s=0.2, cpuset_only=False
    )
    yield cfg
    for node in (ray_nodes.head, ray_nodes.other):
        stop_node_allocator(node)


@ray.remote(num_cpus=0)
class Owner:
    """A stand-in owner actor that leases for itself (the real sampler actor is tested in test_actors)."""

    def take(self, allocator: Any, owner: str) -> int:
        ctx = ray.get_runtime_context()
        lease = ray.get(
            allocator.acquire.remote(
                owner, caller_node=ctx.get_node_id(), pid=os.getpid(), actor_id=ctx.get_actor_id()
            )
        )
        return int(lease.cpu)


def wait_until(predicate: Any, timeout_s: float = 120.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.1)
    return False


def test_one_allocator_per_node_placed_on_its_node(ray_nodes: RayNodes, config: AllocatorConfig) -> None:
    handles = {node: get_node_allocator(node, config) for node in (ray_nodes.head, ray_nodes.other)}
    answers = {node: ping(h) for node, h in handles.items()}
    assert {node: a["node_id"] for node, a in answers.items() if a} == {n: n for n in handles}
    assert answers[ray_nodes.head]["pid"] != answers[ray_nodes.other]["pid"]  # type: ignore[index]
    # get_if_exists: asking again finds the same actor, by name, in the lowtail namespace
    again = get_node_allocator(ray_nodes.head, config)
    assert ping(again) == answers[ray_nodes.head]
    assert ray.get_actor(allocator_name(ray_nodes.head), namespace=NAMESPACE)._actor_id == again._actor_id


def test_a_caller_from_another_node_is_refused(ray_nodes: RayNodes, config: AllocatorConfig) -> None:
    other = get_node_allocator(ray_nodes.other, config)
    with pytest.raises(WrongNode, match=f"caller on node {ray_nodes.head} asked the lease allocator"):
        ray.get(other.acquire.remote("sample:x", caller_node=ray_nodes.head))
    assert ray.get(other.leases.remote()) == []


def test_lease_errors_cross_ray_as_their_own_class(ray_nodes: RayNodes, config: AllocatorConfig) -> None:
    alloc = get_node_allocator(ray_nodes.head, config)
    for i in range(4):
        ray.get(alloc.acquire.remote(f"sample:{i}", caller_node=ray_nodes.head))
    with pytest.raises(LeaseExhausted, match="'sample:4'"):
        ray.get(alloc.acquire.remote("sample:4", caller_node=ray_nodes.head))


def test_an_allocator_with_another_config_is_a_clear_error(
    ray_nodes: RayNodes, config: AllocatorConfig
) -> None:
    get_node_allocator(ray_nodes.head, config)
    with pytest.raises(AllocatorMismatch, match=r"share=1; asked for .* share=3"):
        get_node_allocator(ray_nodes.head, AllocatorConfig(state_dir=config.state_dir, share=3))


def test_a_killed_owner_actor_lease_is_reclaimed(ray_nodes: RayNodes, config: AllocatorConfig) -> None:
    alloc = get_node_allocator(ray_nodes.head, config)
    on_head = NodeAffinitySchedulingStrategy(ray_nodes.head, soft=False)
    owners = [Owner.options(scheduling_strategy=on_head).remote() for _ in range(2)]  # type: ignore[attr-defined]
    cpus = ray.get([o.take.remote(alloc, f"sample:h0:{i}") for i, o in enumerate(owners)])
    assert len(set(cpus)) == 2
    ray.kill(owners[0])
    # the allocator's own audit thread notices (pid gone / actor DEAD) without anyone asking
    assert wait_until(lambda: [x.owner for x in ray.get(alloc.leases.remote())] == ["sample:h0:1"])


def test_a_restarted_allocator_rebuilds_its_table_from_the_node_state(
    ray_nodes: RayNodes, config: AllocatorConfig
) -> None:
    alloc = get_node_allocator(ray_nodes.head, config)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        live = ray.get(alloc.acquire.remote("infer:0:0", caller_node=ray_nodes.head, pid=os.getpid()))
        ray.get(alloc.acquire.remote("sample:h0:0", caller_node=ray_nodes.head, pid=child.pid))
        before = ping(alloc)
        ray.get(alloc.shutdown.remote())  # no more ticks: the dead owner must be found by the rebuild
    finally:
        child.kill()
        child.wait()
    ray.kill(alloc, no_restart=False)  # the process dies; Ray restarts the actor (max_restarts=-1)
    assert wait_until(lambda: (p := ping(alloc, 2.0)) is not None and p["pid"] != before["pid"])  # type: ignore[index]
    assert [(x.owner, x.cpu) for x in ray.get(alloc.leases.remote())] == [("infer:0:0", live.cpu)]
    dropped = ray.get(alloc.dropped_on_start.remote())
    assert [(x.owner, why) for x, why in dropped] == [("sample:h0:0", "owner is dead")]


def test_an_allocator_constructor_failure_is_reported_as_that_failure_not_a_timeout(
    ray_nodes: RayNodes, tmp_path: Path
) -> None:
    # A plan whose isolated CPUs are not in this machine's cpuset: the constructor raises PoolMismatch.
    plan = tiny_plan(isolated="100-101", housekeeping="0", l3=("0,100-101",))
    cfg = AllocatorConfig(state_dir=str(tmp_path), plan=plan.to_dict())
    t0 = time.monotonic()
    with pytest.raises(AllocatorStartFailed, match=r"to start: lowtail.node.lease.PoolMismatch: .* 100-101 "):
        get_node_allocator(ray_nodes.head, cfg, timeout_s=120)
    assert time.monotonic() - t0 < 60  # reported as it happened, not after the answer timeout
    stop_node_allocator(ray_nodes.head)


def test_an_allocator_for_a_node_that_does_not_exist_is_unavailable_not_an_escaping_ray_error(
    ray_nodes: RayNodes, config: AllocatorConfig
) -> None:
    gone = "ab" * 28  # a well-formed node id no raylet has
    with pytest.raises(AllocatorUnavailable, match=f"cannot be placed on node {gone}"):
        get_node_allocator(gone, config, timeout_s=60)


def test_stopping_with_remove_state_leaves_no_directory(ray_nodes: RayNodes, tmp_path: Path) -> None:
    cfg = AllocatorConfig(
        state_dir=str(tmp_path / "leases-{node}"), plan=tiny_plan("1-4").to_dict(), cpuset_only=False
    )
    alloc = get_node_allocator(ray_nodes.head, cfg)
    ray.get(alloc.leases.remote())
    state = tmp_path / f"leases-{ray_nodes.head}"
    assert state.is_dir()
    assert stop_node_allocator(ray_nodes.head, remove_state=True)
    assert not state.exists()  # not even the empty directory
    kept = tmp_path / "kept-{node}"
    other = Path(str(kept).replace("{node}", ray_nodes.head))
    alloc = get_node_allocator(
        ray_nodes.head, AllocatorConfig(state_dir=str(kept), cpuset_only=False, plan=cfg.plan)
    )
    ray.get(alloc.leases.remote())
    (other / "operator-notes").write_text("mine\n")
    assert stop_node_allocator(ray_nodes.head, remove_state=True)
    assert (other / "operator-notes").exists()  # a directory with anything else in it stays
