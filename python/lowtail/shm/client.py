"""The client side of the queue: a sampler's lane, its tickets, and the hot path ``submit`` / ``wait``.

A client (``QueueClient.attach``) takes a free lane under its OFD byte lock, registers by bumping the
lane's gen, and owns the lane's slots: it writes a request, publishes it with the doorbell, then
spins, yields and parks on the lane's answer counter until the worker's resp_seq matches. Field
offsets and their single writers are in ``lowtail.shm.layout``.
"""

from __future__ import annotations

import os
import time
import weakref
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from lowtail.shm import ofd_lock
from lowtail.shm import payload as ndslot
from lowtail.shm.control import Mapped, QueueDescriptor, attach_mapped, deadline_ns, spec_text
from lowtail.shm.errors import (
    BadRequest,
    LaneBusy,
    LaneUnavailable,
    PayloadTooLarge,
    QueueError,
    QueueTimeout,
    RequestFailed,
    WorkerDied,
)
from lowtail.shm.futex import full_barrier, futex_wait, futex_wake
from lowtail.shm.layout import (
    FREE,
    H_DOORBELLS,
    H_WORKER_PID,
    H_WORKER_SLEEP,
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
    SLOT_BYTES,
    ST_BAD_REQUEST,
    ST_CLIENT_GONE,
    ST_FAILED,
    ST_OK,
    ST_TOO_LARGE,
    ST_WORKER_DIED,
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
    WRITING,
)
from lowtail.shm.payload import Arrays, AttachedSlots, NdarraySlot, NdarraySlotPool, PayloadLayout

_STATUS_ERRORS: dict[int, type[QueueError]] = {
    ST_FAILED: RequestFailed,
    ST_BAD_REQUEST: BadRequest,
    ST_TOO_LARGE: PayloadTooLarge,
    ST_WORKER_DIED: WorkerDied,
    ST_CLIENT_GONE: RequestFailed,
}
PURE_SPIN_NS = 20_000  # a client spins without system calls this long, then yields while spinning
PARK_SLICE_S = 0.02  # a parked client re-checks worker liveness this often (50 wake-ups/s, ~0.05% CPU)


def _read_message(m: Mapped, g: int, n: int) -> str:
    """The error message the worker wrote into the response region of slot ``g`` (clamped to it)."""
    off = m.geo.resp_off(g)
    n = max(0, min(n, m.geo.resp_bytes))
    return bytes(m.buf[off : off + n]).decode("utf-8", "replace")


@dataclass
class Ticket:
    """A submitted request; ``QueueClient.wait`` turns it into outputs once."""

    slot: int
    seq: int
    batch: int
    submit_ns: int
    consumed: bool = False


class Pending:
    """The seed's two-phase async form: ``client.start(...)`` returns at once, ``finish`` waits."""

    def __init__(self, client: QueueClient, ticket: Ticket) -> None:
        self.client = client
        self.ticket = ticket

    def done(self) -> bool:
        """True when the answer is there (``finish`` then returns without waiting)."""
        return self.client.ready(self.ticket)

    def finish(self, timeout: float = 1.0) -> Arrays:
        return self.client.wait(self.ticket, timeout)


class QueueClient:
    """A sampler's end of the queue: one lane, up to ``slots_per_lane`` requests in flight.

    Not thread-safe: one client per thread (a sampler loop); a process may hold several. Attach
    after ``fork``/``spawn``, never before: a forked child would share the lane's lifetime lock.
    """

    def __init__(self, desc: QueueDescriptor, m: Mapped, lane: int, spin_us: int) -> None:
        self.descriptor = desc
        self.lane = lane
        self._m = m
        cfg, geo = desc.config, m.geo
        self._cfg = cfg
        self._spin_ns = spin_us * 1000
        q = m.q
        self._gen = int(q[geo.lane(lane, L_GEN)]) + 1
        q[geo.lane(lane, L_GEN)] = self._gen
        q[geo.lane(lane, L_PID)] = os.getpid()
        q[geo.lane(lane, L_PARKED)] = 0
        self._g0 = lane * geo.spl
        self._head = int(q[H_DOORBELLS // 8 + lane])
        self._doorbell_i = H_DOORBELLS // 8 + lane
        self._ring_i = geo.lane(lane, L_RING)
        self._parked_i = geo.lane(lane, L_PARKED)
        self._count_i = geo.lane(lane, L_RESP_COUNT)
        self._free: list[int] = []
        # Slots with a request in flight -> its ticket (a weak reference), or None once nobody waits
        # for it (a dead predecessor's, an abandoned or failed ticket's). A slot whose ticket is gone
        # is reusable as soon as the worker answered it (or fenced it): the worker writes nothing
        # to an answered slot, so reuse cannot cross answers.
        self._inflight: dict[int, weakref.ref[Ticket] | None] = {}
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
                self._inflight[s] = None
        self._free.reverse()  # pop() hands out slot 0 first
        self._pool = NdarraySlotPool(cfg.shm_dir, cfg.mode, cfg.numa_node)
        self._nd_req: dict[int, NdarraySlot] = {}
        self._attached = AttachedSlots()
        self._req_views: dict[int, tuple[PayloadLayout, Arrays]] = {}
        self._resp_views: dict[int, tuple[bytes, Arrays]] = {}
        self._timing = (0, 0, 0, 0)
        self._closed = False

    @classmethod
    def attach(cls, desc: QueueDescriptor, spin_us: int | None = None) -> QueueClient:
        """Map the queue and take a free lane (the only step that may contend: OFD byte locks)."""
        m = attach_mapped(desc)
        try:
            for lane in range(m.geo.lanes):
                if ofd_lock.try_lock(m.seg.fd, 1 + lane):
                    return cls(desc, m, lane, desc.config.client_spin_us if spin_us is None else spin_us)
        except BaseException:
            m.close()
            raise
        m.close()
        raise LaneUnavailable(
            f"all {desc.config.lanes} lanes of queue {desc.name} are held by live clients; "
            f"create the queue with more lanes"
        )

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

    def close(self) -> None:
        """Give the lane back; requests still in flight are abandoned (their answers are dropped)."""
        if self._closed:
            return
        self._closed = True
        self._req_views.clear()
        self._resp_views.clear()
        self._m.q[self._m.geo.lane(self.lane, L_PID)] = 0
        ofd_lock.unlock(self._m.seg.fd, 1 + self.lane)  # a view kept past close must not hold the lane
        self._attached.close()
        self._pool.close()
        self._m.close()

    def _published_slots(self) -> set[int]:
        """Slots the worker may still take: ring positions [tail, doorbell) of this lane.

        Read tail first: the worker only moves it forward, so the positions it can still read are a
        subset of those read here.
        """
        q, geo = self._m.q, self._m.geo
        tail = q[geo.lane(self.lane, L_TAIL)]
        head = q[H_DOORBELLS // 8 + self.lane]
        if not 0 <= head - tail <= geo.spl:
            return set(range(geo.spl))  # corrupt words: trust nothing, wait for answers
        ring = geo.lane(self.lane, L_RING)
        return {int(q[ring + k % geo.spl]) for k in range(tail, head)}

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        q, geo = self._m.q, self._m.geo
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
            f"all {geo.spl} slots of lane {self.lane} have requests in flight; wait() for one (or "
            f"abandon() it) before submitting more; an abandoned request's slot returns once it is answered"
        )

    def abandon(self, ticket: Ticket) -> None:
        """Nobody will wait for ``ticket``: its slot is reused once the worker answered it.

        Dropping the ticket has the same effect (the client holds it weakly).
        """
        ticket.consumed = True
        if ticket.slot in self._inflight:
            self._inflight[ticket.slot] = None

    def _write_external(self, s: int, g: int, plan: PayloadLayout, arrays: Mapping[str, Any]) -> int:
        """A payload too large for the slot: arrays into a pooled ndarray slot, its name in the header."""
        self._req_views.pop(g, None)  # the header written below replaces any cached inline one
        need = plan.ext_bytes
        nd = self._nd_req.pop(s, None)
        if nd is None or nd.capacity < need or ndslot.rotation_spares(nd.capacity):
            # Taken before the last one is given back: a rotating size class never rewrites at once
            # the slot the worker read last (its lines are in the worker core's cache, payload.py).
            last, nd = nd, self._pool.acquire(need, rotate=True)
            if last is not None:
                self._pool.release(last)
        self._nd_req[s] = nd
        nd.write(arrays, plan.spec)
        return ndslot.write_header(self._m.buf, self._m.geo.req_off(g), nd.name, plan.spec)

    def _check_size(self, plan: PayloadLayout) -> None:
        geo = self._m.geo
        limit = self._cfg.max_ndslot_bytes
        if plan.ext_bytes > limit:
            raise PayloadTooLarge(
                f"request of {plan.ext_bytes} bytes ({spec_text(plan.spec)}) exceeds the "
                f"{geo.req_bytes}-byte slot and the ndarray-slot limit of {limit} bytes"
            )
        if ndslot.inline_nbytes(plan.spec, "x" * 64) > geo.req_bytes:
            raise PayloadTooLarge(
                f"the header of {spec_text(plan.spec)} alone exceeds the {geo.req_bytes}-byte slot"
            )

    # -- hot path: submit, wait --------------------------------------------------------------------

    def submit(self, arrays: Mapping[str, np.ndarray[Any, Any]]) -> Ticket:
        """Write the request into a slot of this lane and publish it; returns at once."""
        if self._closed:
            raise QueueError("submit on a closed QueueClient")
        plan = ndslot.plan_of(arrays)
        m = self._m
        geo, q = m.geo, m.q
        inline = plan.inline_end <= geo.req_bytes
        if not inline:
            self._check_size(plan)
        s = self._free.pop() if self._free else self._take_slot()
        g = self._g0 + s
        si = (geo.slot_base >> 3) + g * (SLOT_BYTES >> 3)
        q[si + W_REQ_STATE] = WRITING
        try:
            if inline:
                cached = self._req_views.get(g)
                off = geo.req_off(g)
                # Written every time (~0.3 us): a header another process overwrote heals at once.
                m.mem[off : off + len(plan.prefix_bytes)] = plan.prefix_bytes
                if cached is None or cached[0] is not plan:
                    cached = (plan, ndslot.views(m.buf, plan.inline_layout, off))
                    self._req_views[g] = cached
                    nd = self._nd_req.pop(s, None)
                    if nd is not None:
                        self._pool.release(nd)
                for name, view in cached[1].items():
                    np.copyto(view, arrays[name], casting="no")
                nbytes = plan.inline_end
            else:
                nbytes = self._write_external(s, g, plan, arrays)
        except BaseException:
            q[si + W_REQ_STATE] = FREE
            self._free.append(s)
            raise
        seq = q[si + W_REQ_SEQ] + 1
        now = time.monotonic_ns()
        q[si + W_REQ_LEN] = nbytes
        q[si + W_SUBMIT_NS] = now
        q[si + W_REQ_SEQ] = seq
        q[si + W_REQ_STATE] = READY
        head = self._head
        q[self._ring_i + head % geo.spl] = s
        self._head = head + 1
        q[self._doorbell_i] = head + 1  # publication: everything above is visible before this (TSO)
        full_barrier()  # order the doorbell store before the load of worker_sleep (Dekker)
        if q[H_WORKER_SLEEP >> 3]:
            q[H_WORKER_SLEEP >> 3] = 0
            futex_wake(m.addr(H_WORKER_SLEEP >> 3))
        ticket = Ticket(s, seq, plan.batch, now)
        self._inflight[s] = weakref.ref(ticket)
        return ticket

    def ready(self, ticket: Ticket) -> bool:
        g = self._g0 + ticket.slot
        return bool(self._m.q[self._m.geo.slot(g, S_RESP_SEQ)] == ticket.seq)

    def wait(self, ticket: Ticket, timeout: float = 1.0) -> Arrays:
        """Outputs of ``ticket`` (copies owned by the caller). Raises QueueTimeout, WorkerDied, ..."""
        if ticket.consumed:
            raise QueueError(f"ticket for slot {ticket.slot} seq {ticket.seq} was already waited for")
        m = self._m
        q = m.q
        g = self._g0 + ticket.slot
        si = (m.geo.slot_base >> 3) + g * (SLOT_BYTES >> 3)
        seq = ticket.seq
        if q[si + W_RESP_SEQ] != seq:
            clock = time.monotonic_ns
            now = clock()
            spin_end = now + self._spin_ns
            yield_from = now + PURE_SPIN_NS
            while q[si + W_RESP_SEQ] != seq:
                now = clock()
                if now > yield_from:
                    # Past a typical round trip: let other runnable tasks on this CPU (other samplers)
                    # go first. sched_yield returns at once when nobody else is runnable.
                    if now > spin_end:
                        self._park(ticket, si, timeout)
                        break
                    os.sched_yield()
        return self._take_answer(ticket, g, si)

    def _park(self, ticket: Ticket, si: int, timeout: float) -> None:
        m = self._m
        q = m.q
        seq, resp_i = ticket.seq, si + W_RESP_SEQ
        clock = time.monotonic_ns
        start = clock()
        deadline = deadline_ns(start, timeout)
        dead_worker = 0
        parked_i, count_i = self._parked_i, self._count_i
        while True:
            expected = q[count_i]
            q[parked_i] = 1
            full_barrier()  # order the parked store before the re-check below (Dekker)
            if q[resp_i] == seq:
                q[parked_i] = 0
                return
            now = clock()
            if q[H_WORKER_PID >> 3] != 0 and not ofd_lock.held(m.seg.fd, 0):
                # A dead worker fails only what it had claimed (it may have run it); an unclaimed
                # request stays queued for the next worker: at most once, and never lost.
                dead_worker = int(q[H_WORKER_PID >> 3])
                if q[si + W_CLAIM_SEQ] == seq:
                    q[parked_i] = 0
                    if q[resp_i] == seq:
                        return
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
            futex_wait(m.addr(count_i), expected, min((deadline - now) / 1e9, PARK_SLICE_S))
            q[parked_i] = 0
            if q[resp_i] == seq:
                return

    def _take_answer(self, ticket: Ticket, g: int, si: int) -> Arrays:
        m = self._m
        geo, q, buf = m.geo, m.q, m.buf
        status = q[si + W_RESP_STATUS]
        self._timing = (ticket.submit_ns, q[si + W_CLAIM_NS], q[si + W_DONE_NS], time.monotonic_ns())
        try:
            if status != ST_OK:
                raise _STATUS_ERRORS.get(status, RequestFailed)(_read_message(m, g, q[si + W_RESP_LEN]))
            off = geo.resp_off(g)
            ext, plan, raw = ndslot.read_plan(m.mem, m.q, off, geo.resp_bytes)
            if ext is not None:
                views = self._attached.get(ext, self._cfg.shm_dir, self._cfg.mode).arrays(plan.spec)
            else:
                cached = self._resp_views.get(g)
                if cached is not None and cached[0] == raw:
                    views = cached[1]
                else:
                    if plan.inline_end > geo.resp_bytes:
                        raise RequestFailed(
                            f"corrupt answer: {plan.inline_end}-byte layout in a {geo.resp_bytes} B slot"
                        )
                    views = ndslot.views(buf, plan.inline_layout, off)
                    self._resp_views[g] = (raw, views)
            return {k: v.copy() for k, v in views.items()}
        finally:
            ticket.consumed = True
            q[si + W_REQ_STATE] = FREE
            self._inflight.pop(ticket.slot, None)
            self._free.append(ticket.slot)

    def infer(self, arrays: Mapping[str, np.ndarray[Any, Any]], timeout: float = 1.0) -> Arrays:
        return self.wait(self.submit(arrays), timeout)

    def start(self, arrays: Mapping[str, np.ndarray[Any, Any]]) -> Pending:
        return Pending(self, self.submit(arrays))
