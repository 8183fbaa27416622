"""The sampler-side client of a hero's inference actors (``lowtail.actors.inference``).

``InferenceClient`` attaches once to the queues of several inference actors **on its own node** (the
replicas of one hero) and spreads calls over them round robin, synchronously (``infer``) or in two
phases (``start`` then ``finish``, the predecessor system's ``infer_batch_async_start/finish``). An
endpoint on another node is refused before anything is attached: shared memory does not cross nodes,
and waiting on it would hang.

Failover across replicas:

- A replica is *down* when no worker serves its queue (the worker's lifetime lock on the queue is not
  held: killed, restarting) or its attachment is lost (its actor died with its queue). Round robin skips
  a down replica at once while another one serves; with a single replica (or all down but one whose
  queue is still there) the request is published anyway and waits for the standby or the restarted
  worker, bounded by the timeout.
- A request published to a replica that goes down before a worker claimed it is moved to a serving
  replica of the same client, **once**: it is first withdrawn from the old queue (then no worker can
  ever claim it) or, when the old queue's actor is gone and no worker holds the queue, nothing can
  answer it any more. When no replica serves and the old queue's actor is gone, it moves to a replica
  whose actor lives and whose worker is restarting (it is served then, within the timeout) rather than
  failing: ``RequestLost`` only when no replica of the client has a live actor. A request the dead
  worker had claimed fails with ``WorkerDied`` (it may have run: never re-run silently).
- ``start()`` never waits on Ray: a lost endpoint is re-resolved by a background thread (``ray.get_actor``
  and the actor's ``endpoint()``, which answers only once its worker serves again), and ``start()`` only
  picks up the result. It takes at most a few fcntl calls and one queue attach (well under
  ``START_BOUND_S``); when no replica can take the request it raises ``EndpointDown`` with
  ``retry_in_s``, the back-off until the next re-resolve attempt (callers sleep that long, never spin).

Timings: every finished ``PendingInference`` carries ``timing`` (the queue's per-request breakdown, see
``RequestTiming``); ``take_window()`` hands the client's series over to the metrics export under the
predecessor's names (``rpc_elapsed_ms``, ``queue_wait_ms``, ``infer_exec_ms``, ``client_overhead_ms``).
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
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
from lowtail.shm import ofd_lock
from lowtail.shm.client import wait_first as queue_wait_first
from lowtail.shm.errors import LaneBusy, QueueError, QueueTimeout, SegmentNotFound, WorkerDied
from lowtail.shm.layout import WORKER_LOCK_BYTE

log = logging.getLogger(__name__)

# The queue's worker holds an OFD lock on WORKER_LOCK_BYTE of the segment file for as long as it lives
# (lowtail.shm.layout): testing it from our own open file description costs one fcntl, no Ray.
START_BOUND_S = 0.05  # documented bound of start(): no Ray call, no wait (a loaded host may exceed it)
ORPHAN_CHECK_S = 0.25  # a single replica's wait re-checks that its actor lives this often
FAILOVER_CHECK_S = 0.005  # with several replicas, a waiting request re-checks its replica this often


class RequestLost(LowtailError, RuntimeError):
    """A request's queue lost its inference actor: no worker will ever answer it (the actor restarts
    with a new queue, which the client re-resolves)."""


class ReplicaBusy(EndpointDown, LaneBusy):
    """The caller's own requests in flight and held zero-copy outputs fill its lane of the chosen replica:
    backpressure, nothing submitted, no replica lost. An ``EndpointDown`` (a caller that backs off on it
    keeps doing so, ``retry_in_s``) and a ``LaneBusy`` (``finish`` or ``release`` one first)."""


# Errors after which an attachment is given up and the endpoint re-resolved when the queue's actor is
# gone too: its worker or its queue is. A timeout is not one of them: the request stays in flight. Nor
# is LaneBusy (the caller's own requests fill its lane: backpressure, the replica is healthy), nor
# AnswerLost (the request ran: it must not be sent again).
LOST_ERRORS: tuple[type[BaseException], ...] = (WorkerDied, SegmentNotFound, RequestLost)


@dataclass
class PendingInference:
    """Phase one's handle: finish it (phase two) to get the outputs.

    ``inputs`` are kept, not copied, so that a request whose replica goes down before a worker claimed
    it can be sent to another replica: do not modify them in place before ``finish``. After ``finish``,
    ``timing`` is the queue's breakdown of this request (``None`` before, or when the queue gave none).
    """

    target: int
    pending: Any  # lowtail.shm.queue.Pending
    t0_ns: int
    samples: int
    inputs: Mapping[str, np.ndarray] | None = None
    moved: bool = False  # already sent to another replica once (never twice)
    claimed: bool = False  # a withdrawal found it claimed by its worker: it may have run, never moved
    timing: Any = None  # lowtail.shm.client.RequestTiming after finish
    sent_s: float = 0.0  # CLOCK_MONOTONIC of its (last) publication: a moved request's is the move

    def release(self) -> None:
        """Give back the zero-copy outputs of ``finish(p, copy=False)``: refused (``QueueError``) while
        an array taken from them is still referenced; a no-op after a copying ``finish``."""
        release = getattr(self.pending, "release", None)
        if release is not None:
            release()

    def done(self) -> bool:
        """True when its answer (or its error) is there: ``finish`` then returns without waiting."""
        try:
            return bool(self.pending.done())
        except (QueueError, ValueError):
            return True  # its queue is gone: finish() reports how


def wait_first(pendings: Sequence[PendingInference], timeout_s: float) -> PendingInference | None:
    """The first of ``pendings`` whose answer is there (``finish`` it next), or None after ``timeout_s``.

    The queue's ``wait_first`` over their requests: it spins and parks on the first one's lane, and
    looks at the other replicas' lanes every WAIT_FIRST_OTHERS_S.
    """
    if not pendings:
        return None
    try:
        first = queue_wait_first([p.pending for p in pendings], timeout_s, slice_s=WAIT_FIRST_OTHERS_S)
    except QueueTimeout:
        return None
    return next(p for p in pendings if p.pending is first)


# How often ``wait_first`` looks at requests of other replicas than the first one's (their answers
# do not wake it): a sampler stepping a few games across replicas waits at most this long too much.
WAIT_FIRST_OTHERS_S = 50e-6


@dataclass
class _Target:
    """One inference actor as this client sees it: its queue attachment, or why and until when not."""

    endpoint: Endpoint
    client: Any = None  # lowtail.shm.queue.QueueClient; None while broken
    lock_fd: int = -1  # our own open file description of the queue's segment (worker liveness)
    in_flight: int = 0  # requests started on ``client`` and not finished
    broken: str | None = None  # why the attachment was given up
    retry_at: float = 0.0  # monotonic time of the next re-resolve attempt
    backoff_s: float = 0.0
    owner: tuple[int, int | None] = (0, None)  # the queue's creator (the actor): pid, start time
    resolver: threading.Thread | None = None  # a re-resolve in the background
    resolved: Endpoint | None = None  # its result, picked up by the caller's thread
    resolve_error: str | None = None


class InferenceClient:
    """Round robin over the inference actors (replicas) of this node, sync or two-phase, with failover.

    See the module's docstring for the failover rules. Records each request's round trip and the rest
    of its timing for the metrics export; ``take_window()`` hands them over and starts a new window.
    Not thread-safe: one client per sampler thread.
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
        self._series: dict[str, list[float]] = {name: [] for name in WINDOW_SERIES}
        self._samples = 0
        self.requests = 0
        self.total_samples = 0
        self.reattached = 0
        self.moved = 0  # requests sent to another replica after theirs went down unclaimed

    @property
    def endpoints(self) -> tuple[Endpoint, ...]:
        return tuple(t.endpoint for t in self._targets)

    @classmethod
    def from_actors(cls, handles: Sequence[Any], **kwargs: Any) -> InferenceClient:
        return cls(ray.get([h.endpoint.remote() for h in handles]), **kwargs)

    # --- attachments (control plane) --------------------------------------------------------------------

    def _attach(self, t: _Target, ep: Endpoint) -> None:
        from lowtail.shm.queue import QueueClient

        client = QueueClient.attach(ep.descriptor)
        try:
            fd = os.open(ep.descriptor.path, os.O_RDONLY | os.O_CLOEXEC)
        except OSError as e:
            client.close()
            raise SegmentNotFound(f"{ep.actor}: queue {ep.descriptor.path} vanished: {e}") from e
        self._close_target(t)
        t.client, t.lock_fd = client, fd
        t.endpoint, t.broken, t.backoff_s, t.in_flight = ep, None, 0.0, 0
        t.owner = queue_owner(ep)

    @staticmethod
    def _close_target(t: _Target) -> None:
        if t.client is not None:
            t.client.close()
            t.client = None
        if t.lock_fd >= 0:
            os.close(t.lock_fd)
            t.lock_fd = -1

    @staticmethod
    def _serving(t: _Target) -> bool:
        """A worker holds ``t``'s queue (one fcntl): requests published now are claimed soon."""
        return t.broken is None and t.lock_fd >= 0 and ofd_lock.held(t.lock_fd, WORKER_LOCK_BYTE)

    @staticmethod
    def _orphaned(t: _Target) -> bool:
        """The queue's creator is gone: its worker exits too and no new one will attach."""
        pid, start = t.owner
        return bool(pid) and (start is None or process_start_time(pid) != start)

    def _lose(self, t: _Target, error: BaseException | str) -> None:
        """Give up ``t``'s attachment (now, or when its last request in flight is finished)."""
        if t.broken is None:
            t.broken = error if isinstance(error, str) else f"{type(error).__name__}: {error}"
            t.retry_at = time.monotonic()  # the first re-resolve is immediate; later ones back off
            log.warning("%s: lost (%s); re-resolving its endpoint", t.endpoint.actor, t.broken)
        if t.in_flight == 0:
            self._close_target(t)

    def _resolve_in_background(self, t: _Target) -> None:
        """Ask Ray for ``t``'s endpoint again, off the caller's thread (``ray.get`` may take seconds:
        the actor answers once its worker serves)."""
        actor, timeout_s, node = t.endpoint.actor, self.resolve_timeout_s, self.node_id

        def resolve() -> None:
            try:
                if not ray.is_initialized():
                    raise LowtailError("Ray is not initialized in this process: cannot re-resolve")
                handle = ray.get_actor(actor, namespace=ACTOR_NAMESPACE)
                ep = cast(Endpoint, ray.get(handle.endpoint.remote(), timeout=timeout_s))
                check_same_node([ep], node)
                t.resolved = ep
            except (ValueError, ray.exceptions.RayError, LowtailError) as e:
                # ValueError: the name is not registered (yet); RayError: dead, restarting, too slow.
                t.resolve_error = f"{type(e).__name__}: {e}"

        t.resolved, t.resolve_error = None, None
        t.resolver = threading.Thread(target=resolve, name=f"resolve-{actor}", daemon=True)
        t.resolver.start()

    def _poll_resolve(self, t: _Target, now: float) -> bool:
        """Start or pick up the re-resolve of a broken target; True once it is attached again."""
        if t.resolver is None:
            if t.client is None and now >= t.retry_at:
                self._resolve_in_background(t)
            return False
        if t.resolver.is_alive():
            return False
        t.resolver = None
        error = t.resolve_error
        if t.resolved is not None:
            try:
                self._attach(t, t.resolved)
            except (QueueError, LowtailError) as e:
                error = f"{type(e).__name__}: {e}"
        if error is not None:
            t.backoff_s = min(self.max_backoff_s, max(self.backoff_s, 2 * t.backoff_s))
            t.retry_at = time.monotonic() + t.backoff_s
            t.broken = f"{t.broken}; re-resolve failed ({error})"[-2000:]
            return False
        self.reattached += 1
        log.info("%s: re-attached (worker pid %d)", t.endpoint.actor, t.endpoint.worker_pid)
        return True

    def _next_target(self) -> int:
        """The next serving target in turn; else one whose queue is still there (its worker restarts
        or its standby takes over: the request waits); else ``EndpointDown``. Never waits on Ray."""
        now = time.monotonic()
        fallback = -1
        for _ in range(len(self._targets)):
            i = next(self._order)
            t = self._targets[i]
            if t.broken is not None and not self._poll_resolve(t, now):
                continue
            if self._serving(t):
                return i
            if self._orphaned(t):  # no worker and no actor: start re-resolving it now
                self._lose(t, f"queue of {t.endpoint.actor} lost its actor")
                self._poll_resolve(t, now)
            elif fallback < 0:
                fallback = i
        if fallback >= 0:
            return fallback
        due = [t.retry_at for t in self._targets if t.broken is not None]
        retry_in = max((min(due) - time.monotonic()) if due else 0.0, self.backoff_s)
        why = "; ".join(f"{t.endpoint.actor}: {t.broken or 'no worker'}" for t in self._targets)
        raise EndpointDown(f"no inference actor can take a request: {why}", retry_in_s=retry_in)

    def _serving_other(self, exclude: int) -> int:
        """A serving target other than ``exclude`` (round robin), or -1."""
        for _ in range(len(self._targets)):
            i = next(self._order)
            if i != exclude and self._serving(self._targets[i]):
                return i
        return -1

    def _standing_other(self, exclude: int) -> int:
        """A target other than ``exclude`` whose queue is attached and whose actor lives (its worker
        restarts or its standby is starting: a request published there is served then), or -1."""
        for _ in range(len(self._targets)):
            i = next(self._order)
            t = self._targets[i]
            if i != exclude and t.broken is None and t.client is not None and not self._orphaned(t):
                return i
        return -1

    # --- requests -------------------------------------------------------------------------------------

    def infer(self, inputs: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Synchronous: the next serving actor in turn serves this batch (owned copies).

        The request and its first wait, up to one failover check's time, are the queue's one call
        (``QueueClient.infer_or_pending``); a request it leaves unanswered goes ``finish``'s way (its
        failover checks first when the call waited a whole check), and one answered with an error
        raises there, as after ``start``. A timed-out request is abandoned: no caller holds it.
        """
        i = self._next_target()
        t = self._targets[i]
        check_s = min(FAILOVER_CHECK_S if len(self._targets) > 1 else ORPHAN_CHECK_S, self.timeout_s)
        t0 = time.perf_counter_ns()
        got = self._submit(t, inputs, t.client.infer_or_pending, check_s)
        samples = len(next(iter(inputs.values())))
        if type(got) is dict:
            t.in_flight -= 1
            self._record(t.client.last_request_timing, samples, t0)
            return got
        p = PendingInference(i, got, t0, samples, inputs, sent_s=time.monotonic())
        waited_s = (time.perf_counter_ns() - t0) / 1e9
        try:  # the checks first only when the call waited a check's time (not a sleep first, no plan)
            return dict(
                self._finish(p, time.monotonic() + self.timeout_s - waited_s, {}, waited_s >= check_s)
            )
        except QueueTimeout:
            self.abandon(p)  # the caller holds no handle: its slot returns once it is answered
            raise

    def start(self, inputs: Mapping[str, np.ndarray]) -> PendingInference:
        """Phase one: publish the batch to the next serving actor in turn and return at once.

        Never waits (see ``START_BOUND_S``); raises ``EndpointDown`` (nothing submitted) when no replica
        can take it; ``ReplicaBusy`` (an ``EndpointDown`` and a ``LaneBusy``: nothing submitted, the
        replica stays in use) when the caller's own requests in flight and held zero-copy outputs fill
        the chosen replica's lane: ``finish`` or ``release`` one first.
        """
        i = self._next_target()
        t = self._targets[i]
        t0 = time.perf_counter_ns()
        pending = self._submit(t, inputs, t.client.start)
        return PendingInference(
            i, pending, t0, len(next(iter(inputs.values()))), inputs, sent_s=time.monotonic()
        )

    def _submit(self, t: _Target, inputs: Mapping[str, np.ndarray], send: Any, *args: Any) -> Any:
        """``send(inputs, *args)`` (``t``'s ``start`` or ``infer_or_pending``), counted in flight; what
        it raises was raised before anything was published."""
        try:
            pending = send(inputs, *args)
        except LaneBusy as e:
            raise ReplicaBusy(f"{t.endpoint.actor}: {e}", retry_in_s=self.backoff_s) from e
        except LOST_ERRORS as e:
            self._lose(t, e)
            raise EndpointDown(f"{t.endpoint.actor}: {e}", retry_in_s=self.backoff_s) from e
        t.in_flight += 1
        return pending

    def _move(self, p: PendingInference) -> bool:
        """Send ``p`` to another serving replica, once, if its own is down and no worker can ever
        claim it there; False (nothing changed) otherwise."""
        old = self._targets[p.target]
        if p.moved or p.inputs is None or len(self._targets) < 2 or self._serving(old):
            return False
        j = self._serving_other(p.target)
        if j < 0 and self._orphaned(old):
            # Its queue lost its actor: nothing will ever answer it there. A replica whose worker is
            # restarting will (within the timeout), so it waits there rather than failing RequestLost.
            j = self._standing_other(p.target)
        if j < 0:
            return False
        withdraw = getattr(p.pending, "withdraw", None)
        if withdraw is not None:
            if not withdraw():
                p.claimed = True
                return False  # claimed meanwhile: its answer or WorkerDied comes
        elif not (
            self._orphaned(old) and old.lock_fd >= 0 and not ofd_lock.held(old.lock_fd, WORKER_LOCK_BYTE)
        ):
            return False  # the queue may get a worker again: it may still claim the request
        else:
            p.pending.client.abandon(p.pending.ticket)  # nobody can answer it: give the slot up
        old.in_flight -= 1
        if old.broken is not None or self._orphaned(old):
            self._lose(old, old.broken or f"queue of {old.endpoint.actor} lost its actor")
        new = self._targets[j]
        p.pending = self._submit(new, p.inputs, new.client.start)
        p.target, p.moved, p.sent_s = j, True, time.monotonic()
        self.moved += 1
        return True

    def finish(
        self, p: PendingInference, timeout_s: float | None = None, copy: bool = True
    ) -> Mapping[str, np.ndarray]:
        """Phase two: wait for that batch's outputs.

        A request the dead worker had claimed fails (``WorkerDied``). One not yet claimed is moved to
        another serving replica (once), else waits for the standby or restarted worker, unless the
        queue's inference actor is gone (``RequestLost``). The liveness checks run only past a normal
        round trip (every ``FAILOVER_CHECK_S`` with several replicas, ``ORPHAN_CHECK_S`` with one).
        ``QueueTimeout``: still in flight; wait again or ``abandon`` it.

        ``copy=False``: the outputs are read-only views of the answer in shared memory (no copy; the
        queue's ``HeldOutputs``), valid until ``p.release()``; the slot is not reused meanwhile, and any
        access after the release raises ``QueueError`` (never a read of a later answer).
        """
        deadline = time.monotonic() + (self.timeout_s if timeout_s is None else timeout_s)
        return self._finish(p, deadline, {} if copy else {"copy": False})

    def _finish(
        self, p: PendingInference, deadline: float, kw: dict[str, Any], check_first: bool = False
    ) -> Mapping[str, np.ndarray]:
        """``finish`` until ``deadline`` (monotonic s); ``check_first``: the failover checks before the
        first wait (``infer``'s one call has waited already)."""
        check_s = FAILOVER_CHECK_S if len(self._targets) > 1 else ORPHAN_CHECK_S
        if check_first:
            self._failed_over(p, self._targets[p.target])
        while True:
            t = self._targets[p.target]
            left = deadline - time.monotonic()
            try:
                out: Mapping[str, np.ndarray] = p.pending.finish(timeout_s=max(0.0, min(left, check_s)), **kw)
                break
            except QueueTimeout:
                if self._failed_over(p, t):
                    continue
                if left <= check_s:
                    raise  # still in flight: the caller may wait again
            except QueueError as e:
                t.in_flight -= 1
                if t.broken is not None or (isinstance(e, LOST_ERRORS) and self._orphaned(t)):
                    self._lose(t, e)
                raise
        t.in_flight -= 1
        if t.broken is not None:
            self._lose(t, t.broken)  # its last answer taken: drop the old attachment
        p.timing = getattr(p.pending, "timing", None)
        self._record(p.timing, p.samples, p.t0_ns)
        return out

    def _failed_over(self, p: PendingInference, t: _Target) -> bool:
        """After a wait for ``p`` (on ``t``) timed out: True when it moved to another replica (or its
        answer came meanwhile); raises ``RequestLost`` (or ``WorkerDied`` when a worker had claimed it:
        it may have run) when nothing can answer it."""
        # Seen gone before _move looks, so _move saw it gone too and tried to move it: a worker dying
        # between _move's look and this one must not turn a movable request into a loss.
        gone = self._orphaned(t) and not self._serving(t)
        if self._move(p):
            return True
        if gone and not self._serving(t):
            if p.done():
                return True  # answered meanwhile: its ``finish`` reads it
            claimed = p.claimed or p.pending.claimed()  # (read before the attachment is dropped)
            t.in_flight -= 1
            self._lose(t, f"queue of {t.endpoint.actor} lost its actor")
            if claimed:  # its worker took it, then died with its actor: it may have run
                raise WorkerDied(
                    f"{t.endpoint.actor}: its worker claimed this request and died with its "
                    f"actor (pid {t.owner[0]}); it may have run: not sent again"
                ) from None
            raise RequestLost(
                f"{t.endpoint.actor}: its actor (pid {t.owner[0]}) is gone with its queue "
                f"{t.endpoint.descriptor.name}; this request will not be answered"
            ) from None
        return False

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
            self._lose(t, t.broken)

    # --- timings -----------------------------------------------------------------------------------------

    def _record(self, timing: Any, samples: int, t0_ns: int) -> None:
        """One answered request of ``samples`` into the series: its ``RequestTiming``, or without one
        its round trip since ``t0_ns`` (``perf_counter_ns``)."""
        end_ns = time.perf_counter_ns()
        s = self._series
        if timing is not None:
            s["rpc_elapsed_ms"].append(timing.round_trip_s * 1e3)
            s["queue_wait_ms"].append(timing.queue_wait_s * 1e3)
            s["infer_exec_ms"].append(timing.engine_s * 1e3)
            s["client_overhead_ms"].append(timing.client_overhead_s * 1e3)
        else:
            s["rpc_elapsed_ms"].append((end_ns - t0_ns) / 1e6)
        self._samples += samples
        self.requests += 1
        self.total_samples += samples

    def take_window(self) -> tuple[list[float], int]:
        """Round trips (ms) and samples since the last call (``take_series`` for every series)."""
        series, samples = self.take_series()
        return series["rpc_elapsed_ms"], samples

    def take_series(self) -> tuple[dict[str, list[float]], int]:
        """The sampler-side series since the last call (ms; names in ``WINDOW_SERIES``) and samples."""
        series, self._series = self._series, {name: [] for name in WINDOW_SERIES}
        samples, self._samples = self._samples, 0
        return series, samples

    def status(self) -> list[dict[str, Any]]:
        """Each replica as this client sees it (for diagnosis)."""
        return [
            {
                "actor": t.endpoint.actor,
                "serving": self._serving(t),
                "broken": t.broken,
                "in_flight": t.in_flight,
                "resolving": t.resolver is not None,
            }
            for t in self._targets
        ]

    def close(self) -> None:
        for t in self._targets:
            self._close_target(t)

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# The sampler-side series, under the predecessor's names (its client's rpc_elapsed_s, queue_wait_s,
# infer_exec_s, client_overhead_s, in ms): exported as sample_infos/sl_remote_<name>.
WINDOW_SERIES = ("rpc_elapsed_ms", "queue_wait_ms", "infer_exec_ms", "client_overhead_ms")
