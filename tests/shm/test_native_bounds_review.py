"""Words and headers another process writes into a real segment, crafted at the edges where a bound
check could pass by arithmetic (a length whose 8-byte prefix wraps a u32, a ring entry with the sign
bit, a doorbell one past a full lane, an answer status or length of 2^64 - 1): each is refused by name,
fails only the request or lane it touched, and the next honest request round-trips. Every test runs on
both hot paths (``queue_impl``), the worker and the client on the same path, in one process, driven
claim by claim; the "other process" is the owner's mapping (``InferenceQueue._m``), which is what any
process with write access to the file can do.

The last section holds lane words that a previous holder of a lane leaves at 2^64 - 1: the next client
of that lane inherits them, and its counters wrap modulo 2^64 (a request sequence skipping 0); a lane's
slots are a power of two, so ring positions stay distinct across that wrap."""

from __future__ import annotations

import contextlib
import struct
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from lowtail.shm.errors import BadRequest, QueueError, RequestFailed
from lowtail.shm.layout import (
    HW_DOORBELLS,
    L_GEN,
    L_RESP_COUNT,
    L_RING,
    L_TAIL,
    W_REQ_SEQ,
    W_RESP_LEN,
    W_RESP_STATUS,
)
from lowtail.shm.queue import InferenceQueue, QueueClient, QueueConfig, QueueWorker
from tests.shm.helpers import echo

pytestmark = pytest.mark.usefixtures("queue_impl")

U64_MAX = (1 << 64) - 1
REQ = 4096  # request and response region bytes of the queues here


def _x(tag: float) -> dict[str, np.ndarray[Any, Any]]:
    return {"x": np.full((1, 8), tag, np.float32)}


def _serve(w: QueueWorker) -> list[int]:
    b = w.claim(timeout_s=0.2)
    if b is None:
        return []
    lanes = b.lanes
    b.complete(echo(b.inputs["x"]))
    return lanes


@contextlib.contextmanager
def _queue(lanes: int = 2, spl: int = 4) -> Iterator[tuple[InferenceQueue, QueueWorker, QueueClient]]:
    cfg = QueueConfig(lanes=lanes, slots_per_lane=spl, coalesce_us=0, request_bytes=REQ, response_bytes=REQ)
    with (
        InferenceQueue.create(cfg) as s,
        QueueWorker.attach(s.descriptor) as w,
        QueueClient.attach(s.descriptor) as c,
    ):
        yield s, w, c


def _round_trip(c: QueueClient, w: QueueWorker, tag: float) -> None:
    t = c.submit(_x(tag))
    assert _serve(w) == [c.lane]
    assert c.wait(t, timeout_s=1.0)["twice"][0, 0] == 2 * tag + 1


# -- the request's payload prefix: length and flags, read by the worker ------------------------------

PREFIXES = [
    (0, 0, "length 0"),
    (REQ - 7, 0, f"length {REQ - 7} "),  # one past the region with its 8-byte prefix
    ((1 << 32) - 8, 0, f"length {(1 << 32) - 8} "),  # 8 + length wraps a u32 to 0
    ((1 << 32) - 1, 0, f"length {(1 << 32) - 1} "),
    (64, 2, "flags 0x2"),
    (64, 1 << 31, "flags 0x80000000"),  # the sign bit of a u32
    (64, (1 << 32) - 1, "flags 0xffffffff"),
]


@pytest.mark.parametrize(("hlen", "flags", "named"), PREFIXES, ids=[p[2].strip() for p in PREFIXES])
def test_a_request_prefix_past_its_region_or_with_unknown_flags_is_a_bad_request(
    hlen: int, flags: int, named: str
) -> None:
    with _queue() as (s, w, c):
        _round_trip(c, w, 1.0)  # the header is known to both decoders' caches first
        t = c.submit(_x(2.0))
        struct.pack_into("<II", s._m.mem, s._m.geo.req_off(c.lane * s._m.geo.spl + t.slot), hlen, flags)
        assert _serve(w) == []  # refused at the claim: nothing reaches the engine
        with pytest.raises(BadRequest, match=f"corrupt payload header: .*{named}"):
            c.wait(t, timeout_s=1.0)
        _round_trip(c, w, 3.0)  # the client writes its prefix every time: the slot heals


def test_a_prefix_that_fits_the_region_exactly_is_read_and_one_byte_more_is_not() -> None:
    """The bound is 8 + length <= region: a header ending on the region's last byte is decoded (and
    refused for what it is, trailing bytes), one byte longer is refused by the bound."""
    with _queue() as (s, w, c):
        _round_trip(c, w, 1.0)
        for hlen, named in ((REQ - 8, "trailing bytes"), (REQ - 7, f"length {REQ - 7} ")):
            t = c.submit(_x(2.0))
            struct.pack_into("<I", s._m.mem, s._m.geo.req_off(c.lane * s._m.geo.spl + t.slot), hlen)
            assert _serve(w) == []
            with pytest.raises(BadRequest, match=named):
                c.wait(t, timeout_s=1.0)
        _round_trip(c, w, 3.0)


# -- ring entries and doorbells: the worker's indices into the lane ---------------------------------


@pytest.mark.parametrize("entry", [4, 1 << 63, U64_MAX], ids=["spl", "sign bit", "u64 max"])
def test_a_ring_entry_at_or_past_the_slots_fences_its_lane_and_nothing_is_claimed(entry: int) -> None:
    with _queue() as (s, w, c), QueueClient.attach(s.descriptor) as other:
        q, geo = s._m.q, s._m.geo
        t = c.submit(_x(1.0))
        q[geo.lane(c.lane, L_RING) + t.seq % geo.spl - 1] = entry  # its first ring position: 0
        tb = other.submit(_x(2.0))
        served = _serve(w) + _serve(w)
        assert served == [other.lane] and w.fenced == 1
        assert other.wait(tb, timeout_s=1.0)["twice"][0, 0] == 5.0
        with pytest.raises(BadRequest, match=f"lane {c.lane} fenced"):
            c.wait(t, timeout_s=1.0)


def test_a_doorbell_one_past_a_full_lane_is_fenced_and_a_full_lane_is_not() -> None:
    with _queue(lanes=1, spl=4) as (s, w, c):
        tickets = [c.submit(_x(float(i))) for i in range(4)]  # doorbell = tail + spl: legal
        got: list[int] = []
        while len(got) < 4:
            got += _serve(w)
        assert [c.wait(t, timeout_s=1.0)["twice"][0, 0] for t in tickets] == [1.0, 3.0, 5.0, 7.0]
        assert w.fenced == 0
        q = s._m.q
        tail = q[s._m.geo.lane(0, L_TAIL)]
        q[HW_DOORBELLS] = tail + 5  # one more published than the lane has slots
        assert _serve(w) == [] and w.fenced == 1
        assert q[s._m.geo.lane(0, L_TAIL)] == tail + 5  # the tail resynchronised to the doorbell


@pytest.mark.parametrize("count", [(1 << 32) - 1, U64_MAX], ids=["u32 max", "u64 max"])
def test_an_answer_count_word_at_its_maximum_wraps_to_zero_on_the_next_answer(count: int) -> None:
    """The lane's answer count (the futex word a parked client waits on) is incremented from what the
    segment holds: from 2^64 - 1 the sum must wrap, not overflow (a build with overflow checks panicked
    in the worker's answer)."""
    with _queue() as (s, w, c):
        ci = s._m.geo.lane(c.lane, L_RESP_COUNT)
        s._m.q[ci] = count
        _round_trip(c, w, 1.0)
        assert s._m.q[ci] == 0
        _round_trip(c, w, 2.0)
        assert s._m.q[ci] == 1


# -- the answer's words and header: read by the client ------------------------------------------------


@pytest.mark.parametrize("status", [7, 1 << 63, U64_MAX])
def test_an_unknown_answer_status_is_a_failure_with_the_message_clamped_to_its_region(status: int) -> None:
    with _queue() as (s, w, c):
        t = c.submit(_x(1.0))
        assert _serve(w) == [c.lane]
        si = s._m.geo.slot_word(c.lane * s._m.geo.spl + t.slot)
        s._m.q[si + W_RESP_STATUS] = status
        s._m.q[si + W_RESP_LEN] = U64_MAX  # the message length: clamped to the region, never past it
        with pytest.raises(RequestFailed) as e:
            c.wait(t, timeout_s=1.0)
        assert len(str(e.value).encode("utf-8", "replace")) <= 3 * REQ  # one region, replacement chars
        _round_trip(c, w, 2.0)


@pytest.mark.parametrize(
    ("hlen", "flags"), [((1 << 32) - 8, 0), (REQ - 7, 0), (64, 2)], ids=["u32 wrap", "one past", "flags"]
)
def test_an_answer_header_past_its_region_is_refused_after_the_cached_layout_missed(
    hlen: int, flags: int
) -> None:
    """The second answer in a slot is read by the layout cached from the first (the native core
    compares the header bytes with it): a header another process changed misses that key, and its
    parse refuses it by the same bound."""
    with _queue(lanes=1, spl=1) as (s, w, c):
        _round_trip(c, w, 1.0)  # the slot's answer layout is cached
        t = c.submit(_x(2.0))
        assert _serve(w) == [c.lane]
        struct.pack_into("<II", s._m.mem, s._m.geo.resp_off(t.slot), hlen, flags)
        with pytest.raises(QueueError, match="corrupt payload header"):
            c.wait(t, timeout_s=1.0)
        _round_trip(c, w, 3.0)  # the worker writes the answer's header every time


def test_an_answer_header_changed_to_another_valid_layout_is_read_by_that_layout() -> None:
    """A key miss is not an error: a header rewritten to another valid layout (one row fewer of the same
    outputs) is parsed and read as that layout, never by the cached one."""
    from lowtail.shm import payload

    with _queue(lanes=1, spl=1) as (s, w, c):
        _round_trip(c, w, 1.0)
        t = c.submit({"x": np.full((2, 8), 2.0, np.float32)})
        assert _serve(w) == [c.lane]
        off = s._m.geo.resp_off(t.slot)
        hlen = struct.unpack_from("<I", s._m.mem, off)[0]
        ext, layout = payload.decode_header(bytes(s._m.mem[off + 8 : off + 8 + hlen]), False)
        assert ext is None
        one = payload.encode_header(None, tuple((n, d, (1, *shape[1:])) for n, d, shape in layout))
        assert len(one) == hlen  # the same bytes but the batch dimension
        s._m.mem[off + 8 : off + 8 + hlen] = one
        got = c.wait(t, timeout_s=1.0)
        assert got["twice"].shape == (1, 8) and got["rowsum"].shape == (1, 1)


# -- lane words inherited from the lane's previous holder ---------------------------------------------


def test_a_lane_generation_of_u64_max_left_by_its_last_holder_does_not_stop_the_next_client() -> None:
    cfg = QueueConfig(lanes=1, slots_per_lane=2, coalesce_us=0)
    with InferenceQueue.create(cfg) as s:
        s._m.q[s._m.geo.lane(0, L_GEN)] = U64_MAX
        with QueueWorker.attach(s.descriptor) as w, QueueClient.attach(s.descriptor) as c:
            _round_trip(c, w, 1.0)


def test_a_doorbell_of_u64_max_left_by_its_last_holder_does_not_stop_the_next_client() -> None:
    cfg = QueueConfig(lanes=1, slots_per_lane=2, coalesce_us=0)
    with InferenceQueue.create(cfg) as s:
        q, geo = s._m.q, s._m.geo
        q[HW_DOORBELLS] = U64_MAX  # and the tail a fence resynchronised to it
        q[geo.lane(0, L_TAIL)] = U64_MAX
        with QueueWorker.attach(s.descriptor) as w, QueueClient.attach(s.descriptor) as c:
            for tag in (1.0, 2.0, 3.0):  # the first across the wrap: doorbell 0 with tail 2^64 - 1
                _round_trip(c, w, tag)


def test_request_sequences_of_u64_max_left_in_the_slots_do_not_fail_the_next_clients_requests() -> None:
    cfg = QueueConfig(lanes=1, slots_per_lane=2, coalesce_us=0)
    with InferenceQueue.create(cfg) as s:
        for g in range(2):
            s._m.q[s._m.geo.slot_word(g) + W_REQ_SEQ] = U64_MAX
        with QueueWorker.attach(s.descriptor) as w, QueueClient.attach(s.descriptor) as c:
            for tag in (1.0, 2.0, 3.0):
                _round_trip(c, w, tag)


def test_requests_in_flight_across_the_doorbells_wrap_take_distinct_ring_positions() -> None:
    """Positions 2, 3, 0, 1: a power of two divides 2^64, so the wrap keeps them apart. (With 3 slots,
    now refused by ``QueueConfig``, positions were 2, 0 and 0 again, and the first at 0 was never
    claimed: its client timed out on both paths.)"""
    cfg = QueueConfig(lanes=1, slots_per_lane=4, coalesce_us=0)
    with InferenceQueue.create(cfg) as s:
        q, geo = s._m.q, s._m.geo
        q[HW_DOORBELLS] = q[geo.lane(0, L_TAIL)] = U64_MAX - 1
        with QueueWorker.attach(s.descriptor) as w, QueueClient.attach(s.descriptor) as c:
            tickets = [c.submit(_x(float(i))) for i in range(4)]
            while _serve(w):
                pass
            assert [c.wait(t, timeout_s=0.3)["twice"][0, 0] for t in tickets] == [1.0, 3.0, 5.0, 7.0]


# -- the prefix read twice: once for the bound, once in the copy that keys the header cache -----------


def test_a_prefix_changed_between_its_load_and_its_copy_does_not_poison_the_header_cache() -> None:
    """Deterministic on the Python reference: ``words`` holds the prefix as the first load saw it
    (flags 0), ``mem`` as the copy saw it (flags 1, a writer flipped it in between). On the native core
    the same race is real but only a concurrent writer reaches it (a flipping process hit it within
    3 s here)."""
    from lowtail.shm import payload

    head = payload.encode_header(None, (("x", "<f4", (1, 8)),))
    inline = struct.pack("<II", len(head), 0) + head
    external = struct.pack("<II", len(head), payload.FLAG_EXTERNAL) + head
    with pytest.raises(BadRequest, match="disagrees with the external flag"):
        payload.decode_header(head, True)  # what the flag-1 prefix means: refused
    payload._header_layouts.clear()
    try:
        seen = np.frombuffer(inline.ljust(256, b"\0"), np.uint64)
        with contextlib.suppress(BadRequest):  # refusing here is also right
            payload.read_header(memoryview(external.ljust(256, b"\0")), memoryview(seen), 0, 256)
        stable = external.ljust(256, b"\0")
        with pytest.raises(BadRequest, match="disagrees with the external flag"):
            payload.read_header(memoryview(stable), memoryview(stable).cast("Q"), 0, 256)
    finally:
        payload._header_layouts.clear()  # no poisoned entry left for the tests after this one
