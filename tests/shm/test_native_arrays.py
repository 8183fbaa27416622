"""The native core's reads of numpy arrays from their own fields (``native/src/ndarray.rs``): only an
exact, C-contiguous ``ndarray`` of the plan's dtype object and shape is read that way, at its own data
address (a view's offset included), its bytes exactly; everything else goes where it went through the
buffer export (declined, or copied to C order first). The same tests run again in a process that has
the core read every array through the export (``LOWTAIL_NATIVE_ARRAY_EXPORTS``), so both ways give the
same answers."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from lowtail.shm import native
from tests.shm.test_native_core import _answer_in_slot_1, _mapped, _Sub, needs_native

REPO = Path(__file__).resolve().parents[2]
EXPORTS_ONLY = "LOWTAIL_NATIVE_ARRAY_EXPORTS"
F4 = np.dtype(np.float32)


@needs_native
def test_this_numpy_is_read_from_its_fields_unless_exports_are_asked_for() -> None:
    import lowtail_native  # type: ignore[import-not-found, unused-ignore]

    direct = EXPORTS_ONLY not in os.environ
    assert lowtail_native.direct_array_reads(np.ndarray) is direct
    assert ("buffer exports" in native.implementation().reason) is not direct


def _region(geo: Any, mm: Any) -> bytes:
    return bytes(mm[geo.req_off(1) : geo.req_off(1) + 256])


@needs_native
def test_a_request_is_read_at_its_own_address_and_anything_not_exactly_the_plans_array_is_declined() -> None:
    with _mapped(1, 2, 256, 256) as (geo, mm, seg, _, core):
        plan = core.RequestPlan(b"\x07" * 64, [("x", 64, 32, (4, 2), F4)], np.ndarray)
        big = np.arange(12, dtype=np.float32).reshape(6, 2)
        frozen = np.frombuffer(np.arange(8, dtype=np.float32).tobytes(), np.float32).reshape(4, 2)
        taken = {
            "a view at an offset": big[1:5],
            "read-only, over bytes": frozen,
            "a fresh array": np.full((4, 2), 7.5, np.float32),
        }
        for why, x in taken.items():
            mm[geo.req_off(1) : geo.req_off(1) + 256] = bytes(256)
            assert core.send_request(seg, 0, 1, 0, plan, {"x": x}) is not None, why
            assert _region(geo, mm)[64:96] == x.tobytes(), why
        wide = np.arange(16, dtype=np.float32).reshape(4, 4)
        declined = {
            "strided": wide[:, ::2],
            "Fortran order": np.asfortranarray(wide[:, :2]),
            "reversed rows": wide[::-1, :2],
            "a subclass": big[1:5].view(_Sub),
            "big-endian": big[1:5].astype(">f4"),
            "an equal dtype, another object": big[1:5].astype(np.dtype("f4", metadata={"k": 1})),
            "another shape": big[:4].reshape(2, 4),
            "0-d": np.array(1.0, np.float32),
            "a numpy scalar": np.float32(1.0),
        }
        mm[geo.req_off(1) : geo.req_off(1) + 256] = bytes(256)
        for why, x in declined.items():
            assert core.send_request(seg, 0, 1, 0, plan, {"x": x}) is None, why
            assert _region(geo, mm) == bytes(256), why


@needs_native
def test_an_empty_array_is_read_as_no_bytes() -> None:
    with _mapped(1, 2, 256, 256) as (geo, mm, seg, _, core):
        plan = core.RequestPlan(b"\x07" * 64, [("x", 64, 0, (0, 2), F4)], np.ndarray)
        assert core.send_request(seg, 0, 1, 0, plan, {"x": np.empty((0, 2), np.float32)}) is not None
        assert _region(geo, mm)[:64] == b"\x07" * 64 and _region(geo, mm)[64:] == bytes(192)


@contextlib.contextmanager
def _answered() -> Iterator[tuple[Any, Any, Any, np.ndarray[Any, Any]]]:
    """A segment with the (4, 2) float32 answer ``y`` in lane 0's slot 1 as its seq 3, and its plan."""
    from lowtail.shm.layout import W_RESP_SEQ

    with _mapped(1, 2, 256, 256) as (geo, mm, seg, q, core):
        key, y = _answer_in_slot_1(geo, mm)
        q[geo.slot_word(1) + W_RESP_SEQ] = 3
        yield seg, core, core.AnswerPlan(key, [("y", 224, 32, (4, 2), F4)], np.empty, np.ndarray), y


@needs_native
def test_an_answer_is_copied_into_the_callers_view_at_its_offset_and_read_only_targets_are_declined() -> None:
    with _answered() as (seg, core, plan, y):
        big = np.full((6, 2), -1.0, np.float32)
        into = {"y": big[1:5]}
        assert core.receive_answer(seg, 0, 1, 3, plan, into)[7] is into
        assert big[1:5].tobytes() == y.tobytes()
        assert (big[0] == -1).all() and (big[5] == -1).all()  # nothing outside the view
        frozen = np.zeros((4, 2), np.float32)
        frozen.flags.writeable = False
        for why, target in {
            "read-only": frozen,
            "strided": np.zeros((4, 4), np.float32)[:, ::2],
            "a subclass": np.zeros((4, 2), np.float32).view(_Sub),
        }.items():
            assert core.receive_answer(seg, 0, 1, 3, plan, {"y": target})[7] is True, why
            assert not target.any(), why


def _known(core: Any, shape: tuple[int, int]) -> Any:
    """Outputs of one float32 array ``y`` of ``shape``, answered at offset 64 after a 64-byte key."""
    rows, row_bytes = shape[0], shape[1] * 4
    plan = (b"\x01" * 64, [64], [row_bytes], 64 + rows * row_bytes)
    return core.KnownOutputs([("y", F4, list(shape))], np.ndarray, [(rows, plan)])


@needs_native
def test_known_outputs_are_answered_from_a_view_at_its_offset_and_a_strided_one_through_a_copy() -> None:
    from lowtail.shm.layout import W_RESP_SEQ

    with _mapped(1, 2, 256, 256) as (geo, mm, seg, q, core):
        known = _known(core, (4, 2))
        wide = np.arange(24, dtype=np.float32).reshape(6, 4)
        for seq, y in enumerate([np.ascontiguousarray(wide[:4, :2])[0:4], wide[1:5, ::2], wide[1:5, 1:3]], 1):
            item = SimpleNamespace(g=1, seq=seq, gen=0, done=False)
            assert core.answer_known(seg, known, {"y": y}, [item], [4], 0, 0) == (0, 0)
            off = geo.resp_off(1)
            assert mm[off + 64 : off + 96] == np.ascontiguousarray(y).tobytes()
            assert q[geo.slot_word(1) + W_RESP_SEQ] == seq and item.done is True
        item = SimpleNamespace(g=1, seq=9, gen=0, done=False)
        for why, y in {
            "a subclass": wide[:4, :2].copy().view(_Sub),
            "another dtype object": wide[:4, :2].astype(np.dtype("f4", metadata={"k": 1})),
            "another shape": wide[:2, :4].copy(),
        }.items():
            assert core.answer_known(seg, known, {"y": y}, [item], [4], 0, 0) is None, why
            assert item.done is False and q[geo.slot_word(1) + W_RESP_SEQ] == 3, why


@needs_native
def test_a_plan_whose_bytes_disagree_with_its_dtype_and_shape_is_refused_when_made() -> None:
    import lowtail_native as core  # type: ignore[import-not-found, unused-ignore]

    with pytest.raises(ValueError, match=r"array 0: 40 bytes, its dtype and shape \[4, 2\] take 32"):
        core.AnswerPlan(b"\x05" * 64, [("y", 64, 40, (4, 2), F4)], np.empty, np.ndarray)
    with pytest.raises(ValueError, match="expected dimensions >= 0"):
        core.RequestPlan(b"\x07" * 64, [("x", 64, 0, (-1, 2), F4)], np.ndarray)
    with pytest.raises(ValueError, match="expected dimensions >= 0"):
        core.KnownOutputs([("y", F4, [4, -2])], np.ndarray, [(4, (b"", [64], [8], 96))])


class _Resizing(Mapping[str, Any]):
    """A mapping whose lookup of ``trigger`` resizes ``victim`` in place (its data reallocated)."""

    def __init__(self, arrays: dict[str, Any], trigger: str, victim: Any) -> None:
        self._arrays, self._trigger, self._victim = arrays, trigger, victim

    def __getitem__(self, name: str) -> Any:
        if name == self._trigger:
            self._victim.resize((64, 2), refcheck=False)  # the old data freed: no pointer may survive it
        return self._arrays[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._arrays)

    def __len__(self) -> int:
        return len(self._arrays)


@needs_native
def test_a_lookup_that_resizes_an_array_looked_up_before_leaves_no_pointer_to_its_old_data() -> None:
    """Python code run by a lookup (a Mapping's ``__getitem__``) happens before any array's bytes are
    taken: the resized array no longer has the plan's shape, so the request is declined (the caller's
    Python path copies it), not read from freed memory."""
    from lowtail.shm.layout import W_RESP_SEQ

    with _mapped(1, 2, 512, 512) as (geo, mm, seg, q, core):
        plan = core.RequestPlan(
            b"\x07" * 64, [("x", 64, 32, (4, 2), F4), ("y", 96, 32, (4, 2), F4)], np.ndarray
        )
        x, y = np.arange(8, dtype=np.float32).reshape(4, 2).copy(), np.ones((4, 2), np.float32)
        assert core.send_request(seg, 0, 1, 0, plan, _Resizing({"x": x, "y": y}, "y", x)) is None
        assert x.shape == (64, 2) and bytes(mm[geo.req_off(1) : geo.req_off(1) + 512]) == bytes(512)
        key = b"\x05" * 64
        off = geo.resp_off(1)
        mm[off : off + 64] = key
        q[geo.slot_word(1) + W_RESP_SEQ] = 3
        aplan = core.AnswerPlan(
            key, [("x", 64, 32, (4, 2), F4), ("y", 96, 32, (4, 2), F4)], np.empty, np.ndarray
        )
        a, b = np.zeros((4, 2), np.float32), np.zeros((4, 2), np.float32)
        assert core.receive_answer(seg, 0, 1, 3, aplan, _Resizing({"x": a, "y": b}, "y", a))[7] is True
        assert a.shape == (64, 2) and not a.any() and not b.any()


class _Sly(str):
    """A name whose comparison resizes ``victim`` in place (Python code run by a dict key's __eq__)."""

    victim: Any = None

    def __eq__(self, other: object) -> bool:
        if _Sly.victim is not None:
            _Sly.victim.resize((64, 2), refcheck=False)
        return str.__eq__(self, other)

    __hash__ = str.__hash__


@needs_native
def test_an_output_name_whose_comparison_resizes_an_output_leaves_no_pointer_to_its_old_data() -> None:
    with _mapped(1, 2, 512, 512) as (geo, mm, seg, _, core):
        plan = (b"\x01" * 64, [64, 96], [8, 8], 128)
        known = core.KnownOutputs([("a", F4, [4, 2]), ("b", F4, [4, 2])], np.ndarray, [(4, plan)])
        a, b = np.arange(8, dtype=np.float32).reshape(4, 2).copy(), np.ones((4, 2), np.float32)
        _Sly.victim = a
        try:
            item = SimpleNamespace(g=1, seq=1, gen=0, done=False)
            assert core.answer_known(seg, known, {"a": a, _Sly("b"): b}, [item], [4], 0, 0) is None
        finally:
            _Sly.victim = None
        assert a.shape == (64, 2) and item.done is False
        assert bytes(mm[geo.resp_off(1) : geo.resp_off(1) + 512]) == bytes(512)


@needs_native
def test_an_array_numpy_warns_about_writing_is_not_written_and_only_numbers_are_planned() -> None:
    with _answered() as (seg, core, plan, _):
        src = np.zeros((4, 2), np.float32)
        shared = np.broadcast_arrays(src, np.zeros((1, 4, 2), np.float32))[0][0]  # C-contiguous, warns
        assert shared.flags.c_contiguous
        assert core.receive_answer(seg, 0, 1, 3, plan, {"y": shared})[7] is True  # the caller decides
        assert not src.any()
        for dtype in ("O", "U4", "M8[s]", "V8"):
            with pytest.raises(ValueError, match="expected a bool or number dtype"):
                core.RequestPlan(b"\x07" * 64, [("x", 64, 32, (4,), np.dtype(dtype))], np.ndarray)
    assert core.direct_array_reads(_Sub) is False  # only the type probed is read from its fields


@needs_native
def test_threads_making_their_first_plans_at_once_never_deadlock_on_the_probe() -> None:
    """The probe runs Python (it may let another thread take the GIL): a second thread asking meanwhile
    must not wait on a lock while holding the GIL. A collection that sleeps inside the probe makes the
    window wide; both threads get their answer."""
    script = """
import gc, sys, threading, time, faulthandler
faulthandler.dump_traceback_later(20, exit=True)
import numpy as np
import lowtail_native as core
here = threading.local()
def slow_collection(phase, info):
    if getattr(here, "probing", False) and phase == "start":
        time.sleep(0.05)
gc.callbacks.append(slow_collection)
got = []
def first_plan():
    here.probing = True
    gc.set_threshold(1)
    got.append(core.direct_array_reads(np.ndarray))
    here.probing = False
threads = [threading.Thread(target=first_plan, daemon=True) for _ in range(2)]
for t in threads:
    t.start()
for t in threads:
    t.join(15)
print("alive", sum(t.is_alive() for t in threads), "got", sorted(got), flush=True)
"""
    run = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=False
    )
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    direct = EXPORTS_ONLY not in os.environ
    assert f"alive 0 got [{direct}, {direct}]" in run.stdout, run.stdout + run.stderr[-3000:]


@needs_native
@pytest.mark.skipif(EXPORTS_ONLY in os.environ, reason="this is the run through the exports")
def test_the_core_array_tests_pass_with_every_array_read_through_its_buffer_export() -> None:
    """This file and the core's plan tests again, in a process whose core reads arrays only through
    the buffer protocol (the path where numpy's fields are not as the probe expects)."""
    names = ("native_arrays", "native_core", "known_outputs", "answer_into")
    files = [f"tests/shm/test_{name}.py" for name in names]
    env = os.environ | {EXPORTS_ONLY: "1"}
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow", *files],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and " failed" not in run.stdout


@needs_native
@pytest.mark.parametrize(
    ("dtype", "shape"),
    [(np.float32, (4, 2)), (np.bool_, (3,)), (np.complex128, (2, 1)), (np.int8, ()), (np.uint16, (0, 2))],
)
def test_fresh_answer_arrays_are_numpys_own_of_the_plans_dtype_and_shape(dtype: Any, shape: Any) -> None:
    """The copy-out's fresh arrays (made through numpy's C API where the probe passed, by ``np.empty``
    otherwise) are what ``np.empty`` makes: exact ndarrays owning C-order, writeable data, of the plan's
    dtype object and shape, each a copy of the answer's bytes; and the dtype's references balance."""
    import sys

    from lowtail.shm.layout import W_RESP_SEQ

    with _mapped(1, 2, 256, 256) as (geo, mm, seg, q, core):
        dt = np.dtype(dtype)
        want = (np.arange(int(np.prod(shape)), dtype=np.int64) % 2 + 3).astype(dt).reshape(shape)
        n, key, off = want.nbytes, b"\x05" * 64, geo.resp_off(1)
        mm[off : off + 64] = key
        mm[off + 64 : off + 64 + n] = want.tobytes()
        q[geo.slot_word(1) + W_RESP_SEQ] = 3
        plan = core.AnswerPlan(key, [("y", 64, n, shape, dt)], np.empty, np.ndarray)
        refs = sys.getrefcount(dt)
        outs = [core.receive_answer(seg, 0, 1, 3, plan, True)[7]["y"] for _ in range(50)]
        for y in outs:
            assert type(y) is np.ndarray and y.dtype is dt and y.shape == shape
            assert y.flags.c_contiguous and y.flags.writeable and y.flags.owndata and y.base is None
            assert y.tobytes() == want.tobytes()
        outs[0][...] = 0  # its own data: neither the next answer nor the mapping changes
        assert outs[1].tobytes() == want.tobytes() and bytes(mm[off + 64 : off + 64 + n]) == want.tobytes()
        del outs, y
        assert sys.getrefcount(dt) == refs
    assert core.fresh_arrays_by_c_api()  # numpy 1.x or 2.x here: the path above is the C API's


class _DuckDtype:
    """Not a numpy dtype, though it answers ``kind`` and ``itemsize`` as one (what the plan's byte count
    is checked with)."""

    kind = "f"
    itemsize = 4


@needs_native
def test_a_plan_whose_dtype_is_not_a_numpy_dtype_makes_its_arrays_by_its_empty() -> None:
    """The C API takes the dtype as a descriptor: an object that only looks like one goes to ``empty``,
    which refuses it, as before the C API was used (given to the C API, it crashed the process)."""
    from lowtail.shm.layout import W_RESP_SEQ

    with _mapped(1, 2, 256, 256) as (geo, mm, seg, q, core):
        key, off = b"\x05" * 64, geo.resp_off(1)
        mm[off : off + 64] = key
        q[geo.slot_word(1) + W_RESP_SEQ] = 3
        plan = core.AnswerPlan(key, [("y", 64, 32, (4, 2), _DuckDtype())], np.empty, np.ndarray)
        with pytest.raises(TypeError):
            core.receive_answer(seg, 0, 1, 3, plan, True)


@needs_native
def test_an_answer_is_read_only_when_every_byte_of_a_long_key_is_the_plans() -> None:
    """The key check compares the slot's header with the plan's in chunks: a key of 600 bytes differing
    in its last byte, in its first, or in the one after a chunk's end is another header (None: the
    Python parse reads it), the same key is read."""
    from lowtail.shm.layout import W_RESP_SEQ

    with _mapped(1, 2, 1024, 1024) as (geo, mm, seg, q, core):
        key, off = bytes(range(256)) * 2 + b"\x09" * 88, geo.resp_off(1)
        y = np.arange(8, dtype=np.float32).reshape(4, 2)
        mm[off + 640 : off + 672] = y.tobytes()
        q[geo.slot_word(1) + W_RESP_SEQ] = 3
        plan = core.AnswerPlan(key, [("y", 640, 32, (4, 2), F4)], np.empty, np.ndarray)
        for at in (599, 0, 256, 255, 512):
            mm[off : off + 600] = key
            mm[off + at] ^= 0xFF
            assert core.receive_answer(seg, 0, 1, 3, plan, True)[7] is None, at
        mm[off : off + 600] = key
        assert core.receive_answer(seg, 0, 1, 3, plan, True)[7]["y"].tobytes() == y.tobytes()
