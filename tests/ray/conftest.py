"""One Ray instance for the test session's Ray tests: a two-node cluster on this machine.

``ray.cluster_utils.Cluster`` starts two raylets with distinct node ids (~5 s), so per-node placement
and the one-allocator-per-node rule are tested without real hosts. The driver runs on the head node.
Token authentication (on by default for local clusters in Ray 2.60) is turned off: nothing here
listens beyond this machine and the tests must not depend on a token file.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from lowtail.actors.allocator import AllocatorConfig

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


@dataclass(frozen=True)
class RayNodes:
    head: str  # the driver's node id
    other: str  # the second raylet's node id


# Package scope: started by the first test here, stopped after the last one, so the raylets do not idle
# through the rest of the session.
@pytest.fixture(scope="package")
def ray_nodes() -> Iterator[RayNodes]:
    import ray
    from ray.cluster_utils import Cluster

    # Ray's sockets live under its temp dir (a unix socket path is limited to 107 bytes): keep it short,
    # and remove it afterwards so the session leaves no /tmp/ray behind. RAY_TMPDIR (rather than
    # temp_dir=) also moves the cluster-address file that Cluster writes.
    temp_dir = tempfile.mkdtemp(prefix="lt-ray-")
    os.environ["RAY_TMPDIR"] = temp_dir
    # Each node declares lowtail_isolated_cpu as lowtail-ray.service does (--resources).
    res = {"lowtail_isolated_cpu": 4}
    cluster = Cluster(
        initialize_head=True, head_node_args={"num_cpus": 4, "resources": res, "include_dashboard": False}
    )
    cluster.add_node(num_cpus=4, resources=res)
    ray.init(address=cluster.address, log_to_driver=False, namespace="lowtail-tests")
    cluster.wait_for_nodes()
    head = ray.get_runtime_context().get_node_id()
    others = [n["NodeID"] for n in ray.nodes() if n["Alive"] and n["NodeID"] != head]
    assert len(others) == 1
    try:
        yield RayNodes(head=head, other=others[0])
    finally:
        ray.shutdown()
        cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        del os.environ["RAY_TMPDIR"]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from lowtail.serve.model import write_model
    from tests.runtime.conftest import SMALL_SPEC

    out = tmp_path_factory.mktemp("model")
    write_model(out, SMALL_SPEC)
    return out


@pytest.fixture
def alloc_cfg(tmp_path: Path, ray_nodes: RayNodes) -> Iterator[AllocatorConfig]:
    """Allocators for this test, stopped after it. This machine isolates one CPU (plan: housekeeping 0,
    isolated 1), so it runs with the demo override (pool 0-1, shared CPUs) unless 4 are isolated."""
    from lowtail.actors.allocator import AllocatorConfig, stop_node_allocator
    from lowtail.lease import node_plan

    plan = node_plan()
    cfg = AllocatorConfig(
        state_dir=str(tmp_path / "leases-{node}"),  # two raylets on one host: a table per node
        plan=plan.to_dict(),
        pool=None if len(plan.isolated) >= 4 else "0-1",  # the demo override on a small machine
        share=1 if len(plan.isolated) >= 4 else 8,
        reclaim_interval_s=0.2,
    )
    yield cfg
    for node in (ray_nodes.head, ray_nodes.other):
        stop_node_allocator(node)
