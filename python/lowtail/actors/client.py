"""The sampler-side client of a hero's inference actors (``lowtail.actors.inference``).

``InferenceClient`` attaches once to the queues of several inference actors **on its own node** and
spreads calls over them round robin, synchronously (``infer``) or in two phases (``start`` then
``finish``, the predecessor system's ``infer_batch_async_start/finish``). An endpoint on another node is
refused before anything is attached: shared memory does not cross nodes, and waiting on it would hang.

Restarts: a killed worker fails only the requests it had claimed (``WorkerDied``); a killed inference
actor is restarted by Ray with a new queue, and every request left on the old one fails (``WorkerDied``
or ``RequestLost``). The client then re-resolves the named actor's endpoint by itself, backing off while
it is down (``EndpointDown`` carries the wait); callers sleep that long, never spin.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, cast

import numpy as np
import ray

from lowtail.actors.endpoint import (
    ACTOR_NAMESPACE,
    Endpoint,
    EndpointDown,
    NoEndpoints,
    check_same_node,
    queue_owner,
)
from lowtail.errors import LowtailError
from lowtail.node.process import process_start_time

log = logging.getLogger(__name__)


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
