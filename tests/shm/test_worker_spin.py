"""The worker's wait for a request on the native path: the core spins on the doorbells
(``Poller.spin_bound``) until ``worker_idle_us`` after the last work, then the worker parks as the
Python path's ``_claim_wait`` does; a request that comes meanwhile becomes ``_claim_native``'s
one-request batch, not the Python wait's ``_coalesce``d one."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest

from lowtail.shm import layout, native
from lowtail.shm.queue import QueueClient, QueueWorker
from tests.shm.helpers import echo, native_pair

pytestmark = pytest.mark.skipif(
    not native.available(), reason=f"no native core: {native.implementation().reason}"
)

X = {"obs": np.arange(8, dtype=np.float32).reshape(2, 4)}


def _spy(w: QueueWorker, name: str) -> list[Any]:
    """The calls of ``w``'s method ``name`` (by their first argument), passed on to it."""
    calls: list[Any] = []
    real = getattr(w, name)

    def spy(*args: Any) -> Any:
        calls.append(args[0] if args else None)
        return real(*args)

    setattr(w, name, spy)
    return calls


def _round_trip(c: QueueClient, w: QueueWorker) -> None:
    t = c.submit(X)
    with w.claim(5.0) as b:
        assert b is not None
        b.complete(echo(b.inputs["obs"]))
    c.wait(t, 5.0)


def test_a_request_sent_while_the_worker_waits_is_claimed_as_the_one_request_batch() -> None:
    with native_pair() as (c, w):
        _round_trip(c, w)  # a header the core has seen: the sampler's next request
        coalesced, python_wait = _spy(w, "_coalesce"), _spy(w, "_claim_wait")
        tickets: list[Any] = []
        sender = threading.Timer(0.05, lambda: tickets.append(c.submit(X)))  # after a first poll found none
        sender.start()
        t0 = time.monotonic()
        with w.claim(10.0) as b:
            assert b is not None
            np.testing.assert_array_equal(b.inputs["obs"], X["obs"])
            b.complete(echo(b.inputs["obs"]))
        assert time.monotonic() - t0 < 5.0  # seen while spinning, not at the claim's timeout
        sender.join()
        assert coalesced == [] and python_wait == []  # the core's spin, then _claim_native's batch
        out = c.wait(tickets[0], 5.0)
        for name, want in echo(X["obs"]).items():
            np.testing.assert_array_equal(out[name], want)


def test_a_lane_corrupted_while_the_worker_waits_is_fenced_and_its_neighbour_is_served() -> None:
    """A client writes an impossible doorbell into its own lane while the worker waits in the core's
    spin: the spin sees it move, the poll fences that lane alone, and the neighbour's request that comes
    next is claimed and answered with its own rows."""
    with native_pair() as (honest, w), QueueClient.attach(w.descriptor) as rogue:
        _round_trip(honest, w)
        bells = w._m.q[layout.HW_DOORBELLS : layout.HW_DOORBELLS + 2]
        tickets: list[Any] = []

        def corrupt_then_send() -> None:
            bells[rogue.lane] = 2**40  # far past the lane's tail: more published than it has slots
            time.sleep(0.02)  # the worker sees it and fences the lane before the honest request comes
            tickets.append(honest.submit(X))

        sender = threading.Timer(0.05, corrupt_then_send)
        sender.start()
        with w.claim(10.0) as b:
            assert b is not None and b.lanes == [honest.lane]
            b.complete(echo(b.inputs["obs"]))
        sender.join()
        assert w.fenced == 1
        out = honest.wait(tickets[0], 5.0)
        for name, want in echo(X["obs"]).items():
            np.testing.assert_array_equal(out[name], want)
        _round_trip(honest, w)  # the honest lane serves on


def test_a_wait_that_goes_idle_parks_and_a_request_wakes_it() -> None:
    with native_pair(idle_us=1000) as (c, w):
        sleep_word = w._m.q[layout.HW_WORKER_SLEEP : layout.HW_WORKER_SLEEP + 1]
        parked: list[bool] = []

        def send() -> None:
            deadline = time.monotonic() + 5.0
            while not sleep_word[0] and time.monotonic() < deadline:
                time.sleep(0.001)
            parked.append(bool(sleep_word[0]))
            c.submit(X)

        sender = threading.Thread(target=send)
        sender.start()
        with w.claim(10.0) as b:
            assert b is not None
            b.complete(echo(b.inputs["obs"]))
        sender.join()
        assert parked == [True]  # the worker parked once idle (not spinning to the claim's timeout)
        assert sleep_word[0] == 0


def test_a_claim_with_nothing_sent_times_out_and_sweeps_departed_clients() -> None:
    with native_pair(idle_us=5000) as (_, w):
        swept = _spy(w, "_sweep_departed")
        t0 = time.monotonic()
        assert w.claim(0.03) is None
        took = time.monotonic() - t0
        assert 0.03 <= took < 5.0
        assert len(swept) == 1


def test_spin_bound_sees_a_doorbell_move_and_returns_when_time_runs_out() -> None:
    with native_pair() as (c, w):
        assert w.claim(0.0) is None  # a poll that drained the doorbells: _drained is what they read
        drained, spin = w._drained, w._poller.spin_bound
        assert drained == w._doorbells.tobytes() and drained != b""
        t0 = time.monotonic_ns()
        assert spin(drained, t0 + 500_000) is False
        assert time.monotonic_ns() - t0 >= 500_000
        # a far deadline: back after a slice (1 ms), never a hang
        t0 = time.monotonic_ns()
        assert spin(drained, t0 + 3_600 * 10**9) is False
        assert 1_000_000 <= time.monotonic_ns() - t0 < 2 * 10**9
        assert spin(b"", t0 + 10**9) is True  # "not drained": moved at once
        assert spin(drained[:-8], t0 + 10**9) is True
        c.submit(X)
        assert spin(drained, time.monotonic_ns() + 10**9) is True
        with w.claim(1.0) as b:
            assert b is not None
            b.complete(echo(b.inputs["obs"]))


def test_spin_bound_is_refused_before_bind() -> None:
    poller = native.poller([0, 0], 2)
    with pytest.raises(ValueError, match="before bind"):
        poller.spin_bound(b"\0" * 16, 0)
