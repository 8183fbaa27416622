"""An example sampler actor: a synthetic game stepped with the policy's actions.

``SamplerActor`` leases a ``sample:`` CPU near its inference actors, pins the thread that runs its
environment and client to it, and steps a synthetic environment with the policy's actions through an
``InferenceClient`` (``lowtail.actors.client``). It is placed with ``NodeAffinitySchedulingStrategy(node,
soft=False)`` on the node of its inference actors (``start_sampler`` takes the endpoints' node).
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np
import ray

from lowtail.actors.allocator import AllocatorConfig, get_node_allocator
from lowtail.actors.client import InferenceClient, PendingInference, RequestLost
from lowtail.actors.endpoint import (
    Endpoint,
    EndpointDown,
)
from lowtail.actors.inference import (
    START_TIMEOUT_S,
    await_started,
    keep_threads_off,
    lease_resources,
)
from lowtail.actors.metrics import MetricsConfig, get_node_metrics
from lowtail.lease import Lease

log = logging.getLogger(__name__)


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
