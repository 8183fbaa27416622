"""The native core's loading and its guards: the generated layout is the checked-in one, an extension
built for another layout or a forced Python path falls back with the reason, and the segment refuses a
geometry or an index it does not own."""

from __future__ import annotations

import contextlib
import importlib.util
import struct
import sys
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lowtail.shm import native
from lowtail.shm.errors import BadRequest
from lowtail.shm.queue import InferenceQueue, QueueClient, QueueConfig
from tests.shm.helpers import echo

REPO = Path(__file__).resolve().parents[2]


def _generator() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("gen_layout", REPO / "native" / "gen_layout.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_the_checked_in_rust_layout_is_what_layout_py_generates() -> None:
    gen = _generator()
    assert (REPO / "native" / "src" / "layout.rs").read_text() == gen.render()
    assert f'LAYOUT_DIGEST: &str = "{native.layout_digest()}"' in gen.render()


def test_an_extension_built_for_another_layout_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("lowtail_native")
    fake.LAYOUT_DIGEST = "0123456789abcdef"  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "lowtail_native", fake)
    monkeypatch.delenv(native.ENV_PURE_PYTHON, raising=False)
    mod, impl = native._load()
    assert mod is None and impl.name == "python"
    assert "0123456789abcdef" in impl.reason and native.layout_digest() in impl.reason


def test_an_extension_built_from_older_sources_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = types.ModuleType("lowtail_native")
    fake.LAYOUT_DIGEST = native.layout_digest()  # type: ignore[attr-defined]
    fake.VERSION = "0.1.0"  # type: ignore[attr-defined]
    fake.Segment = type("Segment", (), {"publish": None, "claim": None})  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "lowtail_native", fake)
    monkeypatch.delenv(native.ENV_PURE_PYTHON, raising=False)
    mod, impl = native._load()
    assert mod is None and impl.name == "python"
    assert "0.1.0" in impl.reason and "take" in impl.reason and "make native" in impl.reason
    # every Segment call there, but not the client's round trip on the module
    fake.Segment = type("Segment", (), dict.fromkeys(native.SEGMENT_CALLS))  # type: ignore[attr-defined]
    mod, impl = native._load()
    assert mod is None and "send_request, receive_answer, round_trip, RequestPlan, AnswerPlan" in impl.reason
    # an extension whose send took any mapping (no layout check of its own) is refused by name: its
    # RequestPlan takes other arguments
    old = {"send": None, "receive_answer": None, "RequestPlan": None, "AnswerPlan": None}
    for name, value in old.items():
        setattr(fake, name, value)
    mod, impl = native._load()
    assert mod is None and "send_request" in impl.reason and "receive_answer" not in impl.reason
    # every name there, but from a build before receive_answer took its park slice: refused by version
    fake.send_request = None  # type: ignore[attr-defined]
    # a build before infer's round trip was one core call (0.14.0): refused by name
    mod, impl = native._load()
    assert mod is None and "lacks round_trip, CallRecorder, complete_known, Poller." in impl.reason
    fake.round_trip = None  # type: ignore[attr-defined]
    # a build before the poll was bound once (0.13.0), whose poll took the segment and cache every
    # call: refused by name
    fake.Poller = type("Poller", (), dict.fromkeys(("accept", "poll_into", "resume_into")))  # type: ignore[attr-defined]
    mod, impl = native._load()
    assert mod is None and "Poller.bind, Poller.poll_bound, Poller.resume_bound" in impl.reason
    fake.Poller = type("Poller", (), dict.fromkeys(native.POLLER_CALLS))  # type: ignore[attr-defined]
    # a build before the serving loop's recorder moved into the core (0.9.0): refused by name
    mod, impl = native._load()
    assert mod is None and impl.reason.endswith(
        "lacks CallRecorder, complete_known: it was built from older sources; rebuild it (make native)"
    )
    fake.CallRecorder = None  # type: ignore[attr-defined]
    # a build before Batch.complete called the core's known-layout answer (0.12.0): refused by name
    mod, impl = native._load()
    assert mod is None and impl.reason.endswith(
        "lacks complete_known: it was built from older sources; rebuild it (make native)"
    )
    fake.complete_known = None  # type: ignore[attr-defined]
    # (and 0.5.x, before receive_answer's copy took the caller's arrays and AnswerPlan the array type;
    # 0.6.0 copied into arrays of the caller's that share memory; 0.6.x answered one request alone in
    # answer_known, with other arguments; 0.14.x's round_trip gave a failed read of an answer it found
    # back unanswered, so the answer was counted where wait read it again; 0.15.x's complete_known read
    # the worker's _known, _native and _outstanding one by one; 0.16.x had no Poller.spin_bound)
    for version in (
        "0.4.9",
        "",
        "0.5.0",
        "0.5.1",
        "0.6.0",
        "0.6.1",
        "0.7.0",
        "0.14.0",
        "0.14.9",
        "0.15.0-dev",
        "0.15.0",
        "0.15.9",
        "0.16.0-dev",
        "0.16.0",
        "0.16.9",
        "0.17.0-dev",
    ):
        fake.VERSION = version  # type: ignore[attr-defined]
        mod, impl = native._load()
        assert mod is None and "older than 0.17.0" in impl.reason and "make native" in impl.reason
    fake.VERSION = "0.17.0"  # type: ignore[attr-defined]
    assert native._load()[0] is fake
    fake.VERSION = "0.17.7"  # type: ignore[attr-defined]
    assert native._load()[0] is fake  # a patch of the same API
    # A newer minor (0.x: its calls may differ) is refused too: a 0.16 core under a 0.15 package failed
    # every batch (AttributeError: no _answer_with), answered as errors, instead of running Python.
    for version in ("0.18.0", "0.18.0-dev", "1.0.0", "0.170.0"):
        fake.VERSION = version  # type: ignore[attr-defined]
        mod, impl = native._load()
        assert mod is None and "newer than 0.17.x" in impl.reason and "make native" in impl.reason, version


def test_lowtail_pure_python_forces_the_python_path(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native.ENV_PURE_PYTHON, "1")
    mod, impl = native._load()
    assert mod is None and impl == native.Implementation("python", "LOWTAIL_PURE_PYTHON=1")


needs_native = pytest.mark.skipif(not native.available(), reason=native.implementation().reason)


@needs_native
def test_the_default_path_is_native_when_it_loads() -> None:
    with (
        InferenceQueue.create(QueueConfig(lanes=2, slots_per_lane=2)) as q,
        QueueClient.attach(q.descriptor) as c,
    ):
        assert c._m.native is not None and native.implementation().name == "native"
        with native.use(False), QueueClient.attach(q.descriptor) as other:
            assert other._m.native is None and native.implementation().name == "python"


@needs_native
def test_the_segment_refuses_a_geometry_and_indices_it_does_not_own() -> None:
    mod = native.core()
    assert mod is not None
    buf = bytearray(1 << 16)
    with pytest.raises(ValueError, match="geometry needs"):
        mod.Segment(buf, 4, 4, 4096, 4096, 1 << 20)  # larger than the buffer
    with pytest.raises(ValueError, match="lanes=0 spl=4 req=64 resp=64: expected lanes 1"):
        mod.Segment(buf, 0, 4, 64, 64, 0)
    with pytest.raises(ValueError, match=r"spl=3 req=64 resp=64: expected lanes 1.* spl a power of two"):
        mod.Segment(buf, 1, 3, 64, 64, 3 * 4096)  # ring positions would collide across the 2^64 wrap
    with pytest.raises(ValueError, match=r"1 lanes of 3 slots: expected .* a power of two of slots"):
        mod.Poller([0], 3)
    with pytest.raises(ValueError, match="writable"):
        mod.Segment(bytes(1 << 16), 1, 1, 64, 64, 8192)
    raw = np.zeros((1 << 17) + 4096, np.uint8)
    start = -raw.ctypes.data % 4096  # page-aligned, as a mapping is
    arr = raw[start : start + (1 << 17)].view(np.uint64)
    seg = mod.Segment(arr.view(np.uint8), 1, 2, 64, 64, 3 * 4096)
    with pytest.raises(IndexError, match="lane 1"):
        seg.publish(1, 0, 8, 0)
    with pytest.raises(IndexError, match="slot 2"):
        seg.spin(0, 2, 1, 0)
    # a ring entry another process wrote out of range is reported, nothing is claimed
    ring = (4096 + 128) // 8
    arr[ring] = 99
    assert seg.claim(0, 0, 1)[:2] == (1, 99)
    seg.close()
    with pytest.raises(IndexError, match="closed"):
        seg.answer_words(0, 0)


def _anon_segment(lanes: int, spl: int, req: int, resp: int) -> tuple[Any, Any, Any]:
    import mmap

    import lowtail_native  # type: ignore[import-not-found, unused-ignore]

    from lowtail.shm.layout import Geometry

    geo = Geometry.of(lanes, spl, req, resp)
    mm = mmap.mmap(-1, geo.total)
    return geo, mm, lowtail_native.Segment(mm, lanes, spl, req, resp, geo.total)


def _publish_raw(geo: Any, mm: Any, region: bytes, tail: int) -> None:
    """Put ``region`` at the start of request slot 0 of lane 0 and make it claimable at ``tail``."""
    from lowtail.shm.layout import L_RING, W_REQ_SEQ

    q = memoryview(mm).cast("Q")
    off = geo.req_off(0)
    mm[off : off + len(region)] = region
    q[geo.slot_word(0) + W_REQ_SEQ] += 1
    q[geo.lane(0, L_RING) + tail % geo.spl] = 0
    q.release()


@needs_native
def test_take_refuses_a_header_that_runs_past_its_request_region() -> None:
    from lowtail.shm import payload

    geo, mm, seg = _anon_segment(1, 2, 1024, 64)
    # A valid header of 1020 bytes: with its 8-byte prefix it ends 4 bytes into the next slot's region,
    # whose bytes are written to match, so only the bound on the length word can refuse it.
    spec = tuple((chr(97 + i) * 242, "<f4", (1,)) for i in range(4))
    head = payload.encode_header(None, spec)
    assert len(head) == 1020
    region = struct.pack("<II", len(head), 0) + head
    _publish_raw(geo, mm, region, 0)
    with pytest.raises(BadRequest, match="length 1020"):
        payload.read_header(memoryview(mm), memoryview(mm).cast("Q"), geo.req_off(0), geo.req_bytes)
    kind, slot, _, _, _, hdr = seg.take(0, 0, 1)
    assert (kind, slot) == (0, 0)
    assert isinstance(hdr, str) and "length 1020" in hdr and "1024-byte region" in hdr
    # the same header 4 bytes shorter fits, and is decoded as Python decodes it
    spec = tuple((chr(97 + i) * (242 if i else 238), "<f4", (1,)) for i in range(4))
    head = payload.encode_header(None, spec)
    _publish_raw(geo, mm, struct.pack("<II", len(head), 0) + head, 1)
    kind, _, _, _, _, hdr = seg.take(0, 1, 1)
    assert kind == 0 and isinstance(hdr, int)
    assert seg.header(hdr) == (None, [(name, 11, [1]) for name, _, _ in spec])
    seg.close()
    mm.close()


@needs_native
def test_the_core_copies_refuse_what_runs_past_a_region_or_an_array_and_answer_nothing() -> None:
    from lowtail.shm.layout import W_RESP_SEQ

    geo, mm, seg = _anon_segment(2, 2, 256, 256)
    q = memoryview(mm).cast("Q")
    src = [np.arange(8, dtype=np.float32).reshape(4, 2)]
    good = (b"\x00" * 64, [64], [8], 128)
    item = (0, 1, 7, 0, 0, 4, 0)  # lane 0 slot 1 seq 7 gen 0, rows 0..4 of plan 0
    cases = [
        ([item], [(b"\x00" * 64, [224], [8], 256)], "outside the 256-byte response region"),  # 224+32 ok
        ([(0, 1, 7, 0, 2, 4, 0)], [good], "outside the 32-byte output"),  # rows 2..6 of 4
        ([item], [(b"\x00" * 64, [32], [8], 128)], "outside the 256-byte response region"),  # over prefix
        ([item], [(b"\x00" * 300, [64], [8], 128)], "300-byte header"),
        ([item, (2, 0, 1, 0, 0, 1, 0)], [good], "lane 2"),  # the second item is bad: nothing answered
        ([item], [good, good][2:], "plan 0 of 0"),
        ([item], [(b"\x00" * 64, [64], [1 << 62], 128)], "overflows"),
    ]
    for items, plans, why in cases[1:]:
        with pytest.raises((IndexError, ValueError), match=why):
            seg.answer_rows(items, plans, src, 0, 0)
        assert q[geo.slot_word(1) + W_RESP_SEQ] == 0  # nothing published
    assert seg.answer_rows([item], cases[0][1], src, 0, 0) == ([0], 0, 0)  # fits exactly; none parked
    assert q[geo.slot_word(1) + W_RESP_SEQ] == 7
    dst = [np.zeros((4, 2), np.float32)]
    with pytest.raises(IndexError, match="outside the 256-byte request region"):
        seg.gather([(0, 0, 0, 4, 0)], [([240], [8])], dst)
    with pytest.raises(IndexError, match="outside the 32-byte destination"):
        seg.gather([(0, 0, 1, 4, 0)], [([64], [8])], dst)
    with pytest.raises(ValueError, match="read-only"):
        ro = np.zeros((4, 2), np.float32)
        ro.flags.writeable = False
        seg.gather([(0, 0, 0, 4, 0)], [([64], [8])], [ro])
    q.release()
    seg.close()
    mm.close()


@needs_native
def test_answer_rows_copies_strided_and_fortran_ordered_outputs_in_c_order() -> None:
    """Outputs in any memory layout are answered as the values they hold: the core copies one that is
    not C-contiguous to C order itself (no refused call for Python to retry)."""
    from lowtail.shm.layout import W_RESP_SEQ

    with _mapped(1, 2, 256, 256) as (geo, mm, seg, q, _):
        wide = np.arange(16, dtype=np.float32).reshape(4, 4)
        for k, out in enumerate([wide[:, ::2], np.asfortranarray(wide[:, :2]), wide[::-1, 1:3], wide[:, :2]]):
            assert out.shape == (4, 2)
            seq = 10 + k
            plan = (b"\x01" * 64, [64], [8], 96)
            assert seg.answer_rows([(0, 1, seq, 0, 1, 2, 0)], [plan], [out], 0, 0) == ([0], 0, 0)
            off = geo.resp_off(1)
            assert mm[off + 64 : off + 80] == np.ascontiguousarray(out[1:3]).tobytes(), k  # rows 1..3
            assert q[geo.slot_word(1) + W_RESP_SEQ] == seq


@contextlib.contextmanager
def _mapped(lanes: int, spl: int, req: int, resp: int) -> Iterator[tuple[Any, Any, Any, Any, Any]]:
    """``_anon_segment`` with its words (``q``) and the core module; all closed at the end."""
    import lowtail_native  # type: ignore[import-not-found, unused-ignore]

    geo, mm, seg = _anon_segment(lanes, spl, req, resp)
    q = memoryview(mm).cast("Q")
    try:
        yield geo, mm, seg, q, lowtail_native
    finally:
        q.release()
        seg.close()
        mm.close()


@needs_native
def test_send_refuses_what_runs_past_the_request_region_and_writes_nothing() -> None:
    from lowtail.shm.layout import W_REQ_SEQ, W_REQ_STATE

    with _mapped(2, 2, 256, 256) as (geo, mm, seg, q, core):
        prefix = b"\x07" * 64
        f4 = np.dtype(np.float32)
        x = {"x": np.arange(8, dtype=np.float32).reshape(4, 2)}  # 32 bytes

        def plan(at: int, n: int = 32) -> Any:
            return core.RequestPlan(prefix, [("x", at, n, (4, 2), f4)], np.ndarray)

        fits = plan(224)  # ends exactly at the region's end
        assert fits.end == 256
        cases = [
            (lambda: plan(232), 0, "264-byte request in a 256-byte"),
            # refused as the plan is made: a direct read takes the plan's bytes as the array's length
            (lambda: plan(64, 36), 0, r"36 bytes, its dtype and shape \[4, 2\] take 32"),
            (lambda: fits, 2, "lane 2"),
        ]
        region = slice(geo.req_off(1), geo.req_off(1) + 256)
        for make, lane, why in cases:
            with pytest.raises((IndexError, ValueError), match=why):
                core.send_request(seg, lane, 1, 0, make(), x)
            assert q[geo.slot_word(1) + W_REQ_SEQ] == 0 and q[geo.slot_word(1) + W_REQ_STATE] == 0
            assert mm[region] == bytes(256)  # nothing written
        with pytest.raises(ValueError, match="overlaps the 64-byte header"):
            plan(32)
        with pytest.raises(ValueError, match="overflows"):
            plan(64, (1 << 64) - 8)
        strided = {"x": np.arange(16, dtype=np.float32).reshape(4, 4)[:, ::2]}
        assert core.send_request(seg, 0, 1, 0, fits, strided) is None  # the caller copies a strided array
        assert mm[region] == bytes(256)
        seq, _ = core.send_request(seg, 0, 1, 0, fits, x)
        assert seq == 1 and q[geo.slot_word(1) + W_REQ_SEQ] == 1
        assert mm[region][:64] == prefix and mm[region][224:] == x["x"].tobytes()


class _Sub(np.ndarray):  # type: ignore[type-arg]
    pass


@needs_native
def test_send_takes_only_a_request_of_the_plans_layout_and_writes_nothing_otherwise() -> None:
    """The layout check ``PayloadLayout.matches`` makes, in the core: the same entries, each an
    ``ndarray`` of the plan's dtype and shape; anything else is None (the caller validates it)."""
    from lowtail.shm.layout import W_REQ_SEQ

    with _mapped(1, 2, 256, 256) as (geo, mm, seg, q, core):
        x = np.arange(8, dtype=np.float32).reshape(4, 2)
        plan = core.RequestPlan(b"\x07" * 64, [("x", 64, 32, (4, 2), np.dtype(np.float32))], np.ndarray)
        others = {
            "another shape, the same bytes": {"x": x.reshape(2, 4)},
            "another dtype, the same bytes": {"x": x.view(np.int32)},
            "another name": {"y": x},
            "an extra entry": {"x": x, "y": x},
            "no entry": {},
            "an ndarray subclass": {"x": x.view(_Sub)},
            "not an array": {"x": memoryview(x.tobytes()).cast("f", (4, 2))},
            "not a mapping": [x],
        }
        region = slice(geo.req_off(1), geo.req_off(1) + 256)
        for why, arrays in others.items():
            assert core.send_request(seg, 0, 1, 0, plan, arrays) is None, why
            assert q[geo.slot_word(1) + W_REQ_SEQ] == 0 and mm[region] == bytes(256), why
        assert core.send_request(seg, 0, 1, 0, plan, {"x": x.copy()}) is not None


def _answer_in_slot_1(geo: Any, mm: Any) -> tuple[bytes, np.ndarray[Any, Any]]:
    """A 64-byte key and a (4, 2) float32 answer at offset 224 of lane 0's slot 1 response region."""
    key = b"\x05" * 64
    y = np.arange(8, dtype=np.float32).reshape(4, 2)
    off = geo.resp_off(1)
    mm[off : off + 64] = key
    mm[off + 224 : off + 256] = y.tobytes()
    return key, y


@needs_native
def test_receive_with_a_park_budget_sleeps_until_woken_by_the_answer_and_reads_it() -> None:
    """A parked client's wait and read in one call: an answer not there sleeps on the lane's answer
    counter (no answer: back after the budget, parked and slept); one answered and woken meanwhile is
    read in the same call."""
    import ctypes
    import threading

    from lowtail.shm.futex import futex_wake
    from lowtail.shm.layout import L_PARKED, L_RESP_COUNT, W_RESP_SEQ

    with _mapped(1, 2, 256, 256) as (geo, mm, seg, q, core):
        key, y = _answer_in_slot_1(geo, mm)
        plan = core.AnswerPlan(key, [("y", 224, 32, (4, 2), np.dtype(np.float32))], np.empty)
        got = core.receive_answer(seg, 0, 1, 3, plan, True, 0, 0, 0, 20_000_000)
        assert got[0] is False and got[8] > 0 and got[9] is True  # parked, slept, timed out
        assert got[1] >= got[8] and q[geo.lane(0, L_PARKED)] == 0

        count_i = geo.lane(0, L_RESP_COUNT)
        addr = ctypes.addressof(ctypes.c_char.from_buffer(mm, count_i * 8))

        def answer() -> None:
            while q[geo.lane(0, L_PARKED)] == 0:  # the client is parked: answer and wake it
                time.sleep(0.001)
            q[geo.slot_word(1) + W_RESP_SEQ] = 3
            q[count_i] += 1
            futex_wake(addr)

        t = threading.Thread(target=answer)
        t.start()
        t0 = time.monotonic()
        got = core.receive_answer(seg, 0, 1, 3, plan, True, 0, 0, 0, 60 * 10**9)
        t.join()
        assert time.monotonic() - t0 < 30  # woken, not timed out
        assert got[0] is True and got[8] > 0 and got[9] is True
        assert got[7]["y"].tobytes() == y.tobytes()


@needs_native
def test_receive_copies_only_an_answer_whose_header_is_the_plans_and_fits_the_region() -> None:
    from lowtail.shm.layout import ST_FAILED, W_RESP_SEQ, W_RESP_STATUS

    with _mapped(1, 2, 256, 256) as (geo, mm, seg, q, core):
        key, y = _answer_in_slot_1(geo, mm)
        si = geo.slot_word(1)

        def plan(k: bytes, at: int, shape: tuple[int, ...] = (4, 2)) -> Any:
            return core.AnswerPlan(k, [("y", at, 32, shape, np.dtype(np.float32))], np.empty)

        assert core.receive_answer(seg, 0, 1, 3, plan(key, 224), True)[0] is False  # not answered
        assert core.receive_answer(seg, 0, 1, 3, plan(key, 224), True, 1000, 1000, 0)[0] is False  # spun 1 us
        t0 = time.monotonic()  # an answer due far beyond a 1 s budget: only the 1 us spin
        far = time.monotonic_ns() + 10**11
        assert core.receive_answer(seg, 0, 1, 3, None, True, 10**9, 1000, far)[0] is False
        assert time.monotonic() - t0 < 0.5
        q[si + W_RESP_SEQ] = 3
        got = core.receive_answer(seg, 0, 1, 3, plan(key, 224), True)
        assert got[0] is True and got[2] == 0
        assert got[7]["y"].tobytes() == y.tobytes() and got[7]["y"].shape == (4, 2)
        assert core.receive_answer(seg, 0, 1, 3, plan(key, 224), False)[7] is True  # held: ours to map
        # a header another process changed, a layout past the region, no plan: nothing read
        assert core.receive_answer(seg, 0, 1, 3, plan(b"\x06" * 64, 224), True)[7] is None
        assert core.receive_answer(seg, 0, 1, 3, plan(key, 232), True)[7] is None
        assert core.receive_answer(seg, 0, 1, 3, None, True)[7] is None
        with pytest.raises(ValueError, match=r"32 bytes, its dtype and shape \[2, 2\] take 16"):
            plan(key, 224, (2, 2))  # refused as the plan is made
        wrong_empty = lambda shape, dtype: np.empty(4, dtype)  # noqa: E731 - makes the wrong array
        short = core.AnswerPlan(key, [("y", 224, 32, (4, 2), np.dtype(np.float32))], wrong_empty)
        with pytest.raises(ValueError, match="a fresh array of 16 bytes, its layout has 32"):
            core.receive_answer(seg, 0, 1, 3, short, True)  # an `empty` that makes the wrong array
        with pytest.raises(ValueError, match="4-byte key"):
            core.AnswerPlan(b"\x05" * 4, [], np.empty)
        with pytest.raises(ValueError, match="overlaps the 64-byte header"):
            plan(key, 32)
        q[si + W_RESP_STATUS] = ST_FAILED  # an error: its message is read by Python
        got = core.receive_answer(seg, 0, 1, 3, plan(key, 224), True)
        assert got[2] == ST_FAILED and got[7] is None


@needs_native
def test_the_native_poll_refuses_doorbells_of_another_geometry_and_a_resume_out_of_turn() -> None:
    import lowtail_native  # type: ignore[import-not-found, unused-ignore]

    from lowtail.shm.layout import HW_DOORBELLS, L_TAIL

    geo, mm, seg = _anon_segment(2, 4, 256, 256)
    with pytest.raises(ValueError, match="0 lanes of 4 slots"):
        lowtail_native.Poller([], 4)
    poller = lowtail_native.Poller([0, 0], 4)
    items: list[Any] = []
    cache = ({}, [0, 0], [0] * 8, tuple)  # no cached views: every request would come back an entry
    with pytest.raises(ValueError, match="a poll before bind"):
        poller.poll_bound(bytes(16), items, 0)
    other = _anon_segment(3, 4, 256, 256)
    with pytest.raises(ValueError, match="a segment of 3 lanes x 4 slots for a poll of 2 lanes x 4 slots"):
        poller.bind(other[2], 4, 16, cache)
    poller.bind(seg, 4, 16, cache)
    with pytest.raises(ValueError, match="8 doorbell bytes for a poll of 2 lanes"):
        poller.poll_bound(bytes(8), items, 0)
    with pytest.raises(ValueError, match="resume_bound without a stopped poll"):
        poller.resume_bound(1, object(), items)
    # a doorbell far past the tail (a garbage word): the lane is fenced, its tail set to the doorbell
    q = memoryview(mm).cast("Q")
    q[HW_DOORBELLS + 1] = 1 << 40  # a word index
    raw = bytes(mm[8 * HW_DOORBELLS : 8 * HW_DOORBELLS + 16])
    before = time.monotonic_ns()
    entries, end, now = poller.poll_bound(raw, items, 0)
    assert before <= now <= time.monotonic_ns()  # the poll's own stamp, on the queue's clock
    assert [e[:4] for e in entries] == [
        (5, 1, 0, 1 << 40)
    ] and "doorbell 1099511627776 with tail 0" in entries[0][6]
    assert end == 0 and poller.tails == [0, 1 << 40] and q[geo.lane(1, L_TAIL)] == 1 << 40
    assert poller.poll_bound(raw, items, 0)[:2] == ([], 0)  # nothing new: nothing looked at
    assert items == []
    # the bound segment closed under the poll: a clean error, not a read of an unmapped page
    q[HW_DOORBELLS] = 1
    seg.close()
    with pytest.raises(IndexError, match="or closed"):
        poller.poll_bound(bytes(mm[8 * HW_DOORBELLS : 8 * HW_DOORBELLS + 16]), items, 0)
    q.release()
    other[2].close()
    mm.close()
    other[1].close()


@contextlib.contextmanager
def _two_clients(use_native: bool) -> Iterator[tuple[Any, QueueClient, QueueClient, Any]]:
    """A queue of two lanes of one slot, no coalescing, on the chosen path: its clients a and b (lanes
    0 and 1) and its worker."""
    from lowtail.shm.queue import QueueWorker

    cfg = QueueConfig(lanes=2, slots_per_lane=1, coalesce_us=0)
    with (
        native.use(use_native),
        InferenceQueue.create(cfg) as q,
        QueueClient.attach(q.descriptor) as a,
        QueueClient.attach(q.descriptor) as b,
        QueueWorker.attach(q.descriptor) as w,
    ):
        yield q, a, b, w


def _claim_rounds(use_native: bool, rounds: list[tuple[int, int]]) -> tuple[list[list[int]], list[list[int]]]:
    """Each round: clients a and b submit a request of that many rows, the worker claims them in one
    batch and echoes it. Returns each batch's lanes in claim order, and (native) the kinds of the poll
    entries that reached Python's ``_polled`` per round."""
    order: list[list[int]] = []
    reached: list[list[int]] = []
    with _two_clients(use_native) as (_, a, b, w):
        polled = w._polled

        def spy(entries: list[Any], items: list[Any], now: int) -> Any:
            reached[-1].extend(e[0] for e in entries)
            return polled(entries, items, now)

        w._polled = spy  # type: ignore[method-assign]
        for k, (rows_a, rows_b) in enumerate(rounds):
            reached.append([])
            xa, xb = np.full((rows_a, 8), k, np.float32), np.full((rows_b, 8), -k, np.float32)
            ta, tb = a.submit({"x": xa}), b.submit({"x": xb})
            batch = w.claim(1.0)
            assert batch is not None and len(batch) == 2
            order.append(batch.lanes)
            with batch:
                batch.complete(echo(batch.inputs["x"]))
            assert (a.wait(ta, 1.0)["twice"] == 2 * xa + 1).all() and (
                b.wait(tb, 1.0)["twice"] == 2 * xb + 1
            ).all()
    return order, reached


@needs_native
def test_the_native_poll_makes_a_samplers_next_request_its_item_in_the_core_in_claim_order() -> None:
    """``poll_bound``: a request whose slot's cached views are for its header (a sampler's next request)
    becomes the worker's ``_Item`` in the core, and no entry of it reaches ``_polled``; a request whose
    header is new is decoded by Python; one whose header was accepted elsewhere but whose slot holds
    other views goes to Python as an APPEND entry, and no request after it is made an item in the core,
    so every batch holds its requests in the order the Python poll takes them."""
    rounds = [(2, 3), (2, 3), (3, 3), (3, 3), (2, 3), (2, 2), (2, 2)]
    order, reached = _claim_rounds(True, rounds)
    assert order == _claim_rounds(False, rounds)[0] == [[0, 1]] * len(rounds)  # lane a first each time
    append, decode = 0, 4  # server._APPEND, server._DECODE
    assert reached == [
        [decode, decode],  # both headers new to the core
        [],  # each slot's views are for its request's header: both made items in the core
        [append, append],  # a's (3, 8) header was accepted from b, its slot holds (2, 8) views; b after it
        [],
        [append, append],  # a's (2, 8) accepted, its slot holds (3, 8) views; b after it
        [append],  # a's made in the core, b's (2, 8) accepted with (3, 8) views in its slot
        [],
    ]


@needs_native
def test_the_items_the_native_poll_makes_carry_the_claim_as_the_python_poll_stamps_it() -> None:
    """An item made in the core is the one ``_polled`` makes: claimed at the poll's clock (the stamp the
    slot's claim word got, the batch's queue wait and claim time from it), its lane seen then, its
    inputs the slot's cached views (inline), through the worker's own caches."""
    from lowtail.shm.layout import W_CLAIM_NS

    with _two_clients(True) as (q, a, b, w):
        assert w._claim_cache[:3] == (w._in_views, w._lane_seen_ns, w._slot_i)
        assert all(
            x is y for x, y in zip(w._claim_cache, (w._in_views, w._lane_seen_ns, w._slot_i), strict=False)
        )
        reached: list[object] = []
        polled = w._polled

        def spy(entries: list[Any], items: list[Any], now: int) -> Any:
            reached.extend(entries)
            return polled(entries, items, now)

        w._polled = spy  # type: ignore[method-assign]
        words = q._m.q
        for k in range(3):
            reached.clear()
            ta, tb = (
                a.submit({"x": np.full((2, 8), k, np.float32)}),
                b.submit({"x": np.ones((3, 8), np.float32)}),
            )
            batch = w.claim(1.0)
            assert batch is not None and batch.lanes == [0, 1]
            claims = [words[it.si + W_CLAIM_NS] for it in batch._items]
            assert claims[0] == claims[1] > 0  # one poll, one clock
            assert batch.queue_wait_ns == [claims[0] - ta.submit_ns, claims[1] - tb.submit_ns]
            assert batch.claimed_ns == claims[0] and w._lane_seen_ns == claims
            if k:  # each slot's views are for its request's header: both made in the core
                assert reached == [] and all(it.inline for it in batch._items)
                assert [it.inputs for it in batch._items] == [w._in_views[it.g][1] for it in batch._items]
            with batch:
                batch.complete(echo(batch.inputs["x"]))
            assert (a.wait(ta, 1.0)["twice"] == 2 * k + 1).all() and (b.wait(tb, 1.0)["twice"] == 3).all()


class _RaisingItem:
    """An item class that raises ``error`` when made (counted): what the core does when it cannot make
    one."""

    error: BaseException = MemoryError("no memory for the item")
    tried = 0

    def __init__(self, *args: object) -> None:
        _RaisingItem.tried += 1
        raise self.error


@needs_native
def test_a_request_the_native_poll_cannot_make_an_item_goes_to_python_and_an_interrupt_strands_no_lane() -> (
    None
):
    """An Exception from the item class: the request goes to ``_polled`` as an entry, is made there and
    answered with the rest. A BaseException (KeyboardInterrupt) propagates from the claim; the lanes
    the poll looked at but did not take are looked at again by the next poll, not left until their
    doorbells move (the lane after the interrupted one was stranded)."""
    from lowtail.shm.queue import QueueTimeout

    x = {"x": np.ones((2, 8), np.float32)}
    with _two_clients(True) as (_, a, b, w):

        def round_trip() -> list[int]:
            ta, tb = a.submit(x), b.submit(x)
            batch = w.claim(1.0)
            assert batch is not None
            with batch:
                batch.complete(echo(batch.inputs["x"]))
            assert (a.wait(ta, 1.0)["twice"] == 3).all() and (b.wait(tb, 1.0)["twice"] == 3).all()
            return batch.lanes

        cache = w._claim_cache
        assert round_trip() == [0, 1]  # the headers decoded by Python, each slot's views cached
        _bind_cache(w, (*cache[:3], _RaisingItem))
        _RaisingItem.tried = 0
        assert round_trip() == [0, 1]  # a's item could not be made in the core: both made by _polled
        assert _RaisingItem.tried == 1  # and none after it tried there
        _RaisingItem.error = KeyboardInterrupt()
        try:
            ta, tb = a.submit(x), b.submit(x)
            with pytest.raises(KeyboardInterrupt):
                w.claim(1.0)
        finally:
            _RaisingItem.error = MemoryError("no memory for the item")
            _bind_cache(w, cache)
        batch = w.claim(1.0)  # lane b, not taken by the interrupted poll
        assert batch is not None and batch.lanes == [1]
        with batch:
            batch.complete(echo(batch.inputs["x"]))
        assert (b.wait(tb, 1.0)["twice"] == 3).all()
        with pytest.raises(QueueTimeout):  # a's request, claimed when the interrupt came: never run
            a.wait(ta, 0.2)


@needs_native
def test_the_native_poll_is_bound_to_a_cache_of_the_workers_shape_or_refuses_it() -> None:
    import lowtail_native  # type: ignore[import-not-found, unused-ignore]

    _, mm, seg = _anon_segment(2, 4, 256, 256)
    poller = lowtail_native.Poller([0, 0], 4)
    with pytest.raises(ValueError, match="a cache of 3 parts: expected 4"):
        poller.bind(seg, 4, 16, ({}, [0, 0], [0] * 8))
    with pytest.raises(TypeError):
        poller.bind(seg, 4, 16, ([], [0, 0], [0] * 8, object))
    with pytest.raises(ValueError, match="a poll before bind"):  # a refused bind binds nothing
        poller.resume_bound(1, object(), [])
    seg.close()
    mm.close()


@needs_native
def test_the_native_poll_refuses_a_bind_while_a_stopped_poll_waits_for_its_resume() -> None:
    """A poll stopped at a header new to the core keeps its round for ``resume_bound``: a bind then
    would resume it with another segment and cache, so it is refused, and taken once the round ends."""
    with _two_clients(True) as (_, a, _b, w):
        a.submit({"x": np.ones((2, 8), np.float32)})  # a layout the core has not seen: the poll stops at it
        items: list[Any] = []
        entries, end, _ = w._poller.poll_bound(w._doorbells.tobytes(), items, 0)
        assert end == 2 and entries[-1][0] == 4  # STOPPED at a DECODE entry
        with pytest.raises(ValueError, match="bind while a stopped poll waits for resume_bound"):
            _bind_cache(w, w._claim_cache)
        taken, _, end = w._poller.resume_bound(None, object(), items)  # decoded to nothing: not taken
        assert taken == 255 and end != 2 and items == []
        _bind_cache(w, w._claim_cache)  # the round is over: bound again


def _bind_cache(w: Any, cache: tuple[Any, ...]) -> None:
    """The worker's claim cache swapped, and its poll bound to it (``QueueWorker._bind_native``)."""
    cfg = w._cfg
    w._claim_cache = cache
    w._poller.bind(w._native, cfg.max_batch_slots, cfg.max_batch_samples, cache)


def _requests(spl: int, *at: tuple[int, int, int]) -> list[types.SimpleNamespace]:
    """Claimed requests as ``answer_known`` reads them (the worker's ``_Item``): (lane, slot, seq) each."""
    return [
        types.SimpleNamespace(lane=lane, g=lane * spl + s, seq=seq, gen=0, done=False) for lane, s, seq in at
    ]


@needs_native
def test_answer_known_answers_exactly_its_layout_and_writes_nothing_for_anything_else() -> None:
    """``answer_known`` answers outputs that are exactly the layout it was made from (names in order,
    ndarray, dtype object, shape; any memory layout) with its plan; anything else returns None and
    publishes nothing, so the worker validates it as before."""
    from lowtail.shm.layout import W_RESP_SEQ

    class Sub(np.ndarray):  # type: ignore[type-arg]
        pass

    with _mapped(1, 2, 256, 256) as (geo, mm, seg, q, core):
        a, b = np.arange(8, dtype=np.float32).reshape(4, 2), np.arange(4, dtype=np.int64).reshape(4, 1)
        plan = (b"\x02" * 64, [64, 96], [8, 8], 128)
        arrays = [("a", a.dtype, a.shape), ("b", b.dtype, b.shape)]
        known = core.KnownOutputs(arrays, np.ndarray, [(4, plan)])
        others: list[Any] = [
            {"b": b, "a": a},  # the same arrays in another order: another header
            {"a": a.astype(np.float64), "b": b},
            {"a": a[:3], "b": b[:3]},
            {"a": np.zeros((4, 3), np.float32), "b": b},
            {"a": a, "b": b, "c": b},
            {"a": a},
            {"a": a, "c": b},
            {"a": a.view(Sub), "b": b},
            {"a": a.tolist(), "b": b},
            types.MappingProxyType({"a": a, "b": b}),  # not a dict
            {1: a, "b": b},
        ]
        for k, outputs in enumerate(others):
            assert core.answer_known(seg, known, outputs, _requests(2, (0, 1, 5)), [4], 0, 0) is None, k
            assert q[geo.slot_word(1) + W_RESP_SEQ] == 0, k  # nothing published
        for seq, first in ((7, a), (8, np.asfortranarray(a[::-1])[::-1])):  # C order, then strided
            it = _requests(2, (0, 1, seq))
            assert core.answer_known(seg, known, {"a": first, "b": b}, it, [4], 0, 0) == (0, 0)
            assert q[geo.slot_word(1) + W_RESP_SEQ] == seq and it[0].done
            off = geo.resp_off(1)
            assert mm[off : off + 64] == b"\x02" * 64
            assert mm[off + 64 : off + 96] == a.tobytes() and mm[off + 96 : off + 128] == b.tobytes()
        with pytest.raises(ValueError, match="1 arrays, 2 offsets and 2 row sizes"):
            core.KnownOutputs(arrays[:1], np.ndarray, [(4, plan)])
        with pytest.raises(ValueError, match="at least 1 row"):
            core.KnownOutputs([arrays[0], ("b", b.dtype, (3, 1))], np.ndarray, [(4, plan)])
        for plans in ([], [(5, plan)], [(0, plan)], [(2, plan), (2, plan)]):
            with pytest.raises(ValueError, match=r"no plan|distinct sizes of 1 to 4 rows"):
                core.KnownOutputs(arrays, np.ndarray, plans)
        # its plan is bounded by the region at each call, as answer_rows bounds it
        wide = core.KnownOutputs(arrays, np.ndarray, [(4, (b"", [240, 0], [8, 8], 0))])
        with pytest.raises(IndexError, match="outside the 256-byte response region"):
            core.answer_known(seg, wide, {"a": a, "b": b}, _requests(2, (0, 1, 9)), [4], 0, 0)
        assert q[geo.slot_word(1) + W_RESP_SEQ] == 8


@needs_native
def test_answer_known_answers_each_request_of_a_batch_its_rows_by_the_plan_of_its_size() -> None:
    """Several requests in one call: each one's rows by the plan of its size, those done before skipped
    (their rows still counted), a lane whose generation changed answered ST_CLIENT_GONE; a size without a
    plan, or rows that are not the outputs', answer nothing."""
    from lowtail.shm.layout import L_GEN, ST_CLIENT_GONE, ST_OK, W_RESP_SEQ, W_RESP_STATUS

    with _mapped(3, 2, 256, 256) as (geo, mm, seg, q, core):
        a = np.arange(12, dtype=np.float32).reshape(6, 2)  # rows of 8 bytes
        one, two = (b"\x01" * 64, [64], [8], 72), (b"\x02" * 64, [64], [8], 80)
        known = core.KnownOutputs([("a", a.dtype, a.shape)], np.ndarray, [(1, one), (2, two)])

        def answered(g: int) -> int:
            return int(q[geo.slot_word(g) + W_RESP_SEQ])

        for rows in ([1, 2, 1, 2], [2, 2, 2], [1, 2, 3]):  # 6 rows in all; 3 rows has no plan
            its = _requests(2, *[(k % 3, k // 3, 40 + k) for k in range(len(rows))])
            got = core.answer_known(seg, known, {"a": a}, its, rows, 0, 0)
            assert (got is None) is (rows == [1, 2, 3]), rows
            assert all(it.done is (got is not None) for it in its), rows
            assert all(answered(it.g) == (it.seq if it.done else 0) for it in its)
            for it in its:
                q[geo.slot_word(it.g) + W_RESP_SEQ] = 0
        assert core.answer_known(seg, known, {"a": a}, _requests(2, (0, 0, 1)), [4], 0, 0) is None
        with pytest.raises(ValueError, match="2 requests and 1 row counts"):
            core.answer_known(seg, known, {"a": a}, _requests(2, (0, 0, 1), (1, 0, 2)), [6], 0, 0)
        # rows 0, 1-2, 3, 4-5: the second is done already, the third's lane has another generation
        its = _requests(2, (0, 0, 11), (1, 0, 12), (2, 0, 13), (0, 1, 14))
        its[1].done = True
        q[geo.lane(2, L_GEN)] = 1
        assert core.answer_known(seg, known, {"a": a}, its, [1, 2, 1, 2], 0, 0) == (0, 0)
        assert [answered(it.g) for it in its] == [11, 0, 13, 14] and all(it.done for it in its)
        status = [q[geo.slot_word(it.g) + W_RESP_STATUS] for it in its]
        assert status[0] == status[3] == ST_OK and status[2] == ST_CLIENT_GONE
        for it, prefix, part in ((its[0], one[0], a[0:1]), (its[3], two[0], a[4:6])):
            off = geo.resp_off(it.g)
            assert mm[off : off + 64] == prefix and mm[off + 64 : off + 64 + part.nbytes] == part.tobytes()
