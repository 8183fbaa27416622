"""Ray inference actors: a leased CPU, a NUMA-bound queue and a pinned OpenVINO worker per actor.

The predecessor system's isolated inference design, with its gaps closed:

- ``InferenceActor`` leases ``infer:<hero>:<actor>`` from its node's allocator, creates the queue bound
  to the leased CPU's NUMA node (the predecessor left page placement to first touch), spawns the pinned
  worker (``lowtail.serve.worker``), keeps its own threads off the worker's CPU (the predecessor's
  "release the main thread"), and publishes an ``Endpoint`` (``lowtail.actors.endpoint``) that carries
  its node id. A supervisor thread restarts a dead worker on the same queue: requests the dead worker
  held fail with ``WorkerDied``, later ones are served. ``shutdown()`` stops the worker, unlinks the
  queue and releases the lease.
- The sampler side is ``lowtail.actors.client`` (``InferenceClient``) and an example sampler actor is
  ``lowtail.actors.sampler``.

Production paths:

- Restarts: a killed inference actor is restarted by Ray (``max_actor_restarts``) with a new queue;
  clients re-resolve its endpoint by name.
- Ray's accounting: every lease holder (inference actor, sampler) requests the CPU it pins as one
  ``CPU`` and one ``lowtail_isolated_cpu`` (``1/share`` with the demo's shared CPUs), so Ray schedules
  nothing else onto leased cores; the allocator and metrics hub request none. Both kinds of actor move
  Ray's threads in their process off the leased CPU; Ray's daemons are kept off by the unit's
  ``CPUAffinity=`` (hosts) or the pod's housekeeping CPU (lowtail_k8s), not here.
- Placement: samplers and inference actors are placed with ``NodeAffinitySchedulingStrategy(node,
  soft=False)`` on the node whose inference actors they use.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import ray

from lowtail.actors.allocator import AllocatorConfig, get_node_allocator
from lowtail.actors.endpoint import (
    ACTOR_NAMESPACE,
    Endpoint,
)
from lowtail.actors.metrics import MetricsConfig, get_node_metrics
from lowtail.errors import LowtailError
from lowtail.lease import Lease

log = logging.getLogger(__name__)


class InferenceActorFailed(LowtailError, RuntimeError):
    """The inference actor could not start or keep its worker."""


@dataclass(frozen=True)
class InferenceSpec:
    """One inference actor: which model, which queue and worker settings, which allocator."""

    hero: str
    index: int
    model_dir: str
    allocator: AllocatorConfig = field(default_factory=AllocatorConfig)
    metrics: MetricsConfig | None = None  # None: no metrics hub
    queue: Any = None  # lowtail.shm.queue.QueueConfig (its numa_node is set from the lease)
    worker: Any = None  # lowtail.serve.worker.WorkerConfig
    ready_timeout_s: float = 120.0
    supervise_interval_s: float = 0.05
    metrics_interval_s: float = 1.0
    max_restarts_per_minute: int = 10  # of the worker, by this actor's supervisor
    max_actor_restarts: int = 5  # of this actor, by Ray (-1: forever); clients re-resolve its endpoint

    @property
    def owner(self) -> str:
        return f"infer:{self.hero}:{self.index}"

    @property
    def actor_name(self) -> str:
        return f"lowtail-infer-{self.hero}-{self.index}"


# A sampler's normal request, 8 heroes x 512 float32 features (16,384 B) plus its 64-byte header, goes
# inline in the slot; the queue's own default (16 KiB) would send every such request through an
# ndarray slot. Room is left for a small second input.
DEFAULT_REQUEST_BYTES = 20480


def default_queue_config() -> Any:
    """The queue an inference actor creates unless ``InferenceSpec.queue`` says otherwise."""
    from lowtail.shm.queue import QueueConfig

    return QueueConfig(request_bytes=DEFAULT_REQUEST_BYTES)


def keep_threads_off(cpu: int) -> frozenset[int]:
    """Move every thread of this process off ``cpu`` (if it may run elsewhere); returns the new mask.

    Ray's gRPC threads exist before any actor code runs; ``sched_setaffinity(0)`` moves only the calling
    thread, so every task id is set (section 4.5's level two, applied to all threads).
    """
    allowed = frozenset(os.sched_getaffinity(0)) - {cpu}
    if not allowed:
        return frozenset(os.sched_getaffinity(0))
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that just exited
            os.sched_setaffinity(int(tid), allowed)
    return allowed


def worker_series(rows: np.ndarray) -> dict[str, np.ndarray]:
    """Per-call worker rows (``lowtail.serve.metrics.CALL_FIELDS``) as the exported series."""
    from lowtail.serve.metrics import COL

    pick = {
        "infer_exec_ms": "engine_wall_ms",
        "infer_total_ms": "wall_ms",
        "engine_cpu_ms": "engine_cpu_ms",
        "engine_thread_cpu_ms": "engine_thread_cpu_ms",
        "deschedule_ms": "deschedule_ms",
        "run_delay_ms": "run_delay_ms",
        "queue_wait_ms": "queue_wait_ms",
        "batch_size": "batch",
    }
    return {name: rows[:, COL[col]].astype(np.float64) for name, col in pick.items()}


@ray.remote(num_cpus=0, max_restarts=0)
class InferenceActor:
    def __init__(self, spec: InferenceSpec) -> None:
        from lowtail.serve.worker import WorkerConfig
        from lowtail.shm.queue import InferenceQueue

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        ctx = ray.get_runtime_context()
        self._spec = spec
        self._node = ctx.get_node_id()
        if ctx.was_current_actor_reconstructed:
            # The previous incarnation died without unlinking its queue: sweep segments of dead owners.
            from lowtail.shm.segments import sweep_dead

            swept = sweep_dead()
            log.warning("%s: restarted by Ray; swept %d dead segments", spec.owner, len(swept))
        self._alloc = get_node_allocator(self._node, spec.allocator)
        self._lease: Lease = ray.get(
            self._alloc.acquire.remote(
                spec.owner, caller_node=self._node, pid=os.getpid(), actor_id=ctx.get_actor_id()
            )
        )
        self._lock = threading.Lock()
        self._queue: Any = None
        self._worker: Any = None
        self._restarts: list[float] = []
        self._failed: str | None = None
        self._cursor = 0
        self._metrics = None if spec.metrics is None else get_node_metrics(self._node, spec.metrics)
        try:
            qcfg = replace(spec.queue or default_queue_config(), numa_node=self._lease.node)
            self._queue = InferenceQueue.create(qcfg)
            self._worker_cfg = spec.worker or WorkerConfig(name=f"{spec.hero}.{spec.index}")
            self._start_worker()
            keep_threads_off(self._lease.cpu)
        except BaseException:
            self._teardown()
            raise
        self._stop = threading.Event()
        self._supervisor = threading.Thread(target=self._supervise, name="worker-supervisor", daemon=True)
        self._supervisor.start()

    # --- worker lifecycle (control plane) --------------------------------------------------------------

    def _start_worker(self) -> None:
        from lowtail.serve.worker import WorkerProcess

        worker = WorkerProcess.start(
            self._queue.descriptor, self._lease.cpu, self._spec.model_dir, self._worker_cfg
        )
        try:
            worker.wait_ready(self._spec.ready_timeout_s)
        except BaseException:
            worker.stop()
            raise
        self._worker = worker
        self._cursor = 0
        log.info("%s: worker pid %d serving on CPU %d", self._spec.owner, worker.pid, self._lease.cpu)

    def _supervise(self) -> None:
        last_push = time.monotonic()
        while not self._stop.wait(self._spec.supervise_interval_s):
            with self._lock:
                if self._worker is not None and not self._worker.alive() and self._failed is None:
                    self._restart_locked()
                if (
                    self._metrics is not None
                    and time.monotonic() - last_push >= self._spec.metrics_interval_s
                ):
                    last_push = time.monotonic()
                    self._push_metrics_locked()

    def _restart_locked(self) -> None:
        old = self._worker
        code = old.stop(timeout_s=0.5)
        self._push_metrics_locked()
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < 60.0] + [now]
        if len(self._restarts) > self._spec.max_restarts_per_minute:
            self._failed = (
                f"worker died {len(self._restarts)} times in a minute (last exit code {code}); not restarting"
            )
            log.error("%s: %s", self._spec.owner, self._failed)
            return
        log.warning("%s: worker pid %d died (exit code %s); restarting", self._spec.owner, old.pid, code)
        try:
            self._start_worker()
        except Exception as e:
            self._failed = f"worker restart failed: {e}"
            log.error("%s: %s", self._spec.owner, self._failed)

    def _push_metrics_locked(self) -> None:
        if self._metrics is None or self._worker is None:
            return
        try:
            batch = self._worker.calls(since=self._cursor)
        except RuntimeError:
            return  # stopped
        self._cursor = batch.cursor
        if batch.rows.shape[0]:
            self._metrics.push.remote(self._spec.owner, worker_series(batch.rows))

    def _teardown(self) -> None:
        if self._worker is not None:
            self._worker.stop()
            self._worker = None
        if self._queue is not None:
            self._queue.close()
            self._queue = None
        ray.get(self._alloc.release.remote(self._spec.owner, caller_node=self._node))

    # --- the actor's methods ---------------------------------------------------------------------------

    def endpoint(self) -> Endpoint:
        """Where to send requests; never a dead worker's (a client re-resolving after a crash may ask
        before the supervisor has noticed: restart it here, under the same lock)."""
        with self._lock:
            if self._worker is not None and not self._worker.alive() and self._failed is None:
                self._restart_locked()
            if self._failed is not None:
                raise InferenceActorFailed(f"{self._spec.owner}: {self._failed}")
            return Endpoint(
                actor=self._spec.actor_name,
                owner=self._spec.owner,
                node_id=self._node,
                cpu=self._lease.cpu,
                numa_node=self._lease.node,
                descriptor=self._queue.descriptor,
                worker_pid=self._worker.pid,
            )

    def ping(self) -> dict[str, Any]:
        return {"owner": self._spec.owner, "node_id": self._node, "pid": os.getpid()}

    def status(self) -> dict[str, Any]:
        with self._lock:
            w = self._worker
            return {
                "owner": self._spec.owner,
                "cpu": self._lease.cpu,
                "numa_node": self._lease.node,
                "worker_pid": None if w is None else w.pid,
                "worker_alive": w is not None and w.alive(),
                "restarts": len(self._restarts),
                "failed": self._failed,
                "actor_affinity": sorted(os.sched_getaffinity(0)),
                "ready": None if w is None else w.ready_info,
            }

    def report(self) -> dict[str, Any]:
        """The current worker's report (percentiles per field since it started) and its isolation check."""
        with self._lock:
            if self._worker is None:
                return {}
            self._push_metrics_locked()
            return {
                "report": self._worker.report().to_dict(),
                "isolation": self._worker.isolation().to_dict(),
                "restarts": len(self._restarts),
            }

    def queue_counts(self) -> dict[str, int]:
        """Slots per state (FREE/WRITING/READY/PROCESSING/DONE/ERROR), for diagnosis."""
        return dict(self._queue.snapshot().counts)

    def kill_worker(self, while_processing: bool = False, timeout_s: float = 10.0) -> int:
        """SIGKILL the worker, as a crash would (tests and drills); the supervisor restarts it.

        ``while_processing``: freeze the worker (SIGSTOP) until a request is seen PROCESSING, so the
        kill certainly lands mid-request.
        """
        with self._lock:
            pid = int(self._worker.pid)
            deadline = time.monotonic() + timeout_s
            while while_processing:
                os.kill(pid, signal.SIGSTOP)
                if self._queue.snapshot().counts.get("PROCESSING", 0) > 0:
                    break
                os.kill(pid, signal.SIGCONT)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no request was PROCESSING within {timeout_s} s")
                time.sleep(0.001)
            self._worker.kill()
            return pid

    def shutdown(self) -> None:
        """Stop the worker, unlink the queue, release the lease. Call before ``ray.kill``."""
        self._stop.set()
        self._supervisor.join(timeout=5)
        with self._lock:
            self._push_metrics_locked()
            self._teardown()


ISOLATED_RESOURCE = "lowtail_isolated_cpu"  # declared by lowtail-ray.service (--resources) per node


class NodeLacksResource(LowtailError, RuntimeError):
    """The target node does not declare the resource a lease holder must request (it would never start)."""


def lease_resources(allocator: AllocatorConfig, node_id: str) -> dict[str, Any]:
    """Ray options for an actor that holds a CPU lease: the CPU it pins, as Ray's scheduler sees it.

    One ``CPU`` and one ``lowtail_isolated_cpu`` per lease (``1/share`` of each with the demo's shared
    CPUs), so Ray places no other work on a leased core and its available resources show the leases.
    A node that does not declare the resource is refused here, not left pending forever.
    """
    amount = 1.0 / allocator.share
    for node in ray.nodes():  # type: ignore[no-untyped-call]
        if node["NodeID"] == node_id and node["Alive"]:
            declared = node["Resources"].get(ISOLATED_RESOURCE, 0.0)
            if declared < amount:
                raise NodeLacksResource(
                    f"node {node_id} declares {ISOLATED_RESOURCE}={declared}, a lease needs {amount:g}: "
                    f"start Ray with --resources='{{\"{ISOLATED_RESOURCE}\": N}}' (N = isolated CPUs; "
                    "lowtail-ray.service and the lowtail_k8s RayCluster do)"
                )
            break
    return {"num_cpus": amount, "resources": {ISOLATED_RESOURCE: amount}}


START_TIMEOUT_S = 120.0  # to be scheduled and constructed, besides the worker's own ready timeout


def await_started(handle: Any, method: Any, what: str, node: str, timeout_s: float) -> None:
    """Wait for a new actor's first answer: a failed constructor raises here with its cause, and an actor
    Ray cannot place (its node's CPU or lowtail_isolated_cpu all taken) is killed and reported instead
    of left pending forever."""
    try:
        ray.get(method.remote(), timeout=timeout_s)
    except ray.exceptions.GetTimeoutError:
        ray.kill(handle, no_restart=True)
        everything: dict[str, float] = ray.available_resources()  # type: ignore[no-untyped-call]
        free = {k: v for k, v in everything.items() if k in ("CPU", ISOLATED_RESOURCE)}
        raise InferenceActorFailed(
            f"{what} on node {node} did not start within {timeout_s:.0f} s; Ray's free resources "
            f"(cluster) {free}: is every CPU or {ISOLATED_RESOURCE} of the node leased?"
        ) from None


def start_inference_actor(spec: InferenceSpec, node_id: str | None = None) -> Any:
    """Create an inference actor on ``node_id`` (default: this node); returns its handle once it serves."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = node_id or ray.get_runtime_context().get_node_id()
    handle = InferenceActor.options(  # type: ignore[attr-defined]
        name=spec.actor_name,
        max_restarts=spec.max_actor_restarts,
        **lease_resources(spec.allocator, node),
        namespace=ACTOR_NAMESPACE,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
    ).remote(spec)
    await_started(handle, handle.ping, spec.actor_name, node, START_TIMEOUT_S + spec.ready_timeout_s)
    return handle


def stop_actor(handle: Any, timeout_s: float = 30.0) -> None:
    """Graceful shutdown (releases what the actor holds), then kill the actor process."""
    with contextlib.suppress(ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
        ray.get(handle.shutdown.remote(), timeout=timeout_s)
    ray.kill(handle, no_restart=True)
