"""The native core's loading and its guards: the generated layout is the checked-in one, an extension
built for another layout or a forced Python path falls back with the reason, and the segment refuses a
geometry or an index it does not own."""

from __future__ import annotations

import importlib.util
import struct
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lowtail.shm import native
from lowtail.shm.errors import BadRequest
from lowtail.shm.queue import InferenceQueue, QueueClient, QueueConfig

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
    with pytest.raises(ValueError, match="out of range"):
        mod.Segment(buf, 0, 4, 64, 64, 0)
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
def test_the_native_poll_refuses_doorbells_of_another_geometry_and_a_resume_out_of_turn() -> None:
    import lowtail_native  # type: ignore[import-not-found, unused-ignore]

    from lowtail.shm.layout import HW_DOORBELLS, L_TAIL

    geo, mm, seg = _anon_segment(2, 4, 256, 256)
    with pytest.raises(ValueError, match="0 lanes of 4 slots"):
        lowtail_native.Poller([], 4)
    poller = lowtail_native.Poller([0, 0], 4)
    with pytest.raises(ValueError, match="8 doorbell bytes for a poll of 2 lanes"):
        poller.poll(seg, bytes(8), 0, 0, 4, 16, 1)
    with pytest.raises(ValueError, match="resume without a stopped poll"):
        poller.resume(seg, 1)
    other = _anon_segment(3, 4, 256, 256)
    with pytest.raises(ValueError, match="for a poll of 2 lanes"):
        poller.poll(other[2], bytes(16), 0, 0, 4, 16, 1)
    # a doorbell far past the tail (a garbage word): the lane is fenced, its tail set to the doorbell
    q = memoryview(mm).cast("Q")
    q[HW_DOORBELLS + 1] = 1 << 40  # a word index
    raw = bytes(mm[8 * HW_DOORBELLS : 8 * HW_DOORBELLS + 16])
    entries, end = poller.poll(seg, raw, 0, 0, 4, 16, 1)
    assert [e[:4] for e in entries] == [
        (5, 1, 0, 1 << 40)
    ] and "doorbell 1099511627776 with tail 0" in entries[0][6]
    assert end == 0 and poller.tails == [0, 1 << 40] and q[geo.lane(1, L_TAIL)] == 1 << 40
    assert poller.poll(seg, raw, 0, 0, 4, 16, 1) == ([], 0)  # nothing new: nothing looked at
    q.release()
    for s in (seg, other[2]):
        s.close()
    mm.close()
    other[1].close()
