"""``wait(out=...)``: an answer copied into the caller's own arrays instead of fresh ones, on every queue
implementation (``queue_impl``): inline or in the worker's ndarray segment, and an ``out`` that does not
fit refused with both layouts named, its slot given back."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from lowtail.shm import client as client_mod
from lowtail.shm import native
from lowtail.shm.queue import InferenceQueue, QueueClient, QueueConfig, QueueError, QueueWorker


class Pair:
    """A client and a worker of one queue in this process: each round trip answered ``y = 2 x``."""

    def __init__(self, q: InferenceQueue) -> None:
        self.worker = QueueWorker.attach(q.descriptor)
        self.client = QueueClient.attach(q.descriptor)

    def trip(self, x: np.ndarray[Any, Any], **kw: Any) -> Any:
        t = self.client.submit({"x": x})
        b = self.worker.claim(5.0)
        assert b is not None
        with b:
            b.complete({"y": b.inputs["x"] * 2})
        return self.client.wait(t, 5.0, **kw)


@pytest.fixture
def pair(queue_impl: str) -> Iterator[Pair]:
    cfg = QueueConfig(lanes=1, slots_per_lane=2, coalesce_us=0, request_bytes=8192, response_bytes=1024)
    with InferenceQueue.create(cfg) as q:
        p = Pair(q)
        try:
            yield p
        finally:
            p.client.close()
            p.worker.close()


@pytest.mark.parametrize("rows", [2, 64], ids=["inline", "ndarray-segment"])
def test_an_answer_is_copied_into_the_callers_arrays(pair: Pair, rows: int) -> None:
    """Rows 64: 1 KiB of answer and its header do not fit the 1 KiB response region."""
    out = {"y": np.zeros((rows, 4), np.float32)}
    for k in range(5):  # the first answer in each slot parses its header, the next ones use the cache
        x = np.full((rows, 4), k, np.float32)
        got = pair.trip(x, out=out)
        assert got is out
        np.testing.assert_array_equal(out["y"], 2 * x)
    np.testing.assert_array_equal(pair.trip(np.ones((rows, 4), np.float32))["y"], 2)  # without out: fresh


def test_a_strided_out_is_filled_too(pair: Pair) -> None:
    y = np.zeros((2, 8), np.float32)[:, ::2]
    for k in range(3):
        pair.trip(np.full((2, 4), k, np.float32), out={"y": y})
        np.testing.assert_array_equal(y, 2 * k)


def _read_only() -> np.ndarray[Any, Any]:
    a = np.zeros((2, 4), np.float32)
    a.flags.writeable = False
    return a


@pytest.mark.parametrize(
    ("out", "named"),
    [
        ({"y": np.zeros((2, 3), np.float32)}, "y: float32[2, 3]"),
        ({"y": np.zeros((2, 4), np.float64)}, "y: float64[2, 4]"),
        ({"z": np.zeros((2, 4), np.float32)}, "z: float32[2, 4]"),
        ({"y": np.zeros((2, 4), np.float32), "z": np.zeros(1)}, "z: float64[1]"),
        ({"y": [0.0] * 8}, "y: list"),
        ({}, "nothing"),
        ({"y": _read_only()}, "y: float32[2, 4]"),
    ],
    ids=["shape", "dtype", "name", "extra", "list", "empty", "read-only"],
)
def test_an_out_that_does_not_fit_is_refused_naming_both_and_its_slot_returns(
    pair: Pair, out: dict[str, Any], named: str
) -> None:
    x = np.ones((2, 4), np.float32)
    pair.trip(x, out={"y": np.zeros((2, 4), np.float32)})  # the slots' answer layout cached
    pair.trip(x, out={"y": np.zeros((2, 4), np.float32)})
    for _ in range(2):  # both slots: a cached layout's refusal, in the core too
        with pytest.raises(
            QueueError, match=r"out has .*" + named.replace("[", r"\[") + r".*y: float32\[2, 4\]"
        ):
            pair.trip(x, out=out)
    for _ in range(3):  # nothing held: the lane's slots all came back
        np.testing.assert_array_equal(pair.trip(x)["y"], 2)


def test_copy_false_with_out_is_refused_before_the_answer_is_taken(pair: Pair) -> None:
    c = pair.client
    t = c.submit({"x": np.ones((2, 4), np.float32)})
    b = pair.worker.claim(5.0)
    assert b is not None
    with b:
        b.complete({"y": b.inputs["x"] * 2})
    with pytest.raises(QueueError, match="not both"):
        c.wait(t, 5.0, copy=False, out={"y": np.zeros((2, 4), np.float32)})  # type: ignore[call-overload]
    np.testing.assert_array_equal(c.wait(t, 5.0)["y"], 2)  # still there, taken once


@pytest.mark.parametrize("queue_impl", ["native"], indirect=True)  # the core's own copy
def test_the_core_copies_into_a_fitting_out_itself(pair: Pair, monkeypatch: pytest.MonkeyPatch) -> None:
    """On the native core a C-contiguous ``out`` of the answer's layout is filled inside
    ``receive_answer``: no Python copy (``_copy_into``) once the slot's layout is cached."""
    assert native.available()
    out = {"y": np.zeros((2, 4), np.float32)}
    for _ in range(2):
        pair.trip(np.ones((2, 4), np.float32), out=out)

    def no_python_copy(*_: object) -> None:
        raise AssertionError("copied in Python")

    monkeypatch.setattr(client_mod, "_copy_into", no_python_copy)
    for k in range(4):
        assert pair.trip(np.full((2, 4), k, np.float32), out=out) is out
        np.testing.assert_array_equal(out["y"], 2 * k)


@pytest.mark.parametrize("overlap", ["same array", "halves of one buffer overlapping"])
def test_an_out_whose_arrays_share_memory_is_refused_naming_them(pair: Pair, overlap: str) -> None:
    """Each array passes alone; together the second copy would overwrite the first answer (seen on
    both paths before: ``a`` came back holding ``b``'s values)."""
    c, w = pair.client, pair.worker

    def trip(out: dict[str, Any] | None) -> Any:
        t = c.submit({"x": np.ones((2, 4), np.float32)})
        b = w.claim(5.0)
        assert b is not None
        with b:
            x = np.array(b.inputs["x"])
            b.complete({"a": x * 2, "b": x * 3})
        return c.wait(t, 5.0) if out is None else c.wait(t, 5.0, out=out)

    trip(None)
    trip(None)  # both slots' answer layouts cached: the core's copy is asked first
    buf = np.zeros(12, np.float32)
    if overlap == "same array":
        out = {"a": buf[:8].reshape(2, 4), "b": buf[:8].reshape(2, 4)}
    else:
        out = {"a": buf[:8].reshape(2, 4), "b": buf[4:].reshape(2, 4)}
    for _ in range(2):
        with pytest.raises(QueueError, match=r"out\['a'\] and out\['b'\] share memory"):
            trip(out)
    apart = {"a": np.zeros((2, 4), np.float32), "b": np.zeros((2, 4), np.float32)}
    got = trip(apart)
    assert got is apart and float(apart["a"][0, 0]) == 2.0 and float(apart["b"][0, 0]) == 3.0
