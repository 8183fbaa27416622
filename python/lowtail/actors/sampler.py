"""An example sampler actor: a synthetic game stepped with the policy's actions.

``SamplerActor`` leases a ``sample:`` CPU near its inference actors, pins the thread that runs its
environment and client to it, and steps a synthetic environment with the policy's actions through an
``InferenceClient`` (``lowtail.actors.inference_client``). It is placed with
``NodeAffinitySchedulingStrategy(node, soft=False)`` on the node of its inference actors
(``start_sampler`` takes the endpoints' node).
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import InitVar, dataclass, field, replace
from typing import Any

import numpy as np
import ray

from lowtail.actors.allocator import AllocatorConfig, get_node_allocator
from lowtail.actors.endpoint import Endpoint, EndpointDown, NoEndpoints
from lowtail.actors.inference import (
    START_TIMEOUT_S,
    await_started,
    keep_threads_off,
    lease_resources,
)
from lowtail.actors.inference_client import InferenceClient, PendingInference, RequestLost
from lowtail.actors.metrics_hub import MetricsConfig, get_node_metrics
from lowtail.node.lease import Lease

# How long a run waits for its last metrics push to reach the hub (SamplerActorImpl._push)
LAST_PUSH_TIMEOUT_S = 10.0

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EnvSpec:
    """A synthetic MOBA environment: ``rows`` observations of ``features`` per step (one request's batch)."""

    features: int = 512
    rows: int = 8
    step_us: int = 200  # CPU time one environment step burns (the game simulation)
    seed: int = 0
    # The old name of ``rows``, accepted for a release: it never counted heroes (a hero is the model a
    # client asks for, InferenceSpec.hero), so a reader took it for one.
    heroes: InitVar[int | None] = None

    def __post_init__(self, heroes: int | None) -> None:
        if heroes is not None:
            warnings.warn("EnvSpec(heroes=) is renamed EnvSpec(rows=)", DeprecationWarning, stacklevel=3)
            object.__setattr__(self, "rows", heroes)


class SyntheticEnv:
    """Deterministic stand-in for a game: the next observation depends on the chosen actions."""

    def __init__(self, spec: EnvSpec) -> None:
        self.spec = spec
        self._rng = np.random.default_rng(spec.seed)
        self.obs = self._rng.standard_normal((spec.rows, spec.features), dtype=np.float32)
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
    # The nice value of the thread that steps the games and waits for answers. Ray starts its workers
    # at nice 15 (its worker_niceness, RAY_worker_niceness): on a CPU shared with an inference worker
    # (the demo's lease override) that starts or restarts at nice -20, a sampler at 15 gets ~0.04 % of
    # the CPU (CFS weights 36 against 88761) and stalls for the whole compile. None: keep Ray's value.
    nice: int | None = -20


@dataclass
class HeroRun:
    """One hero's requests in a sampler's run: every request started ends as an answer, a failure or a
    request still in flight at the end (none is dropped silently)."""

    hero: str
    started: int = 0
    answered: int = 0
    failed: int = 0
    errors: dict[str, int] = field(default_factory=dict)  # failed requests by error class
    waits: int = 0  # times no replica of this hero could take a request (EndpointDown)
    moved: int = 0  # requests sent to another replica after theirs went down unclaimed
    reattached: int = 0
    answer_s: list[float] = field(default_factory=list)  # CLOCK_MONOTONIC of each answer (host-wide)
    replica: list[int] = field(default_factory=list)  # which replica answered (the client's index)
    sent_s: list[float] = field(default_factory=list)  # when each answered request was published

    def longest_gap_s(self, start_s: float | None = None, end_s: float | None = None) -> float:
        """The longest time without an answer, between ``start_s`` and ``end_s`` (monotonic) if given."""
        t = np.asarray(self.answer_s)
        lo = t[0] if start_s is None and t.size else start_s
        hi = t[-1] if end_s is None and t.size else end_s
        if lo is None or hi is None:
            return float("nan")
        inside = t[(t >= lo) & (t <= hi)]
        return float(np.diff(np.concatenate(([lo], inside, [hi]))).max())


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
    heroes: dict[str, HeroRun] = field(default_factory=dict)
    # CLOCK_MONOTONIC of the run's first and last step (one clock for every process on the node): a
    # measurement window around an event must lie inside [started_s, ended_s] to say anything about it.
    started_s: float = 0.0
    ended_s: float = 0.0


def hero_of(ep: Endpoint) -> str:
    """The hero an inference actor serves, from its lease owner ``infer:<hero>:<index>``."""
    return ep.owner.split(":")[1]


def by_hero(endpoints: Sequence[Endpoint]) -> dict[str, list[Endpoint]]:
    """Endpoints grouped by hero, in the order given: one client per hero, its replicas round robin."""
    groups: dict[str, list[Endpoint]] = {}
    for ep in endpoints:
        groups.setdefault(hero_of(ep), []).append(ep)
    return groups


class SamplerActorImpl:
    """An example sampler (``SamplerActor`` is this class as a Ray actor; ``start_sampler`` creates one),
    in the predecessor's shape: **one ``InferenceClient`` per hero**, each spreading that hero's requests
    over its replicas (the endpoints are grouped by the hero of their lease owner ``infer:<hero>:<i>``).
    Every game step asks each hero's policy for its actions; a hero whose request failed (its worker died
    holding it) or could not be sent contributes no action to that step (the game goes on), so one
    hero's outage never stalls the others.

    Methods: ``lease()``, ``affinity()``, ``nice()``, ``infer(inputs)`` / ``infer_many(batches,
    two_phase)`` (the first hero's client), ``run(seconds, mode, depth)`` -> ``SamplerResult``,
    ``shutdown()``.
    """

    def __init__(self, spec: SamplerSpec, endpoints: Sequence[Endpoint]) -> None:
        # As InferenceActorImpl: a constructor's error is raised by the first call, as itself.
        self._init_error: Exception | None = None
        try:
            self._init(spec, endpoints)
        except Exception as e:
            self._init_error = e

    def _init(self, spec: SamplerSpec, endpoints: Sequence[Endpoint]) -> None:
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
        self._clients: dict[str, InferenceClient] = {}
        self._nice: Any = None  # lowtail.serve.pinning.NiceResult of the sampling thread
        try:
            if spec.pin:
                # Ray's own threads of this process off the leased CPU, then the thread that runs the
                # actor's methods (the main thread, for a non-threaded actor) onto it.
                keep_threads_off(self._lease.cpu)
                os.sched_setaffinity(0, {self._lease.cpu})
            if spec.nice is not None:
                from lowtail.serve.pinning import raise_priority

                self._nice = raise_priority(spec.nice)  # not permitted: it says so and keeps Ray's
            if not endpoints:
                raise NoEndpoints("no inference endpoints: expected at least one Endpoint on this node")
            for hero, eps in by_hero(endpoints).items():
                self._clients[hero] = InferenceClient(eps, node_id=self._node, timeout_s=spec.timeout_s)
        except BaseException:
            for c in self._clients.values():
                c.close()
            ray.get(self._alloc.release.remote(self._owner, caller_node=self._node))
            raise
        self._client = next(iter(self._clients.values()))
        self._metrics = None if spec.metrics is None else get_node_metrics(self._node, spec.metrics)
        self._env = SyntheticEnv(spec.env)

    def lease(self) -> Lease:
        """This sampler's CPU lease (raises what made its construction fail)."""
        if self._init_error is not None:
            raise self._init_error
        return self._lease

    def affinity(self) -> list[int]:
        return sorted(os.sched_getaffinity(0))

    def nice(self) -> int:
        """The nice value of the thread that runs this actor's methods (``SamplerSpec.nice``, if allowed)."""
        return os.getpriority(os.PRIO_PROCESS, 0)

    def infer(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        return self._client.infer(inputs)

    def infer_many(
        self, batches: list[dict[str, np.ndarray]], two_phase: bool
    ) -> list[dict[str, np.ndarray]]:
        """Serve several batches at once: all started, then all finished (two-phase) or one by one."""
        if not two_phase:
            return [self._client.infer(b) for b in batches]
        pending = [self._client.start(b) for b in batches]
        return [dict(self._client.finish(p)) for p in pending]

    def run(
        self, seconds: float, mode: str = "async", depth: int = 2, push_interval_s: float = 1.0
    ) -> SamplerResult:
        """Step the environment for ``seconds``: ``sync`` (infer, step) or ``async`` (two-phase with
        ``depth`` games in flight); each step asks every hero's client."""
        if mode not in ("sync", "async"):
            raise ValueError(f"mode {mode!r}: expected 'sync' or 'async'")
        envs = [self._env] + [
            SyntheticEnv(replace(self._spec.env, seed=self._spec.env.seed + k)) for k in range(1, depth)
        ]
        if mode == "sync":
            envs = envs[:1]
        result = SamplerResult(self._spec.name, self._lease.cpu, mode, 0.0, 0, 0)
        runs = {hero: HeroRun(hero) for hero in self._clients}
        result.heroes = runs
        t_end = time.monotonic() + seconds
        t0 = time.monotonic()
        last_push = t0
        pending: list[dict[str, PendingInference]] = [{} for _ in envs]
        self._down_since: float | None = None
        while time.monotonic() < t_end:
            for k, env in enumerate(envs):
                if not pending[k]:
                    pending[k] = self._start_all(env.obs, runs, result, t_end)
                    if mode == "async":
                        continue
                out = self._finish_all(pending[k], runs, result)
                pending[k] = {}
                if out is None:
                    continue
                env.step(out)
                result.steps += 1
                result.samples += env.spec.rows
                if mode == "async":
                    pending[k] = self._start_all(env.obs, runs, result, t_end)
            if time.monotonic() - last_push >= push_interval_s:
                last_push = time.monotonic()
                self._push(result)
        for k, p in enumerate(pending):
            if p:
                out = self._finish_all(p, runs, result)
                if out is not None:
                    envs[k].step(out)
                    result.steps += 1
                    result.samples += envs[k].spec.rows
        result.ended_s = time.monotonic()
        result.started_s, result.seconds = t0, result.ended_s - t0
        for hero, c in self._clients.items():
            runs[hero].reattached, runs[hero].moved = c.reattached, c.moved
        result.reattached = sum(c.reattached for c in self._clients.values())
        for r in runs.values():
            for name, n in r.errors.items():
                result.errors[name] = result.errors.get(name, 0) + n
            result.waits += r.waits
        self._push(result, last=True)
        return result

    def _start_all(
        self, obs: np.ndarray, runs: dict[str, HeroRun], result: SamplerResult, t_end: float
    ) -> dict[str, PendingInference]:
        """One request per hero; a hero no replica can take now is left out of this step."""
        started: dict[str, PendingInference] = {}
        retry_in: list[float] = []
        for hero, client in self._clients.items():
            try:
                started[hero] = client.start({"obs": obs})
                runs[hero].started += 1
            except EndpointDown as e:
                runs[hero].waits += 1
                retry_in.append(e.retry_in_s)
        if not started and retry_in:
            # Nothing was submitted anywhere: wait for the next re-resolve attempt (its back-off).
            self._down_since = self._down_since or time.monotonic()
            time.sleep(max(0.0, min(*retry_in, t_end - time.monotonic())))
        return started

    def _finish_all(
        self, pending: dict[str, PendingInference], runs: dict[str, HeroRun], result: SamplerResult
    ) -> dict[str, np.ndarray] | None:
        """Every hero's answer to one step (keys ``<hero>/<output>``), or None when none came."""
        from lowtail.shm.queue import QueueError, QueueTimeout

        out: dict[str, np.ndarray] = {}
        for hero, p in pending.items():
            run = runs[hero]
            client = self._clients[hero]
            try:
                got = client.finish(p)
            except (QueueError, RequestLost) as e:
                # A dead worker or actor fails what it held: count it, keep sampling. A request that only
                # timed out is given up here, so it must not stay counted in flight.
                if isinstance(e, QueueTimeout):
                    client.abandon(p)
                self._down_since = self._down_since or time.monotonic()
                run.failed += 1
                run.errors[type(e).__name__] = run.errors.get(type(e).__name__, 0) + 1
                continue
            now = time.monotonic()
            run.answered += 1
            run.answer_s.append(now)
            run.replica.append(p.target)
            run.sent_s.append(p.sent_s)
            if self._down_since is not None:
                result.recovery_s.append(now - self._down_since)
                self._down_since = None
            for name, value in got.items():
                out[f"{hero}/{name}"] = value
        return out or None

    def _push(self, result: SamplerResult, last: bool = False) -> None:
        """The series and samples since the last push, to the node's metrics hub. The ``last`` push of a
        run is waited for (bounded): a caller that flushes the hub once the run returned, then stops
        this actor, would otherwise race it (Ray orders no calls of different callers, and a call a
        stopped actor had not sent is lost), and a short run's samples could miss every window."""
        merged: dict[str, list[float]] = {}
        samples = 0
        for client in self._clients.values():
            series, n = client.take_series()
            samples += n
            for name, values in series.items():
                merged.setdefault(name, []).extend(values)
        result.rpc_ms.extend(merged.get("rpc_elapsed_ms", []))
        if self._metrics is not None:
            ref = self._metrics.push.remote(self._owner, {k: v for k, v in merged.items() if v}, samples)
            if last:
                try:
                    ray.get(ref, timeout=LAST_PUSH_TIMEOUT_S)
                except ray.exceptions.RayError as e:  # a hub gone or stalled: the run's result stands
                    log.warning("the last metrics push of %s was not confirmed: %s", self._owner, e)

    def shutdown(self) -> None:
        if self._init_error is not None:
            return  # the failed constructor released its lease
        for c in self._clients.values():
            c.close()
        ray.get(self._alloc.release.remote(self._owner, caller_node=self._node))


SamplerActor = ray.remote(num_cpus=0, max_restarts=0)(SamplerActorImpl)


def start_sampler(
    spec: SamplerSpec,
    endpoints: Sequence[Endpoint],
    node_id: str | None = None,
    start_timeout_s: float = START_TIMEOUT_S,
) -> Any:
    """Create a sampler actor next to its inference actors (their node, unless told otherwise)."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    node = node_id or (endpoints[0].node_id if endpoints else ray.get_runtime_context().get_node_id())
    handle = SamplerActor.options(
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id=node, soft=False),
        **lease_resources(spec.allocator, node),
    ).remote(spec, list(endpoints))
    await_started(handle, handle.lease, f"sampler {spec.name}", node, start_timeout_s)
    return handle
