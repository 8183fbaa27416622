"""Ray inference actors: a leased CPU, a NUMA-bound queue and a pinned OpenVINO worker per actor.

- ``InferenceActor`` leases ``infer:<hero>:<actor>`` from its node's allocator, creates the queue bound to the
  leased CPU's NUMA node (page placement is not left to first touch), spawns the pinned worker
  (``lowtail.serve.worker_process``), keeps its own threads off the worker's CPU, and publishes an
  ``Endpoint`` (``lowtail.actors.endpoint``) that carries its node id. A supervisor thread restarts a dead
  worker on the same queue: requests the dead worker held fail with ``WorkerDied``, later ones are served.
  ``shutdown()`` stops the worker, unlinks the queue and releases the lease.
- The sampler side is ``lowtail.actors.inference_client`` (``InferenceClient``) and an example sampler
  actor is ``lowtail.actors.sampler``.

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
import re
import signal
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING, Any

import numpy as np
import ray

from lowtail.actors.allocator import AllocatorConfig, get_node_allocator
from lowtail.actors.endpoint import (
    ACTOR_NAMESPACE,
    Endpoint,
)
from lowtail.actors.metrics_hub import MetricsConfig, get_node_metrics
from lowtail.errors import LowtailError

if TYPE_CHECKING:  # imported when used: the actor's module must import fast and without numpy's users
    from lowtail.serve.config import WorkerConfig
    from lowtail.serve.pinning import NiceResult
    from lowtail.serve.worker_process import WorkerProcess
    from lowtail.shm.control import InferenceQueue, QueueConfig
from lowtail.node.lease import Lease
from lowtail.shm import native

log = logging.getLogger(__name__)


class InferenceActorFailed(LowtailError, RuntimeError):
    """The inference actor could not start or keep its worker."""


class BadInferenceSpec(LowtailError, ValueError):
    """An ``InferenceSpec`` value that cannot work (refused at construction, not at lease time)."""


_LABEL_RE = re.compile(
    r"[A-Za-z0-9_.\-]+"
)  # a lease owner's name part (lowtail.node.lease: infer:<hero>:<i>)


@dataclass(frozen=True)
class InferenceSpec:
    """One inference actor: which model, which queue and worker settings, which allocator.

    ``standby`` (default on): a hot standby worker (model compiled, queue attached, parked on the
    leased CPU without using it) takes over the moment the worker dies; ``standby=False`` saves its
    memory (one more worker process: its RSS, about the compiled model's size plus OpenVINO's runtime)
    at the price of a worker restart (spawn, imports, compile: 1-3.5 s on a loaded 2-vCPU host) after a
    crash. Validated at construction: a bad value is named here, not when the lease is taken.
    """

    hero: str
    index: int
    model_dir: str
    allocator: AllocatorConfig = field(default_factory=AllocatorConfig)
    metrics: MetricsConfig | None = None  # None: no metrics hub
    queue: QueueConfig | None = None  # its numa_node is set from the lease
    worker: WorkerConfig | None = None  # its name, the log label, gets the hero
    standby: bool = True
    ready_timeout_s: float = 120.0
    supervise_interval_s: float = 0.05
    metrics_interval_s: float = 1.0
    max_restarts_per_minute: int = 10  # of the worker, by this actor's supervisor
    max_actor_restarts: int = 5  # of this actor, by Ray (-1: forever); clients re-resolve its endpoint
    # The nice value of every thread of the actor process: its supervisor restarts a dead worker (and
    # the worker starts at its parent's value until it has pinned itself), its method thread answers
    # the clients' endpoint() on re-resolve. Ray starts its workers at nice 15 (worker_niceness): on CPUs
    # shared with workers and samplers at -20 (the demo's lease override) the kill call of `lowtail bench
    # failover` ran seconds after its plan (docs/benchmarks.md). None: keep Ray's value.
    nice: int | None = -20

    def __post_init__(self) -> None:
        def bad(name: str, value: object, expected: str) -> BadInferenceSpec:
            return BadInferenceSpec(f"InferenceSpec {name}={value!r}: expected {expected}")

        if not isinstance(self.hero, str) or not _LABEL_RE.fullmatch(self.hero):
            raise bad(
                "hero",
                self.hero,
                "letters, digits, '_', '.' or '-' (it names the lease infer:<hero>:<index>)",
            )
        if isinstance(self.index, bool) or not isinstance(self.index, int) or self.index < 0:
            raise bad("index", self.index, "an integer >= 0")
        if not isinstance(self.model_dir, (str, os.PathLike)) or not str(self.model_dir):
            raise bad("model_dir", self.model_dir, "a path to an OpenVINO IR (.xml + .bin) or its directory")
        for name in ("ready_timeout_s", "supervise_interval_s", "metrics_interval_s"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise bad(name, value, "seconds > 0")
        if (
            isinstance(self.max_restarts_per_minute, bool)
            or not isinstance(self.max_restarts_per_minute, int)
            or self.max_restarts_per_minute < 0
        ):
            raise bad("max_restarts_per_minute", self.max_restarts_per_minute, "an integer >= 0")
        if (
            isinstance(self.max_actor_restarts, bool)
            or not isinstance(self.max_actor_restarts, int)
            or self.max_actor_restarts < -1
        ):
            raise bad("max_actor_restarts", self.max_actor_restarts, "an integer >= -1 (-1: forever)")
        if not isinstance(self.standby, bool):
            raise bad("standby", self.standby, "True or False")
        if self.nice is not None and (
            isinstance(self.nice, bool) or not isinstance(self.nice, int) or not -20 <= self.nice <= 19
        ):
            raise bad("nice", self.nice, "an integer from -20 to 19, or None (Ray's value)")

    @property
    def owner(self) -> str:
        return f"infer:{self.hero}:{self.index}"

    @property
    def actor_name(self) -> str:
        return f"lowtail-infer-{self.hero}-{self.index}"


# A sampler's normal request, 8 heroes x 512 float32 features (16,384 B) plus its 64-byte header, goes
# inline in the slot; the queue's own default (16 KiB) would send every such request through an
# ndarray segment. Room is left for a small second input.
DEFAULT_REQUEST_BYTES = 20480


def default_queue_config() -> QueueConfig:
    """The queue an inference actor creates unless ``InferenceSpec.queue`` says otherwise."""
    from lowtail.shm.queue import QueueConfig

    return QueueConfig(request_bytes=DEFAULT_REQUEST_BYTES)


def keep_threads_off(cpu: int) -> frozenset[int]:
    """Move every thread of this process off ``cpu`` (if it may run elsewhere); returns the new mask.

    Ray's gRPC threads exist before any actor code runs; ``sched_setaffinity(0)`` moves only the calling
    thread, so the mask is set on every task id: per-thread affinity for all of the process's threads,
    not only the caller's.
    """
    allowed = frozenset(os.sched_getaffinity(0)) - {cpu}
    if not allowed:
        return frozenset(os.sched_getaffinity(0))
    for tid in os.listdir("/proc/self/task"):
        with contextlib.suppress(OSError):  # a thread that just exited
            os.sched_setaffinity(int(tid), allowed)
    return allowed


def worker_series(rows: np.ndarray) -> dict[str, np.ndarray]:
    """Per-call worker rows (``lowtail.serve.call_stats.CALL_FIELDS``) as the exported worker-side series
    (``lowtail.telemetry.export.SERIES``; the per-request ones under the predecessor's names are the
    samplers')."""
    from lowtail.serve.call_stats import COL

    pick = {
        "worker_infer_exec_ms": "engine_wall_ms",
        "infer_total_ms": "wall_ms",
        "engine_cpu_ms": "engine_cpu_ms",
        "engine_thread_cpu_ms": "engine_thread_cpu_ms",
        "deschedule_ms": "deschedule_ms",
        "run_delay_ms": "run_delay_ms",
        "worker_queue_wait_ms": "queue_wait_ms",
        "worker_batch_size": "batch",
    }
    return {name: rows[:, COL[col]].astype(np.float64) for name, col in pick.items()}


def worker_config(spec: InferenceSpec) -> WorkerConfig:
    """The worker's config with the hero label in its name (log prefix, ``slow_infer hero=``), whatever
    ``spec.worker`` says: a custom name is kept after the label."""
    from lowtail.serve.worker_process import WorkerConfig

    label = f"{spec.hero}.{spec.index}"
    cfg = spec.worker or WorkerConfig()
    if not cfg.name:
        return replace(cfg, name=label)
    return cfg if cfg.name.startswith(label) else replace(cfg, name=f"{label}.{cfg.name}")


class InferenceActorImpl:
    """The inference actor (``InferenceActor`` is this class as a Ray actor; ``start_inference_actor``
    creates one): a leased CPU, a NUMA-bound queue, a pinned worker and, by default, its hot standby.

    Methods (call them as ``handle.<method>.remote(...)``):

    - ``endpoint()``: the ``Endpoint`` samplers attach to (raises ``InferenceActorFailed`` once the
      worker was given up).
    - ``ping()``: owner, node id and pid of the actor process (liveness).
    - ``status()``: lease, worker and standby (pid, alive, serving), restarts, promotions, failure.
    - ``report()``: the worker's per-field percentiles since it started and its isolation check.
    - ``queue_counts()``: the queue's slots per state, for diagnosis.
    - ``kill_worker(while_processing=False)``: SIGKILL the serving worker, as a crash would (drills);
      ``kills()``: what each kill cost (the requests the worker had claimed).
    - ``shutdown()``: stop the workers, unlink the queue, release the lease (call before ``ray.kill``).

    A supervisor thread watches the worker every ``supervise_interval_s``. With a standby, a dead
    worker's standby is already serving (it takes the queue's worker lock the moment the worker dies):
    the supervisor promotes it and starts a new standby in the background. Without one it restarts the
    worker on the same queue. Either way the requests the dead worker had claimed fail ``WorkerDied``
    and the others are served; more than ``max_restarts_per_minute`` deaths stop it (``endpoint()``
    says why).
    """

    def __init__(self, spec: InferenceSpec) -> None:
        # A constructor that raises reaches the caller as Ray's ActorDiedError, which keeps only the
        # text of its cause: the error is kept instead and raised by the first call (ping), where Ray
        # hands it over as itself (RayTaskError.cause); start_inference_actors then stops the actor.
        self._init_error: Exception | None = None
        try:
            self._init(spec)
        except Exception as e:
            self._init_error = e

    def _check_started(self) -> None:
        if self._init_error is not None:
            raise self._init_error

    def _init(self, spec: InferenceSpec) -> None:
        from lowtail.shm.queue import InferenceQueue

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
        ctx = ray.get_runtime_context()
        self._spec = spec
        self._node = ctx.get_node_id()
        self._nice: NiceResult | None = None  # of the method thread
        if spec.nice is not None:
            from lowtail.serve.pinning import raise_threads_priority

            self._nice = raise_threads_priority(spec.nice)  # before the supervisor and workers start
        # A previous incarnation (Ray restarts a dead actor) died without unlinking its queue: sweep the
        # segments of dead owners. Ray's was_current_actor_reconstructed would say whether this is a
        # restart, but it emits a RayDeprecationWarning of its own (it reads the deprecated actor_id).
        from lowtail.shm.segments import sweep_dead

        swept = sweep_dead()
        if swept:
            log.warning(
                "%s: swept %d segments of dead owners (a previous incarnation's)", spec.owner, len(swept)
            )
        self._alloc = get_node_allocator(self._node, spec.allocator)
        self._lease: Lease = ray.get(
            self._alloc.acquire.remote(
                spec.owner, caller_node=self._node, pid=os.getpid(), actor_id=ctx.get_actor_id()
            )
        )
        self._lock = threading.Lock()
        self._queue: InferenceQueue | None = None
        self._worker: WorkerProcess | None = None
        self._standby: WorkerProcess | None = None  # a ready hot standby
        self._standby_starter: threading.Thread | None = None
        self._stop = threading.Event()
        self._restarts: list[float] = []
        self._deaths = 0
        self._promotions = 0
        self._kills: list[dict[str, Any]] = []
        self._failed: str | None = None
        self._cursor = 0
        self._metrics = None if spec.metrics is None else get_node_metrics(self._node, spec.metrics)
        try:
            qcfg = replace(spec.queue or default_queue_config(), numa_node=self._lease.node)
            self._queue = InferenceQueue.create(qcfg)
            self._worker_cfg = worker_config(spec)
            self._start_worker()
            if spec.standby:
                self._start_standby()  # ready before the actor reports started: covered from the outset
            keep_threads_off(self._lease.cpu)
        except BaseException:
            self._teardown()
            raise
        self._supervisor = threading.Thread(target=self._supervise, name="worker-supervisor", daemon=True)
        self._supervisor.start()

    # --- worker lifecycle (control plane) --------------------------------------------------------------

    def _live_queue(self) -> InferenceQueue:
        if self._queue is None:
            raise InferenceActorFailed(f"{self._spec.owner}: the actor is shut down (its queue is gone)")
        return self._queue

    def _spawn(self, standby: bool) -> WorkerProcess:
        from lowtail.serve.worker_process import WorkerProcess

        worker = WorkerProcess.start(
            self._live_queue().descriptor,
            self._lease.cpu,
            self._spec.model_dir,
            self._worker_cfg,
            standby=standby,
        )
        try:
            worker.wait_ready(self._spec.ready_timeout_s)
        except BaseException:
            worker.stop()
            raise
        return worker

    def _start_worker(self) -> None:
        self._worker = self._spawn(standby=False)
        self._cursor = 0
        log.info("%s: worker pid %d serving on CPU %d", self._spec.owner, self._worker.pid, self._lease.cpu)

    def _start_standby(self) -> None:
        self._standby = self._spawn(standby=True)
        log.info("%s: standby pid %d parked on CPU %d", self._spec.owner, self._standby.pid, self._lease.cpu)

    def _standby_in_background(self) -> None:
        """Start a new standby without holding the lock (compiling takes seconds)."""

        def run() -> None:
            try:
                standby = self._spawn(standby=True)
            except Exception as e:
                log.error("%s: standby failed to start: %s", self._spec.owner, e)
                return
            with self._lock:
                if self._stop.is_set() or self._failed is not None or self._standby is not None:
                    standby.stop()
                    return
                self._standby = standby
            log.info("%s: new standby pid %d parked", self._spec.owner, standby.pid)

        self._standby_starter = threading.Thread(target=run, name="standby-starter", daemon=True)
        self._standby_starter.start()

    def _supervise(self) -> None:
        last_push = time.monotonic()
        while not self._stop.wait(self._spec.supervise_interval_s):
            with self._lock:
                if self._failed is None:
                    self._check_workers_locked()
                if (
                    self._metrics is not None
                    and time.monotonic() - last_push >= self._spec.metrics_interval_s
                ):
                    last_push = time.monotonic()
                    self._push_metrics_locked()

    def _starting_standby(self) -> bool:
        return self._standby_starter is not None and self._standby_starter.is_alive()

    def _check_workers_locked(self) -> None:
        self._adopt_serving_standby_locked()
        if self._standby is not None and not self._standby.alive():
            log.warning("%s: standby pid %d died; starting another", self._spec.owner, self._standby.pid)
            self._standby.stop(timeout_s=0.5)
            self._standby = None
        if self._worker is not None and not self._worker.alive():
            self._worker_died_locked()
        if self._failed is not None or self._starting_standby():
            return
        if self._worker is None and self._standby is None:  # the standby meant to take over never came
            try:
                self._start_worker()
            except Exception as e:
                self._failed = f"worker restart failed: {e}"
                log.error("%s: %s", self._spec.owner, self._failed)
                return
        if self._spec.standby and self._standby is None:
            self._standby_in_background()

    def _worker_died_locked(self) -> None:
        old = self._worker
        if old is None:  # already handled: nothing is left to stop
            return
        code = old.stop(timeout_s=0.5)
        self._push_metrics_locked()
        self._deaths += 1
        now = time.monotonic()
        self._restarts = [t for t in self._restarts if now - t < 60.0] + [now]
        if len(self._restarts) > self._spec.max_restarts_per_minute:
            self._failed = (
                f"worker died {len(self._restarts)} times in a minute (last exit code {code}); not restarting"
            )
            log.error("%s: %s", self._spec.owner, self._failed)
            self._worker = None
            if self._standby is not None:  # it would serve, and die the same way: stop it too
                self._standby.stop()
                self._standby = None
            return
        if self._standby is not None:
            # It took the queue over the moment the worker died (it needs nobody's word for that).
            self._worker, self._standby = self._standby, None
            self._cursor = 0
            self._promotions += 1
            log.warning(
                "%s: worker pid %d died (exit code %s); standby pid %d serves",
                self._spec.owner,
                old.pid,
                code,
                self._worker.pid,
            )
            return
        if self._starting_standby():
            # The standby being started takes the queue over as soon as it is ready: no second worker.
            self._worker = None
            log.warning(
                "%s: worker pid %d died (exit code %s); the standby starting takes over",
                self._spec.owner,
                old.pid,
                code,
            )
            return
        log.warning("%s: worker pid %d died (exit code %s); restarting", self._spec.owner, old.pid, code)
        try:
            self._start_worker()
        except Exception as e:
            self._worker = None
            self._failed = f"worker restart failed: {e}"
            log.error("%s: %s", self._spec.owner, self._failed)

    def _adopt_serving_standby_locked(self) -> None:
        """No worker (it died while a standby was starting): the standby serves once ready."""
        if self._worker is None and self._standby is not None:
            self._worker, self._standby = self._standby, None
            self._cursor = 0
            self._promotions += 1

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
        self._stop.set()
        starter = self._standby_starter
        if starter is not None:
            starter.join(timeout=self._spec.ready_timeout_s + 10)
        for w in (self._standby, self._worker):
            if w is not None:
                w.stop()
        self._standby = self._worker = None
        if self._queue is not None:
            self._queue.close()
            self._queue = None
        ray.get(self._alloc.release.remote(self._spec.owner, caller_node=self._node))

    # --- the actor's methods ---------------------------------------------------------------------------

    def endpoint(self) -> Endpoint:
        """Where to send requests; never a dead worker's (a client re-resolving after a crash may ask
        before the supervisor has noticed: handle it here, under the same lock)."""
        self._check_started()
        with self._lock:
            if self._failed is None:
                self._check_workers_locked()
                self._adopt_serving_standby_locked()
            if self._failed is not None:
                raise InferenceActorFailed(f"{self._spec.owner}: {self._failed}")
            if self._worker is None:
                raise InferenceActorFailed(f"{self._spec.owner}: no worker yet (its standby is starting)")
            return Endpoint(
                actor=self._spec.actor_name,
                owner=self._spec.owner,
                node_id=self._node,
                cpu=self._lease.cpu,
                numa_node=self._lease.node,
                descriptor=self._live_queue().descriptor,
                worker_pid=self._worker.pid,
            )

    def ping(self) -> dict[str, Any]:
        """Owner, node id and pid of this actor process (raises what made its construction fail)."""
        self._check_started()
        return {"owner": self._spec.owner, "node_id": self._node, "pid": os.getpid()}

    def status(self) -> dict[str, Any]:
        """The lease, the worker and its standby (pid, alive, serving, start-up report), restarts, and
        the nice values of this actor's threads."""
        from lowtail.serve.pinning import thread_nices

        with self._lock:
            self._adopt_serving_standby_locked()
            w, sb = self._worker, self._standby
            return {
                "owner": self._spec.owner,
                "cpu": self._lease.cpu,
                "numa_node": self._lease.node,
                "worker_pid": None if w is None else w.pid,
                "worker_alive": w is not None and w.alive(),
                "standby_enabled": self._spec.standby,
                "standby_pid": None if sb is None else sb.pid,
                "standby_alive": sb is not None and sb.alive(),
                "standby_serving": sb is not None and sb.serving(),
                "standby_starting": self._starting_standby(),
                "restarts": len(self._restarts),
                "deaths": self._deaths,
                "promotions": self._promotions,
                "failed": self._failed,
                "actor_affinity": sorted(os.sched_getaffinity(0)),
                "actor_nice": None if self._nice is None else asdict(self._nice),
                "actor_thread_nices": sorted(set(thread_nices())),
                # this node's queue hot path (the worker's own is in its ready report)
                "queue_core": native.implementation().to_dict(),
                "ready": None if w is None else w.ready_info,
                "standby_ready": None if sb is None else sb.ready_info,
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
        return dict(self._live_queue().snapshot().counts)

    def kill_worker(self, while_processing: bool = False, timeout_s: float = 10.0) -> int:
        """SIGKILL the serving worker, as a crash would (tests and drills); its standby takes over, or the
        supervisor restarts it. The worker is frozen (SIGSTOP) first and the requests it had claimed
        counted (``kills()``); ``while_processing``: kept frozen until one is PROCESSING, so the kill
        certainly lands mid-request. Returns the killed pid."""
        with self._lock:
            if self._worker is None:
                raise InferenceActorFailed(f"{self._spec.owner}: no worker to kill")
            pid = int(self._worker.pid)
            deadline = time.monotonic() + timeout_s
            while True:
                os.kill(pid, signal.SIGSTOP)
                claimed = self._live_queue().snapshot().counts.get("PROCESSING", 0)
                if claimed > 0 or not while_processing:
                    break
                os.kill(pid, signal.SIGCONT)
                if time.monotonic() > deadline:
                    raise TimeoutError(f"no request was PROCESSING within {timeout_s} s")
                time.sleep(0.001)
            self._worker.kill()
            self._kills.append({"pid": pid, "claimed": int(claimed), "at_s": time.monotonic()})
            return pid

    def kills(self) -> list[dict[str, Any]]:
        """Each ``kill_worker``: the pid, the requests it had claimed, when (CLOCK_MONOTONIC seconds)."""
        return list(self._kills)

    def shutdown(self) -> None:
        """Stop the workers, unlink the queue, release the lease. Call before ``ray.kill``."""
        if self._init_error is not None:
            return  # the failed constructor released what it had taken
        self._stop.set()
        self._supervisor.join(timeout=5)
        with self._lock:
            self._push_metrics_locked()
        self._teardown()


# The Ray actor class; help(InferenceActorImpl) shows its methods.
InferenceActor = ray.remote(num_cpus=0, max_restarts=0)(InferenceActorImpl)


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


def start_failure(error: BaseException) -> BaseException:
    """What made an actor's constructor fail, as itself (``ModelNotFound``, ``LeaseExhausted``, ...),
    rather than Ray's ``ActorDiedError`` around it; the Ray error is kept as its ``__cause__``."""
    inner = error.cause if isinstance(error, ray.exceptions.RayTaskError) else None
    if isinstance(inner, Exception):
        inner.__cause__ = error
        return inner
    return error


def await_started(handle: Any, method: Any, what: str, node: str, timeout_s: float) -> None:
    """Wait for a new actor's first answer: a failed constructor raises here as its own error
    (``start_failure``), and an actor Ray cannot place (its node's CPU or lowtail_isolated_cpu all
    taken) is killed and reported instead of left pending forever."""
    await_all_started([(handle, method, what)], node, timeout_s)


def await_all_started(actors: Sequence[tuple[Any, Any, str]], node: str, timeout_s: float) -> None:
    """``await_started`` for several actors constructed at the same time (their constructors overlap)."""
    refs = [(handle, method.remote(), what) for handle, method, what in actors]
    deadline = time.monotonic() + timeout_s
    failure: BaseException | None = None
    for handle, ref, what in refs:
        try:
            ray.get(ref, timeout=max(0.0, deadline - time.monotonic()))
        except ray.exceptions.GetTimeoutError:
            ray.kill(handle, no_restart=True)
            everything: dict[str, float] = ray.available_resources()  # type: ignore[no-untyped-call]
            free = {k: v for k, v in everything.items() if k in ("CPU", ISOLATED_RESOURCE)}
            failure = failure or InferenceActorFailed(
                f"{what} on node {node} did not start within {timeout_s:.0f} s; Ray's free resources "
                f"(cluster) {free}: is every CPU or {ISOLATED_RESOURCE} of the node leased?"
            )
        except ray.exceptions.RayError as e:
            ray.kill(handle, no_restart=True)  # a failed constructor left a shell that serves nothing
            failure = failure or start_failure(e)
    if failure is not None:
        raise failure


def _inference_options(spec: InferenceSpec, node: str) -> Any:
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    return InferenceActor.options(
        name=spec.actor_name,
        max_restarts=spec.max_actor_restarts,
        **lease_resources(spec.allocator, node),
        namespace=ACTOR_NAMESPACE,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
    )


def start_inference_actor(spec: InferenceSpec, node_id: str | None = None) -> Any:
    """Create an inference actor on ``node_id`` (default: this node); returns its handle once it serves.

    A constructor that fails raises its own error (``ModelNotFound`` for an empty model directory,
    ``LeaseExhausted``, ``WorkerStartFailed``, ...). To start several at once: ``start_inference_actors``.
    """
    return start_inference_actors([spec], node_id)[0]


def start_inference_actors(specs: Sequence[InferenceSpec], node_id: str | None = None) -> list[Any]:
    """Create several inference actors on one node in parallel: their workers spawn and compile at the
    same time (each on its own leased CPU) instead of one after another. Returns the handles once all
    serve; if any fails, the others are stopped and the first failure is raised as itself."""
    node = node_id or ray.get_runtime_context().get_node_id()
    handles = [_inference_options(spec, node).remote(spec) for spec in specs]
    try:
        await_all_started(
            [(h, h.ping, spec.actor_name) for h, spec in zip(handles, specs, strict=True)],
            node,
            START_TIMEOUT_S + max(spec.ready_timeout_s for spec in specs),
        )
    except BaseException:
        for h in handles:
            stop_actor(h, timeout_s=10.0)
        raise
    return handles


def stop_actor(handle: Any, timeout_s: float = 30.0) -> None:
    """Graceful shutdown (releases what the actor holds), then kill the actor process."""
    with contextlib.suppress(ray.exceptions.GetTimeoutError, ray.exceptions.RayActorError):
        ray.get(handle.shutdown.remote(), timeout=timeout_s)
    ray.kill(handle, no_restart=True)
