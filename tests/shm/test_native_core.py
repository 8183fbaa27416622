"""The native core's loading and its guards: the generated layout is the checked-in one, an extension
built for another layout or a forced Python path falls back with the reason, and the segment refuses a
geometry or an index it does not own."""

from __future__ import annotations

import importlib.util
import sys
import types
from pathlib import Path

import numpy as np
import pytest

from lowtail.shm import native
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
