"""The per-node lease allocator as a Ray actor, and how owners reach it.

One named, detached Ray actor per node: named from the node id, ``lifetime="detached"``, created with
``get_if_exists=True`` and placed with ``NodeAffinitySchedulingStrategy(node_id, soft=False)``, so every
process on a node finds the same one and no node ever borrows another's. It restarts itself
(``max_restarts=-1``) and a restarted allocator rebuilds its table from the node's state file
(``lease.LeaseAllocator``), dropping owners that died meanwhile.

An owner is reclaimed when its process is gone (pid and start time, ``lease.pid_alive``): owners are
processes on this node and a Ray actor is its own worker process, which Ray ends when the actor dies,
so no per-lease query of Ray's GCS is needed (its public state API needs the dashboard, which lowtail
nodes run without). Leases are node-local: an allocator refuses a caller from another node with a
clear error.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import ray
from ray.exceptions import ActorUnschedulableError, GetTimeoutError, RayActorError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from lowtail.node import cpulist
from lowtail.node.cpuset import cgroup_cpuset
from lowtail.node.lease import (
    DEFAULT_STATE_DIR,
    Lease,
    LeaseAllocator,
    LeaseError,
    locate_plan,
    pid_alive,
)
from lowtail.node.plan import Plan

NAMESPACE = "lowtail"
log = logging.getLogger(__name__)


class AllocatorUnavailable(LeaseError):
    """The node's allocator actor did not answer a ping in time, or is dead."""


class AllocatorStartFailed(LeaseError):
    """The node's allocator raised in its constructor; the message carries that error."""


class WrongNode(LeaseError):
    """A lease asked of another node's allocator: CPUs and shared memory are node-local."""


class AllocatorMismatch(LeaseError):
    """The node's allocator already runs with a different pool/share than this caller asked for."""


def allocator_name(node_id: str) -> str:
    return f"lowtail-lease-{node_id}"


@dataclass(frozen=True)
class AllocatorConfig:
    """What a node allocator is created with; ``pool``/``share`` are the demo-only overrides."""

    # "{node}" in the path becomes the node id: several raylets on one host (ray.cluster_utils.Cluster
    # in tests) then keep separate tables, as separate hosts would.
    state_dir: str = str(DEFAULT_STATE_DIR)
    plan: dict[str, Any] | None = None  # None: the node's plan (lease.node_plan)
    pool: str | None = None  # a cpulist replacing the plan's isolated CPUs (demo only)
    share: int = 1  # owners per CPU (demo only)
    audit_interval_s: float = 30.0
    reclaim_interval_s: float = 2.0
    # Lease only CPUs in the allocator's cgroup cpuset (the pod's cpuset, the host's otherwise): never its
    # affinity mask, which lowtail-ray.service narrows to the housekeeping CPUs (CPUAffinity=), while the
    # pinned worker may still move onto any CPU of the cpuset. Off only for plans that describe another
    # machine (tests): the allocator pins nothing itself.
    cpuset_only: bool = True


def build_allocator(
    node_id: str, config: AllocatorConfig, *, proc_root: str = "/proc/self", fs_root: str = "/"
) -> LeaseAllocator:
    """The allocator a ``NodeLeaseActor`` on ``node_id`` runs: its plan, and its pool cut to the cgroup's
    cpuset (not this process's affinity mask). The roots point at a pod-like fixture tree in tests."""
    if config.plan is not None:
        plan, plan_source = Plan.from_dict(config.plan), "plan given in AllocatorConfig"
    else:
        plan, plan_source = locate_plan()
    allowed: frozenset[int] | None = None
    source = "no cpuset restriction"
    if config.cpuset_only:
        cpuset = cgroup_cpuset(proc_root, fs_root)
        if cpuset is None:
            log.warning("no cgroup cpuset visible: leasing from the whole plan (%s)", plan_source)
        else:
            allowed, source = cpuset.cpus, f"cgroup cpuset {cpuset.source}"
    log.info("node %s: plan from %s; allowed CPUs from %s", node_id, plan_source, source)
    return LeaseAllocator(
        plan,
        state_dir=config.state_dir.replace("{node}", node_id),
        pool=None if config.pool is None else cpulist.parse(config.pool),
        allowed=allowed,
        allowed_source=f"{source}; plan from {plan_source}",
        share=config.share,
        alive=pid_alive,
        audit_interval_s=config.audit_interval_s,
    )


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=0)
class NodeLeaseActor:
    """A ``LeaseAllocator`` on its node, plus a thread that reclaims dead owners and logs the audit line."""

    def __init__(self, node_id: str, config: AllocatorConfig) -> None:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        here = ray.get_runtime_context().get_node_id()
        if here != node_id:
            raise WrongNode(f"allocator for node {node_id} was placed on node {here}")
        self._node_id = node_id
        self._config = config
        self._alloc = build_allocator(node_id, config)
        self._stop = threading.Event()
        self._ticker = threading.Thread(target=self._tick_loop, name="lease-audit", daemon=True)
        self._ticker.start()
        log.info("allocator on node %s: %s", node_id, self._alloc.audit_line())

    def _tick_loop(self) -> None:
        while not self._stop.wait(self._config.reclaim_interval_s):
            try:
                self._alloc.tick()
            except Exception:  # keep auditing whatever one tick hit
                log.exception("lease audit tick failed")

    def _check_node(self, caller_node: str | None) -> None:
        if caller_node is not None and caller_node != self._node_id:
            raise WrongNode(
                f"caller on node {caller_node} asked the lease allocator of node {self._node_id}: "
                "CPU leases are node-local; use get_node_allocator() on the caller's own node"
            )

    def ping(self) -> dict[str, Any]:
        return {"node_id": self._node_id, "pid": os.getpid(), "pool": cpulist.format(self._alloc.pool)}

    def config(self) -> AllocatorConfig:
        return self._config

    def acquire(
        self,
        owner: str,
        *,
        caller_node: str | None = None,
        near_cpu: int | None = None,
        near_node: int | None = None,
        pid: int | None = None,
        actor_id: str | None = None,
    ) -> Lease:
        self._check_node(caller_node)
        return self._alloc.acquire(owner, near_cpu=near_cpu, near_node=near_node, pid=pid, actor_id=actor_id)

    def release(self, owner: str, *, caller_node: str | None = None) -> Lease | None:
        self._check_node(caller_node)
        return self._alloc.release(owner)

    def reclaim(self) -> list[Lease]:
        return self._alloc.reclaim()

    def leases(self) -> list[Lease]:
        return self._alloc.leases()

    def audit_line(self) -> str:
        return self._alloc.audit_line()

    def describe(self) -> dict[str, Any]:
        return {"node_id": self._node_id, **self._alloc.describe()}

    def dropped_on_start(self) -> list[tuple[Lease, str]]:
        return self._alloc.dropped_on_start

    def shutdown(self) -> None:
        """Stop the audit thread; the caller then kills the actor (its table stays on the node)."""
        self._stop.set()


def get_node_allocator(
    node_id: str | None = None, config: AllocatorConfig | None = None, *, timeout_s: float = 60.0
) -> Any:
    """The allocator actor of ``node_id`` (default: this process's node), created on first use.

    Raises ``AllocatorMismatch`` when it already runs with another pool/share/state dir than ``config``,
    and ``AllocatorUnavailable`` when it does not answer within ``timeout_s``.
    """
    node = node_id or ray.get_runtime_context().get_node_id()
    cfg = config or AllocatorConfig()
    handle = NodeLeaseActor.options(  # type: ignore[attr-defined]
        name=allocator_name(node),
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
    ).remote(node, cfg)
    try:
        running: AllocatorConfig = ray.get(handle.config.remote(), timeout=timeout_s)
    except GetTimeoutError:
        raise AllocatorUnavailable(
            f"lease allocator {allocator_name(node)} did not answer within {timeout_s:.0f} s "
            "(is the node overloaded, or its raylet gone?)"
        ) from None
    except ActorUnschedulableError as e:
        raise AllocatorUnavailable(
            f"lease allocator {allocator_name(node)} cannot be placed on node {node}: {e}"
        ) from None
    except RayActorError as e:
        # The constructor's own exception (PoolMismatch, PlanNotFound, ...) is in the message: say that,
        # not "no answer".
        raise AllocatorStartFailed(
            f"lease allocator {allocator_name(node)} failed to start: {creation_error(e)}"
        ) from None
    mine = (cfg.state_dir, cfg.pool, cfg.share, cfg.plan)
    theirs = (running.state_dir, running.pool, running.share, running.plan)
    if mine != theirs:
        raise AllocatorMismatch(
            f"allocator {allocator_name(node)} runs with state_dir={running.state_dir} pool={running.pool} "
            f"share={running.share}; asked for state_dir={cfg.state_dir} pool={cfg.pool} share={cfg.share}"
            " (stop it with stop_node_allocator() first)"
        )
    return handle


def creation_error(e: BaseException) -> str:
    """The exception line of an actor's failed constructor (Ray wraps it in a colored traceback)."""
    text = re.sub(r"\x1b\[[0-9;]*m", "", str(e))
    lines = [line for line in text.splitlines() if line.strip() and not line.startswith((" ", "\t"))]
    return lines[-1] if lines else text


def ping(handle: Any, timeout_s: float = 5.0) -> dict[str, Any] | None:
    """The allocator's ping answer, or None when it is dead or does not answer in time."""
    try:
        answer: dict[str, Any] = ray.get(handle.ping.remote(), timeout=timeout_s)
    except (GetTimeoutError, RayActorError):
        return None
    return answer


def stop_node_allocator(node_id: str | None = None, *, remove_state: bool = False) -> bool:
    """Kill the node's allocator for good (tests, demo teardown). Returns whether one was running.

    The state file stays unless ``remove_state``: leases of live owners outlive an allocator.
    """
    node = node_id or ray.get_runtime_context().get_node_id()
    try:
        handle: Any = ray.get_actor(allocator_name(node), namespace=NAMESPACE)
    except ValueError:
        return False
    state_dir: str | None = None
    try:
        running: AllocatorConfig = ray.get(handle.config.remote(), timeout=10)
        state_dir = running.state_dir.replace("{node}", node)
        ray.get(handle.shutdown.remote(), timeout=10)
    except (GetTimeoutError, RayActorError):
        pass
    ray.kill(handle, no_restart=True)
    if remove_state and state_dir is not None:
        for name in ("leases.json", "leases.lock"):
            Path(state_dir, name).unlink(missing_ok=True)
        with contextlib.suppress(OSError):  # only if empty: anything else in it is someone else's
            Path(state_dir).rmdir()
    return True
