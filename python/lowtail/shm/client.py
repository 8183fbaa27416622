"""The client side of the queue: a sampler's lane, its tickets, and the hot path ``submit`` / ``wait``.

A client (``QueueClient.attach``) takes a free lane under its OFD byte lock, registers by bumping the
lane's gen, and owns the lane's slots: it writes a request, publishes it with the doorbell, then
spins and parks on the lane's answer counter until the worker's resp_seq matches. Field
offsets and their single writers are in ``lowtail.shm.layout``.
"""

from __future__ import annotations

import math
import os
import time
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, overload

import numpy as np

from lowtail.shm import native, ofd_lock, payload
from lowtail.shm.control import Mapped, QueueDescriptor, attach_mapped, deadline_ns, spec_text
from lowtail.shm.errors import (
    AnswerLost,
    BadRequest,
    LaneBusy,
    LaneUnavailable,
    PayloadTooLarge,
    QueueError,
    QueueTimeout,
    RequestFailed,
    RequestWithdrawn,
    SegmentNotFound,
    WorkerDied,
)
from lowtail.shm.futex import FutexWaiter, full_barrier, futex_wait, futex_wake
from lowtail.shm.layout import (
    CALL_BATCH_MASK,
    CALL_DESCHEDULE_SHIFT,
    FREE,
    HW_DOORBELLS,
    HW_WORKER_PID,
    HW_WORKER_SLEEP,
    INHERITED,
    L_GEN,
    L_PARKED,
    L_PID,
    L_RESP_COUNT,
    L_RING,
    L_TAIL,
    READY,
    S_CLAIM_SEQ,
    S_REQ_SEQ,
    S_REQ_STATE,
    S_RESP_SEQ,
    ST_BAD_REQUEST,
    ST_CLIENT_GONE,
    ST_FAILED,
    ST_OK,
    ST_TOO_LARGE,
    ST_WITHDRAWN,
    ST_WORKER_DIED,
    U64_MAX,
    U64_WRAP,
    W_CALL,
    W_CALL_ENGINE_NS,
    W_CLAIM_NS,
    W_CLAIM_SEQ,
    W_DONE_NS,
    W_REQ_LEN,
    W_REQ_SEQ,
    W_REQ_STATE,
    W_RESP_LEN,
    W_RESP_SEQ,
    W_RESP_STATUS,
    W_SUBMIT_NS,
    W_WITHDRAWN,
    WORKER_LOCK_BYTE,
    WRITING,
    client_lock_byte,
)
from lowtail.shm.payload import (
    Arrays,
    AttachedNdarraySegments,
    NdarraySegment,
    NdarraySegmentPool,
    PayloadLayout,
)

_STATUS_ERRORS: dict[int, type[QueueError]] = {
    ST_FAILED: RequestFailed,
    ST_BAD_REQUEST: BadRequest,
    ST_TOO_LARGE: PayloadTooLarge,
    ST_WORKER_DIED: WorkerDied,
    ST_CLIENT_GONE: RequestFailed,
    ST_WITHDRAWN: RequestWithdrawn,
}
# Waiting (docs/benchmarks.md has the figures behind each constant). A wait spins without system calls,
# then parks on the futex; it never calls sched_yield, which on a shared CPU gives the CPU away for a tick.
PURE_SPIN_NS = 20_000  # the spin of a wait whose answer is not predicted within the spin budget
PARK_SLICE_S = 0.02  # a parked client re-checks worker liveness this often (50 wake-ups/s, ~0.05% CPU)
PARK_SLICE_NS = int(PARK_SLICE_S * 1e9)
# Predictive waiting: a client learns how long its answers take and sleeps until just before the next,
# so the answer lands while it spins and the worker makes no wake-up call.
# (LATE_WINDOW and PREDICT_UP_SHIFT: the core's round trip learns with copies of them, held equal by a test)
LATE_WINDOW = 0xFF  # the last 8 answers, one bit each: was it later than prediction + spin budget
MAX_LATE = 2  # more late answers than this in the window: waits vary too much to predict, do not sleep
PREDICT_UP_SHIFT = 2  # the prediction rises by 1/4 of the gap after a longer answer (drops at once)
MARGIN_NS = 50_000  # wake this long before the predicted answer; shorter round trips never sleep
MIN_TIMED_PARK_NS = 50_000  # a shorter sleep saves less spinning than its two context switches cost
OVERSLEEP_SHIFT = 3  # the futex timeout's learned lateness rises at once and decays by 1/8 per sleep
MAX_OVERSLEEP_NS = (
    1_000_000  # one oversleep counts at most this much: a preempted sleep cannot cancel the next
)


# Whether a client spins at all: only a client with an isolated CPU of its own spins (the queue's
# ``client_spin_us``); every other parks at once, since a spinning sampler burns the CPU it shares.
# "Its own": the waiting thread's affinity is one CPU, isolated by the kernel, and no other live client
# of this queue runs there. Decided once at attach (``spin_us`` overrides).
ISOLATED_CPUS_PATH = "/sys/devices/system/cpu/isolated"


@dataclass(frozen=True, slots=True)
class SpinPolicy:
    """The spin budget a client chose and why (``QueueClient.spin_policy``)."""

    spin_us: int
    own_cpu: bool
    reason: str


def isolated_cpus(path: str | None = None) -> frozenset[int]:
    """The CPUs the running kernel isolated (empty when none, or when the file cannot be read)."""
    from lowtail.node import cpulist

    try:
        with open(path or ISOLATED_CPUS_PATH) as f:
            text = f.read().strip()
    except OSError:
        return frozenset()
    try:
        return frozenset(cpulist.parse(text)) if text else frozenset()
    except ValueError:
        return frozenset()  # unreadable: treat as not isolated (park), the cheap side to err on


def choose_spin(
    budget_us: int,
    affinity: frozenset[int] | set[int],
    isolated: frozenset[int],
    peer_affinities: Mapping[int, frozenset[int]],
) -> SpinPolicy:
    """The default spin budget: ``budget_us`` on a CPU of the client's own, else 0 (see above).

    ``peer_affinities``: the other live clients of the queue, pid -> affinity mask.
    """
    if len(affinity) != 1:
        cpus = ",".join(str(c) for c in sorted(affinity))
        return SpinPolicy(0, False, f"affinity is {len(affinity)} CPUs ({cpus}), not one of its own: park")
    (cpu,) = affinity
    if cpu not in isolated:
        return SpinPolicy(
            0, False, f"CPU {cpu} is not isolated by the kernel (shared with other tasks): park"
        )
    sharing = sorted(pid for pid, mask in peer_affinities.items() if cpu in mask)
    if sharing:
        return SpinPolicy(0, False, f"CPU {cpu} is shared with the clients of pids {sharing}: park")
    return SpinPolicy(budget_us, True, f"CPU {cpu} is isolated and its own: spin up to {budget_us} us")


def next_prediction_ns(predicted_ns: int, latency_ns: int) -> int:
    """The predicted submit-to-answer time after an answer that took ``latency_ns`` (0: none yet)."""
    if latency_ns < predicted_ns or predicted_ns == 0:
        return latency_ns
    return predicted_ns + ((latency_ns - predicted_ns) >> PREDICT_UP_SHIFT)


def park_until_ns(submit_ns: int, now_ns: int, predicted_ns: int, margin_ns: int) -> int:
    """Until when a wait that starts at ``now_ns`` sleeps before it spins; 0: spin at once."""
    until = submit_ns + predicted_ns - margin_ns
    return until if predicted_ns and until - now_ns >= MIN_TIMED_PARK_NS else 0


def _read_message(m: Mapped, g: int, n: int) -> str:
    """The error message the worker wrote into the response region of slot ``g`` (clamped to it)."""
    off = m.geo.resp_off(g)
    n = max(0, min(n, m.geo.resp_bytes))
    return bytes(m.buf[off : off + n]).decode("utf-8", "replace")


@dataclass(frozen=True, slots=True)
class RequestTiming:
    """Where one request's time went (seconds; CLOCK_MONOTONIC, the same clock in every process).

    ``queue_wait_s``: publication -> the worker's claim. ``engine_s``: ``infer()`` wall time of the
    engine call the request rode in, and ``batch_size`` the samples of that call (its own and those
    merged with it). ``call_deschedule_s``: that call's wall time minus the serving thread's CPU time,
    from its claim to its answer (time the worker was runnable or preempted, not computing).
    ``client_overhead_s``: this client's own work, the copy-in before publication plus the copy-out
    after the answer. ``round_trip_s``: publication -> the worker's answer stamp (when the answer was
    ready, not when the caller came back for it). ``ready_to_return_s``: answer stamp -> ``wait``
    returning (the client's wake-up and copy-out). ``queue_wait_s + engine_s <= round_trip_s``.
    Error answers carry them too; call figures are 0 for an answer no engine call made (an error).
    """

    queue_wait_s: float
    engine_s: float
    batch_size: int
    call_deschedule_s: float
    client_overhead_s: float
    round_trip_s: float
    ready_to_return_s: float


@dataclass(slots=True, weakref_slot=True)
class Ticket:
    """A submitted request; ``QueueClient.wait`` turns it into outputs once."""

    slot: int
    seq: int
    batch: int
    submit_ns: int
    consumed: bool = False
    copy_in_ns: int = 0
    # The answer's stamps as read by wait: claim_ns, done_ns, call engine ns, call word, seen, returned.
    stamps: tuple[int, int, int, int, int, int] | None = None
    held: HeldOutputs | None = None  # zero-copy outputs not yet released
    # When a one-call's core saw the answer, already counted there (``wait`` reads it, counts nothing).
    seen_ns: int = 0

    @property
    def timing(self) -> RequestTiming | None:
        """The request's ``RequestTiming`` once ``wait`` took its answer (None before, or without one)."""
        st = self.stamps
        if st is None:
            return None
        claim, done, engine, call, seen, end = st
        return request_timing((self.submit_ns, claim, done, end), engine, call, self.copy_in_ns + end - seen)


def request_timing(
    stamps: tuple[int, int, int, int], engine: int, call: int, overhead_ns: int
) -> RequestTiming:
    """``RequestTiming`` of an answer: its ``stamps`` (submit, claim, done, returned; ns), its call's
    engine time and word, and the client's own ns (copy-in and copy-out)."""
    submit, claim, done, end = stamps
    return RequestTiming(
        queue_wait_s=(claim - submit) / 1e9,
        engine_s=engine / 1e9,
        batch_size=call & CALL_BATCH_MASK,
        call_deschedule_s=(call >> CALL_DESCHEDULE_SHIFT) / 1e6,
        client_overhead_s=overhead_ns / 1e9,
        round_trip_s=(done - submit) / 1e9,
        ready_to_return_s=(end - done) / 1e9,
    )


class HeldOutputs(Mapping[str, np.ndarray]):
    """Zero-copy outputs (``wait(..., copy=False)``): read-only views of the answer in shared memory.

    The slot is not reused while they are held. ``release()`` (or leaving a ``with`` block) gives it
    back, and refuses with ``QueueError`` while an array taken from here, or any view of one, is still
    referenced: every view is made from one base array per answer, numpy keeps that base alive under
    every view made from them, and the client holds it only weakly, so a live base means a live view
    and nothing can read a later answer through one. Every access after release raises. Dropped
    without ``release()``, the slot returns once this object and every array over it are gone.
    """

    __slots__ = ("__weakref__", "_base", "_client", "_fields", "_seq", "_slot", "_views")

    def __init__(
        self,
        client: QueueClient,
        ticket: Ticket,
        base: np.ndarray[Any, Any],
        fields: tuple[tuple[str, Any, Any, int, int], ...],
    ) -> None:
        self._client: QueueClient | None = client
        # The slot and seq, not the ticket: the ticket holds this object (no cycle for the GC to find).
        self._slot, self._seq = ticket.slot, ticket.seq
        self._fields = fields  # (name, dtype, shape, byte offset in the base, nbytes)
        self._base = weakref.ref(base)
        self._views: dict[str, np.ndarray[Any, Any]] | None = _views_of(base, fields)

    def __getitem__(self, name: str) -> np.ndarray[Any, Any]:
        return self._valid()[name]

    def _valid(self) -> dict[str, np.ndarray[Any, Any]]:
        if self._views is None:
            raise QueueError(f"zero-copy outputs of slot {self._slot} seq {self._seq} were released")
        return self._views

    def __iter__(self) -> Iterator[str]:
        return iter(self._valid())

    def __len__(self) -> int:
        return len(self._fields)

    @property
    def released(self) -> bool:
        return self._views is None

    def release(self) -> None:
        """Give the answer slot back; ``QueueError`` while an array taken from here is still referenced."""
        client = self._client
        if self._views is None or client is None:
            return
        self._views = None  # our own references: if nobody else holds a view, the base goes with them
        base = self._base()
        if base is not None:
            self._views = _views_of(base, self._fields)
            del base  # the traceback keeps this frame: a retry inside the caller's except must not find it
            raise QueueError(
                f"zero-copy outputs of slot {self._slot} seq {self._seq} are still referenced "
                f"(an array taken from them, or a view of one): drop them (del) or copy() before release(); "
                f"the slot stays held"
            )
        self._client = None
        client._free_held(self._slot)

    def copy(self) -> Arrays:
        """Owned copies of the outputs (valid after release)."""
        return {name: v.copy() for name, v in self._valid().items()}

    def __enter__(self) -> HeldOutputs:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def _into(out: Arrays, copy: bool) -> Arrays:
    """``wait``'s ``out``, refused with ``copy=False`` (zero-copy views and a copy cannot both be had)."""
    if not copy:
        raise QueueError("wait(copy=False, out=...): zero-copy views or a copy into out, not both")
    return out


def _copy_into(out: Arrays, views: Sequence[tuple[str, np.ndarray[Any, Any]]], ticket: Ticket) -> Arrays:
    """The answer's arrays ``views`` copied into the caller's ``out`` (``wait(out=...)``), checked first:
    ``out`` has exactly the answer's names, each a writable array of its dtype and shape."""
    if len(out) == len(views):
        for name, view in views:  # loops, not all() of a generator: no frames of their own
            dst = out.get(name)
            if (
                not isinstance(dst, np.ndarray)
                or dst.shape != view.shape
                or dst.dtype != view.dtype
                or not dst.flags.writeable
            ):
                break
        else:
            _refuse_shared(out, views, ticket)
            for name, view in views:
                out[name][...] = view  # the same dtype and shape: neither casts nor broadcasts
            return out
    given = ", ".join(
        f"{k}: {np.dtype(v.dtype).name}{list(v.shape)}"
        if isinstance(v, np.ndarray)
        else f"{k}: {type(v).__name__}"
        for k, v in out.items()
    )
    answer = ", ".join(f"{k}: {v.dtype.name}{list(v.shape)}" for k, v in views)
    raise QueueError(
        f"wait(out=...): out has {given or 'nothing'}, the answer to request seq {ticket.seq} has "
        f"{answer} (each name once, that dtype and shape, writable); the request ran and its answer is "
        f"dropped"
    )


def _refuse_shared(out: Arrays, views: Sequence[tuple[str, np.ndarray[Any, Any]]], ticket: Ticket) -> None:
    """Two of ``out``'s arrays over the same memory would take each other's answer: refused by name."""
    for i in range(1, len(views)):
        for j in range(i):
            a, b = views[j][0], views[i][0]
            if np.may_share_memory(out[a], out[b]):
                raise QueueError(
                    f"wait(out=...): out[{a!r}] and out[{b!r}] share memory, each answer array needs its "
                    f"own; the request ran (seq {ticket.seq}) and its answer is dropped"
                )


def _views_of(
    base: np.ndarray[Any, Any], fields: tuple[tuple[str, Any, Any, int, int], ...]
) -> dict[str, np.ndarray[Any, Any]]:
    return {name: base[off : off + n].view(dtype).reshape(shape) for name, dtype, shape, off, n in fields}


# An answer's layout as a client reads it: its prefix and header bytes (the cache key), the worker's
# ndarray segment or None (inline), each array's (name, dtype, shape, byte offset, nbytes), the
# payload's end, for an inline answer the views of its arrays in the response region, and on the native
# core its ``AnswerPlan`` (None on the Python path).
_AnswerLayout = tuple[
    bytes,
    str | None,
    tuple[tuple[str, Any, Any, int, int], ...],
    int,
    tuple[tuple[str, np.ndarray[Any, Any]], ...],
    Any,
]


class Pending:
    """The two-phase async form: ``client.start(...)`` returns at once, ``finish`` waits."""

    __slots__ = ("client", "ticket")

    def __init__(self, client: QueueClient, ticket: Ticket) -> None:
        self.client = client
        self.ticket = ticket

    def done(self) -> bool:
        """True when the answer is there (``finish`` then returns without waiting); never blocks."""
        return self.client.ready(self.ticket)

    @overload
    def finish(
        self, timeout_s: float = 1.0, *, copy: Literal[True] = True, out: Arrays | None = None
    ) -> Arrays: ...
    @overload
    def finish(self, timeout_s: float = 1.0, *, copy: Literal[False]) -> HeldOutputs: ...
    def finish(
        self, timeout_s: float = 1.0, *, copy: bool = True, out: Arrays | None = None
    ) -> Arrays | HeldOutputs:
        """``QueueClient.wait`` of this request (``out``: the caller's arrays to copy the answer into)."""
        if out is None:
            return self.client.wait(self.ticket, timeout_s, copy=copy)  # type: ignore[call-overload, no-any-return]
        return self.client.wait(self.ticket, timeout_s, copy=copy, out=out)  # type: ignore[call-overload, no-any-return]

    def claimed(self) -> bool:
        """True once a worker claimed the request: it may have run (never send it elsewhere)."""
        return self.client.claimed(self.ticket)

    def withdraw(self) -> bool:
        """Take the request back: True if no worker of this queue will ever run it (send it elsewhere),
        False if the worker claimed it first (``finish`` for its answer, ``WorkerDied`` or
        ``RequestWithdrawn``)."""
        return self.client.withdraw(self.ticket)

    def release(self) -> None:
        """Give back the zero-copy outputs of ``finish(copy=False)`` (see ``HeldOutputs.release``)."""
        if self.ticket.held is not None:
            self.ticket.held.release()

    @property
    def timing(self) -> RequestTiming | None:
        """``RequestTiming`` of the answer once ``finish`` took it; None before."""
        return self.ticket.timing


def _settled(p: Pending, dead_worker: bool) -> bool:
    """``p``'s ``finish`` will not wait: answered, claimed by a dead worker (``dead_worker``), or its
    client is closed or its queue unmapped (``finish`` says how)."""
    try:
        return p.client.ready(p.ticket) or (dead_worker and p.client._claimed_by_dead_worker(p.ticket))
    except (QueueError, ValueError):
        return True


def wait_first(
    pendings: Sequence[Pending], timeout_s: float = 1.0, *, slice_s: float | None = None
) -> Pending:
    """The first of ``pendings`` whose ``finish`` will not wait (answered, or its worker died holding it).

    Spins for the shortest spin budget among their clients, then sleeps on the answer counter of the
    first one's lane (every answer in that lane wakes it; the others are checked at least every
    ``slice_s``, WAIT_FIRST_SLICE_S by default). Raises ``QueueTimeout`` after ``timeout_s``. The one
    wait for the first of several answers: the actors' ``wait_first`` runs this one.
    """
    if not pendings:
        raise QueueError("wait_first of no pending requests")
    clock = time.monotonic_ns
    now = clock()
    spin_end = now + min(p.client._spin_ns for p in pendings)
    deadline = deadline_ns(now, timeout_s)
    while True:
        for p in pendings:
            if _settled(p, False):
                return p
        now = clock()
        if now > spin_end:
            break
    lead = pendings[0].client
    others_s = WAIT_FIRST_SLICE_S if slice_s is None else slice_s
    while True:
        for p in pendings:
            if _settled(p, True):
                return p
        now = clock()
        if now >= deadline:
            raise QueueTimeout(
                f"none of {len(pendings)} requests answered within {timeout_s} s (they stay in flight)"
            )
        # One lane: every answer in it wakes us. Several: the first lane's answers do, the others are
        # looked at every slice.
        one_lane = all(p.client is lead for p in pendings)
        wait_s = min((deadline - now) / 1e9, PARK_SLICE_S if one_lane else others_s)
        lead._sleep_on_lane(wait_s, pendings)


WAIT_FIRST_SLICE_S = 0.001


class _Prediction:
    """What a client learned about its answers (the predictive wait above ``next_prediction_ns``)."""

    __slots__ = ("late", "oversleep_ns", "predicted_ns", "spin_ns")

    def __init__(self, spin_ns: int) -> None:
        self.predicted_ns = 0  # submit to answer, learned (0: nothing learned, spin first)
        self.oversleep_ns = 0  # how late a timed futex wait returns, learned
        self.late = 0  # of the last 8 answers, those later than prediction + spin budget (bits)
        self.spin_ns = spin_ns  # the client's spin budget: what makes an answer late (the core reads it)


class _WaitCounts:
    """How a client's waits went: answers found at once, while spinning, while parked; futex waits; and
    the wall time spent spinning and parked (ns; a park's includes its wake-up and the wait for a CPU)."""

    __slots__ = ("futex_waits", "immediate", "park_ns", "parked", "spin_ns", "spinning", "timed_parks")

    def __init__(self) -> None:
        self.immediate = self.spinning = self.parked = self.timed_parks = self.futex_waits = 0
        self.spin_ns = self.park_ns = 0


class QueueClient:
    """A sampler's end of the queue: one lane, up to ``slots_per_lane`` requests in flight.

    Not thread-safe: one client per thread (a sampler loop); a process may hold several. Attach
    after ``fork``/``spawn``, never before: a forked child would share the lane's lifetime lock.
    """

    _park_at_once = False  # on the native core without a spin budget: ``wait`` calls ``_receive_parked``
    _timeout = (math.nan, 0, 0, 0)  # ``_infer_native``: the last timeout's ``_budgets`` (a NaN: none yet)
    _timing = (0, 0, 0, 0)  # the last answer's submit, claim, done and seen stamps (``last_timing``)
    # ``infer_or_pending``'s last answered call: entered, submitted, claimed, done, seen, returned (ns),
    # its engine call's ns and call word
    _one_call = (0, 0, 0, 0, 0, 0, 0, 0)

    def __init__(self, desc: QueueDescriptor, m: Mapped, lane: int, spin: SpinPolicy) -> None:
        self.descriptor = desc
        self.lane = lane
        self._m = m
        cfg, geo = desc.config, m.geo
        self._cfg = cfg
        self.spin_policy = spin
        self._spin_ns = spin.spin_us * 1000
        self._pred = _Prediction(self._spin_ns)
        q = m.q
        self._q, self._mem = q, m.mem
        self._gen = int(q[geo.lane(lane, L_GEN)]) % U64_MAX + 1
        q[geo.lane(lane, L_PID)] = os.getpid()
        q[geo.lane(lane, L_PARKED)] = 0
        self._g0, self._spl, self._req_bytes = lane * geo.spl, geo.spl, geo.req_bytes
        # per slot s of the lane: u64 index of its slot words, byte offsets of its regions
        self._si = [geo.slot_word(self._g0 + s) for s in range(geo.spl)]
        self._req_off = [geo.req_off(self._g0 + s) for s in range(geo.spl)]
        self._resp_off = [geo.resp_off(self._g0 + s) for s in range(geo.spl)]
        self._head = int(q[HW_DOORBELLS + lane])
        self._doorbell_i = HW_DOORBELLS + lane
        self._ring_i = geo.lane(lane, L_RING)
        self._parked_i = geo.lane(lane, L_PARKED)
        self._count_i = geo.lane(lane, L_RESP_COUNT)
        self._waiter = FutexWaiter(m.addr(self._count_i))
        self._native = m.native  # the native core, or None: the Python path (lowtail.shm.native)
        core = m.native and native.core_of(m.native)
        self._send: Any = core and core.send_request  # the core's round trip (lowtail_native's client.rs)
        self._receive: Any = core and core.receive_answer
        self._round_trip: Any = core and core.round_trip  # both in one call (``infer``)
        if core is not None:  # bound once: the Python path's submit tests nothing about the core
            self.submit = self._submit_native  # type: ignore[method-assign]
            self.infer = self._infer_native  # type: ignore[method-assign]
            self._park_at_once = not self._spin_ns  # ``wait``: ``_receive_parked``
        self._free: list[int] = []
        # Slots with a request in flight -> its ticket (a weak reference), or None once nobody waits
        # for it (a dead predecessor's, an abandoned or failed ticket's). A slot whose ticket is gone
        # is reusable as soon as the worker answered it (or fenced it): the worker writes nothing
        # to an answered slot, so reuse cannot cross answers.
        self._inflight: dict[int, weakref.ref[Ticket] | None] = {}
        self._recover_slots()
        self._pool = NdarraySegmentPool(cfg.shm_dir, cfg.mode, cfg.numa_node)
        self._nd_req: dict[int, NdarraySegment] = {}
        self._attached = AttachedNdarraySegments()
        # The layout of the last request sent, and whether it fits a slot inline.
        self._layout: PayloadLayout | None = None
        self._layout_inline = False
        self._req_plan: Any = None  # on the native core: what it copies for that layout (RequestPlan)
        # Per slot: the inline layout written there last and the views of its arrays, and the layout
        # of the last answer read there (``_answer_layout``).
        self._req_views: list[tuple[PayloadLayout, tuple[tuple[str, np.ndarray[Any, Any]], ...]] | None]
        self._req_views = [None] * geo.spl
        self._answers: list[_AnswerLayout | None] = [None] * geo.spl
        # Slots whose answer is held zero-copy: the HeldOutputs (weakly) and the memoryview its arrays
        # export. Reused only once released, or once both it and every array over it are gone.
        self._held: dict[int, tuple[weakref.ref[HeldOutputs], memoryview, weakref.ref[Any]]] = {}
        # How waits went (tests and benchmarks read them through wait_counts): answers found at once,
        # while spinning, while parked (the worker made a wake call); timed and plain futex waits.
        self._counts = _WaitCounts()
        self._closed = False

    @classmethod
    def attach(cls, desc: QueueDescriptor, spin_us: int | None = None) -> QueueClient:
        """Map the queue and take a free lane (the only step that may contend: OFD byte locks).

        ``spin_us``: how long a wait spins for its answer before it parks. None (the default): the
        queue's ``client_spin_us`` when the calling thread has a CPU of its own (pinned alone to an
        isolated CPU that no other client of this queue may use, as a ``sample:`` lease gives it),
        else 0: the wait parks on the futex at once and costs its CPU only the wake-up
        (``spin_policy`` says which and why). A number: that budget, whatever the CPU.
        """
        if spin_us is not None and not 0 <= spin_us <= 1_000_000:
            raise QueueError(f"spin_us={spin_us!r}: expected None or 0..1000000 (microseconds)")
        m = attach_mapped(desc)
        try:
            for lane in range(m.geo.lanes):
                if ofd_lock.try_lock(m.seg.fd, client_lock_byte(lane)):
                    if spin_us is None:
                        spin = cls._default_spin(m, lane, desc.config.client_spin_us)
                    else:
                        spin = SpinPolicy(spin_us, False, f"spin_us={spin_us} given")
                    return cls(desc, m, lane, spin)
        except BaseException:
            m.close()
            raise
        m.close()
        raise LaneUnavailable(
            f"all {desc.config.lanes} lanes of queue {desc.name} are held by live clients; "
            f"create the queue with more lanes"
        )

    @staticmethod
    def _default_spin(m: Mapped, lane: int, budget_us: int) -> SpinPolicy:
        """``choose_spin`` for the calling thread, against the other live clients of this queue."""
        affinity = frozenset(os.sched_getaffinity(0))
        isolated = isolated_cpus()
        peers: dict[int, frozenset[int]] = {}
        if len(affinity) == 1 and affinity <= isolated:  # only then do the peers matter
            me = os.getpid()
            for other in range(m.geo.lanes):
                pid = int(m.q[m.geo.lane(other, L_PID)])
                # a lane's pid word is its client's: bounded to real pids before it reaches a syscall
                if (
                    other == lane
                    or pid == me
                    or not 0 < pid < 1 << 22
                    or not ofd_lock.held(m.seg.fd, client_lock_byte(other))
                ):
                    continue
                try:
                    peers[pid] = frozenset(os.sched_getaffinity(pid))
                except OSError:
                    continue  # gone, or not ours to inspect
        return choose_spin(budget_us, affinity, isolated, peers)

    def __enter__(self) -> QueueClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def generation(self) -> int:
        return self._gen

    @property
    def last_timing(self) -> dict[str, int]:
        """Of the last answer taken: time queued before the claim, claim to answer, and round trip (ns)."""
        submit, claim, done, end = self._timing
        return {"queue_wait_ns": claim - submit, "infer_ns": done - claim, "round_trip_ns": end - submit}

    @property
    def predicted_ns(self) -> int:
        """The learned submit-to-answer time (0 until an answer was waited for)."""
        return self._pred.predicted_ns

    @property
    def wait_counts(self) -> dict[str, int]:
        """How the waits went: answers found at once, while spinning, or while parked (the worker made
        a wake system call, unless the re-check after setting the parked flag found the answer); and the
        predictive sleeps and futex waits made."""
        c = self._counts
        return {
            "immediate": c.immediate,
            "spinning": c.spinning,
            "parked": c.parked,
            "timed_parks": c.timed_parks,
            "futex_waits": c.futex_waits,
        }

    @property
    def wait_times(self) -> dict[str, int]:
        """Wall time the waits spent spinning and parked (ns): a park's includes the wake-up and the
        wait for a CPU after it; an answer found at once adds to neither."""
        return {"spin_ns": self._counts.spin_ns, "park_ns": self._counts.park_ns}

    def close(self) -> None:
        """Give the lane back; requests still in flight are abandoned (their answers are dropped)."""
        if self._closed:
            return
        self._closed = True
        self._req_views = [None] * self._spl
        self._answers = [None] * self._spl
        self._m.q[self._m.geo.lane(self.lane, L_PID)] = 0
        live = self._drop_held()
        self._attached.close()  # an ndarray segment under a live view stays mapped by that view's export
        self._pool.close()
        if not live:
            self._release_lane()
            return
        # Zero-copy arrays still read this lane's answer slots: the lane stays locked (no new client
        # takes it and gets a worker to write into them) and the queue stays mapped until the last
        # of those arrays is gone.
        left = [len(live)]

        def one_gone() -> None:
            left[0] -= 1
            if left[0] == 0:
                self._release_lane()

        for base in live:
            weakref.finalize(base, one_gone)

    def _release_lane(self) -> None:
        # explicit: an export elsewhere keeps the fd open
        ofd_lock.unlock(self._m.seg.fd, client_lock_byte(self.lane))
        self._m.close()

    def _recover_slots(self) -> None:
        """Sort this lane's slots, as a predecessor client may have left them, into free and in flight
        (marked INHERITED), then store the lane's new gen: a worker that sees it sees the marks (TSO)."""
        q, geo = self._m.q, self._m.geo
        published = self._published_slots()
        for s in range(geo.spl):
            g = self._g0 + s
            req = q[geo.slot(g, S_REQ_SEQ)]
            if req == q[geo.slot(g, S_RESP_SEQ)] or (
                req != q[geo.slot(g, S_CLAIM_SEQ)] and s not in published
            ):
                # answered, or written by a predecessor killed before its doorbell: the worker can
                # never reach it (it is in no ring position it will read), so it is ours at once
                q[geo.slot(g, S_REQ_STATE)] = FREE
                self._free.append(s)
            else:
                # in flight, or left so by the predecessor: never published into, freed once answered;
                # the worker answers it ST_CLIENT_GONE if it neither holds nor can still take it
                q[geo.slot(g, S_REQ_STATE)] = INHERITED
                self._inflight[s] = None
        self._free.reverse()  # pop() hands out slot 0 first
        q[geo.lane(self.lane, L_GEN)] = self._gen

    def _drop_held(self) -> list[np.ndarray[Any, Any]]:
        """Invalidate every held zero-copy answer; the bases that arrays taken from them still keep."""
        live = []
        for ref, mv, base_ref in self._held.values():
            held = ref()
            if held is not None:
                held._views = held._client = None
            base = base_ref()
            if base is not None:
                live.append(base)  # its export keeps the mapping: never unmapped under the arrays
            else:
                mv.release()
        self._held.clear()
        return live

    def _free_held(self, slot: int) -> None:
        """``HeldOutputs.release`` succeeded: the slot is free again."""
        entry = self._held.pop(slot, None)
        if entry is not None:
            entry[1].release()
        if entry is not None and not self._closed:
            self._m.q[self._si[slot] + W_REQ_STATE] = FREE
            self._free.append(slot)

    def _published_slots(self) -> set[int]:
        """Slots the worker may still take: ring positions [tail, doorbell) of this lane.

        Read tail first: the worker only moves it forward, so the positions it can still read are a
        subset of those read here.
        """
        q, geo = self._m.q, self._m.geo
        tail = q[geo.lane(self.lane, L_TAIL)]
        head = q[HW_DOORBELLS + self.lane]
        n = (head - tail) % U64_WRAP
        if n > geo.spl:
            return set(range(geo.spl))  # corrupt words: trust nothing, wait for answers
        ring = geo.lane(self.lane, L_RING)
        return {int(q[ring + (tail + k) % U64_WRAP % geo.spl]) for k in range(n)}

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        q, geo = self._m.q, self._m.geo
        for s, (held, mv, base) in list(self._held.items()):
            if held() is None and base() is None:  # dropped without release(), no array over it left
                mv.release()
                del self._held[s]
                q[geo.slot(self._g0 + s, S_REQ_STATE)] = FREE
                return s
        for s, ref in list(self._inflight.items()):
            ticket = ref() if ref is not None else None
            if ticket is not None and not ticket.consumed:
                continue  # someone may still wait() for it
            g = self._g0 + s
            if q[geo.slot(g, S_REQ_SEQ)] == q[geo.slot(g, S_RESP_SEQ)]:
                del self._inflight[s]
                q[geo.slot(g, S_REQ_STATE)] = FREE
                return s
        raise LaneBusy(
            f"all {geo.spl} slots of lane {self.lane} have requests in flight or zero-copy answers held; "
            f"wait() for one (or abandon() it), release() held outputs, before submitting more; an "
            f"abandoned request's slot returns once it is answered"
        )

    def abandon(self, ticket: Ticket) -> None:
        """Nobody will wait for ``ticket``: its slot is reused once the worker answered it.

        Dropping the ticket has the same effect (the client holds it weakly).
        """
        ticket.consumed = True
        if ticket.slot in self._inflight:
            self._inflight[ticket.slot] = None

    def _write_external(self, s: int, g: int, layout: PayloadLayout, arrays: Mapping[str, Any]) -> int:
        """A payload too large for the slot: arrays into a pooled ndarray segment, its name in the header."""
        self._req_views[s] = None  # the header written below replaces any cached inline one
        need = layout.ext_bytes
        nd = self._nd_req.pop(s, None)
        if nd is None or nd.capacity < need or payload.rotation_spares(nd.capacity):
            # Taken before the last one is given back: a rotating size class never rewrites at once
            # the slot the worker read last (its lines are in the worker core's cache, payload.py).
            last = nd
            try:
                nd = self._pool.acquire(need, rotate=True)
            finally:
                if last is not None:
                    self._pool.release(last)  # also when acquire failed (ENOSPC): nothing held twice
        self._nd_req[s] = nd
        nd.write(arrays, layout.spec)
        return payload.write_header(self._m.buf, self._m.geo.req_off(g), nd.name, layout.spec)

    def _check_size(self, layout: PayloadLayout) -> None:
        geo = self._m.geo
        limit = self._cfg.max_ndslot_bytes
        if layout.ext_bytes > limit:
            raise PayloadTooLarge(
                f"request of {layout.ext_bytes} bytes ({spec_text(layout.spec)}) exceeds the "
                f"{geo.req_bytes}-byte slot and the ndarray-segment limit of {limit} bytes"
            )
        if payload.inline_nbytes(layout.spec, "x" * 64) > geo.req_bytes:
            raise PayloadTooLarge(
                f"the header of {spec_text(layout.spec)} alone exceeds the {geo.req_bytes}-byte slot"
            )

    # -- hot path: submit, wait --------------------------------------------------------------------

    def submit(self, arrays: Mapping[str, np.ndarray[Any, Any]]) -> Ticket:
        """Write the request into a slot of this lane and publish it; returns at once."""
        if self._closed:
            raise QueueError("submit on a closed QueueClient")
        entered = time.monotonic_ns()
        layout = self._layout
        if layout is None or not layout.matches(arrays):  # a new layout: validated, then checked cheaply
            layout = self._new_layout(arrays)
        q = self._q
        s = self._free.pop() if self._free else self._take_slot()
        si = self._si[s]
        head = self._head
        try:
            q[si + W_REQ_STATE] = WRITING
            if self._layout_inline:
                off = self._req_off[s]
                # Written every time (~0.1 us): a header another process overwrote heals at once.
                self._mem[off : off + len(layout.prefix_bytes)] = layout.prefix_bytes
                cached = self._req_views[s]
                if cached is None or cached[0] is not layout:
                    got = payload.views(self._m.buf, layout.inline_layout, off)
                    cached = self._req_views[s] = (layout, tuple(got.items()))
                    self._drop_nd_req(s)
                for name, view in cached[1]:
                    # ``layout`` matches: same dtype and shape, so this neither casts nor broadcasts
                    view[...] = arrays[name]  # (np.copyto(..., casting="no"): ~0.25 us more per array)
                nbytes = layout.inline_end
            else:
                nbytes = self._write_external(s, self._g0 + s, layout, arrays)
        except BaseException:
            q[si + W_REQ_STATE] = FREE
            self._free.append(s)
            raise
        # The publication (on the native core too, for the requests ``_submit_native`` leaves to this).
        seq = q[si + W_REQ_SEQ] + 1
        if seq == U64_WRAP:  # modulo 2^64 and never 0
            seq = 1
        nxt = head + 1 if head != U64_MAX else 0  # a compare, not a modulo: the hot path's cheaper wrap
        now = time.monotonic_ns()
        q[si + W_REQ_LEN] = nbytes
        q[si + W_SUBMIT_NS] = now
        q[si + W_REQ_SEQ] = seq
        q[si + W_REQ_STATE] = READY
        q[self._ring_i + head % self._spl] = s
        q[self._doorbell_i] = nxt  # publication: everything above is visible before this (TSO)
        full_barrier()  # order the doorbell store before the load of worker_sleep (Dekker)
        if q[HW_WORKER_SLEEP]:
            q[HW_WORKER_SLEEP] = 0
            futex_wake(self._m.addr(HW_WORKER_SLEEP))
        self._head = nxt
        ticket = Ticket(s, seq, layout.batch, now, False, now - entered)
        self._inflight[s] = weakref.ref(ticket)
        return ticket

    def _submit_native(self, arrays: Mapping[str, np.ndarray[Any, Any]]) -> Ticket:
        """``submit`` on the native core (bound at attach): a request of the last layout's, inline and
        C-contiguous, is checked, copied and published by one core call; any other goes ``submit``'s
        way (validated, copied and published in Python), which also makes the plan of a new layout."""
        plan = self._req_plan
        if plan is None or self._closed:
            return QueueClient.submit(self, arrays)
        entered = time.monotonic_ns()
        s = self._free.pop() if self._free else self._take_slot()
        head = self._head
        try:
            sent = self._send(self._native, self.lane, s, head, plan, arrays)
        except BaseException:
            self._unwind(s, head)
            raise
        if sent is None:  # another layout, or a strided array: nothing was written
            self._free.append(s)
            return QueueClient.submit(self, arrays)
        seq, now = sent
        if self._nd_req:
            self._drop_nd_req(s)
        self._head = head + 1 if head != U64_MAX else 0
        ticket = Ticket(s, seq, self._layout.batch, now, False, now - entered)  # type: ignore[union-attr]
        self._inflight[s] = weakref.ref(ticket)
        return ticket

    def _infer_native(
        self, arrays: Mapping[str, np.ndarray[Any, Any]], timeout_s: float = 1.0, *, pending: bool = False
    ) -> Arrays:
        """``infer`` on the native core (bound at attach): a request of the last layout's, with no sleep
        predicted first, in one core call with no ticket (``round_trip``); what that call leaves goes
        ``wait``'s way with a ticket, another layout or a sleep first ``submit``'s (docs/design.md).
        With ``pending`` (``infer_or_pending``) what it leaves is returned as its ``Pending`` instead."""
        plan, pred, spin = self._req_plan, self._pred, self._spin_ns
        sleep_first = spin and pred.predicted_ns > MARGIN_NS and pred.late.bit_count() <= MAX_LATE
        if plan is None or self._closed or sleep_first:  # (``_await``'s predictive sleep)
            return self._then(self.submit(arrays), timeout_s, pending)
        if timeout_s != self._timeout[0]:  # (a NaN is never equal: refused below every time)
            self._timeout = self._budgets(timeout_s)  # refused before anything is sent
        _, left, spin_ns, park_ns = self._timeout
        s = self._free.pop() if self._free else self._take_slot()
        head, ans = self._head, self._answers[s]
        try:
            got = self._round_trip(
                self._native, self.lane, s, head, plan, arrays, ans and ans[5],
                spin_ns, PURE_SPIN_NS, pred.predicted_ns, park_ns, pred,
            )  # fmt: skip
        except BaseException:  # a raising signal handler (Ctrl-C) may come as the call returns
            self._unwind(s, head)
            raise
        if got is None:  # another layout, or a strided array: nothing was written
            self._free.append(s)
            return self._then(QueueClient.submit(self, arrays), timeout_s, pending)
        seq, submit_ns, answered, now, claim_ns, done_ns, out, parked_at, slept = got
        if self._nd_req:
            self._drop_nd_req(s)
        self._head = head + 1 if head != U64_MAX else 0
        counts = self._counts  # as ``_receive_or_park`` and ``_receive_parked`` count
        if parked_at:
            counts.park_ns += now - parked_at
            counts.futex_waits += slept
            counts.parked += answered
        elif not answered:
            pass
        elif spin:
            counts.spinning += 1
        else:
            counts.immediate += 1
        if spin:
            counts.spin_ns += (parked_at or now) - submit_ns
        if answered and type(out) is dict:  # the core learned its latency and freed its slot as ``wait`` does
            self._timing = (submit_ns, claim_ns, done_ns, now)
            self._free.append(s)
            return out
        ticket = Ticket(s, seq, self._layout.batch, submit_ns)  # type: ignore[union-attr]
        if pending:
            self._inflight[s] = weakref.ref(ticket)
            ticket.seen_ns = now if answered else 0
            return Pending(self, ticket)  # type: ignore[return-value]
        return self._wait_on(ticket, answered, now, parked_at, left)

    def _then(self, ticket: Ticket, timeout_s: float, pending: bool) -> Arrays:
        """``_infer_native``'s request sent another way: waited for, or with ``pending`` returned."""
        return Pending(self, ticket) if pending else self.wait(ticket, timeout_s)  # type: ignore[return-value]

    def infer_or_pending(self, arrays: Mapping[str, np.ndarray[Any, Any]], wait_s: float) -> Arrays | Pending:
        """``infer`` with a wait that can be resumed: the outputs (fresh copies) when the answer came,
        error-free and of the last answer's layout, within ``wait_s``; otherwise the request's ``Pending``
        to ``finish`` (its answer, or its error: nothing after publication is raised here), ``withdraw``
        or give up. Raises what ``start`` raises, with nothing published (but for a raising signal
        handler, Ctrl-C, which may come as the core call returns: a request it published stays in flight
        with nobody waiting for it, as after ``infer``). On the native core the
        request and its first wait are ``infer``'s one core call; the Python path returns ``start``'s
        Pending. ``last_request_timing``: the ``RequestTiming`` of the last outputs returned."""
        if self._native is None:
            return self.start(arrays)
        entered = time.monotonic_ns()
        got: Any = self._infer_native(arrays, wait_s, pending=True)  # outputs, or with ``pending`` a Pending
        if type(got) is dict:
            # Its slot is the free list's last (``_infer_native`` put it back): its call's words stay
            # until this client sends the next request there.
            si, q = self._si[self._free[-1]], self._q
            self._one_call = (
                entered,
                *self._timing,
                time.monotonic_ns(),
                int(q[si + W_CALL_ENGINE_NS]),
                int(q[si + W_CALL]),
            )
        elif not got.ticket.copy_in_ns:  # the core call's ticket: its copy-in is the time before publication
            got.ticket.copy_in_ns = max(0, got.ticket.submit_ns - entered)
        return got  # type: ignore[no-any-return]

    @property
    def last_request_timing(self) -> RequestTiming:
        """``RequestTiming`` of the last outputs ``infer_or_pending`` returned. Its copy-in and copy-out
        are one figure there, ``client_overhead_s``: the call's time outside publication to answer seen."""
        entered, submit, claim, done, seen, returned, engine, call = self._one_call
        return request_timing(
            (submit, claim, done, returned), engine, call, returned - entered - (seen - submit)
        )

    @property
    def last_call_stamps(self) -> tuple[int, int, int, int, int, int, int]:
        """The stamps of the last outputs ``infer_or_pending`` returned (CLOCK_MONOTONIC ns): the call
        entered, the request published, claimed, answered, the answer seen, the call returned; then the
        engine call's time."""
        return self._one_call[:7]

    def _wait_on(self, ticket: Ticket, answered: bool, now: int, parked_at: int, left: int) -> Arrays:
        """``_infer_native``'s request that its core call left, answered or not, taken on by ``wait``
        with a ticket; ``left``: the timeout in ns from its publication."""
        self._inflight[ticket.slot] = weakref.ref(ticket)
        counts, submit_ns = self._counts, ticket.submit_ns
        if parked_at and not answered:  # the first slice passed: parked on as ``_await`` goes on
            deadline = submit_ns + left
            answered = self._park(
                ticket, self._si[ticket.slot], deadline, deadline, first=False, since=submit_ns
            )
            seen = time.monotonic_ns()
            counts.parked += 1
            counts.park_ns += seen - now
            now = seen
        if answered:
            ticket.seen_ns = now  # counted where it was found, not again by ``wait``
        return self.wait(ticket, max(0.0, (submit_ns + left - time.monotonic_ns()) / 1e9))

    def _unwind(self, s: int, head: int) -> None:
        """A submit interrupted in the core (a raising signal handler runs as the call returns): a
        request it published stays in flight, with nobody waiting for it (its slot returns once it is
        answered, and the ring goes on after it); one it did not publish gives its slot back."""
        if self._q[self._doorbell_i] == (head + 1 if head != U64_MAX else 0):
            self._head = int(self._q[self._doorbell_i])
            self._inflight[s] = None
            if self._nd_req:
                self._drop_nd_req(s)
        else:
            self._q[self._si[s] + W_REQ_STATE] = FREE
            self._free.append(s)

    def _budgets(self, timeout_s: float) -> tuple[float, int, int, int]:
        """``_infer_native``'s budgets for a timeout, kept while the timeout is the same: the timeout,
        in ns, the spin budget within it and the first park slice, as ``_receive_or_park`` sets them
        (a spinning client parks at least 1 ns) and ``_receive_parked`` (a zero timeout: no park)."""
        left = deadline_ns(0, timeout_s)
        park_ns = min(left, PARK_SLICE_NS)
        return timeout_s, left, min(self._spin_ns, left), max(1, park_ns) if self._spin_ns else park_ns

    def _drop_nd_req(self, s: int) -> None:
        """Slot ``s`` holds an inline request now: its last one's ndarray segment goes back to the pool."""
        nd = self._nd_req.pop(s, None)
        if nd is not None:
            self._pool.release(nd)

    def _new_layout(self, arrays: Mapping[str, np.ndarray[Any, Any]]) -> PayloadLayout:
        """A request layout new to this client: validated, its size checked, kept for the next requests
        with, on the native core, what the core copies for it (when it fits a slot inline)."""
        layout = payload.validated_layout(arrays)
        inline = layout.inline_end <= self._req_bytes
        if not inline:
            self._check_size(layout)  # a refused request leaves the cached layout as it was
        plan = None
        if inline and self._native is not None:
            fields = [
                (a.name, a.offset, a.nbytes, a.shape, dtype)
                for a, (_, dtype, _) in zip(layout.inline_layout, layout.checks, strict=True)
            ]
            plan = native.core_of(self._native).RequestPlan(layout.prefix_bytes, fields, np.ndarray)
        self._layout, self._layout_inline, self._req_plan = layout, inline, plan
        return layout

    def ready(self, ticket: Ticket) -> bool:
        """Whether ``ticket``'s answer is there (``wait`` returns at once); never blocks."""
        return bool(self._q[self._si[ticket.slot] + W_RESP_SEQ] == ticket.seq)

    def withdraw(self, ticket: Ticket) -> bool:
        """Take back a request: True if no worker of this queue will ever run it (it may be sent
        elsewhere; its slot returns once a worker has passed it), False if a worker claimed it first:
        ``wait`` then gives its answer, or ``WorkerDied``, or ``RequestWithdrawn`` (the worker saw the
        withdrawal in time and did not run it). The protocol is in ``lowtail.shm.layout``."""
        if ticket.consumed:
            raise QueueError(
                f"ticket for slot {ticket.slot} seq {ticket.seq} was already waited for or withdrawn"
            )
        q, si, seq = self._q, self._si[ticket.slot], ticket.seq
        if q[si + W_CLAIM_SEQ] == seq:
            return False
        q[si + W_WITHDRAWN] = seq
        full_barrier()  # order the mark before the load of claim_seq (Dekker with the worker's claim)
        if q[si + W_CLAIM_SEQ] == seq:
            return False
        ticket.consumed = True
        self._inflight[ticket.slot] = None  # reusable once a worker answered it ST_WITHDRAWN
        return True

    def claimed(self, ticket: Ticket) -> bool:
        """True once a worker claimed ``ticket``'s request (its slot's claim word is the request's)."""
        return bool(self._q[self._si[ticket.slot] + W_CLAIM_SEQ] == ticket.seq)

    def _claimed_by_dead_worker(self, ticket: Ticket) -> bool:
        # Claimed and nobody holds the worker lock: its claimer is gone (a closing worker answers what
        # it claimed before it unlocks). The pid word is only a hint any client could zero.
        q = self._q
        return bool(
            q[self._si[ticket.slot] + W_CLAIM_SEQ] == ticket.seq
            and not ofd_lock.held(self._m.seg.fd, WORKER_LOCK_BYTE)
        )

    def _sleep_on_lane(self, timeout_s: float, pendings: Sequence[Pending]) -> None:
        """Park on this lane's answer counter (``wait_first``) unless one of ``pendings`` is answered."""
        q, count_i, parked_i = self._q, self._count_i, self._parked_i
        expected = q[count_i]
        q[parked_i] = 1
        full_barrier()  # order the parked store before the re-check (Dekker)
        if not any(_settled(p, False) for p in pendings):
            self._counts.futex_waits += 1
            futex_wait(self._m.addr(count_i), expected, timeout_s)
        q[parked_i] = 0

    @overload
    def wait(
        self, ticket: Ticket, timeout_s: float = 1.0, *, copy: Literal[True] = True, out: Arrays | None = None
    ) -> Arrays: ...
    @overload
    def wait(self, ticket: Ticket, timeout_s: float = 1.0, *, copy: Literal[False]) -> HeldOutputs: ...
    def wait(
        self, ticket: Ticket, timeout_s: float = 1.0, *, copy: bool = True, out: Arrays | None = None
    ) -> Arrays | HeldOutputs:
        """Outputs of ``ticket``: copies owned by the caller, with ``copy=False`` zero-copy views
        (``HeldOutputs``) valid until released, or with ``out`` the caller's arrays, one per answer array
        (its name, dtype and shape, writable), filled. Raises QueueTimeout, WorkerDied, RequestWithdrawn,
        ... Afterwards ``ticket.timing`` is its ``RequestTiming``."""
        if ticket.consumed:
            raise QueueError(f"ticket for slot {ticket.slot} seq {ticket.seq} was already waited for")
        take: Any = copy if out is None else _into(out, copy)  # fresh copies, held views, or out's arrays
        q, s = self._q, ticket.slot
        si, ans = self._si[s], self._answers[s]  # ans: the layout of the last answer read in this slot
        if ticket.seen_ns:  # the one call saw it (and counted it where it was found)
            now, got = ticket.seen_ns, None
        elif self._park_at_once:  # native, no spin budget: check, park and read in one core call first
            now, got = self._receive_parked(ticket, si, timeout_s, ans, take)
        elif q[si + W_RESP_SEQ] == ticket.seq:
            now, got = time.monotonic_ns(), None
            self._counts.immediate += 1
        else:
            now, got = self._await(ticket, si, timeout_s, ans, take)
        # -- take the answer (on the native core: its words, header check and copy-out in one call)
        if (nat := self._native) is None:
            status, claim_ns, done_ns = q[si + W_RESP_STATUS], q[si + W_CLAIM_NS], q[si + W_DONE_NS]
            engine_ns, call, arrays = q[si + W_CALL_ENGINE_NS], q[si + W_CALL], None
            if ans is not None and status == ST_OK:
                off = self._resp_off[s]
                # the prefix and header of the slot's last answer (written with every answer): it holds
                if self._mem[off : off + len(ans[0])].tobytes() != ans[0]:
                    ans = None
                elif take is True and ans[1] is None:  # the common case, without a call: an inline copy
                    arrays = {}
                    for name, view in ans[4]:  # a loop, not a comprehension: no frame of its own (3.11)
                        arrays[name] = view.copy()
        else:
            got = got or self._receive(nat, self.lane, s, ticket.seq, ans and ans[5], take)
            _, _, status, claim_ns, done_ns, engine_ns, call, arrays, _, _ = got
            if arrays is None:
                ans = None  # another header (or an error): parsed again
            elif arrays is True:
                arrays = None  # the header is ``ans``'s; the copy (held, ndarray segment, out) is ours
        self._timing = (ticket.submit_ns, claim_ns, done_ns, now)
        # Learned from the worker's answer stamp, not a wake-up's latency; a garbage one costs one badly
        # timed sleep. ``late``: would a sleep have ended with the answer beyond the spin budget?
        pred, latency = self._pred, done_ns - ticket.submit_ns
        pred.late = ((pred.late << 1) | (latency > pred.predicted_ns + self._spin_ns)) & LATE_WINDOW
        pred.predicted_ns = next_prediction_ns(pred.predicted_ns, latency)
        held = False
        try:
            if arrays is not None:
                return arrays
            taken, held = self._take_answer(ticket, status, s, copy, ans, out=out), not copy
            return taken
        finally:
            ticket.stamps = (claim_ns, done_ns, engine_ns, call, now, time.monotonic_ns())
            ticket.consumed = True
            self._inflight.pop(s, None)
            if not held:
                q[si + W_REQ_STATE] = FREE
                self._free.append(s)

    def _await(
        self, ticket: Ticket, si: int, timeout_s: float, ans: _AnswerLayout | None, copy: bool
    ) -> tuple[int, Any]:
        """Wait for an answer that was not there at once: a predictive sleep when it is due far off, a
        spin, then the park. Returns when it was seen and, when the core's call saw it, the core's read
        of it (``receive_answer``; None otherwise)."""
        clock = time.monotonic_ns
        entered = clock()
        pred, counts = self._pred, self._counts
        deadline = 0
        # (a prediction below the margin never parks: the fast path skips the call; with no spin
        # budget a sleep that ends before the answer would only be followed by a second one)
        if self._spin_ns and pred.predicted_ns > MARGIN_NS and pred.late.bit_count() <= MAX_LATE:
            deadline, seen = self._sleep_before_spin(ticket, si, timeout_s)
            if seen:
                return seen, None
        # The whole budget when the answer is due within it (a predictive sleep just ended before it,
        # or answers usually come that fast); else a round trip's worth, then park.
        due_ns = 0 if deadline else ticket.submit_ns + pred.predicted_ns
        # Before the spin: a budget of up to a second ends at the wait's deadline, not after it.
        deadline = deadline or deadline_ns(clock(), timeout_s)
        if self._native is not None:
            now, got = self._receive_or_park(ticket, deadline, due_ns, ans, copy)
            if got[0]:
                return now, got
            first = not got[8]  # the core slept the park's first slice
        else:
            first = True
            q, resp_i, seq = self._q, si + W_RESP_SEQ, ticket.seq
            now = start = clock()
            spin_end = min(
                deadline,
                now + (self._spin_ns if due_ns <= now + self._spin_ns else min(PURE_SPIN_NS, self._spin_ns)),
            )
            while True:
                now = clock()  # read before the check that sees the answer: the time it came
                if q[resp_i] == seq:
                    counts.spin_ns += now - start
                    counts.spinning += 1
                    return now, None
                if now > spin_end:
                    break
            counts.spin_ns += now - start
        self._park(ticket, si, deadline, deadline, first, since=entered)
        seen = clock()
        counts.parked += 1
        counts.park_ns += seen - now
        return seen, None

    def _sleep_before_spin(self, ticket: Ticket, si: int, timeout_s: float) -> tuple[int, int]:
        """The predictive sleep: until just before the predicted answer, when that is far enough off
        (``park_until_ns``). Returns (the wait's deadline, or 0 without a sleep; when the answer was
        seen, or 0 when the sleep ended first)."""
        pred, counts = self._pred, self._counts
        now = time.monotonic_ns()
        until = park_until_ns(ticket.submit_ns, now, pred.predicted_ns, MARGIN_NS + pred.oversleep_ns)
        if not until:
            return 0, 0
        counts.timed_parks += 1
        deadline = deadline_ns(now, timeout_s)
        answered = self._park(ticket, si, min(until, deadline), deadline)
        seen = time.monotonic_ns()
        counts.park_ns += seen - now
        if not answered:
            return deadline, 0
        counts.parked += 1
        return deadline, seen

    def _receive_parked(
        self, ticket: Ticket, si: int, timeout_s: float, ans: _AnswerLayout | None, take: Any
    ) -> tuple[int, Any]:
        """``wait``'s way on the native core for a client that parks at once (no spin budget, so no
        predictive sleep and no spin): the answer's check, the park's first slice and its read in one
        ``receive_answer`` call before any other Python (a woken sampler runs its code from a cold
        cache, where each frame costs several times its warm price); a longer wait goes on in
        ``_park``. Counted as the other ways count. Returns when the answer was seen and the core's
        read of it (None when ``_park`` saw it)."""
        start = time.monotonic_ns()
        # (a timeout under one slice, or not a number: its own slice, checked by ``deadline_ns``)
        park_ns = PARK_SLICE_NS if timeout_s >= PARK_SLICE_S else deadline_ns(start, timeout_s) - start
        got = self._receive(
            self._native, self.lane, ticket.slot, ticket.seq, ans and ans[5], take, 0, 0, 0, park_ns
        )
        now, parked_at, counts = got[1], got[8], self._counts
        if not parked_at:
            if got[0]:
                counts.immediate += 1
                return now, got
            parked_at = now  # a zero timeout has no slice: it parks (and times out) in ``_park``
        else:
            counts.futex_waits += got[9]
            if got[0]:
                counts.parked += 1
                counts.park_ns += now - parked_at
                return now, got
        deadline = deadline_ns(start, timeout_s)
        self._park(ticket, si, deadline, deadline, first=not got[8], since=start)
        seen = time.monotonic_ns()
        counts.parked += 1
        counts.park_ns += seen - parked_at
        return seen, None

    def _receive_or_park(
        self, ticket: Ticket, deadline: int, due_ns: int, ans: _AnswerLayout | None, copy: bool
    ) -> tuple[int, Any]:
        """On the native core: the spin (the answer seen within ~0.1 us, the GIL released), the park's
        first slice and the answer's read in one call (``receive_answer``); a longer wait goes on in
        ``_park``. Returns when the call ended and its result."""
        start = time.monotonic_ns()
        park_ns = max(1, min(deadline - start, PARK_SLICE_NS))
        spin = min(self._spin_ns, max(0, deadline - start))
        plan = ans and ans[5]
        got = self._receive(
            self._native, self.lane, ticket.slot, ticket.seq, plan, copy, spin, PURE_SPIN_NS, due_ns, park_ns
        )
        now, parked_at, counts = got[1], got[8], self._counts
        counts.spin_ns += (parked_at or now) - start
        if parked_at:
            counts.park_ns += now - parked_at
            counts.futex_waits += got[9]
        if got[0]:
            if parked_at:
                counts.parked += 1
            else:
                counts.spinning += 1
        return now, got

    def _take_answer(
        self,
        ticket: Ticket,
        status: int,
        s: int,
        copy: bool,
        ans: _AnswerLayout | None,
        *,
        out: Arrays | None = None,
    ) -> Arrays | HeldOutputs:
        """The one way an answer is read, whoever waited for it (``wait``, ``Pending.finish``, the
        actors' ``InferenceClient.finish``): an error status raises; else the answer's layout (``ans``,
        the slot's cached one when its header is unchanged, else parsed here) gives its arrays in the
        response region or in the worker's ndarray segment, copied out or, with ``copy=False``, held
        zero-copy until released. (``wait`` copies an inline answer of the cached layout itself.)"""
        m = self._m
        if status != ST_OK:
            raise _STATUS_ERRORS.get(status, RequestFailed)(
                _read_message(m, self._g0 + s, m.q[self._si[s] + W_RESP_LEN])
            )
        off = self._resp_off[s]
        if ans is None:
            ans = self._answer_layout(s, off)
        _, ext, fields, end, views, _ = ans
        if ext is None:
            if out is not None:
                return _copy_into(out, views, ticket)
            if copy:
                fresh: Arrays = {}
                for name, view in views:
                    fresh[name] = view.copy()
                return fresh
            mv = self._mem[off : off + end]
        else:
            nd = self._answer_slot(ext)
            if end > nd.capacity:
                raise RequestFailed(
                    f"corrupt answer: {end}-byte layout in ndarray segment {ext} ({nd.capacity} B)"
                )
            if out is not None:
                return _copy_into(out, tuple(_views_of(nd.buf, fields).items()), ticket)
            if copy:
                return {name: view.copy() for name, view in _views_of(nd.buf, fields).items()}
            mv = memoryview(nd.segment.mm)[:end]
        # frombuffer holds a buffer export of the mapping for as long as the base (and so every view)
        # lives: the mapping cannot be closed under it (``np.ndarray(buffer=mv)`` keeps none, and a
        # closed mapping read through it was a SIGSEGV).
        base: np.ndarray[Any, Any] = np.frombuffer(mv, np.uint8)
        base.flags.writeable = False
        held = HeldOutputs(self, ticket, base, fields)
        ticket.held = held
        self._held[s] = (weakref.ref(held), mv, weakref.ref(base))
        return held

    def _answer_layout(self, s: int, off: int) -> _AnswerLayout:
        """Parse the answer header in slot ``s``'s response region; kept for the slot's next answers."""
        m = self._m
        geo = m.geo
        ext, layout, raw = payload.read_header(m.mem, m.q, off, geo.resp_bytes)
        # Offsets from the start of the response region, or of the ndarray segment.
        lay, end = (
            (layout.inline_layout, layout.inline_end)
            if ext is None
            else payload.array_offsets(layout.spec, 0)
        )
        if ext is None and end > geo.resp_bytes:
            raise RequestFailed(f"corrupt answer: {end}-byte layout in a {geo.resp_bytes} B slot")
        fields = tuple((a.name, a.dtype, a.shape, a.offset, a.nbytes) for a in lay)
        views = () if ext is not None else tuple(_views_of(m.buf[off : off + end], fields).items())
        plan = None
        if self._native is not None:  # what the core checks and copies out for this layout
            arrays = [(a.name, a.offset, a.nbytes, tuple(a.shape), a.dtype) for a in lay]
            core = native.core_of(self._native)
            plan = core.AnswerPlan(raw, arrays if ext is None else [], np.empty, np.ndarray)
        ans = (raw, ext, fields, end, views, plan)
        self._answers[s] = ans
        return ans

    def _answer_slot(self, name: str) -> NdarraySegment:
        """The worker's ndarray segment holding an answer (mapped once, kept): ``AnswerLost`` when gone."""
        try:
            return self._attached.get(name, self._cfg.shm_dir, self._cfg.mode)
        except SegmentNotFound as e:
            # Published, so it ran: its slot went with its worker (a graceful close unlinks its pool, a
            # sweep a dead one's) before this client mapped it. Never a lost attachment to retry.
            raise AnswerLost(
                f"request in lane {self.lane} of queue {self.descriptor.name} ran and was answered, but "
                f"its answer's ndarray segment is gone with its worker ({e}); it is not sent again"
            ) from None

    def _park(
        self, ticket: Ticket, si: int, until: int, deadline: int, first: bool = True, *, since: int = 0
    ) -> bool:
        """Sleep on the lane's answer counter: True once the answer is there, False at ``until``
        (monotonic ns, before ``deadline``). Raises QueueTimeout at the deadline and WorkerDied when
        the worker died holding the request. ``first``: no slice slept yet (the core's receive_answer
        may have slept the first). ``since``: when the wait began, which its timeout counts from."""
        m, q = self._m, self._m.q
        seq, resp_i, clock = ticket.seq, si + W_RESP_SEQ, time.monotonic_ns
        start = since or clock()
        dead_worker = 0
        parked_i, count_i, waiter = self._parked_i, self._count_i, self._waiter
        nat = self._native
        expected = 0
        while True:
            if nat is None:
                expected = q[count_i]
                q[parked_i] = 1
                full_barrier()  # order the parked store before the re-check below (Dekker)
            if q[resp_i] == seq:
                q[parked_i] = 0
                return True
            now = clock()
            # Liveness from the second slice on: a wait that parks at once (no CPU of its own) skips
            # the lock query on the way to its first sleep, and a worker that died before it still
            # shows within one PARK_SLICE_S.
            if (
                not first
                and (q[HW_WORKER_PID] != 0 or q[si + W_CLAIM_SEQ] == seq)
                and not ofd_lock.held(m.seg.fd, WORKER_LOCK_BYTE)
            ):
                # A dead worker fails only what it had claimed (it may have run it); an unclaimed
                # request stays queued for the next worker: at most once, and never lost. Claimed
                # with the lock free is a dead claimer whatever the pid word says (a client can zero it).
                dead_worker = int(q[HW_WORKER_PID])
                if q[si + W_CLAIM_SEQ] == seq:
                    q[parked_i] = 0
                    if q[resp_i] == seq:
                        return True
                    ticket.consumed = True  # the next worker answers it WorkerDied; then the slot returns
                    self._inflight[ticket.slot] = None
                    raise WorkerDied(
                        f"the worker (pid {dead_worker}) of queue {self.descriptor.name} died processing "
                        f"request seq {seq} in lane {self.lane}; it may or may not have run and is not "
                        f"retried"
                    )
            if now >= deadline:
                q[parked_i] = 0
                why = (
                    f"the worker (pid {dead_worker}) is dead; the request waits, unclaimed, for the next"
                    if dead_worker
                    else "the request stays in flight"
                )
                raise QueueTimeout(
                    f"no answer within {(now - start) / 1e9:.3f} s for request seq {seq} in lane {self.lane} "
                    f"of queue {self.descriptor.name} ({why}; wait again, abandon() or drop the ticket)"
                )
            self._counts.futex_waits += 1
            first = False
            if nat is not None:
                # The park (flag, barrier, re-check, futex, flag) in one native call.
                answered = bool(
                    nat.park(self.lane, ticket.slot, seq, max(0, min(until - now, PARK_SLICE_NS)))[0]
                )
            else:
                waiter.wait(expected, min((until - now) / 1e9, PARK_SLICE_S))
                q[parked_i] = 0
                answered = q[resp_i] == seq
            now = clock()
            if now >= until and until < deadline:
                # A predictive sleep ran past its end: learn how late (up at once, down slowly). A
                # futex timeout returns 80-160 us late on the KVM guest this was built on (50 us of
                # it the timer slack of a SCHED_OTHER thread). Woken by the answer, it is a lower
                # bound: the estimate grows until the timeout comes first and the sleep ends before
                # the answer.
                late = min(now - until, MAX_OVERSLEEP_NS)
                over = self._pred.oversleep_ns
                self._pred.oversleep_ns = late if late > over else over - ((over - late) >> OVERSLEEP_SHIFT)
                return answered
            if answered:
                return True

    def infer(self, arrays: Mapping[str, np.ndarray[Any, Any]], timeout_s: float = 1.0) -> Arrays:
        return self.wait(self.submit(arrays), timeout_s)

    def start(self, arrays: Mapping[str, np.ndarray[Any, Any]]) -> Pending:
        return Pending(self, self.submit(arrays))
