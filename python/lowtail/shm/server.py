"""The worker side of the queue: the single consumer's claim, answer and fencing, and ``Batch``.

One worker (``QueueWorker.attach``, the pinned OpenVINO process) holds the worker lock, claims
published requests fairly across lanes in batches (``claim`` -> ``_poll`` -> ``_take``), answers
them (``Batch.complete`` -> ``_answer``) and fences a lane whose control words are impossible.
A hot standby (``WorkerStandby``) maps the queue and waits, without using CPU, for the worker lock;
``take_over`` becomes the worker the moment the live one is gone. Field offsets and their single
writers are in ``lowtail.shm.layout``.
"""

from __future__ import annotations

import os
import select
import struct
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from lowtail.shm import native, ofd_lock, payload
from lowtail.shm.control import Mapped, QueueDescriptor, attach_mapped, deadline_ns, spec_text
from lowtail.shm.errors import BadRequest, BatchClosed, PayloadTooLarge, QueueError
from lowtail.shm.futex import full_barrier, futex_wait, futex_wake_all, wake_handle
from lowtail.shm.layout import (
    CALL_BATCH_MASK,
    CALL_DESCHEDULE_SHIFT,
    HW_DOORBELLS,
    HW_WORKER_EPOCH,
    HW_WORKER_PID,
    HW_WORKER_SLEEP,
    INHERITED,
    L_GEN,
    L_PARKED,
    L_PID,
    L_RESP_COUNT,
    L_RING,
    L_TAIL,
    SLOT_BYTES,
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
    W_REQ_SEQ,
    W_REQ_STATE,
    W_RESP_LEN,
    W_RESP_SEQ,
    W_RESP_STATUS,
    W_SUBMIT_NS,
    W_WITHDRAWN,
    WORKER_LOCK_BYTE,
    client_lock_byte,
)

# read_header and validated_layout run per request and per batch: bound here, because CPython 3.11 does
# not specialise an attribute load from a module with a __getattr__ (payload's deprecated names).
from lowtail.shm.payload import (
    Arrays,
    NdarraySegment,
    NdarraySegmentPool,
    NdarraySegmentReader,
    PayloadLayout,
    read_header,
    validated_layout,
)
from lowtail.shm.segments import DeadSweep

WORKER_PARK_SLICE_S = 0.25
# The sweep of dead clients' ndarray segments runs in the worker's idle time, in steps of at most this
# long (then the claim returns): a request that arrives meanwhile waits no longer than one step (the
# whole sweep in one go took 146-162 ms at 20,000 entries). A pass starts at most once a second.
SWEEP_STEP_NS = 1_000_000
SWEEP_EVERY_NS = 1_000_000_000
# A standby whose wait cannot watch the live worker's pid (pid 0, reused, another namespace) re-tries
# the worker lock this often: bounded CPU, and a takeover at most this late in those corner cases.
STANDBY_RETRY_S = 0.002
# A lane is "active lately" when the worker saw a request of it this recently: a batch under
# min_batch_samples waits up to coalesce_us for such a lane, never for a lane long quiet.
ACTIVE_LANE_NS = 50_000_000


def _samples(items: list[_Item]) -> int:
    """The samples (batch rows) of the claimed items whose request decoded."""
    return sum(it.layout.batch for it in items if it.layout is not None)


def _rows(outputs: Mapping[str, np.ndarray[Any, Any]], off: int, n: int) -> dict[str, np.ndarray[Any, Any]]:
    """Rows ``off`` to ``off + n`` of each output. A function of its own: on CPython 3.11 a comprehension
    that captures ``off`` and ``n`` makes them cells of the function it is in, allocated on each call."""
    return {k: v[off : off + n] for k, v in outputs.items()}


def _write_message(m: Mapped, g: int, message: str) -> int:
    """An error answer's message into the response region of slot ``g`` (truncated to it); its length."""
    raw = message.encode("utf-8", "replace")[: m.geo.resp_bytes]
    off = m.geo.resp_off(g)
    m.buf[off : off + len(raw)] = np.frombuffer(raw, np.uint8)
    return len(raw)


class _Item:
    """One claimed request (worker-private). Also made by the native poll without ``__init__``
    (``Poller.poll_bound``; ``ITEM_SLOTS`` and ``new_item`` in native/src/poll.rs): it sets these slots
    directly, to the values ``__init__`` gives them, so ``__init__`` must set exactly ``ITEM_SLOTS``
    from its parameters in that order (``tests/shm/test_native_item.py`` holds the two in step)."""

    __slots__ = (
        "claim_ns",
        "done",
        "g",
        "gen",
        "inline",
        "inputs",
        "lane",
        "layout",
        "seq",
        "si",
        "submit_ns",
    )

    def __init__(  # noqa: PLR0917 - built once per request on the hot path: positional is cheapest
        self,
        lane: int,
        g: int,
        si: int,
        seq: int,
        gen: int,
        submit_ns: int,
        claim_ns: int,
        layout: PayloadLayout | None = None,
        inputs: Arrays | None = None,
        inline: bool = False,
    ) -> None:
        self.lane = lane
        self.g = g
        self.si = si
        self.seq = seq
        self.gen = gen
        self.submit_ns = submit_ns
        self.claim_ns = claim_ns
        self.layout = layout
        self.inputs = inputs
        self.inline = inline  # the inputs are views of the request's slot (not an ndarray segment's copy)
        self.done = False


# What the native poll did with a request (lowtail_native.Poller.poll_bound), and how the poll ended.
_APPEND, _CARRY, _POLL_WITHDRAWN, _REFUSED, _DECODE, _FENCE = 0, 1, 2, 3, 4, 5
_DRAINED, _LEFT, _STOPPED = 0, 1, 2
# What the core copies for one answer layout: prefix bytes, each array's offset and bytes per row, the end
_Plan = tuple[bytes, list[int], list[int], int]
_NO_WAKES = (0, 0)  # what answering a batch cost in wakes when no client of it was parked
KNOWN_OUTPUTS_MAX = 64  # output layouts (one per batch size) the core recognises without validation
KNOWN_PLANS_MAX = 64  # request sizes per known output layout the core has an answer plan for
# A Batch without its class call (type_call, slot_tp_init and __init__'s frame: ~2,300 instructions):
# _claim_native sets its slots as Batch.__init__ does for one request
_new_batch = object.__new__
_NUMPY_DIFF_FROM = 8 * 64  # doorbell bytes (64 lanes) above which _poll compares with numpy


class Batch:
    """Requests claimed together: merged inputs, and per-request completion. Use it as a context:

        with worker.claim(timeout_s) as batch:   # after checking the claim is not None
            batch.complete(model(batch.inputs))

    ``inputs`` are zero-copy views of the requests' slots (one request), or one merged copy (several):
    a client may write its next request into its slot as soon as it has its answer, so the views are
    valid only until ``complete()`` or ``fail()``. From then on, and after the block, the batch refuses
    ``inputs``, ``complete()`` and ``fail()`` with ``BatchClosed``. numpy cannot revoke an array it has
    handed out (a buffer with exports cannot be released), so a view taken before stays readable; the
    views of a client's slot are read-only, so it can never write the client's next request: copy
    what must outlive the answer. Leaving the block answers every request still unanswered as
    failed (an exception inside names itself in the message) and lets the exception propagate: the
    batch's clients get an error, not a hang, and the worker claims the next batch as usual.
    """

    __slots__ = (
        "_inputs", "_items", "_open", "_worker", "claimed_ns", "failed", "layout", "queue_wait_ns", "sizes",
    )  # fmt: skip

    def __init__(self, worker: QueueWorker, items: list[_Item]) -> None:
        self._worker = worker
        self._items = items
        self._open = True
        self.failed = 0  # requests this batch answered failed (fail, fail_request, the end of its block)
        self._inputs: Arrays
        # The interned layout of ``inputs`` (names, dtypes, shapes), for a model's check by identity
        # (``Engine.check``); None for a batch with no decoded request.
        self.layout: PayloadLayout | None
        if len(items) == 1:  # the common case, without the list building below
            it = items[0]
            self.layout = it.layout
            self.sizes = [it.layout.batch] if it.layout is not None else []
            self.queue_wait_ns = [it.claim_ns - it.submit_ns]
            self.claimed_ns = it.claim_ns
            if it.inputs is not None:
                self._inputs = it.inputs  # zero-copy views of the request slot (or ndarray segment)
                return
        self.sizes = [it.layout.batch for it in items if it.layout is not None]
        first = next((it.layout for it in items if it.layout is not None), None)
        # merged requests share one merge_key: the first's layout with the batch's rows
        self.layout = first.with_batch(sum(self.sizes)) if first is not None else None
        self.queue_wait_ns = [it.claim_ns - it.submit_ns for it in items]
        # CLOCK_MONOTONIC of the poll that took the earliest request: the worker times claim work from it
        self.claimed_ns = min([it.claim_ns for it in items], default=0)
        parts = [it.inputs for it in items if it.inputs is not None]
        if len(parts) == 1:
            self._inputs = parts[0]
        else:
            merged = worker._gather(items) if worker._native is not None else None
            self._inputs = (
                merged if merged is not None else {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}
            )

    def __len__(self) -> int:
        return len(self._items)

    def __enter__(self) -> Batch:
        if not self._open:
            raise BatchClosed("a batch already answered cannot be entered again: claim the next one")
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: object) -> None:
        if not self._open:
            return
        if any(not it.done for it in self._items):
            why = (
                "the worker left the batch without answering it"
                if exc is None
                else f"worker error while serving this batch: {type(exc).__name__}: {exc}"
            )
            self.fail(why)
        self._close()

    def _close(self) -> None:
        self._open = False
        self._inputs = {}  # drops the merged copy; the slot views stay cached in the worker for reuse

    @property
    def _usable(self) -> bool:
        # A closed worker answered this batch's requests failed and released the mapping its views
        # point into: derived from the worker, so claim() keeps no list of open batches.
        return self._open and not self._worker._closed

    def _refuse(self, what: str) -> BatchClosed:
        if self._open:  # not answered, yet unusable: its worker was closed
            return BatchClosed(
                f"{what} a batch whose worker was closed: its requests were answered failed and its views "
                f"point into a mapping that is gone"
            )
        return BatchClosed(
            f"{what} a batch already answered: its zero-copy views may hold a client's next request "
            f"(copy what must outlive complete(), inside the batch's with block)"
        )

    @property
    def inputs(self) -> Arrays:
        """The requests' inputs (zero-copy views for one request): valid until ``complete``/``fail``."""
        if not self._open or self._worker._closed:  # _usable, inlined: read once per call
            raise self._refuse("inputs of")
        return self._inputs

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @property
    def lanes(self) -> list[int]:
        return [it.lane for it in self._items]

    def complete(
        self, outputs: Mapping[str, np.ndarray[Any, Any]], *, engine_ns: int = 0, deschedule_ns: int = 0
    ) -> tuple[int, int]:
        """Split ``outputs`` (leading dimension = total samples) per request and answer each.

        ``engine_ns``, ``deschedule_ns``: the call's ``infer()`` wall time, its wall minus thread CPU from
        the claim to here (us in 32 bits: 71 minutes); every answer carries them and the call's samples
        (``RequestTiming.engine_s`` / ``call_deschedule_s`` / ``batch_size``). The input views are refused
        afterwards (a client may reuse its slot once answered). Returns what waking its parked clients
        cost, as ``QueueWorker.wakes`` counts: (ns, lanes woken)."""
        worker = self._worker
        # A layout answered before: the core (complete_known; _known is empty on the Python path)
        woken = worker._complete_known(self, outputs, engine_ns, deschedule_ns) if worker._known else None
        if woken is not None:
            return woken  # type: ignore[no-any-return]
        if not self._open or worker._closed:  # _usable, inlined: this is the hot path
            raise self._refuse("complete() on")
        sizes = self.sizes
        total = sizes[0] if len(sizes) == 1 else sum(sizes)
        d_us = deschedule_ns // 1000 if deschedule_ns > 0 else 0  # not min()/max(): ~1,400 instructions
        d_us = d_us if d_us < CALL_BATCH_MASK else CALL_BATCH_MASK
        call = (total & CALL_BATCH_MASK) | (d_us << CALL_DESCHEDULE_SHIFT)
        try:
            layout = validated_layout(outputs)
        except BadRequest as e:
            self.fail(f"worker outputs: {e}")
            raise
        if layout.batch != total:
            got = ", ".join(f"{name}={shape}" for name, _, shape in layout.spec)
            msg = f"worker outputs must share the batch's leading dimension {total}: got {got}"
            self.fail(msg)
            raise BadRequest(msg)
        self._close()
        try:
            if worker._native is not None:
                woken = worker._answer_many(self._items, outputs, layout, engine_ns, call)  # and woken
            elif len(self._items) == 1:
                it = self._items[0]
                if not it.done:
                    worker._answer(it, ST_OK, outputs, layout, "", engine_ns=engine_ns, call=call)
            else:
                off = 0
                for it in self._items:
                    assert it.layout is not None
                    n = it.layout.batch
                    if not it.done:
                        part = _rows(outputs, off, n)
                        worker._answer(
                            it, ST_OK, part, layout.with_batch(n), "", engine_ns=engine_ns, call=call
                        )
                    off += n
        except BaseException as e:
            # _answer turns a write failure into that request's error answer; whatever still escapes
            # (an interrupt) must not leave the rest of the closed batch unanswered.
            woken = self._fail_unanswered(e)
            raise
        finally:
            if woken is None:
                woken = worker._wake_parked(self._items)
        return woken

    def _fail_unanswered(self, e: BaseException) -> tuple[int, int]:
        """After ``e`` escaped the answer of this closed batch: its requests not answered yet are
        answered failed naming it, and their parked clients woken; what the wakes cost. A request whose
        answer went out before ``e`` (the core's call answers request after request, then wakes) keeps
        it: never an error written over an answer its client may be reading."""
        worker = self._worker
        outstanding = worker._outstanding
        for it in self._items:
            if it.done or worker._published(it):  # (a published one not marked: its mark may have raised)
                if (o := outstanding.get(it.g)) is not None and o.seq == it.seq:  # (not a later request's)
                    del outstanding[it.g]
                continue
            worker._answer(it, ST_FAILED, None, None, f"answer not written: {type(e).__name__}: {e}")
            self.failed += 1
        return worker._wake_parked(self._items)

    def fail(self, message: str) -> None:
        """Answer every request not answered yet as failed with ``message``; the views go with it."""
        if not self._usable:
            raise self._refuse("fail() on")
        self._close()
        for it in self._items:
            if not it.done:
                self._worker._answer(it, ST_FAILED, None, None, message)
                self.failed += 1
        self._worker._wake_parked(self._items)

    def fail_request(self, i: int, message: str) -> None:
        """Fail request ``i`` alone; the others stay to be completed (their views stay valid)."""
        if not self._usable:
            raise self._refuse("fail_request() on")
        it = self._items[i]
        if not it.done:
            self._worker._answer(it, ST_FAILED, None, None, message)
            self._worker._wake_parked([it])
            self.failed += 1


class WorkerCounts:
    """What a worker did besides serving (diagnostics, tests)."""

    __slots__ = ("fenced", "inherited_gone", "orphans_failed", "wake_ns", "withdrawn", "woken")

    def __init__(self) -> None:
        self.fenced = self.inherited_gone = self.orphans_failed = self.withdrawn = 0
        self.wake_ns = self.woken = 0  # the Python path's wakes() (the native core counts its own)


class QueueWorker:
    """The single consumer. Holds the worker lock (byte 0) for its lifetime; publishes its pid."""

    # The Python path's (no segment, no known layout): the native recorder's complete_known declines
    # its batches (_bind_native binds the native path's)
    _answer_with: tuple[Any, dict[int, Any], dict[int, _Item]] = (None, {}, {})

    def __init__(self, desc: QueueDescriptor, m: Mapped, idle_us: int) -> None:
        self.descriptor = desc
        self._m = m
        cfg, geo, q = desc.config, m.geo, m.q
        self._cfg = cfg
        self._idle_ns = idle_us * 1000
        prev = int(q[HW_WORKER_PID])
        q[HW_WORKER_PID] = os.getpid()
        q[HW_WORKER_EPOCH] = q[HW_WORKER_EPOCH] + 1
        q[HW_WORKER_SLEEP] = 0
        self._tails = [int(q[geo.lane(lane, L_TAIL)]) for lane in range(geo.lanes)]
        # u64 indices of each lane's fields, computed once for the hot path
        self._ring_i = [geo.lane(lane, L_RING) for lane in range(geo.lanes)]
        self._gen_i = [geo.lane(lane, L_GEN) for lane in range(geo.lanes)]
        self._tail_i = [geo.lane(lane, L_TAIL) for lane in range(geo.lanes)]
        self._count_i = [geo.lane(lane, L_RESP_COUNT) for lane in range(geo.lanes)]
        self._parked_i = [geo.lane(lane, L_PARKED) for lane in range(geo.lanes)]
        self._slot_i = [geo.slot_word(g) for g in range(geo.lanes * geo.spl)]  # each slot's first word
        self._wake = [wake_handle(m.addr(i)) for i in self._count_i]  # each lane's answer-count futex
        self._native = m.native  # the native core, or None: the Python path (lowtail.shm.native)
        self._known: dict[int, Any] = {}  # the output layouts the core recognises (_bind_native)
        # Per batch size: the layout of _known's entry and its answer plan per request size
        self._known_plans: dict[int, tuple[PayloadLayout, dict[int, _Plan]]] = {}
        self._db_i = HW_DOORBELLS
        self._doorbells = q[self._db_i : self._db_i + geo.lanes]
        self._drained = b""
        self._seen_words = np.array(self._tails, np.uint64)  # doorbells at the last poll; first the tails:
        self._seen = self._seen_words.tobytes()  # a lane whose doorbell is not its tail (0 too) is looked at
        self._moved_mask = np.zeros(geo.lanes, bool)
        self._leftover: list[int] = []  # lanes the last poll left with requests it did not take
        self._head_of = struct.Struct("<Q").unpack_from
        self._pool = NdarraySegmentPool(cfg.shm_dir, cfg.mode, cfg.numa_node)
        self._nd_resp: dict[int, NdarraySegment] = {}
        self._slots_in = NdarraySegmentReader()  # clients' ndarray segments: read, never mapped
        self._swept_ns = 0
        self._sweep = DeadSweep(cfg.shm_dir, kinds=("nd",))
        # Per request slot: the views of its last inline request, with that request's header key and layout
        self._in_views: dict[int, tuple[object, Arrays, PayloadLayout]] = {}
        # The layouts of the core's header ids, for the views. Not the Poller's accepted map: that one
        # holds the samples of the inline headers accepted, for the poll's limits in the core, and not
        # the layouts Python builds. Both are bounded and ids are never reused, so either may be cleared.
        self._native_headers: dict[int, tuple[str | None, PayloadLayout]] = {}
        # Per payload layout: what the core's gather and answer_rows copy (offsets, bytes per row)
        self._plans: dict[PayloadLayout, tuple[bytes, list[int], list[int], int]] = {}
        self._plans1: dict[PayloadLayout, list[tuple[bytes, list[int], list[int], int]]] = {}
        self._out_views: dict[int, tuple[PayloadLayout, Arrays]] = {}
        self._carry: list[_Item] = []
        self._outstanding: dict[int, _Item] = {}
        self._hold_slots = cfg.max_batch_slots if cfg.coalesce_us > 0 else 0  # a batch held below this
        self._last_work_ns = time.monotonic_ns()
        self._lane_seen_ns = [0] * geo.lanes
        self._lane_gen = [0] * geo.lanes  # the gen whose ndarray segments _slots_in holds, per lane
        self._inherited: tuple[list[int], dict[int, int]] = ([-1] * geo.lanes, {})  # _answer_inherited
        self._active: list[int] = []
        self._rr = 0
        self.counts = WorkerCounts()
        self._closed = False
        if self._native is not None:
            self._bind_native(geo.spl)
        self.counts.orphans_failed = self._fail_orphans(prev)

    def _bind_native(self, spl: int) -> None:
        """The native core's parts of the hot path: the poll in the core (the Python ``_poll`` is the
        reference), bound here rather than tested per call, so the Python path's hot path pays nothing
        for the core; and what answers outputs of a layout answered before (``_known``: per batch
        rows, the outputs of the batch answered last with that many rows, as the core recognises them,
        with the answer plans of the request sizes answered in that layout). ``_claim_cache`` is what
        the core's poll makes a sampler's next request an ``_Item`` with (``Poller.poll_bound``): the
        objects ``_polled`` uses, bound into the poll here with the segment and the batch limits, so
        none of them may be rebound (the views cache is cleared in place)."""
        self._poller = native.poller(self._tails, spl)
        self._claim_cache = (self._in_views, self._lane_seen_ns, self._slot_i, _Item)
        cfg = self._cfg
        self._poller.bind(self._native, cfg.max_batch_slots, cfg.max_batch_samples, self._claim_cache)
        self._poll = self._poll_native  # type: ignore[method-assign]
        self.claim = self._claim_native  # type: ignore[method-assign]
        # The samples under which _coalesce may hold a batch of one request (_claim_native's check)
        self._hold_below = cfg.min_batch_samples if self._hold_slots > 1 else 0
        self._take = self._take_refused  # type: ignore[method-assign]
        self._wake_parked = self._wake_parked_native  # type: ignore[method-assign]
        core = native.core_of(self._native)
        self._known_outputs: Any = core.KnownOutputs
        self._complete_known: Any = core.complete_known  # Batch.complete's first step
        # What complete_known answers with (none of them is ever rebound), read as one attribute
        self._answer_with = (self._native, self._known, self._outstanding)

    @classmethod
    def attach(cls, desc: QueueDescriptor, idle_us: int | None = None) -> QueueWorker:
        m = attach_mapped(desc)
        if not ofd_lock.try_lock(m.seg.fd, WORKER_LOCK_BYTE):
            pid = m.q[HW_WORKER_PID]
            m.close()
            raise QueueError(f"queue {desc.name} already has a live worker (pid {pid}); one worker per queue")
        return cls(desc, m, desc.config.worker_idle_us if idle_us is None else idle_us)

    def __enter__(self) -> QueueWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def fenced(self) -> int:
        """Lanes fenced for an impossible control word."""
        return self.counts.fenced

    @property
    def inherited_gone(self) -> int:
        """Requests a lane's new client inherited that no worker held, answered ST_CLIENT_GONE."""
        return self.counts.inherited_gone

    @property
    def withdrawn(self) -> int:
        """Requests found withdrawn at their claim, answered ST_WITHDRAWN without running."""
        return self.counts.withdrawn

    @property
    def restarted_failed(self) -> int:
        """Requests a dead predecessor had claimed, answered WorkerDied when this worker attached."""
        return self.counts.orphans_failed

    def _fail_orphans(self, prev_pid: int) -> int:
        """Answer WorkerDied for every request a previous worker left PROCESSING."""
        m = self._m
        geo, q = m.geo, m.q
        orphans: list[_Item] = []
        for g in range(geo.lanes * geo.spl):
            si = geo.slot(g, 0)
            req = q[si + W_REQ_SEQ]
            if q[si + W_CLAIM_SEQ] == req and q[si + W_RESP_SEQ] != req:
                lane = g // geo.spl
                it = _Item(lane, g, si, int(req), int(q[geo.lane(lane, L_GEN)]), 0, 0)
                msg = f"worker restarted: the previous worker (pid {prev_pid}) died processing this request"
                self._answer(it, ST_WORKER_DIED, None, None, msg)
                orphans.append(it)
        self._wake_parked(orphans)
        return len(orphans)

    def close(self) -> None:
        """Answer what was claimed but not completed ("worker closed"), release the lock, unmap. A batch
        not answered yet refuses its views from now on (``Batch`` reads the worker's state)."""
        if self._closed:
            return
        self._closed = True
        pending = self._carry + [it for it in self._outstanding.values() if not it.done]
        for it in pending:
            if not it.done:
                self._answer(it, ST_FAILED, None, None, "worker closed before answering")
        self._wake_parked(pending)
        self._carry.clear()
        self._outstanding.clear()
        self._in_views.clear()
        self._out_views.clear()
        self._doorbells.release()
        self._m.q[HW_WORKER_PID] = 0
        # Unlock explicitly: a mapping still exported to a caller's view (batch inputs kept past
        # complete()) keeps the open file description, and with it the lock, alive after close(fd).
        ofd_lock.unlock(self._m.seg.fd, WORKER_LOCK_BYTE)
        self._slots_in.close()
        self._sweep.close()
        self._pool.close()
        self._m.close()

    def _sweep_departed(self, now_ns: int) -> None:
        """When idle: close what dead clients' lanes sent and unlink the ndarray segments of dead owners,
        so a killed client's slots do not hold tmpfs for the queue's whole life. A pass starts at most
        every SWEEP_EVERY_NS and goes on one SWEEP_STEP_NS step per idle claim (``DeadSweep``)."""
        if not self._sweep.in_pass:
            if now_ns - self._swept_ns < SWEEP_EVERY_NS:
                return
            self._swept_ns = now_ns
            self._answer_inherited()
            m = self._m
            for lane in self._slots_in.lanes():
                # Its client closed (pid word 0) or died (lock free): an fd kept here would pin the
                # pages of slots it unlinked for as long as the lane stays unused.
                if not m.q[m.geo.lane(lane, L_PID)] or not ofd_lock.held(m.seg.fd, client_lock_byte(lane)):
                    self._slots_in.drop_lane(lane)
        self._sweep.step(SWEEP_STEP_NS)

    def _answer_inherited(self) -> None:
        """Answer ST_CLIENT_GONE the requests a lane's new client inherited (slot state INHERITED) that
        this worker neither holds nor can still take, once seen so at two sweep passes.

        Runs only when idle: an idle worker has claimed every request published before its poll, and
        a claim runs between two passes, so a predecessor's request published before the first look is
        held (or answered) by the second. The new client's own requests are never INHERITED, so one
        being published as the worker looks is never answered as gone. The client stores the lane's
        gen after marking its slots, so a lane is looked at when its gen moved, or while it has slots
        noted at the previous pass. ``_inherited``: per lane the gen last looked at (-1 at first: every
        lane once, for a worker that attaches after the client), and the slots noted -> their req_seq.
        """
        m = self._m
        q, spl = m.q, m.geo.spl
        seen_gen, noted = self._inherited
        self._inherited = (seen_gen, {})
        lanes = {g // spl for g in noted}
        for lane, gen_i in enumerate(self._gen_i):
            if q[gen_i] != seen_gen[lane]:
                seen_gen[lane] = q[gen_i]
                lanes.add(lane)
        held = {it.g for it in self._carry}
        gone: list[_Item] = []
        # Every slot's state word in one strided view: a lane of 4,096 slots is searched by numpy, not
        # visited in Python (a first pass looks at every lane).
        states = np.asarray(q)[m.geo.slot_word(0) + W_REQ_STATE :: SLOT_BYTES >> 3][: m.geo.lanes * spl]
        for lane in sorted(lanes):
            for k in np.flatnonzero(states[lane * spl : (lane + 1) * spl] == INHERITED).tolist():
                g = lane * spl + k
                si = self._slot_i[g]
                seq = q[si + W_REQ_SEQ]
                if q[si + W_REQ_STATE] != INHERITED or seq == q[si + W_RESP_SEQ]:
                    continue
                if g in self._outstanding or g in held:
                    continue
                if noted.get(g) != seq:
                    self._inherited[1][g] = seq  # first seen: answered at the next pass if still so
                    continue
                it = _Item(lane, g, si, seq, q[self._gen_i[lane]], q[si + W_SUBMIT_NS], time.monotonic_ns())
                q[si + W_CLAIM_SEQ] = seq
                why = "inherited from the lane's previous client; no worker holds it"
                self._answer(it, ST_CLIENT_GONE, None, None, f"lane {lane}: {why}")
                gone.append(it)
        self.counts.inherited_gone += len(gone)
        self._wake_parked(gone)

    def reclaimable_lanes(self) -> list[int]:
        """Lanes whose client died (the kernel already released their locks; the next attach takes them)."""
        m = self._m
        return [
            lane
            for lane in range(m.geo.lanes)
            if m.q[m.geo.lane(lane, L_PID)] and not ofd_lock.held(m.seg.fd, client_lock_byte(lane))
        ]

    # -- hot path: claim, answer -------------------------------------------------------------------

    def claim(self, timeout_s: float = 0.05) -> Batch | None:
        """The next batch, or None after ``timeout_s`` seconds without a request."""
        if self._closed:
            raise QueueError("claim on a closed QueueWorker")
        if self._carry:
            carried, self._carry = self._carry, []
            return self._batch(carried)
        items: list[_Item] = []
        self._poll(items)  # returns at once when the doorbells are as drained; work waiting: no clock
        if items:
            return self._coalesce(items)
        return self._claim_wait(items, timeout_s)

    def _claim_native(self, timeout_s: float = 0.05) -> Batch | None:
        """``claim`` on the native path (bound at attach). The common claim, one request made an item
        by the core's poll with nothing to hold or merge, in this one frame: its ``Batch`` made as
        ``Batch.__init__`` makes one request's, without the class call (``_new_batch``, then its slots),
        fewer instructions per call than ``_poll_native``, ``_coalesce`` and the class call. Any other
        claim goes on as ``claim`` goes, from where this one stands. A claim that finds nothing waits in
        ``_wait_native`` (the core's spin, then the park) and polls again, so a request that comes
        while it waits is made the same one-frame batch."""
        if self._closed or self._carry:
            return QueueWorker.claim(self, timeout_s)
        items: list[_Item] = []
        deadline = 0
        while True:
            raw = self._doorbells.tobytes()
            if raw != self._drained:
                entries, end, now = self._poller.poll_bound(raw, items, 0)
                if entries or end == _STOPPED:
                    self._poll_native_rest(raw, items, entries, end, now)
                else:
                    self._drained = raw if end == _DRAINED else b""
                if len(items) == 1:
                    it = items[0]
                    layout, inputs = it.layout, it.inputs
                    # _coalesce's hold (one request is under max_batch_slots when that is above 1): not
                    # when the request alone reaches min_batch_samples
                    if layout is not None and inputs is not None and layout.batch >= self._hold_below:
                        self._last_work_ns = claimed = it.claim_ns
                        self._outstanding[it.g] = it
                        b = _new_batch(Batch)
                        b._worker, b._items, b._open, b.failed, b.layout = self, items, True, 0, layout
                        b.sizes, b.queue_wait_ns = [layout.batch], [claimed - it.submit_ns]
                        b.claimed_ns, b._inputs = claimed, inputs
                        return b
                if items:
                    return self._coalesce(items)
            if not deadline:
                deadline = deadline_ns(time.monotonic_ns(), timeout_s)
            if not self._wait_native(deadline):
                return None

    def _wait_native(self, deadline: int) -> bool:
        """``_claim_wait``'s wait on the native path, with nothing taken: the core spins on the doorbells
        until ``worker_idle_us`` after the last work (``Poller.spin_bound``: a request is seen within a
        few loads, not an interpreter loop's iteration, and ``_claim_native`` then makes its batch), then
        the worker parks as ``_claim_wait`` parks. True when the doorbells may have moved (poll them);
        False at ``deadline``, after ``_claim_wait``'s sweep of departed clients."""
        now = time.monotonic_ns()
        if now >= deadline:
            self._sweep_departed(now)
            return False
        idle_end = self._last_work_ns + self._idle_ns
        if now < idle_end:
            self._poller.spin_bound(self._drained, min(idle_end, deadline))
            return True
        m = self._m
        m.q[HW_WORKER_SLEEP] = 1
        full_barrier()  # order the sleep store before the doorbell re-check (Dekker)
        if self._doorbells.tobytes() == self._drained:
            futex_wait(m.addr(HW_WORKER_SLEEP), 1, min((deadline - now) / 1e9, WORKER_PARK_SLICE_S))
        m.q[HW_WORKER_SLEEP] = 0
        return True

    def _claim_wait(self, items: list[_Item], timeout_s: float) -> Batch | None:
        """The rest of ``claim`` when its first poll took nothing: poll, spin, then park until a request
        or ``timeout_s``."""
        doorbells, poll = self._doorbells, self._poll
        m = self._m
        q = m.q
        clock = time.monotonic_ns
        now = clock()
        deadline = deadline_ns(now, timeout_s)
        sleep_i = HW_WORKER_SLEEP
        while True:
            if doorbells.tobytes() != self._drained:
                poll(items)
                if items:
                    return self._coalesce(items)
            now = clock()
            if now >= deadline:
                self._sweep_departed(now)
                return None
            if now - self._last_work_ns < self._idle_ns:
                continue
            q[sleep_i] = 1
            full_barrier()  # order the sleep store before the doorbell re-check (Dekker)
            poll(items)
            if items:
                q[sleep_i] = 0
                return self._coalesce(items)
            futex_wait(m.addr(sleep_i), 1, min((deadline - now) / 1e9, WORKER_PARK_SLICE_S))
            q[sleep_i] = 0

    def _poll(self, items: list[_Item]) -> None:
        """Take published requests within the batch limits, fairly across lanes.

        Every lane whose doorbell is ahead of its tail is looked at, one request per lane per round,
        starting after the lane that was served last: a ready request waits for at most one request
        of each other lane (tested with 8 clients; measured by ``lowtail bench queue``). ``_drained``
        (the doorbells fully taken) is only recorded when no lane was left with work.
        """
        raw = self._doorbells.tobytes()
        if raw == self._drained:
            return  # nothing new in any lane: one 8*L-byte compare instead of L word reads
        tails = self._tails
        lanes, spl = len(tails), self._m.geo.spl
        # The lanes to look at: those whose doorbell moved since the last poll and those it left with
        # work, found by XOR-ing the doorbell bytes with the last ones seen (a few big-int operations
        # per moved lane): idle attached lanes cost nothing. Unpacking and comparing all L lanes in
        # Python added ~5 us per claim at 256 lanes (``lowtail bench lanes``, docs/benchmarks.md).
        if len(raw) > _NUMPY_DIFF_FROM:
            # Above 64 lanes one vectorised compare (~1.1 us at any lane count) is cheaper than the
            # big-int XOR and its shifts (2.5-3 us at 256 lanes, the round trip's +3 us there).
            cur = np.frombuffer(raw, np.uint64)
            np.not_equal(cur, self._seen_words, out=self._moved_mask)
            self._seen_words[:] = cur
            changed: list[int] = self._moved_mask.nonzero()[0].tolist()
        else:
            moved = int.from_bytes(raw, "little") ^ int.from_bytes(self._seen, "little")
            changed = []
            base = 0
            while moved:
                low = ((moved & -moved).bit_length() - 1) >> 6
                changed.append(base + low)
                moved >>= (low + 1) << 6
                base += low + 1
        if not items and not self._leftover and len(changed) == 1:
            # The common case, one request in one lane (a lone sampler, or the next one in turn):
            # take it without the round-robin bookkeeping below (same outcome, ~2 us less per claim).
            low = changed[0]
            if self._head_of(raw, low << 3)[0] - tails[low] == 1:
                self._seen = raw
                it = self._take(low, tails[low], time.monotonic_ns())
                self._rr = (low + 1) % lanes
                if it is not None and it.layout is not None:
                    items.append(it)
                self._drained = raw
                return
        look = set(self._leftover)
        look.update(changed)
        self._seen = raw
        head_of = self._head_of
        heads = {lane: head_of(raw, lane << 3)[0] for lane in look}
        cfg = self._cfg
        max_slots, max_samples = cfg.max_batch_slots, cfg.max_batch_samples
        samples = _samples(items) if items else 0  # usually none yet: no generator for nothing
        now = time.monotonic_ns()
        start = self._rr
        order = sorted(lane for lane in look if heads[lane] != tails[lane])
        pending = [lane for lane in order if lane >= start] + [lane for lane in order if lane < start]
        full = False
        while pending and not full:
            again: list[int] = []
            for lane in pending:
                if len(items) >= max_slots or samples >= max_samples:
                    full = True
                    break
                head, tail = heads[lane], tails[lane]
                if not 0 < (head - tail) % U64_WRAP <= spl:  # more published than the lane has slots
                    self._fence(lane, f"doorbell {head} with tail {tail} and {spl} slots per lane")
                    continue
                it = self._take(lane, tail, now)
                if it is not None and it.layout is not None:
                    if items and samples + it.layout.batch > max_samples:
                        self._carry.append(it)  # claimed already: first in the next batch
                        full = True
                    else:
                        items.append(it)
                        samples += it.layout.batch
                self._rr = (lane + 1) % lanes
                if tails[lane] != heads[lane]:
                    again.append(lane)
            pending = again
        self._leftover = [lane for lane in look if heads[lane] != tails[lane]]
        self._drained = b"" if pending or full else raw  # full: lanes after the cut were not looked at

    def _take(self, lane: int, tail: int, now: int) -> _Item | None:
        """Claim the request at ring position ``tail`` of ``lane`` and advance the tail past it.

        claim_seq is stored before the tail: a worker killed between the two leaves a claimed request
        that the next worker answers ``WorkerDied`` and then skips when it finds it in the ring (a
        request already claimed is never taken twice). Returns None for a position that holds no
        claimable request (a bad request, answered here, or a duplicate).
        """
        q, geo = self._m.q, self._m.geo
        s = q[self._ring_i[lane] + tail % geo.spl]
        self._tails[lane] = nxt = tail + 1 if tail != U64_MAX else 0  # modulo 2^64, by a compare (cheaper)
        if s >= geo.spl:
            q[self._tail_i[lane]] = nxt
            self._fence(lane, f"ring entry {s} at position {tail}, expected a slot 0..{geo.spl - 1}")
            return None
        g = lane * geo.spl + s
        si = self._slot_i[g]
        seq = q[si + W_REQ_SEQ]
        if q[si + W_CLAIM_SEQ] == seq or q[si + W_RESP_SEQ] == seq:
            q[self._tail_i[lane]] = nxt
            return None  # claimed (by us or a dead predecessor) or answered: never twice
        it = _Item(lane, g, si, seq, q[self._gen_i[lane]], q[si + W_SUBMIT_NS], now)
        q[si + W_CLAIM_NS] = now
        q[si + W_CLAIM_SEQ] = seq  # PROCESSING
        full_barrier()  # order the claim before the load of the withdrawn mark (Dekker with withdraw)
        q[self._tail_i[lane]] = nxt
        if q[si + W_WITHDRAWN] == seq:
            return self._claimed(it, True)
        # _claimed's common case, inlined: a call per request on the Python path's hot path
        self._lane_seen_ns[lane] = now
        self._decode(it)
        return it

    def _take_refused(self, lane: int, tail: int, now: int) -> _Item | None:
        """``_take`` on the native path, where the poll claims in the core (``_poll_native``)."""
        raise QueueError("QueueWorker._take on the native path: its poll claims in the core")

    def _claimed(self, it: _Item, withdrawn: bool) -> _Item | None:
        """A request just claimed: answered ST_WITHDRAWN when its client took it back (never run:
        layout.py, withdrawing), else decoded for the batch."""
        if withdrawn:
            self._answer(it, ST_WITHDRAWN, None, None, "withdrawn by its client before it ran")
            self._wake_parked([it])
            self.counts.withdrawn += 1
            return None
        self._lane_seen_ns[it.lane] = it.claim_ns
        self._decode(it)
        return it

    def _poll_native(self, items: list[_Item]) -> None:
        """``_poll`` in the core (``lowtail_native.Poller.poll_bound``, bound at attach to this worker's
        segment, batch limits and ``_claim_cache``): the same lanes in the same order within the same
        limits, every claim and header decode in one call per batch, stamped with the core's clock, a
        sampler's next request made its ``_Item`` there; the other requests come back as entries for
        ``_polled``. A request whose header the core has not seen accepted stops it: decoded here, it
        goes back with ``resume_bound``, which appends it when it is taken."""
        raw = self._doorbells.tobytes()
        if raw == self._drained:
            return
        entries, end, now = self._poller.poll_bound(raw, items, _samples(items) if items else 0)
        self._poll_native_rest(raw, items, entries, end, now)

    def _poll_native_rest(
        self, raw: bytes, items: list[_Item], entries: list[Any], end: int, now: int
    ) -> None:
        """``_poll_native`` once ``poll_bound`` returned ``entries`` and ``end`` for the doorbells ``raw``"""
        poller = self._poller
        while True:
            last = self._polled(entries, items, now) if entries else None
            if end != _STOPPED:
                break
            assert last is not None
            decoded = None if last.layout is None else last.layout.batch
            taken, entries, end = poller.resume_bound(decoded, last, items)  # appends it if taken
            if taken == _CARRY:
                self._carry.append(last)
        self._drained = raw if end == _DRAINED else b""

    def _polled(
        self, entries: list[tuple[int, int, int, int, int, int, Any]], items: list[_Item], now: int
    ) -> _Item | None:
        """The native poll's entries into ``_Item``s, in claim order: the batch's, the carried, the
        answers of withdrawn and refused requests and the fences; the last one to decode, or None."""
        spl, slot_i, in_views, seen = self._m.geo.spl, self._slot_i, self._in_views, self._lane_seen_ns
        for what, lane, s, seq, gen, submit_ns, hdr in entries:
            if what == _APPEND:
                # The header the slot's views were made for (a sampler's next request), which the core
                # sent here (after an earlier APPEND entry of this poll, or when it could not make the
                # item): those views and their layout, without the lookups and the call of _decode below.
                g = lane * spl + s
                cached = in_views.get(g)
                if cached is not None and cached[0] == hdr:
                    it = _Item(lane, g, slot_i[g], seq, gen, submit_ns, now, cached[2], cached[1], True)
                    seen[lane] = now
                    items.append(it)
                    continue
            if what == _FENCE:
                self._fence(lane, hdr, resync=False)  # the core set the tail (to ``seq``)
                continue
            g = lane * spl + s
            it = _Item(lane, g, slot_i[g], seq, gen, submit_ns, now)
            if what == _POLL_WITHDRAWN:
                self._claimed(it, True)
                continue
            self._lane_seen_ns[lane] = now
            if what == _REFUSED:  # the core refused the header: the request fails alone
                self._fail_decode(it, BadRequest(hdr))
                continue
            hit = self._native_headers.get(hdr)
            if hit is None:
                try:
                    hit = self._native_header(self._native, hdr)
                except Exception as e:  # a header the Python checks refuse after the core's
                    self._fail_decode(it, e)
                    hit = None
            if hit is not None:
                self._decode(it, hit[0], hit[1], hdr)
            if what == _DECODE:
                if it.inline and it.layout is not None:
                    self._poller.accept(hdr, it.layout.batch)  # counted in the core from now on
                return it
            if it.layout is not None:  # accepted, so decoded (unless the core's cache was cleared since)
                (items if what == _APPEND else self._carry).append(it)
        return None

    def _native_header(self, nat: Any, hdr: int) -> tuple[str | None, PayloadLayout]:
        """The layout of a header the core's poll decoded, cached here by its id."""
        got = nat.header(hdr)
        if got is None:  # the core's cache was cleared since: never right after a poll returned the id
            raise QueueError(f"the native core no longer holds header {hdr}")
        ext, arrays = got
        spec = tuple((name, payload.DTYPES[code - 1], tuple(shape)) for name, code, shape in arrays)
        hit = (ext, payload.intern_layout(spec))
        if len(self._native_headers) >= 4096:
            self._native_headers.clear()  # shapes that vary without bound must not grow memory
        self._native_headers[hdr] = hit
        return hit

    def _fence(self, lane: int, why: str, *, resync: bool = True) -> None:
        """An impossible control word in ``lane``: fail its unanswered requests, resynchronise the tail.

        The worker goes on serving the other lanes. A well-behaved client of the lane sees its
        unclaimed requests fail with ``BadRequest`` naming the word. The tail is set to the doorbell
        as read here, which after a garbage doorbell is the garbage, not the client's own count: the
        client's next request can then be fenced too (and fail the same way), which puts the tail back
        in step with its doorbell; the requests after that are served (tested in test_queue_attacks).
        """
        m = self._m
        q, geo = m.q, m.geo
        head = q[self._db_i + lane]
        failed: list[_Item] = []
        gen = q[self._gen_i[lane]]
        for s in range(geo.spl):
            g = lane * geo.spl + s
            si = geo.slot_word(g)
            seq = q[si + W_REQ_SEQ]
            # Only requests nobody claimed: a claimed one is answered by its claimer, exactly once.
            if seq != q[si + W_RESP_SEQ] and seq != q[si + W_CLAIM_SEQ]:
                it = _Item(lane, g, si, seq, gen, q[si + W_SUBMIT_NS], time.monotonic_ns())
                q[si + W_CLAIM_SEQ] = seq
                self._answer(it, ST_BAD_REQUEST, None, None, f"lane {lane} fenced: {why}")
                failed.append(it)
        if resync:  # else the native poll did it: it holds the tails
            self._tails[lane] = head
            q[self._tail_i[lane]] = head
        self.counts.fenced += 1
        self._wake_parked(failed)

    def _decode(
        self, it: _Item, ext: str | None = None, layout: PayloadLayout | None = None, key: object = None
    ) -> None:
        """The inputs of a claimed request: zero-copy views of its slot (cached per slot by ``key``, its
        header's bytes or the native core's id for them) or a copy of its ndarray segment. The native
        path passes the header the core decoded (``ext``, ``layout``, ``key``); the Python path reads it."""
        m = self._m
        geo, buf = m.geo, m.buf
        g = it.g
        try:
            if layout is None:
                ext, layout, key = read_header(m.mem, m.q, geo.req_off(g), geo.req_bytes)
            if ext is not None:
                if self._lane_gen[it.lane] != it.gen:  # a new client: unmap what the last one sent
                    self._slots_in.drop_lane(it.lane)
                    self._lane_gen[it.lane] = it.gen
                cfg = self._cfg
                owner = int(m.q[geo.lane(it.lane, L_PID)])
                views = self._slots_in.read(
                    ext, cfg.shm_dir, cfg.mode, it.lane, owner, g, layout, cfg.max_ndslot_bytes
                )
            else:
                cached = self._in_views.get(g)
                if cached is not None and cached[0] == key:
                    views = cached[1]
                else:
                    if layout.inline_end > geo.req_bytes:
                        raise BadRequest(
                            f"request layout of {layout.inline_end} B exceeds the {geo.req_bytes} B slot"
                        )
                    views = payload.views(buf, layout.inline_layout, geo.req_off(g))
                    for v in views.values():  # the client's slot: a view kept too long can never write it
                        v.flags.writeable = False
                    self._in_views[g] = (key, views, layout)
                it.inline = True
        except Exception as e:  # whatever a request holds, it fails alone
            self._fail_decode(it, e)
            return
        it.layout, it.inputs = layout, views

    def _fail_decode(self, it: _Item, e: Exception) -> None:
        bad = not isinstance(e, QueueError) or isinstance(e, BadRequest)
        status = ST_TOO_LARGE if isinstance(e, PayloadTooLarge) else ST_BAD_REQUEST if bad else ST_FAILED
        self._answer(it, status, None, None, str(e))
        self._wake_parked([it])

    def _coalesce(self, items: list[_Item]) -> Batch:
        """The batch of what a claim's poll took: held for up to ``coalesce_us`` while under
        ``min_batch_samples`` (``_coalesce_wait``), then made (``_batch``, inlined: a frame less per
        claim, whose hot path is one request that nothing holds)."""
        # When work was last found: the poll's clock (its requests' claim stamp), no read of its own
        self._last_work_ns = items[-1].claim_ns
        n = len(items)
        if n < self._hold_slots:  # coalescing on (else 0) and the batch not full
            first = items[0].layout  # polled items decoded: a layout each; one request, no generator
            samples = first.batch if n == 1 and first is not None else _samples(items)
            if samples < self._cfg.min_batch_samples:
                self._coalesce_wait(items)
                self._last_work_ns = time.monotonic_ns()
                n = len(items)
        if n > 1:
            items = self._mergeable(items)
        outstanding = self._outstanding
        for it in items:
            outstanding[it.g] = it
        return Batch(self, items)

    # _coalesce_wait and _mergeable hold the generator expressions of making a batch: a function with
    # one keeps the names it captures in cells, made on every call (every claim), taken or not.
    def _coalesce_wait(self, items: list[_Item]) -> None:
        """Poll for up to ``coalesce_us`` more while the batch is under ``min_batch_samples``, when
        another lane was active lately: a lone client is never held."""
        cfg = self._cfg
        now = time.monotonic_ns()
        in_batch = {it.lane for it in items}
        recent = now - ACTIVE_LANE_NS
        if any(t > recent and lane not in in_batch for lane, t in enumerate(self._lane_seen_ns)):
            end = now + cfg.coalesce_us * 1000
            while time.monotonic_ns() < end and len(items) < cfg.max_batch_slots:
                self._poll(items)
                if _samples(items) >= cfg.min_batch_samples:
                    break

    def _batch(self, items: list[_Item]) -> Batch:
        """A batch of carried requests (``_coalesce`` makes a polled one the same way)."""
        if len(items) > 1:
            items = self._mergeable(items)
        for it in items:
            self._outstanding[it.g] = it
        return Batch(self, items)

    def _mergeable(self, items: list[_Item]) -> list[_Item]:
        """The requests of ``items`` that merge with the first; the rest carried into batches of their
        own next."""
        key = items[0].layout.merge_key if items[0].layout is not None else ()
        same = [it for it in items if it.layout is not None and it.layout.merge_key == key]
        if len(same) != len(items):
            self._carry.extend(it for it in items if it not in same)
        return same

    def _answer(
        self,
        it: _Item,
        status: int,
        arrays: Mapping[str, np.ndarray[Any, Any]] | None,
        layout: PayloadLayout | None,
        message: str,
        *,
        engine_ns: int = 0,
        call: int = 0,
        publish: bool = True,
    ) -> tuple[int, int] | None:
        """Answer ``it``: its payload or error message, then its words (``engine_ns`` and ``call`` from
        Batch.complete). ``publish=False`` writes the payload alone and returns (status, bytes)."""
        m = self._m
        q, geo, g = m.q, m.geo, it.g
        n = 0
        if q[self._gen_i[it.lane]] != it.gen:  # the lane changed hands since the claim: fenced
            status, message = ST_CLIENT_GONE, "the client that sent this request is gone"
        elif status == ST_OK and arrays is not None and layout is not None:
            try:
                if layout.inline_end <= geo.resp_bytes:
                    cached = self._out_views.get(g)
                    off = geo.resp_off(g)
                    # Written every time, as the client does: a header another process overwrote heals.
                    m.mem[off : off + len(layout.prefix_bytes)] = layout.prefix_bytes
                    if cached is None or cached[0] is not layout:
                        cached = (layout, payload.views(m.buf, layout.inline_layout, off))
                        self._out_views[g] = cached
                    for name, view in cached[1].items():
                        np.copyto(view, arrays[name], casting="no")
                    n = layout.inline_end
                else:
                    n = self._answer_external(g, layout, arrays)
            except Exception as e:  # an answer that cannot be written fails alone
                # (no inode, EMFILE, ENOMEM, a full tmpfs): it becomes this request's error answer.
                status = ST_TOO_LARGE if isinstance(e, PayloadTooLarge) else ST_FAILED
                why = "" if isinstance(e, QueueError) else f"answer not written: {type(e).__name__}: "
                message = f"{why}{e}"
        if status != ST_OK:
            self._out_views.pop(g, None)
            n = _write_message(m, g, message)
        if not publish:
            return status, n
        nat = self._native
        if nat is None:
            si = it.si
            q[si + W_RESP_LEN] = n
            q[si + W_RESP_STATUS] = status
            q[si + W_CALL_ENGINE_NS] = engine_ns
            q[si + W_CALL] = call
            q[si + W_DONE_NS] = time.monotonic_ns()
            q[si + W_RESP_SEQ] = it.seq  # publication: everything above is visible before it (TSO)
            ci = self._count_i[it.lane]
            q[ci] = (q[ci] + 1) & 0xFFFFFFFF
        else:  # the caller wakes (_wake_parked), once for all it answered
            nat.answer([(it.lane, g - it.lane * geo.spl, it.seq, status, n)], engine_ns, call, False)
        it.done = True
        self._outstanding.pop(g, None)
        return None

    def _plan(self, layout: PayloadLayout) -> tuple[bytes, list[int], list[int], int]:
        """What the core copies for ``layout``: prefix bytes, each array's offset in a slot region and
        bytes per row, the payload's end."""
        plan = self._plans.get(layout)
        if plan is None:
            rows = layout.batch
            plan = (
                layout.prefix_bytes,
                [a.offset for a in layout.inline_layout],
                [a.nbytes // rows for a in layout.inline_layout],
                layout.inline_end,
            )
            if len(self._plans) >= 4096:
                self._plans.clear()
            self._plans[layout] = plan
        return plan

    def _gather(self, items: list[_Item]) -> Arrays | None:
        """The native path's merge of several requests' inline inputs into one batch: the arrays
        allocated here, every copy in one core call. None when a request's inputs are not all in its
        slot (an ndarray segment's copy): the caller concatenates."""
        decoded = [it for it in items if it.layout is not None]
        if not all(it.inline for it in decoded):
            return None
        first = decoded[0].layout
        assert first is not None
        total = sum(it.layout.batch for it in decoded if it.layout is not None)
        merged = first.with_batch(total)
        out: Arrays = {name: np.empty(shape, dtype) for name, dtype, shape in merged.spec}
        plans: list[tuple[list[int], list[int]]] = []
        index: dict[PayloadLayout, int] = {}
        work: list[tuple[int, int, int, int, int]] = []
        spl = self._m.geo.spl
        row = 0
        for it in decoded:
            lay = it.layout
            assert lay is not None
            k = index.get(lay)
            if k is None:
                k = index[lay] = len(plans)
                plan = self._plan(lay)
                plans.append((plan[1], plan[2]))
            work.append((it.lane, it.g - it.lane * spl, row, lay.batch, k))
            row += lay.batch
        self._native.gather(work, plans, list(out.values()))
        return out

    def _published(self, it: _Item) -> bool:
        """``it``'s answer is out: its slot's answer word is its request's (written last, after the
        answer; a later request in that slot is answered after this one)."""
        return bool(self._m.q[self._slot_i[it.g] + W_RESP_SEQ] == it.seq)

    def _answer_one(
        self,
        it: _Item,
        outputs: Mapping[str, np.ndarray[Any, Any]],
        layout: PayloadLayout,
        engine_ns: int,
        call: int,
    ) -> tuple[int, int]:
        """``_answer_many`` of one request (a sampler's batch as it came) that fits its slot: no
        per-request lists to build, its plan cached per layout."""
        plans = self._plans1.get(layout)
        if plans is None:
            if len(self._plans1) >= 4096:
                self._plans1.clear()
            plans = self._plans1[layout] = [self._plan(layout)]
        ns, woken = self._answer_rows(
            [(it.lane, it.g - it.lane * self._m.geo.spl, it.seq, it.gen, 0, layout.batch, 0)],
            plans, outputs, engine_ns, call,
        )  # fmt: skip
        it.done = True
        self._outstanding.pop(it.g, None)
        self._remember(outputs, layout, {layout.batch: plans[0]})
        return ns, woken

    def _remember(
        self, outputs: Mapping[str, np.ndarray[Any, Any]], layout: PayloadLayout, plans: dict[int, _Plan]
    ) -> None:
        """Keep ``outputs``' layout (validated, answered inline) with the answer ``plans`` of the request
        sizes it was answered in, for the core's ``complete_known`` (``Batch.complete``'s first step):
        outputs of that layout (the same names in order, ndarrays of the same dtype objects and shapes)
        are then answered by the core without validating them again, in batches of those request sizes.
        Only a dict of ndarrays by str keys: what the core compares. Bounded: KNOWN_OUTPUTS_MAX batch
        sizes, KNOWN_PLANS_MAX request sizes each."""
        make = self._known_outputs
        if type(outputs) is not dict or not 0 < len(plans) <= KNOWN_PLANS_MAX:
            return
        arrays = list(outputs.values())
        if not all(type(k) is str for k in outputs) or not all(type(a) is np.ndarray for a in arrays):
            return
        total = layout.batch
        prev = self._known_plans.get(total)
        if prev is not None and prev[0] == layout:
            merged = {**prev[1], **plans}  # the sizes of earlier compositions stay answerable
            if len(merged) <= KNOWN_PLANS_MAX:
                plans = merged
        if total not in self._known and len(self._known) >= KNOWN_OUTPUTS_MAX:
            self._known.clear()  # batch sizes that vary without bound must not grow memory
            self._known_plans.clear()
        self._known_plans[total] = (layout, plans)
        self._known[total] = make(
            [(k, a.dtype, a.shape) for k, a in outputs.items()], np.ndarray, list(plans.items())
        )

    def _answer_rows(
        self,
        work: list[tuple[int, int, int, int, int, int, int]],
        plans: list[tuple[bytes, list[int], list[int], int]],
        outputs: Mapping[str, np.ndarray[Any, Any]],
        engine_ns: int,
        call: int,
    ) -> tuple[int, int]:
        """The core's ``answer_rows`` on the outputs as they are: their order is the layout's (read from
        them by ``validated_layout``), and the core copies one that is not C-contiguous to C order. A
        core that refuses such a buffer (an older build) gets C-contiguous copies: it takes every
        buffer before it writes anything, so the retry answers once."""
        src = list(outputs.values())
        try:
            _, ns, woken = self._native.answer_rows(work, plans, src, engine_ns, call)
        except (ValueError, BufferError):  # numpy refused a C-contiguous buffer of a strided array
            if all(a.flags.c_contiguous for a in src):
                raise
            src = [np.ascontiguousarray(a) for a in src]
            _, ns, woken = self._native.answer_rows(work, plans, src, engine_ns, call)
        return ns, woken

    def _answer_many(
        self,
        items: list[_Item],
        outputs: Mapping[str, np.ndarray[Any, Any]],
        layout: PayloadLayout,
        engine_ns: int,
        call: int,
    ) -> tuple[int, int]:
        """The native path's ``Batch.complete``: each request's rows of ``outputs`` copied into its
        response region, its answer words, the answer counts and one wake per parked lane, in one core
        call; what the wakes cost, (ns, lanes). Answers too large for a slot go to ndarray segments,
        written here first."""
        one = len(items) == 1
        if one and not items[0].done and layout.inline_end <= self._m.geo.resp_bytes:
            return self._answer_one(items[0], outputs, layout, engine_ns, call)
        parts: list[tuple[_Item, int, int, PayloadLayout]] = []  # (request, first row, rows, its layout)
        off = 0
        for it in items:
            assert it.layout is not None
            n = it.layout.batch
            if not it.done:
                parts.append((it, off, n, layout if one else layout.with_batch(n)))
            off += n
        spl, resp_bytes = self._m.geo.spl, self._m.geo.resp_bytes
        known: dict[int, _Plan] = {}  # the plans answered here, per request size: for _remember
        if all(lay.inline_end <= resp_bytes for _, _, _, lay in parts):
            plans: list[tuple[bytes, list[int], list[int], int]] = []
            index: dict[PayloadLayout, int] = {}
            work: list[tuple[int, int, int, int, int, int, int]] = []
            for it, row, n, lay in parts:
                k = index.get(lay)
                if k is None:
                    k = index[lay] = len(plans)
                    plans.append(self._plan(lay))
                work.append((it.lane, it.g - it.lane * spl, it.seq, it.gen, row, n, k))
            ns, woken = self._answer_rows(work, plans, outputs, engine_ns, call)
            known = {lay.batch: plans[k] for lay, k in index.items()}  # each size has one layout
        else:
            words: list[tuple[int, int, int, int, int]] = []
            for it, row, n, lay in parts:
                part = outputs if one else {k: v[row : row + n] for k, v in outputs.items()}
                got = self._answer(it, ST_OK, part, lay, "", publish=False)
                assert got is not None
                status, nbytes = got
                words.append((it.lane, it.g - it.lane * spl, it.seq, status, nbytes))
            ns, woken = self._native.answer(words, engine_ns, call)
        for it, *_ in parts:  # done once published: an interrupt before leaves them to complete()'s handler
            it.done = True
            self._outstanding.pop(it.g, None)
        if known:
            self._remember(outputs, layout, known)
        return ns, woken

    def _answer_external(
        self, g: int, layout: PayloadLayout, arrays: Mapping[str, np.ndarray[Any, Any]]
    ) -> int:
        geo = self._m.geo
        need, limit = layout.ext_bytes, self._cfg.max_ndslot_bytes
        if need > limit or payload.inline_nbytes(layout.spec, "x" * 64) > geo.resp_bytes:
            raise PayloadTooLarge(
                f"answer of {need} bytes ({spec_text(layout.spec)}) exceeds the {geo.resp_bytes}-byte "
                f"slot and the ndarray-segment limit of {limit} bytes"
            )
        self._out_views.pop(g, None)
        nd = self._nd_resp.get(g)
        if nd is None or nd.capacity < need:
            if nd is not None:
                del self._nd_resp[g]  # released: if the acquire below fails, no other slot shares it
                self._pool.release(nd)
            nd = self._pool.acquire(need)
            self._nd_resp[g] = nd
        nd.write(arrays, layout.spec)
        return payload.write_header(self._m.buf, geo.resp_off(g), nd.name, layout.spec)

    def wakes(self) -> tuple[int, int]:
        """What waking parked clients cost this worker so far: (ns spent in the futex-wake system calls,
        lanes woken). Reported on their own (``bench serve --breakdown``): the first wake of a halted
        vCPU costs the waker tens of us, the scheduler's price, not the queue's."""
        nat = self._native
        if nat is not None:
            return nat.wakes()  # type: ignore[no-any-return]
        return self.counts.wake_ns, self.counts.woken

    def _wake_parked(self, items: list[_Item]) -> tuple[int, int]:
        """Wake the parked clients of ``items``' lanes, once per lane: (ns in the wakes, lanes woken)."""
        if not items:
            return _NO_WAKES
        m = self._m
        q = m.q
        full_barrier()  # order the answers' stores before the loads of client_parked (Dekker)
        parked_i, wake = self._parked_i, self._wake
        if len(items) == 1:
            lane = items[0].lane
            if q[parked_i[lane]]:
                return self._wake_timed(wake[lane]), 1
            return _NO_WAKES
        ns = woken = 0
        for lane in {it.lane for it in items}:
            if q[parked_i[lane]]:
                ns += self._wake_timed(wake[lane])
                woken += 1
        return ns, woken

    def _wake_parked_native(self, items: list[_Item]) -> tuple[int, int]:
        """``_wake_parked`` on the native core: one wake per parked lane, counted by the core."""
        if items:
            return self._native.wake_lanes([it.lane for it in items])  # type: ignore[no-any-return]
        return _NO_WAKES

    def _wake_timed(self, handle: Any) -> int:
        """One lane's futex wake, timed around the system call alone (the core's ``wakes`` does the
        same); the ns it took."""
        t0 = time.monotonic_ns()
        futex_wake_all(handle)
        ns = time.monotonic_ns() - t0
        counts = self.counts
        counts.wake_ns += ns
        counts.woken += 1
        return ns


class WorkerStandby:
    """A second worker's hold on a queue: mapped, parked until the live worker is gone.

    ``take_over`` returns the ``QueueWorker`` once this process holds the worker lock (byte 0): the
    kernel drops a dead worker's lock as its files close, before its pidfd reports the exit, so the
    standby sleeps in ``poll`` on the live worker's pidfd (no CPU while it lives) and takes the lock at
    once when it is readable. Attaching as the worker then answers what the dead one had claimed
    ``WorkerDied`` (``_fail_orphans``: claimed requests are never run twice) and serves every other
    request where it stands in its lane's ring: nothing published is lost and nothing is re-run.
    """

    def __init__(self, desc: QueueDescriptor, m: Mapped, idle_us: int) -> None:
        self.descriptor = desc
        self._m: Mapped | None = m
        self._idle_us = idle_us
        self._watched = 0  # the worker pid the pidfd below refers to
        self._exited = 0  # a watched pid seen exit while the lock stayed held (the next worker's, soon)
        self._pidfd = -1

    @classmethod
    def attach(cls, desc: QueueDescriptor, idle_us: int | None = None) -> WorkerStandby:
        """Map the queue as its standby worker (nothing is written to it until ``take_over``)."""
        return cls(desc, attach_mapped(desc), desc.config.worker_idle_us if idle_us is None else idle_us)

    def __enter__(self) -> WorkerStandby:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def take_over(self, timeout_s: float) -> QueueWorker | None:
        """The queue's worker as soon as no other process is, or None after ``timeout_s`` seconds."""
        m = self._m
        if m is None:
            raise QueueError("take_over on a closed or promoted WorkerStandby")
        deadline = deadline_ns(time.monotonic_ns(), timeout_s)
        while not ofd_lock.try_lock(m.seg.fd, WORKER_LOCK_BYTE):
            left_s = (deadline - time.monotonic_ns()) / 1e9
            if left_s <= 0:
                return None
            fd = self._watch(int(m.q[HW_WORKER_PID]))
            if fd < 0:
                time.sleep(min(left_s, STANDBY_RETRY_S))
                continue
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            if poller.poll(max(1, int(min(left_s, WORKER_PARK_SLICE_S) * 1000))):
                self._exited = self._watched  # from now on its pidfd is always readable: retry slowly
        self._unwatch()
        self._m = None  # the mapping (and the lock on its description) belongs to the worker now
        return QueueWorker(self.descriptor, m, self._idle_us)

    def _watch(self, pid: int) -> int:
        """A pidfd of the live worker ``pid`` (readable once it exited), or -1 when there is none."""
        if pid == self._exited:
            return -1
        if pid != self._watched:
            self._unwatch()
            if pid:
                try:
                    self._pidfd = os.pidfd_open(pid)
                except OSError:  # gone already (its lock is free or about to be), or not ours to see
                    return -1
                self._watched = pid
        return self._pidfd

    def _unwatch(self) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)
        self._pidfd, self._watched = -1, 0

    def close(self) -> None:
        """Unmap, unless ``take_over`` already handed the mapping to the worker."""
        self._unwatch()
        if self._m is not None:
            self._m.close()
            self._m = None
