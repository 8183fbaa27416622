"""Ray inference actors, the sampler-side client, and an example sampler actor.

The seed's isolated design (section 3.1), with its gaps closed:

- ``InferenceActor`` leases ``infer:<hero>:<actor>`` from its node's allocator, creates the queue bound
  to the leased CPU's NUMA node (the seed left page placement to first touch), spawns the pinned worker
  (``lowtail.serve.worker``), keeps its own threads off the worker's CPU (the seed's "release the main
  thread"), and publishes an ``Endpoint`` that carries its node id. A supervisor thread restarts a dead
  worker on the same queue: requests the dead worker held fail with ``WorkerDied``, later ones are served.
  ``shutdown()`` stops the worker, unlinks the queue and releases the lease.
- ``InferenceClient`` attaches once to the queues of several inference actors **on its own node** and
  spreads calls over them round robin, synchronously (``infer``) or in two phases (``start`` then
  ``finish``, the seed's ``infer_batch_async_start/finish``). An endpoint on another node is refused
  before anything is attached: shared memory does not cross nodes, and waiting on it would hang.
- ``SamplerActor`` leases a ``sample:`` CPU near its inference actors, pins the thread that runs its
  environment and client to it, and steps a synthetic environment with the policy's actions.

Production paths:

- Restarts: a killed worker fails only the requests it had claimed (``WorkerDied``; unclaimed ones are
  served by the restarted worker); a killed inference actor is restarted by Ray (``max_actor_restarts``)
  with a new queue, and every request left on the old one fails (``WorkerDied`` or ``RequestLost``).
  Clients then re-resolve the named actor's endpoint by themselves, backing off while it is down
  (``EndpointDown`` carries the wait); samplers sleep that long, never spin.
- Ray's accounting: every lease holder (inference actor, sampler) requests the CPU it pins as one
  ``CPU`` and one ``lowtail_isolated_cpu`` (``1/share`` with the demo's shared CPUs), so Ray schedules
  nothing else onto leased cores; the allocator and metrics hub request none. Both kinds of actor move
  Ray's threads in their process off the leased CPU; Ray's daemons are kept off by the unit's
  ``CPUAffinity=`` (hosts) or the pod's housekeeping CPU (lowtail_k8s), not here.
- Placement: samplers and inference actors are placed with ``NodeAffinitySchedulingStrategy(node,
  soft=False)`` on the node whose inference actors they use (``start_sampler`` takes the endpoints'
  node); a client refuses endpoints of another node (``CrossNodeAttach``).
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import signal
import threading
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, cast

import numpy as np
import ray

from lowtail.actors.allocator import AllocatorConfig, get_node_allocator
from lowtail.actors.metrics import MetricsConfig, get_node_metrics
from lowtail.errors import LowtailError
from lowtail.lease import Lease, process_start_time

log = logging.getLogger(__name__)


class CrossNodeAttach(LowtailError, RuntimeError):
    """A client asked to use an inference actor on another node (shared memory is node-local)."""


class NoEndpoints(LowtailError, ValueError):
    """A client was given no inference actors to talk to."""


class InferenceActorFailed(LowtailError, RuntimeError):
    """The inference actor could not start or keep its worker."""


class EndpointDown(LowtailError, RuntimeError):
    """No inference actor of this client can take a request now; nothing was submitted.

    ``retry_in_s`` is when the next re-resolve attempt is due (the back-off): sleep, do not spin.
    """

    def __init__(self, message: str, retry_in_s: float) -> None:
        super().__init__(message)
        self.retry_in_s = retry_in_s


ACTOR_NAMESPACE = "lowtail"


@dataclass(frozen=True)
class Endpoint:
    """What a sampler needs to reach one inference actor: published by the actor, small and picklable."""

    actor: str
    owner: str  # the lease owner, infer:<hero>:<index>
    node_id: str
    cpu: int
    numa_node: int
    descriptor: Any  # lowtail.shm.queue.QueueDescriptor
    worker_pid: int


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


# --- the sampler side -----------------------------------------------------------------------------------


@dataclass
class PendingInference:
    """Phase one's handle: finish it (phase two) to get the outputs."""

    target: int
    pending: Any  # lowtail.shm.queue.Pending
    t0_ns: int
    samples: int


@dataclass
class _Target:
    """One inference actor as this client sees it: its queue attachment, or why and until when not."""

    endpoint: Endpoint
    client: Any = None  # lowtail.shm.queue.QueueClient; None while broken
    in_flight: int = 0  # requests started on ``client`` and not finished
    broken: str | None = None  # why the attachment was given up
    retry_at: float = 0.0  # monotonic time of the next re-resolve attempt
    backoff_s: float = 0.0
    owner: tuple[int, int | None] = (0, None)  # the queue's creator (the actor): pid, start time


def queue_owner(ep: Endpoint) -> tuple[int, int | None]:
    """The process that created ``ep``'s queue (its inference actor) and its start time."""
    from lowtail.shm.segments import parse_name

    parts = parse_name(ep.descriptor.path.name)
    pid = 0 if parts is None else parts.pid
    return pid, process_start_time(pid) if pid else None


class RequestLost(LowtailError, RuntimeError):
    """A request's queue lost its inference actor: no worker will ever answer it (the actor restarts
    with a new queue, which the client re-resolves)."""


# Errors after which an attachment is given up and the endpoint re-resolved: the worker (or the actor
# and its queue) is gone. A timeout is not one of them: the request stays in flight.
_LOST = ("WorkerDied", "SegmentNotFound", "LaneBusy", "RequestLost")
ORPHAN_CHECK_S = 0.25


class InferenceClient:
    """Round robin over the inference actors of this node, sync or two-phase.

    Survives restarts: when a worker or its inference actor dies, the requests it held fail (``WorkerDied``
    and friends, one per request in flight), and the attachment is given up once its last request is
    finished. The next call re-resolves the endpoint from the named actor (``ray.get_actor``; a restarting
    actor answers once it serves again) and attaches afresh. While no actor can be reached, calls raise
    ``EndpointDown`` before submitting anything, carrying how long to wait: attempts back off
    exponentially (``backoff_s`` doubling up to ``max_backoff_s``), never a busy loop.

    Records each request's round trip (``rpc_elapsed_ms``) for the metrics export; ``take_window()``
    hands them over and starts a new window.
    """

    def __init__(
        self,
        endpoints: Sequence[Endpoint],
        *,
        node_id: str | None = None,
        timeout_s: float = 2.0,
        resolve_timeout_s: float = 10.0,
        backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
    ) -> None:
        if not endpoints:
            raise NoEndpoints("no inference endpoints: expected at least one Endpoint on this node")
        self.node_id = node_id or ray.get_runtime_context().get_node_id()
        check_same_node(endpoints, self.node_id)
        self.timeout_s = timeout_s
        self.resolve_timeout_s = resolve_timeout_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self._targets = [_Target(ep) for ep in endpoints]
        try:
            for t in self._targets:
                self._attach(t, t.endpoint)
        except BaseException:
            self.close()
            raise
        self._order = itertools.cycle(range(len(self._targets)))
        self._rpc_ms: list[float] = []
        self._samples = 0
        self.requests = 0
        self.total_samples = 0
        self.reattached = 0

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        return tuple(t.endpoint for t in self._targets)

    @classmethod
    def from_actors(cls, handles: Sequence[Any], **kwargs: Any) -> InferenceClient:
        return cls(ray.get([h.endpoint.remote() for h in handles]), **kwargs)

    # --- attachments (control plane) --------------------------------------------------------------------

    def _attach(self, t: _Target, ep: Endpoint) -> None:
        from lowtail.shm.queue import QueueClient

        t.client = QueueClient.attach(ep.descriptor)
        t.endpoint, t.broken, t.backoff_s, t.in_flight = ep, None, 0.0, 0
        t.owner = queue_owner(ep)

    def _orphaned(self, t: _Target) -> bool:
        """The queue's creator is gone: its worker exits too and no new one will attach."""
        pid, start = t.owner
        return bool(pid) and (start is None or process_start_time(pid) != start)

    def _lose(self, t: _Target, error: BaseException) -> None:
        """Give up ``t``'s attachment (now, or when its last request in flight is finished)."""
        if t.broken is None:
            t.broken = f"{type(error).__name__}: {error}"
            t.retry_at = time.monotonic()  # the first re-resolve is immediate; later ones back off
            log.warning("%s: lost (%s); re-resolving its endpoint", t.endpoint.actor, t.broken)
        if t.in_flight == 0 and t.client is not None:
            t.client.close()
            t.client = None

    def _resolve(self, t: _Target) -> bool:
        """Re-resolve a broken target's endpoint and attach; on failure schedule the next attempt."""
        try:
            handle = ray.get_actor(t.endpoint.actor, namespace=ACTOR_NAMESPACE)
            ep = cast(Endpoint, ray.get(handle.endpoint.remote(), timeout=self.resolve_timeout_s))
            check_same_node([ep], self.node_id)
            self._attach(t, ep)
        except (ValueError, ray.exceptions.RayError, LowtailError) as e:
            # ValueError: the name is not registered (yet); RayError: dead, restarting, or too slow.
            t.backoff_s = min(self.max_backoff_s, max(self.backoff_s, 2 * t.backoff_s))
            t.retry_at = time.monotonic() + t.backoff_s
            t.broken = f"{t.broken}; re-resolve failed ({type(e).__name__}: {e})"[-2000:]
            return False
        self.reattached += 1
        log.info("%s: re-attached (worker pid %d)", ep.actor, ep.worker_pid)
        return True

    def _next_target(self) -> int:
        """The next live target in turn, re-resolving broken ones that are due; else ``EndpointDown``."""
        now = time.monotonic()
        for _ in range(len(self._targets)):
            i = next(self._order)
            t = self._targets[i]
            if t.broken is None:
                return i
            if t.client is None and now >= t.retry_at and self._resolve(t):
                return i
        due = min(t.retry_at for t in self._targets) - time.monotonic()
        why = "; ".join(f"{t.endpoint.actor}: {t.broken}" for t in self._targets)
        raise EndpointDown(
            f"no inference actor reachable: {why}",
            retry_in_s=max(due, self.backoff_s),
        )

    # --- requests -------------------------------------------------------------------------------------

    def _record(self, t0_ns: int, samples: int) -> None:
        self._rpc_ms.append((time.perf_counter_ns() - t0_ns) / 1e6)
        self._samples += samples
        self.requests += 1
        self.total_samples += samples

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Synchronous: the next actor in turn serves this batch."""
        return self.finish(self.start(inputs))

    def start(self, inputs: Mapping[str, np.ndarray]) -> PendingInference:
        """Phase one: publish the batch to the next actor in turn and return at once."""
        from lowtail.shm.queue import QueueError

        i = self._next_target()
        t = self._targets[i]
        t0 = time.perf_counter_ns()
        try:
            pending = t.client.start(dict(inputs))
        except QueueError as e:
            if type(e).__name__ in _LOST:
                self._lose(t, e)
                raise EndpointDown(f"{t.endpoint.actor}: {e}", retry_in_s=self.backoff_s) from e
            raise
        t.in_flight += 1
        return PendingInference(i, pending, t0, len(next(iter(inputs.values()))))

    def finish(self, p: PendingInference, timeout_s: float | None = None) -> dict[str, np.ndarray]:
        """Phase two: wait for that batch's outputs.

        A request the dead worker had claimed fails (``WorkerDied``); one not yet claimed waits for the
        restarted worker, unless the queue's inference actor is gone (``RequestLost``, checked every
        ``ORPHAN_CHECK_S`` of waiting: past a normal round trip, so never on the hot path).
        """
        from lowtail.shm.queue import QueueError, QueueTimeout

        t = self._targets[p.target]
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        try:
            while True:
                left = deadline - time.monotonic()
                try:
                    out: dict[str, np.ndarray] = p.pending.finish(
                        timeout_s=max(0.0, min(left, ORPHAN_CHECK_S))
                    )
                    break
                except QueueTimeout:
                    if self._orphaned(t):
                        raise RequestLost(
                            f"{t.endpoint.actor}: its actor (pid {t.owner[0]}) is gone with its queue "
                            f"{t.endpoint.descriptor.name}; this request will not be answered"
                        ) from None
                    if left <= ORPHAN_CHECK_S:
                        raise  # still in flight: the caller may wait again
        except QueueTimeout:
            raise
        except (QueueError, RequestLost) as e:
            t.in_flight -= 1
            if type(e).__name__ in _LOST or t.broken is not None:
                self._lose(t, e)
            raise
        t.in_flight -= 1
        if t.broken is not None:
            self._lose(t, RuntimeError(t.broken))  # its last answer taken: drop the old attachment
        self._record(p.t0_ns, p.samples)
        return out

    def abandon(self, p: PendingInference) -> None:
        """Nobody will wait for ``p`` any more (given up after ``QueueTimeout``).

        Its slot returns to the queue once the worker answers or fences it, and it stops counting as in
        flight: otherwise a lost attachment is never dropped and the client never re-resolves.
        """
        t = self._targets[p.target]
        if t.client is None or p.pending.client is not t.client:
            return  # that attachment is already gone (or replaced): nothing of it is counted
        if p.pending.ticket.consumed:
            return
        t.client.abandon(p.pending.ticket)
        t.in_flight -= 1
        if t.broken is not None:
            self._lose(t, RuntimeError(t.broken))

    def take_window(self) -> tuple[list[float], int]:
        """Round trips (ms) and samples since the last call."""
        rpc, self._rpc_ms = self._rpc_ms, []
        samples, self._samples = self._samples, 0
        return rpc, samples

    def close(self) -> None:
        for t in self._targets:
            if t.client is not None:
                t.client.close()
                t.client = None

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_same_node(endpoints: Sequence[Endpoint], here: str) -> None:
    """Refuse endpoints of another node before anything is attached (waiting on them would hang)."""
    remote = [ep for ep in endpoints if ep.node_id != here]
    if remote:
        names = ", ".join(f"{ep.actor} (node {ep.node_id})" for ep in remote)
        raise CrossNodeAttach(
            f"inference endpoints {names} are not on this node ({here}): shared-memory queues are "
            "node-local; place samplers with their inference actors (NodeAffinitySchedulingStrategy) "
            "and pass only the endpoints of their own node"
        )


@dataclass(frozen=True)
class EnvSpec:
    """A synthetic MOBA environment: ``heroes`` observations of ``features`` per step."""

    features: int = 512
    heroes: int = 8
    step_us: int = 200  # CPU time one environment step burns (the game simulation)
    seed: int = 0


class SyntheticEnv:
    """Deterministic stand-in for a game: the next observation depends on the chosen actions."""

    def __init__(self, spec: EnvSpec) -> None:
        self.spec = spec
        self._rng = np.random.default_rng(spec.seed)
        self.obs = self._rng.standard_normal((spec.heroes, spec.features), dtype=np.float32)
        self.steps = 0

    def step(self, outputs: Mapping[str, np.ndarray]) -> np.ndarray:
        deadline = time.thread_time_ns() + self.spec.step_us * 1000
        heads = [v for k, v in sorted(outputs.items()) if v.ndim == 2 and v.shape[1] > 1]
        actions = np.stack([h.argmax(axis=1) for h in heads], axis=1) if heads else np.zeros((1, 1))
        drift = np.resize(actions.astype(np.float32), self.obs.shape) / 16.0
        noise = self._rng.standard_normal(self.obs.shape, dtype=np.float32)
        while time.thread_time_ns() < deadline:  # the simulation's own CPU work
            noise = np.tanh(noise)
        self.obs = (0.9 * self.obs + 0.1 * drift + 0.05 * noise).astype(np.float32)
        self.steps += 1
        return self.obs


@dataclass(frozen=True)
class SamplerSpec:
    name: str
    env: EnvSpec = field(default_factory=EnvSpec)
    allocator: AllocatorConfig = field(default_factory=AllocatorConfig)
    metrics: MetricsConfig | None = None
    pin: bool = True
    timeout_s: float = 2.0


@dataclass
class SamplerResult:
    name: str
    cpu: int
    mode: str
    seconds: float
    steps: int
    samples: int
    errors: dict[str, int] = field(default_factory=dict)  # failed requests by error class
    waits: int = 0  # times no inference actor was reachable and the sampler backed off
    reattached: int = 0  # endpoints re-resolved after a worker or actor restart
    recovery_s: list[float] = field(default_factory=list)  # each outage: first failure to next answer
    rpc_ms: list[float] = field(default_factory=list)


@ray.remote(num_cpus=0, max_restarts=0)
class SamplerActor:
    def __init__(self, spec: SamplerSpec, endpoints: Sequence[Endpoint]) -> None:
        ctx = ray.get_runtime_context()
        self._spec = spec
        self._node = ctx.get_node_id()
        self._owner = f"sample:{spec.name}"
        self._alloc = get_node_allocator(self._node, spec.allocator)
        near = endpoints[0].cpu if endpoints else None
        self._lease: Lease = ray.get(
            self._alloc.acquire.remote(
                self._owner,
                caller_node=self._node,
                near_cpu=near,
                pid=os.getpid(),
                actor_id=ctx.get_actor_id(),
            )
        )
        try:
            if spec.pin:
                # Ray's own threads of this process off the leased CPU, then the thread that runs the
                # actor's methods (the main thread, for a non-threaded actor) onto it.
                keep_threads_off(self._lease.cpu)
                os.sched_setaffinity(0, {self._lease.cpu})
            self._client = InferenceClient(endpoints, node_id=self._node, timeout_s=spec.timeout_s)
        except BaseException:
            ray.get(self._alloc.release.remote(self._owner, caller_node=self._node))
            raise
        self._metrics = None if spec.metrics is None else get_node_metrics(self._node, spec.metrics)
        self._env = SyntheticEnv(spec.env)

    def lease(self) -> Lease:
        return self._lease

    def affinity(self) -> list[int]:
        return sorted(os.sched_getaffinity(0))

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._client.infer(inputs)

    def infer_many(
        self, batches: list[dict[str, np.ndarray]], two_phase: bool
    ) -> list[dict[str, np.ndarray]]:
        """Serve several batches at once: all started, then all finished (two-phase) or one by one."""
        if not two_phase:
            return [self._client.infer(b) for b in batches]
        pending = [self._client.start(b) for b in batches]
        return [self._client.finish(p) for p in pending]

    def run(
        self, seconds: float, mode: str = "async", depth: int = 2, push_interval_s: float = 1.0
    ) -> SamplerResult:
        """Step the environment for ``seconds``: ``sync`` (infer, step) or ``async`` (two-phase with
        ``depth`` games in flight, their requests spread round robin over the inference actors)."""
        from lowtail.shm.queue import QueueError, QueueTimeout

        if mode not in ("sync", "async"):
            raise ValueError(f"mode {mode!r}: expected 'sync' or 'async'")
        envs = [self._env] + [
            SyntheticEnv(replace(self._spec.env, seed=self._spec.env.seed + k)) for k in range(1, depth)
        ]
        if mode == "sync":
            envs = envs[:1]
        result = SamplerResult(self._spec.name, self._lease.cpu, mode, 0.0, 0, 0)
        t_end = time.monotonic() + seconds
        t0 = time.monotonic()
        last_push = t0
        pending: list[PendingInference | None] = [None] * len(envs)
        down_since: float | None = None
        while time.monotonic() < t_end:
            for k, env in enumerate(envs):
                try:
                    p = pending[k]
                    if p is None:
                        pending[k] = self._client.start({"obs": env.obs})
                        if mode == "async":
                            continue
                        p = pending[k]
                    assert p is not None
                    pending[k] = None
                    out = self._client.finish(p)
                except EndpointDown as e:
                    # Nothing was submitted: wait for the next re-resolve attempt (its back-off).
                    down_since = down_since or time.monotonic()
                    result.waits += 1
                    time.sleep(max(0.0, min(e.retry_in_s, t_end - time.monotonic())))
                    continue
                except (QueueError, RequestLost) as e:
                    # A restarted worker or actor fails what it held: count it, keep sampling. A request
                    # that only timed out is given up here, so it must not stay counted in flight.
                    if isinstance(e, QueueTimeout) and p is not None:
                        self._client.abandon(p)
                    down_since = down_since or time.monotonic()
                    result.errors[type(e).__name__] = result.errors.get(type(e).__name__, 0) + 1
                    continue
                if down_since is not None:
                    result.recovery_s.append(time.monotonic() - down_since)
                    down_since = None
                env.step(out)
                result.steps += 1
                result.samples += env.spec.heroes
                if mode == "async":
                    with contextlib.suppress(EndpointDown):  # if so, started on the next round
                        pending[k] = self._client.start({"obs": env.obs})
            if time.monotonic() - last_push >= push_interval_s:
                last_push = time.monotonic()
                self._push(result)
        for k, p in enumerate(pending):
            if p is not None:
                try:
                    envs[k].step(self._client.finish(p))
                    result.steps += 1
                    result.samples += envs[k].spec.heroes
                except (QueueError, RequestLost) as e:
                    if isinstance(e, QueueTimeout):
                        self._client.abandon(p)
                    result.errors[type(e).__name__] = result.errors.get(type(e).__name__, 0) + 1
        result.seconds = time.monotonic() - t0
        result.reattached = self._client.reattached
        self._push(result)
        return result

    def _push(self, result: SamplerResult) -> None:
        rpc, samples = self._client.take_window()
        result.rpc_ms.extend(rpc)
        if self._metrics is not None:
            self._metrics.push.remote(self._owner, {"rpc_elapsed_ms": rpc}, samples)

    def shutdown(self) -> None:
        self._client.close()
        ray.get(self._alloc.release.remote(self._owner, caller_node=self._node))


def start_sampler(
    spec: SamplerSpec,
    endpoints: Sequence[Endpoint],
    node_id: str | None = None,
    start_timeout_s: float = START_TIMEOUT_S,
) -> Any:
    """Create a sampler actor next to its inference actors (their node, unless told otherwise)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = node_id or (endpoints[0].node_id if endpoints else ray.get_runtime_context().get_node_id())
    handle = SamplerActor.options(  # type: ignore[attr-defined]
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
        **lease_resources(spec.allocator, node),
    ).remote(spec, list(endpoints))
    await_started(handle, handle.lease, f"sampler {spec.name}", node, start_timeout_s)
    return handle
