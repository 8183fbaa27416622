"""Ndarray segments per request: nothing is mapped per request, and rotating sizes take turns.

The counters (``NdarraySegment.created``/``attached``) are the observable: a mapping re-created per
request would show in them whatever the timing. Rotation (``payload.ROTATE_BYTES``) is checked by the
ndarray segments the requests name: a rotating size never lands in the slot the worker read last.
"""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest

from lowtail.shm import payload
from lowtail.shm.payload import NdarraySegment, NdarraySegmentPool, rotation_spares
from lowtail.shm.queue import InferenceQueue, QueueClient, QueueConfig, QueueWorker

CFG = QueueConfig(lanes=1, slots_per_lane=2, request_bytes=4096, response_bytes=4096, coalesce_us=0)


def _round_trip(c: QueueClient, w: QueueWorker, x: np.ndarray) -> str | None:
    """One request of ``x``: the worker checks every byte and answers; returns the ndarray segment the
    request named (None inline)."""
    t = c.submit({"x": x})
    b = w.claim(1.0)
    assert b is not None
    got = b.inputs["x"]
    np.testing.assert_array_equal(got, x)
    m, g = w._m, b._items[0].g
    slot = payload.read_header(m.mem, m.q, m.geo.req_off(g), m.geo.req_bytes)[0]
    b.complete({"y": got[:, :1].copy()})
    np.testing.assert_array_equal(c.wait(t, 1.0)["y"], x[:, :1])
    return slot


@pytest.mark.parametrize("kib", [64, 512, 1024, 2048, 4096])
def test_same_size_requests_create_and_attach_nothing_after_the_first_turn(kib: int) -> None:
    rows = kib * 1024 // 4 // 8
    turn = rotation_spares(kib * 1024) + 1  # slots a size cycles through (1: no rotation)
    with (
        InferenceQueue.create(CFG) as s,
        QueueClient.attach(s.descriptor) as c,
        QueueWorker.attach(s.descriptor) as w,
    ):
        for i in range(turn):
            _round_trip(c, w, np.full((8, rows), i, np.float32))
        created, attached = NdarraySegment.created, NdarraySegment.attached
        for i in range(3 * turn + 2):
            _round_trip(c, w, np.full((8, rows), 100 + i, np.float32))  # new values: no stale page
        assert (NdarraySegment.created - created, NdarraySegment.attached - attached) == (0, 0)


@pytest.mark.parametrize(("kib", "rotates"), [(64, False), (512, True), (1024, True), (4096, False)])
def test_a_rotating_size_never_rewrites_the_slot_the_worker_read_last(kib: int, rotates: bool) -> None:
    rows = kib * 1024 // 4 // 8
    with (
        InferenceQueue.create(CFG) as s,
        QueueClient.attach(s.descriptor) as c,
        QueueWorker.attach(s.descriptor) as w,
    ):
        addrs = [_round_trip(c, w, np.full((8, rows), i, np.float32)) for i in range(12)]
    turn = rotation_spares(kib * 1024) + 1
    assert (turn > 1) == rotates
    if rotates:
        assert all(a != b for a, b in itertools.pairwise(addrs))
        assert len(set(addrs)) == turn and addrs[turn:] == addrs[:-turn]  # the same turn, in order
    else:
        assert len(set(addrs)) == 1


def test_requests_in_flight_keep_their_slots_while_a_size_rotates() -> None:
    rows = (1 << 20) // 4 // 8  # 1 MiB: a rotating size
    with (
        InferenceQueue.create(CFG) as s,
        QueueClient.attach(s.descriptor) as c,
        QueueWorker.attach(s.descriptor) as w,
    ):
        for rnd in range(4):
            xs = [np.full((8, rows), 10 * rnd + k, np.float32) for k in range(2)]
            tickets = [c.submit({"x": x}) for x in xs]  # both slots of the lane in flight at once
            seen = []
            while len(seen) < 2:
                b = w.claim(1.0)
                assert b is not None
                seen.extend(float(v) for v in b.inputs["x"][:, 0].reshape(len(b), -1)[:, 0])
                b.complete({"y": b.inputs["x"][:, :1].copy()})
            assert sorted(seen) == [10 * rnd, 10 * rnd + 1]  # neither overwrote the other's slot
            for t, x in zip(tickets, xs, strict=True):
                np.testing.assert_array_equal(c.wait(t, 1.0)["y"], x[:, :1])


def test_the_pool_cycles_a_rotating_size_least_recently_released_first(tmp_path: Path) -> None:
    pool = NdarraySegmentPool(str(tmp_path))
    try:
        cap = 512 << 10
        spares = rotation_spares(cap)
        held = pool.acquire(cap, rotate=True)
        order = [held.name]
        for _ in range(3 * (spares + 1)):
            nxt = pool.acquire(cap, rotate=True)
            pool.release(held)
            held = nxt
            order.append(held.name)
        assert len(pool) == spares + 1
        assert order[spares + 1 :] == order[: -(spares + 1)]
        assert len(set(order[: spares + 1])) == spares + 1
        plain = pool.acquire(cap)  # without rotate: any free slot at once, nothing new
        assert len(pool) == spares + 1 and plain.name != held.name
    finally:
        pool.close()


def test_rotation_is_bounded_to_sizes_it_pays_for() -> None:
    assert rotation_spares(payload.ROTATE_MIN_CAP // 2) == 0
    assert rotation_spares(payload.ROTATE_MAX_CAP * 2) == 0
    spares = [rotation_spares(1 << k) for k in range(19, 22)]  # 512 KiB .. 2 MiB
    assert all(1 <= n <= 3 for n in spares)
