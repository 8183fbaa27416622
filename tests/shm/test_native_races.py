"""The native core against what another process does between its reads, and at the edges of what it
is given: header bytes flipped by a concurrent writer while the worker polls, ring positions that name
one slot again and again across the counters' wrap, an answer forged by its own client and the slot
reused before the worker's late answer, the largest geometry's last lane and slot, outputs of every
dtype, stride and width (alone, merged, and by the layout the core knows), clients killed while the
core copies and publishes, and a client closed while another thread waits in the core. Every test
runs on both hot paths (``queue_impl``): what the reference does is what the core must do."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing.context import BaseContext
from typing import Any

import numpy as np
import pytest

from lowtail.shm import client as client_mod
from lowtail.shm import payload, server
from lowtail.shm.errors import BadRequest, LaneBusy, QueueError
from lowtail.shm.layout import (
    FREE,
    HW_DOORBELLS,
    HW_WORKER_PID,
    L_PARKED,
    L_RING,
    L_TAIL,
    READY,
    U64_MAX,
    W_CLAIM_SEQ,
    W_REQ_SEQ,
    W_REQ_STATE,
    W_RESP_LEN,
    W_RESP_SEQ,
    W_RESP_STATUS,
)
from lowtail.shm.queue import InferenceQueue, QueueClient, QueueConfig, QueueWorker
from tests.shm.helpers import echo

pytestmark = pytest.mark.usefixtures("queue_impl")
Arrays = dict[str, np.ndarray[Any, Any]]


def _x(tag: float, rows: int = 1) -> Arrays:
    return {"x": np.full((rows, 8), tag, np.float32)}


def _serve(w: QueueWorker, model: Callable[[np.ndarray[Any, Any]], Arrays] = echo) -> list[int]:
    b = w.claim(timeout_s=0.2)
    if b is None:
        return []
    with b:
        lanes = b.lanes
        b.complete(model(b.inputs["x"]))
    return lanes


def _conf(lanes: int, spl: int, **cfg: Any) -> QueueConfig:
    """A queue of 4 KiB regions, no coalescing unless asked."""
    cfg.setdefault("coalesce_us", 0)
    return QueueConfig(lanes=lanes, slots_per_lane=spl, request_bytes=4096, response_bytes=4096, **cfg)


@contextlib.contextmanager
def _queue(lanes: int = 2, spl: int = 4, **cfg: Any) -> Iterator[tuple[InferenceQueue, QueueWorker]]:
    with InferenceQueue.create(_conf(lanes, spl, **cfg)) as s, QueueWorker.attach(s.descriptor) as w:
        yield s, w


# -- outputs of every dtype, stride and width: each request gets exactly its own rows -----------------


def _misaligned(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``a``'s values in memory one byte off the dtype's alignment."""
    raw = np.empty(a.nbytes + 1, np.uint8)
    out = raw[1:].view(a.dtype).reshape(a.shape)
    out[...] = a
    return out


def _reversed_rows(a: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """``a``'s values as a view with a negative row stride."""
    return np.ascontiguousarray(a[::-1])[::-1]


# Each kind: (the outputs as the model hands them over, the same values as the client must read them).
ODD_OUTPUTS: dict[str, Callable[[np.ndarray[Any, Any]], Arrays]] = {
    "complex128": lambda x: {"c": (x[:, :4] + 1j * x[:, 4:]).astype(np.complex128)},
    "bool and float16": lambda x: {"b": x > 2.5, "h": x.astype(np.float16)},
    "zero width": lambda x: {"none": np.empty((len(x), 0), np.float32), "y": x + 1},
    "negative row stride": lambda x: {"y": _reversed_rows(x * 3)},
    "fortran 3-d": lambda x: {"y": np.asfortranarray((x * 5).reshape(len(x), 2, 4))},
    "broadcast, read-only": lambda x: {"y": np.broadcast_to(x[:, :1], (len(x), 8))},
    "misaligned u64": lambda x: {"y": _misaligned(x.astype(np.uint64) << np.uint64(40))},
}


@pytest.mark.parametrize("kind", sorted(ODD_OUTPUTS))
def test_odd_outputs_reach_each_request_row_for_row_alone_again_and_merged(kind: str) -> None:
    """Alone (the layout validated), alone again (the layout the core knows), then merged with a
    request of another lane (rows split between them): each client reads its own rows, exactly."""
    model = ODD_OUTPUTS[kind]
    with (
        _queue() as (s, w),
        QueueClient.attach(s.descriptor) as a,
        QueueClient.attach(s.descriptor) as b,
    ):
        for tag in (1.0, 2.0):
            xa = np.arange(16, dtype=np.float32).reshape(2, 8) + tag
            t = a.submit({"x": xa})
            assert _serve(w, model) == [a.lane]
            got = a.wait(t, timeout_s=1.0)
            want = {k: np.ascontiguousarray(v) for k, v in model(xa).items()}
            assert set(got) == set(want)
            for k, v in want.items():
                assert got[k].dtype == v.dtype and np.array_equal(got[k], v), (kind, k, tag)
        xa = np.arange(24, dtype=np.float32).reshape(3, 8) - 7
        xb = np.arange(8, dtype=np.float32).reshape(1, 8) * 11
        ta, tb = a.submit({"x": xa}), b.submit({"x": xb})
        assert sorted(_serve(w, model)) == sorted([a.lane, b.lane])  # one batch of both
        for c, t, x in ((a, ta, xa), (b, tb, xb)):
            got = c.wait(t, timeout_s=1.0)
            for k, v in model(x).items():
                assert got[k].shape == v.shape and np.array_equal(got[k], v), (kind, k)


# -- the edges of the geometry ------------------------------------------------------------------------


def test_the_last_of_256_lanes_parked_is_woken_by_its_answer(monkeypatch: pytest.MonkeyPatch) -> None:
    """Lane 255 is the top bit of the core's wake bitset: its parked client must be woken by the
    worker (a missed wake would still end the wait at its park slice, so the wake count is checked).
    One slice spans the test: a slice that ends while the worker answers lets the client see the
    answer unparked, and the worker rightly skips the wake (a loaded CI host made that happen)."""
    monkeypatch.setattr(client_mod, "PARK_SLICE_S", 30.0)
    monkeypatch.setattr(client_mod, "PARK_SLICE_NS", 30 * 10**9)
    with _queue(lanes=256, spl=1) as (s, w), contextlib.ExitStack() as stack:
        clients = [stack.enter_context(QueueClient.attach(s.descriptor, spin_us=0)) for _ in range(256)]
        last = clients[-1]
        assert last.lane == 255
        t = last.submit(_x(4.0))
        got: list[Any] = []
        waiter = threading.Thread(target=lambda: got.append(last.wait(t, timeout_s=10.0)))
        waiter.start()
        deadline = time.monotonic() + 10
        while not s._m.q[s._m.geo.lane(255, L_PARKED)] and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(0.05)  # from the flag's store into the futex wait
        before = w.wakes()[1]
        assert _serve(w) == [255]
        waiter.join(10)
        assert not waiter.is_alive() and got[0]["twice"][0, 0] == 9.0
        assert w.wakes()[1] == before + 1


def test_4096_slots_of_a_lane_each_with_its_own_layout_are_answered_each_by_its_own() -> None:
    """Every slot of the largest lane in flight at once, past the header caches' bound (4096 headers):
    half share one header (counted in the core without stopping), half are new (decoded in Python),
    so the core's header cache is cleared within a poll, after it claimed requests of a header it
    knew and before Python took their layouts."""
    cols = [8 if k % 2 else 9 + k for k in range(2 * 4096)]
    with (
        _queue(lanes=1, spl=4096, max_batch_slots=16, max_batch_samples=16) as (s, w),
        QueueClient.attach(s.descriptor) as c,
    ):
        for half in (cols[:4096], cols[4096:]):
            tickets = [c.submit({"x": np.full((1, n), float(k), np.float32)}) for k, n in enumerate(half)]
            done = 0
            while done < len(half):
                b = w.claim(timeout_s=1.0)
                assert b is not None, f"{done} of {len(half)} claimed"
                with b:
                    done += len(b)
                    b.complete({"y": b.inputs["x"] + 1})
            for k, (n, t) in enumerate(zip(half, tickets, strict=True)):
                y = c.wait(t, timeout_s=1.0)["y"]
                assert y.shape == (1, n) and (y == k + 1).all(), k


# -- ring positions and doorbells written by the lane's own client --------------------------------------


def test_ring_positions_naming_one_slot_across_the_wrap_run_it_once_and_a_doorbell_behind_fences() -> None:
    ran: list[float] = []

    def model(x: np.ndarray[Any, Any]) -> Arrays:
        ran.extend(x[:, 0].tolist())
        return echo(x)

    with InferenceQueue.create(_conf(2, 4)) as s:
        q, geo = s._m.q, s._m.geo
        q[HW_DOORBELLS] = q[geo.lane(0, L_TAIL)] = U64_MAX - 1  # lane 0 two positions before the wrap
        with (
            QueueWorker.attach(s.descriptor) as w,
            QueueClient.attach(s.descriptor) as hostile,
            QueueClient.attach(s.descriptor) as honest,
        ):
            assert hostile.lane == 0
            t = hostile.submit(_x(7.0))
            for k in range(4):  # every position of the ring names that one slot; four "published"
                q[geo.lane(0, L_RING) + (U64_MAX - 1 + k) % (1 << 64) % 4] = t.slot
            q[HW_DOORBELLS] = 2  # 2^64 - 2 + 4, wrapped
            th = honest.submit(_x(1.0))
            while _serve(w, model):
                pass
            assert sorted(ran) == [1.0, 7.0] and w.fenced == 0  # its request ran once, nothing fenced
            assert hostile.wait(t, timeout_s=1.0)["twice"][0, 0] == 15.0
            assert honest.wait(th, timeout_s=1.0)["twice"][0, 0] == 3.0
            assert q[geo.lane(0, L_TAIL)] == 2
            q[HW_DOORBELLS] = 1  # behind the tail
            th = honest.submit(_x(2.0))
            while _serve(w, model):
                pass
            assert w.fenced == 1 and honest.wait(th, timeout_s=1.0)["twice"][0, 0] == 5.0


# -- an answer forged by its own client, and the slot reused before the worker's late answer -----------


def test_a_forged_answer_then_the_slot_reused_never_takes_the_workers_late_answer() -> None:
    with (
        _queue(lanes=2, spl=1) as (s, w),
        QueueClient.attach(s.descriptor) as a,
        QueueClient.attach(s.descriptor) as b,
    ):
        q, geo = s._m.q, s._m.geo
        ta, tb = a.submit(_x(1.0)), b.submit(_x(2.0))
        batch = w.claim(timeout_s=1.0)
        assert batch is not None and len(batch) == 2
        outputs = echo(batch.inputs["x"])
        si = geo.slot_word(a.lane * geo.spl + ta.slot)
        q[si + W_RESP_STATUS], q[si + W_RESP_LEN], q[si + W_RESP_SEQ] = 0, 0, ta.seq  # forged
        with pytest.raises(QueueError):  # nothing was ever answered there: no header to read
            a.wait(ta, timeout_s=1.0)
        t2 = a.submit(_x(3.0))  # the same (only) slot, while the worker still holds the first
        assert t2.slot == ta.slot and q[si + W_REQ_SEQ] == t2.seq
        batch.complete(outputs)  # the late answer of the first request
        assert not a.ready(t2)
        assert b.wait(tb, timeout_s=1.0)["twice"][0, 0] == 5.0
        assert _serve(w) == [a.lane]
        assert a.wait(t2, timeout_s=1.0)["twice"][0, 0] == 7.0


# -- header bytes flipped by another process while the worker polls ----------------------------------


def _prefixed(name: str | None, spec: payload.Spec, flags: int = 0) -> bytes:
    head = payload.encode_header(name, spec)
    return len(head).to_bytes(4, "little") + flags.to_bytes(4, "little") + head


FLIPS = [
    _prefixed(None, (("x", "<f4", (1, 8)),)),  # what its client wrote
    _prefixed(None, (("x", "<f4", (2, 8)),)),  # another valid layout, merged with the honest one
    _prefixed(None, (("z", "<i4", (1, 3)),)),
    _prefixed(None, (("x", "<f4", (1, 1 << 20)),)),  # valid, but larger than the region
    _prefixed("lowtail.nd.0.1.000000000000", (("x", "<f4", (1, 8)),), flags=1),  # no such segment
    _prefixed(None, (("x", "<f4", (1, 8)),), flags=1),  # the flag without a name
    b"\xff" * 48,
]


def submit_and_abandon(desc: Any, seconds: float, out: Any) -> None:
    """Keep this lane's slots full of requests nobody waits for (a process body)."""
    with QueueClient.attach(desc) as c:
        out.put(c.lane)
        end = time.monotonic() + seconds
        sent = 0
        while time.monotonic() < end:
            with contextlib.suppress(QueueError):  # all slots in flight: the next answer frees one
                c.abandon(c.submit(_x(-1.0)))
                sent += 1
    out.put(("sent", sent))


def flip_headers(desc: Any, lane: int, seconds: float, seed: int, out: Any) -> None:
    """Rewrite the request headers and sequence words of ``lane``'s published slots (those between the
    worker's tail and the doorbell) at random, as fast as it can, while the worker claims them (a
    process body: any process that maps the file can)."""
    from lowtail.shm import queue as qm

    rng = np.random.default_rng(seed)
    m = qm._attach(desc)
    geo, q = m.geo, m.q
    spl, g0 = geo.spl, lane * geo.spl
    tail_i, ring_i, bell_i = geo.lane(lane, L_TAIL), geo.lane(lane, L_RING), HW_DOORBELLS + lane
    picks = rng.integers(0, 1 << 30, 1 << 16).tolist()
    flips = 0
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            r = picks[flips & 0xFFFF]
            tail, n = q[tail_i], (q[bell_i] - q[tail_i]) % (1 << 64)
            k = q[ring_i + (tail + r % n) % spl] if 0 < n <= spl else r % spl
            if k < spl:
                raw = FLIPS[(r >> 8) % len(FLIPS)]
                off = geo.req_off(g0 + k)
                m.mem[off : off + len(raw)] = raw
                if (r >> 16) % 64 == 0:
                    q[geo.slot_word(g0 + k) + W_REQ_SEQ] += 1  # claimable again, or never
            flips += 1
    finally:
        del q
        m.close()
    out.put(("flips", flips))


def test_headers_flipped_by_another_process_while_the_worker_polls_fail_only_that_lane(
    ctx: BaseContext,
) -> None:
    with _queue(lanes=3, spl=8) as (s, w), QueueClient.attach(s.descriptor) as honest:
        out = ctx.Queue()
        sender = ctx.Process(target=submit_and_abandon, args=(s.descriptor, 1.5, out))
        sender.start()
        lane = out.get(timeout=30)
        flipper = ctx.Process(target=flip_headers, args=(s.descriptor, lane, 1.5, 3, out))
        flipper.start()
        try:
            ok = failed_batches = 0
            end = time.monotonic() + 1.5
            while time.monotonic() < end or ok < 50:
                assert time.monotonic() < end + 30, f"only {ok} honest round trips"
                t = honest.submit(_x(float(ok)))
                time.sleep(0.0002)  # the other lane's requests wait published: the flipper's window
                while not honest.ready(t):
                    try:
                        _serve(w)  # a claim never raises, whatever the other lane holds
                    except (KeyError, ValueError, BadRequest):
                        failed_batches += 1  # the model met the flipped lane's inputs: that batch alone
                got = honest.wait(t, timeout_s=1.0)
                assert got["twice"].shape == (1, 8) and (got["twice"] == 2 * ok + 1).all(), ok
                ok += 1
            ends = dict(out.get(timeout=30) for _ in range(2))
            assert ends["sent"] > 0 and ends["flips"] > 0
        finally:
            for p in (sender, flipper):
                p.join(30)
                if p.is_alive():
                    p.kill()
                    p.join()
        assert sender.exitcode == 0 and flipper.exitcode == 0


# -- clients killed while the core copies, publishes, spins, parks and reads ------------------------------


def churn(desc: Any, seed: int, attached: Any, crossed: Any) -> None:
    """Round trips of every kind (fresh copies, into ``out``, zero-copy held, several in flight) until
    killed; every answer checked against its own request (a process body). It reports through shared
    words, not a queue: a process killed while it writes a queue's pipe leaves its lock taken."""
    rng = np.random.default_rng(seed)
    with QueueClient.attach(desc, spin_us=int(rng.integers(0, 2)) * 50) as c:
        attached.value = c.lane
        into = {"twice": np.empty((3, 8), np.float32), "rowsum": np.empty((3, 1), np.float64)}
        k = 0
        while True:
            k += 1
            x = np.full((3, 8), float(k), np.float32)
            tickets = [c.submit({"x": x}) for _ in range(int(rng.integers(1, 4)))]
            for i, t in enumerate(tickets):
                how = (k + i) % 3
                got = c.wait(t, 5.0, out=into) if how == 1 else c.wait(t, 5.0, copy=how == 0)
                crossed.value += got["twice"][0, 0] != 2 * k + 1
                if how == 2:
                    got.release()


def test_clients_killed_at_random_moments_of_their_round_trips_lose_no_slot_and_cross_no_answer(
    ctx: BaseContext,
) -> None:
    from tests.shm.helpers import checking_client, echo_server

    rng = np.random.default_rng(5)
    with InferenceQueue.create(_conf(1, 4)) as s:
        worker = ctx.Process(target=echo_server, args=(s.descriptor, None, 120.0))
        worker.start()
        out, crossed = ctx.Queue(), ctx.RawValue("q", 0)  # type: ignore[attr-defined]
        try:
            for seed in range(12):
                attached = ctx.RawValue("q", -1)  # type: ignore[attr-defined]
                p = ctx.Process(target=churn, args=(s.descriptor, seed, attached, crossed))
                p.start()
                deadline = time.monotonic() + 30
                while attached.value == -1:
                    assert time.monotonic() < deadline and p.is_alive(), f"client {seed} never attached"
                    time.sleep(0.001)
                assert attached.value == 0  # the killed client's lane, each time
                time.sleep(float(rng.uniform(0.0, 0.03)))
                os.kill(p.pid, signal.SIGKILL)  # type: ignore[arg-type]
                p.join(10)
                assert p.exitcode == -signal.SIGKILL, f"client {seed} ended by itself: {p.exitcode}"
            checking = ctx.Process(target=checking_client, args=(s.descriptor, 99, 60, out))
            checking.start()
            checking.join(60)
            assert out.get(timeout=5) == (99, 60, 0)  # never a crossed answer, no slot lost
            assert crossed.value == 0 and worker.is_alive()
        finally:
            worker.terminate()
            worker.join(10)


# -- a client closed by another thread while one waits in the core ------------------------------------


def close_under_a_waiter(desc: Any, out: Any) -> None:
    """Park in ``wait`` on one thread, ``close`` the client from another, then let the answer come and
    touch what the waiter may still read (a process body: a read of unmapped memory kills it)."""
    c = QueueClient.attach(desc, spin_us=0)
    t = c.submit(_x(1.0))
    ended: list[str] = []

    def waiter() -> None:
        try:
            c.wait(t, timeout_s=2.0)
            ended.append("answered")
        except Exception as e:
            ended.append(type(e).__name__)

    th = threading.Thread(target=waiter)
    th.start()
    time.sleep(0.05)  # parked in the core by now (a futex wait of one slice at a time)
    try:
        c.close()
        closed = "closed"
    except Exception as e:  # the client is one thread's: what another thread's close does is not promised
        closed = type(e).__name__
    out.put(("closed", closed))
    th.join(10)
    out.put(("waited", ended, th.is_alive()))


def test_a_client_closed_under_a_waiting_thread_never_reads_unmapped_memory(ctx: BaseContext) -> None:
    with InferenceQueue.create(_conf(1, 2)) as s, QueueWorker.attach(s.descriptor) as w:
        out = ctx.Queue()
        p = ctx.Process(target=close_under_a_waiter, args=(s.descriptor, out))
        p.start()
        try:
            assert out.get(timeout=30)[0] == "closed"
            _serve(w)  # its answer lands in a lane whose client closed (or is closing)
            kind, ended, alive = out.get(timeout=30)
            assert kind == "waited" and ended and not alive
        finally:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join()
        assert p.exitcode == 0, f"the client died with {p.exitcode} (-11: a read of unmapped memory)"
        with QueueClient.attach(s.descriptor) as again:  # the lane came back
            assert again.lane == 0


# -- slot words a lane's last holder leaves behind, met by the lane's next client -------------------------


def _next_client_round_trips(s: InferenceQueue, w: QueueWorker, within_s: float) -> str:
    """The lane's next client tries round trips while the worker claims (idle claims included) for
    ``within_s``: "answered", or what the last try raised."""
    with QueueClient.attach(s.descriptor) as c:
        end, last = time.monotonic() + within_s, "no try"
        while time.monotonic() < end:
            try:
                t = c.submit(_x(3.0))
            except QueueError as e:
                last = f"{type(e).__name__}: {e}"
                w.claim(timeout_s=0.05)
                continue
            _serve(w)
            return "answered" if c.wait(t, timeout_s=1.0)["twice"][0, 0] == 7.0 else "crossed"
    return last


def _claimed_by_no_worker(q: Any, geo: Any, si: int) -> None:
    """Its slots look claimed (the worker's word), yet no worker holds them: nobody will answer them."""
    q[si + W_REQ_SEQ] = q[si + W_CLAIM_SEQ] = 9


def _garbage_tail_over_unpublished(q: Any, geo: Any, si: int) -> None:
    """The tail word is garbage and the slots hold sequences never published: nobody will take them."""
    q[geo.lane(0, L_TAIL)] = 12345
    q[si + W_REQ_SEQ] += 5


LEFT_BEHIND = {
    "claimed by no worker": _claimed_by_no_worker,
    "garbage tail word": _garbage_tail_over_unpublished,
}


@pytest.mark.parametrize("left", sorted(LEFT_BEHIND))
def test_slot_words_a_lanes_last_holder_leaves_do_not_deny_the_lane_to_the_next_client(left: str) -> None:
    """A lane's last holder can write anything into its own slot words before it goes. The next client
    of the lane (``QueueClient._recover_slots``) waits for the answers of slots that look claimed, or
    published between the tail word and the doorbell, and marks them INHERITED; the idle worker answers
    ST_CLIENT_GONE those it neither holds nor can still take once seen at two sweep passes (one
    SWEEP_EVERY_NS apart, 1 s: hence the 5 s budget). Seen failing on both paths before: LaneBusy."""
    with _queue(lanes=1, spl=2) as (s, w):
        q, geo = s._m.q, s._m.geo
        with QueueClient.attach(s.descriptor):
            for k in range(geo.spl):
                LEFT_BEHIND[left](q, geo, geo.slot_word(k))
        assert _next_client_round_trips(s, w, 5.0) == "answered"
        assert w.inherited_gone == geo.spl


def _idle_passes(w: QueueWorker, passes: int) -> None:
    """Idle claims until the worker has begun ``passes`` sweep passes (SWEEP_EVERY_NS shortened to 20 ms
    by the caller). Counted, not timed: a loaded host that stalls the worker runs fewer in a given time."""
    deadline, last, begun = time.monotonic() + 30, w._swept_ns, 0
    while begun < passes:
        assert time.monotonic() < deadline, f"{begun} of {passes} sweep passes begun in 30 s of idle claims"
        assert w.claim(timeout_s=0.005) is None
        if w._swept_ns != last:
            last, begun = w._swept_ns, begun + 1


def test_a_predecessors_request_the_worker_holds_is_answered_by_its_batch_not_as_inherited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A request the lane's last holder left claimed in a batch not completed yet: the next client
    inherits it, and the idle worker's passes leave it to its batch (answering it there as well would
    answer it twice); the batch's late answer frees the slot."""
    monkeypatch.setattr(server, "SWEEP_EVERY_NS", 20_000_000)
    with _queue(lanes=1, spl=1) as (s, w):
        q, si = s._m.q, s._m.geo.slot_word(0)
        with QueueClient.attach(s.descriptor) as first:
            first.submit(_x(1.0))
            b = w.claim(timeout_s=1.0)
            assert b is not None
        with QueueClient.attach(s.descriptor) as c:
            with pytest.raises(LaneBusy):
                c.submit(_x(3.0))
            _idle_passes(w, 5)
            assert q[si + W_RESP_SEQ] != q[si + W_REQ_SEQ] and w.inherited_gone == 0
            with b:
                b.complete(echo(b.inputs["x"]))
            assert q[si + W_RESP_SEQ] == q[si + W_REQ_SEQ] and w.inherited_gone == 0
            t = c.submit(_x(3.0))  # the late answer freed the slot
            _serve(w)
            assert c.wait(t, timeout_s=1.0)["twice"][0, 0] == 7.0


def test_a_poisoned_lanes_recovery_goes_unnoticed_by_the_neighbour_lane(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The other lane's client, with a request the worker holds across the passes and round trips
    between them, sees nothing of the poisoned lane's recovery: its held request is answered once by
    its batch with its own rows, every round trip too, and only the poisoned lane's slots are gone."""
    monkeypatch.setattr(server, "SWEEP_EVERY_NS", 20_000_000)
    with _queue(lanes=2, spl=2) as (s, w):
        q, geo = s._m.q, s._m.geo
        with QueueClient.attach(s.descriptor) as neighbour:
            with QueueClient.attach(s.descriptor) as bad:
                for k in range(geo.spl):
                    _claimed_by_no_worker(q, geo, geo.slot_word(bad.lane * geo.spl + k))
            held_t = neighbour.submit(_x(5.0))
            held = w.claim(timeout_s=1.0)
            assert held is not None and held.lanes == [neighbour.lane]
            with QueueClient.attach(s.descriptor) as c:
                assert c.lane != neighbour.lane
                for k in range(1, 16):  # passes every 20 ms, the neighbour's round trips between them
                    t = neighbour.submit(_x(float(k)))
                    assert _serve(w) == [neighbour.lane]
                    assert neighbour.wait(t, timeout_s=1.0)["twice"][0, 0] == 2 * k + 1
                    _idle_passes(w, 1)
                assert w.inherited_gone == geo.spl  # the poisoned lane's two, none of the neighbour's
                with held:
                    held.complete(echo(held.inputs["x"]))
                assert neighbour.wait(held_t, timeout_s=1.0)["twice"][0, 0] == 11.0
                t = c.submit(_x(3.0))
                _serve(w)
                assert c.wait(t, timeout_s=1.0)["twice"][0, 0] == 7.0


def test_the_next_clients_own_requests_are_never_answered_as_inherited(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """While two slots the last holder left unanswerable wait for the worker's passes, the next
    client's requests on the other slots are served, every one with its own answer; then the two
    inherited slots come back, answered ST_CLIENT_GONE once each. A request of its own stopped
    between its sequence word and its doorbell is never answered as gone."""
    monkeypatch.setattr(server, "SWEEP_EVERY_NS", 20_000_000)
    with _queue(lanes=1, spl=4) as (s, w):
        q, geo = s._m.q, s._m.geo
        with QueueClient.attach(s.descriptor):
            for k in (0, 1):
                _claimed_by_no_worker(q, geo, geo.slot_word(k))
        with QueueClient.attach(s.descriptor) as c:
            stalled = c._si[c._free[-1]]  # its next request, stopped before its doorbell: not inherited
            q[stalled + W_REQ_SEQ] += 1
            q[stalled + W_REQ_STATE] = READY
            _idle_passes(w, 3)
            assert q[stalled + W_RESP_SEQ] != q[stalled + W_REQ_SEQ]  # left alone, not answered as gone
            q[stalled + W_REQ_SEQ] -= 1
            q[stalled + W_REQ_STATE] = FREE
            end, k = time.monotonic() + 0.3, 0
            while time.monotonic() < end:  # about 15 passes, a request or two between each
                k += 1
                tickets = [(tag, c.submit(_x(tag))) for tag in (k, k + 0.5)]
                served = 0
                while served < len(tickets):
                    b = w.claim(timeout_s=1.0)
                    assert b is not None
                    with b:
                        served += len(b)
                        b.complete(echo(b.inputs["x"]))
                for tag, t in tickets:
                    assert c.wait(t, timeout_s=1.0)["twice"][0, 0] == 2 * np.float32(tag) + 1
                assert w.claim(timeout_s=0.005) is None  # idle: a sweep pass when one is due
            assert w.inherited_gone == 2
            tickets = [c.submit(_x(float(i))) for i in range(geo.spl)]  # all four slots are free again
            for i, t in enumerate(tickets):
                _serve(w)
                assert c.wait(t, timeout_s=1.0)["twice"][0, 0] == 2 * i + 1


# -- a worker killed at random moments of its native claims and answers -----------------------------------


def tagged_rounds(desc: Any, cid: int, stop: Any, out: Any) -> None:
    """Keep up to three tagged requests in flight until ``stop`` is set; count how each ended: answered
    with its own rows, answered with another's, WorkerDied, or no end within its timeout (a process
    body)."""
    from lowtail.shm.errors import LaneBusy, QueueTimeout, WorkerDied

    ends = {"own": 0, "crossed": 0, "died": 0, "lost": 0}
    with QueueClient.attach(desc) as c:
        inflight: list[tuple[float, Any]] = []
        k = 0
        while not stop.is_set() or inflight:
            if not stop.is_set() and len(inflight) < 3:
                k += 1
                tag = cid * 1e6 + k
                try:
                    inflight.append((tag, c.submit({"x": np.full((1 + k % 3, 8), tag, np.float32)})))
                    continue
                except LaneBusy:  # slots of requests a dead worker held return once the next one answers
                    if not inflight:
                        time.sleep(0.001)
                        continue
            tag, t = inflight.pop(0)
            try:
                got = c.wait(t, timeout_s=10.0)["twice"]
                ends["own" if (got == 2 * np.float32(tag) + 1).all() else "crossed"] += 1
            except WorkerDied:
                ends["died"] += 1
            except QueueTimeout:
                ends["lost"] += 1
    out.put((cid, ends))


def _processing(s: InferenceQueue) -> bool:
    """Whether a request of the queue is claimed and not answered (PROCESSING)."""
    q, geo = s._m.q, s._m.geo
    for g in range(geo.lanes * geo.spl):
        si = geo.slot_word(g)
        if q[si + W_CLAIM_SEQ] == q[si + W_REQ_SEQ] != q[si + W_RESP_SEQ]:
            return True
    return False


def test_a_worker_killed_at_random_moments_answers_each_request_once_or_reports_it_died(
    ctx: BaseContext,
) -> None:
    from tests.shm.helpers import echo_server

    rng = np.random.default_rng(11)
    with InferenceQueue.create(_conf(4, 4, coalesce_us=200)) as s:
        out = ctx.Queue()
        stop = ctx.Event()  # set after the last kill: the clients keep requests coming until then
        clients = [ctx.Process(target=tagged_rounds, args=(s.descriptor, cid, stop, out)) for cid in range(3)]
        workers = []
        try:
            for p in clients:
                p.start()
            for k in range(8):
                # every other worker's model takes 2 ms: kills land while requests are claimed, too
                w = ctx.Process(target=echo_server, args=(s.descriptor, None, 60.0, 0.002 * (k % 2)))
                workers.append(w)
                w.start()
                deadline = time.monotonic() + 30
                while s._m.q[HW_WORKER_PID] != w.pid:  # attached: the kill lands in its serving
                    assert time.monotonic() < deadline and w.is_alive(), "a worker never attached"
                    time.sleep(0.001)
                time.sleep(float(rng.uniform(0.02, 0.2)))
                if k % 2:  # and these land on a claimed request (its own or its predecessor's), however late
                    while not _processing(s):
                        assert time.monotonic() < deadline and w.is_alive(), "a worker never claimed"
                        time.sleep(0.0005)
                os.kill(w.pid, signal.SIGKILL)  # type: ignore[arg-type]
                w.join(10)
            workers.append(ctx.Process(target=echo_server, args=(s.descriptor, None, 60.0)))
            workers[-1].start()  # the last one serves what is left
            time.sleep(0.2)  # and a few rounds more
            stop.set()
            ends = [out.get(timeout=60)[1] for _ in clients]
        finally:
            stop.set()
            for p in clients + workers:
                p.join(0.1 if p in workers else 30)
                if p.is_alive():
                    p.kill()
                    p.join()
        assert all(e["crossed"] == 0 and e["lost"] == 0 for e in ends), ends
        assert sum(e["own"] for e in ends) > 0 and sum(e["died"] for e in ends) > 0, ends


# -- a wait's timeout against the client's spin budget -------------------------------------------------------


def test_a_wait_ends_at_its_timeout_even_when_its_spin_budget_is_longer() -> None:
    """The spin budget may be up to a second; a wait of 50 ms whose answer never comes (no worker) must
    not spin the whole second first, and its error says how long it waited."""
    from lowtail.shm.errors import QueueTimeout

    with (
        InferenceQueue.create(_conf(1, 2)) as s,
        QueueClient.attach(s.descriptor, spin_us=1_000_000) as c,
    ):
        t = c.submit(_x(1.0))
        start = time.monotonic()
        with pytest.raises(QueueTimeout, match=r"no answer within (\d+\.\d+) s") as e:
            c.wait(t, timeout_s=0.05)
        waited = time.monotonic() - start
        # The defect added the whole 1 s spin budget: bounds below it leave room for a loaded host.
        reported = float(re.search(r"within (\d+\.\d+) s", str(e.value)).group(1))  # type: ignore[union-attr]
        assert 0.05 <= reported < 1.0 and waited < 1.0, f"a 50 ms wait took {waited:.3f} s: {e.value}"


def test_a_zero_copy_answer_sent_as_the_next_request_is_copied_from_the_held_slot() -> None:
    """The request arrays are read-only views of this client's own answer region (held zero-copy):
    the copy-in reads the shared mapping, the held slot is not reused under them."""
    with _queue(lanes=1, spl=2) as (s, w), QueueClient.attach(s.descriptor) as c:
        t = c.submit(_x(1.0))
        _serve(w)
        for _ in range(4):
            held = c.wait(t, timeout_s=1.0, copy=False)
            t = c.submit({"x": held["twice"]})
            assert t.slot != held._slot
            held.release()
            _serve(w)
        assert (c.wait(t, timeout_s=1.0)["twice"] == 63.0).all()  # 1 -> 3 -> 7 -> 15 -> 31 -> 63
