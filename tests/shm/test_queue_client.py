"""The client's hot path: the cached request layout, and how a client waits (predictive park, spin).

Mechanism, not latency: the wait counters say where each answer found the client (at once, spinning,
parked), whatever the host's speed.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
import time
from collections.abc import Iterator
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lowtail.shm import client as client_mod
from lowtail.shm import native, payload
from lowtail.shm.client import MARGIN_NS, MIN_TIMED_PARK_NS, next_prediction_ns, park_until_ns
from lowtail.shm.layout import W_CLAIM_SEQ
from lowtail.shm.queue import (
    BadRequest,
    InferenceQueue,
    QueueClient,
    QueueConfig,
    QueueDescriptor,
    QueueError,
    QueueWorker,
    WorkerDied,
)
from tests.shm import helpers

MS = 1_000_000


@pytest.fixture
def server() -> Iterator[InferenceQueue]:
    with InferenceQueue.create(QueueConfig(lanes=2, slots_per_lane=2, coalesce_us=0)) as s:
        yield s


@contextlib.contextmanager
def _worker_at(ctx: BaseContext, server: InferenceQueue, latencies_s: list[float]) -> Iterator[None]:
    """A worker process answering the k-th request latencies_s[k] after its submit (then the last)."""
    worker = ctx.Process(target=helpers.serve_at_latencies, args=(server.descriptor, latencies_s, 30.0))  # type: ignore[attr-defined]
    worker.start()
    try:
        yield
    finally:
        if worker.is_alive():
            worker.terminate()
        worker.join(10)
        assert worker.exitcode is not None, f"worker {worker.pid} did not exit"


def _rounds(c: QueueClient, n: int) -> dict[str, int]:
    """n checked round trips; the change of the client's wait counts over them."""
    before = c.wait_counts
    x = np.ones((1, 4), np.float32)
    for _ in range(n):
        np.testing.assert_array_equal(c.infer({"x": x}, timeout_s=30.0)["y"], x)
    return {k: v - before[k] for k, v in c.wait_counts.items()}


# -- the prediction and the decision to park ---------------------------------------------------------


def test_prediction_takes_the_first_answer_drops_at_once_and_rises_by_a_quarter() -> None:
    assert next_prediction_ns(0, 3 * MS) == 3 * MS  # nothing learned yet: the first answer
    assert next_prediction_ns(3 * MS, 1 * MS) == 1 * MS  # an earlier answer: at once
    assert next_prediction_ns(1 * MS, 5 * MS) == 2 * MS  # a later one: a quarter of the gap
    p = 1 * MS
    for _ in range(40):  # answers that stay late pull it up to them, never past
        p = next_prediction_ns(p, 5 * MS)
        assert p <= 5 * MS
    assert p > 5 * MS - 1000


def test_a_wait_sleeps_only_when_its_answer_is_predicted_beyond_the_margin() -> None:
    submit = 1_000 * MS
    # unknown, near, or already due: spin at once (0)
    assert park_until_ns(submit, submit, 0, MARGIN_NS) == 0
    assert park_until_ns(submit, submit, MARGIN_NS + MIN_TIMED_PARK_NS - 1, MARGIN_NS) == 0
    assert park_until_ns(submit, submit + 2 * MS, 2 * MS, MARGIN_NS) == 0
    # far: sleep until the margin before the predicted answer
    assert park_until_ns(submit, submit, 2 * MS, MARGIN_NS) == submit + 2 * MS - MARGIN_NS
    # a two-phase caller that comes back late sleeps only what is left
    assert park_until_ns(submit, submit + 1 * MS, 2 * MS, MARGIN_NS) == submit + 2 * MS - MARGIN_NS


def test_the_queue_round_trip_is_shorter_than_a_sleep_would_be() -> None:
    # bench queue's ~15 us round trips (and anything under margin + min sleep) always spin
    assert park_until_ns(0, 0, 15_000, MARGIN_NS) == 0
    assert client_mod.PURE_SPIN_NS <= MARGIN_NS + MIN_TIMED_PARK_NS


# -- the cached request layout ------------------------------------------------------------------------


def test_plan_matches_only_the_same_names_dtypes_and_shapes() -> None:
    x = np.zeros((4, 3), np.float32)
    layout = payload.validated_layout({"x": x, "m": np.zeros((4,), np.bool_)})
    assert layout.matches({"x": np.ones((4, 3), np.float32), "m": np.ones((4,), np.bool_)})
    assert layout.matches({"m": np.ones((4,), np.bool_), "x": x})  # same arrays by name
    for other in (
        {"x": x},  # one missing
        {"x": x, "m": np.zeros((4,), np.bool_), "z": x},  # one more
        {"x": x.astype(np.float64), "m": np.zeros((4,), np.bool_)},  # another dtype
        {"x": np.zeros((1, 3), np.float32), "m": np.zeros((4,), np.bool_)},  # would broadcast
        {"y": x, "m": np.zeros((4,), np.bool_)},  # another name
        {"x": x.tolist(), "m": np.zeros((4,), np.bool_)},  # not an array
        {"x": np.ma.masked_array(x), "m": np.zeros((4,), np.bool_)},  # a subclass: validated again
        [x, x],  # not a mapping
    ):
        assert not layout.matches(other)  # type: ignore[arg-type]


def test_a_request_of_another_layout_after_a_cached_one_is_sent_as_it_is(server: InferenceQueue) -> None:
    """The layout cache must never cast or broadcast: each request arrives with its own dtype and shape."""
    with QueueClient.attach(server.descriptor) as c, QueueWorker.attach(server.descriptor) as w:
        xs = [
            np.arange(12, dtype=np.float32).reshape(4, 3),
            np.arange(12, dtype=np.float32).reshape(4, 3) + 1,  # the cached layout
            np.arange(12, dtype=np.float64).reshape(4, 3),  # another dtype, same shape
            np.arange(3, dtype=np.float64).reshape(1, 3),  # a shape that would broadcast
            np.arange(12, dtype=np.float32).reshape(4, 3),  # back to the first
        ]
        for x in xs:
            t = c.submit({"x": x})
            b = w.claim(timeout_s=1.0)
            assert b is not None
            got = b.inputs["x"]
            assert got.dtype == x.dtype and got.shape == x.shape
            b.complete({"y": got})
            np.testing.assert_array_equal(c.wait(t, timeout_s=1.0)["y"], x)
        with pytest.raises(BadRequest, match="expected a numpy array"):
            c.submit({"x": [[1.0, 2.0]]})  # type: ignore[dict-item]


def test_an_answer_of_another_layout_in_the_same_slot_is_read_as_it_is(server: InferenceQueue) -> None:
    with QueueClient.attach(server.descriptor) as c, QueueWorker.attach(server.descriptor) as w:
        x = np.ones((2, 3), np.float32)
        for y in (np.ones((2, 5), np.float32), np.ones((2, 5), np.int64) * 7, np.zeros((2,), np.uint8)):
            t = c.submit({"x": x})
            b = w.claim(timeout_s=1.0)
            assert b is not None
            b.complete({"y": y})
            out = c.wait(t, timeout_s=1.0)["y"]
            assert out.dtype == y.dtype
            np.testing.assert_array_equal(out, y)


# -- where the answer finds the client ---------------------------------------------------------------


def test_an_answer_already_there_is_taken_without_spinning_or_parking(server: InferenceQueue) -> None:
    with QueueClient.attach(server.descriptor) as c, QueueWorker.attach(server.descriptor) as w:
        for k in range(5):
            t = c.submit({"x": np.full((1, 4), k, np.float32)})
            b = w.claim(timeout_s=1.0)
            assert b is not None
            b.complete({"y": b.inputs["x"]})
            assert c.wait(t, timeout_s=1.0)["y"][0, 0] == k
        counts = c.wait_counts
        assert counts["immediate"] == 5
        assert counts["spinning"] == counts["parked"] == counts["futex_waits"] == 0
        timing = c.last_timing  # learned from the worker's stamps: submit to answer
        assert 0 < c.predicted_ns <= timing["queue_wait_ns"] + timing["infer_ns"]


def test_a_client_that_learned_its_wait_sleeps_then_meets_the_answer_spinning(
    ctx: BaseContext, server: InferenceQueue
) -> None:
    """The worker answers 20 ms after each submit. The client learns that, sleeps until shortly before
    it and spins: the answer finds it spinning, so the worker has no parked client to wake. (A spin
    budget of 100 ms absorbs any lateness of the answer on a loaded host. The client's own wake-up
    can be late by up to a millisecond on a loaded 2-vCPU guest: it learns that lateness, and answers
    that find it still asleep meanwhile are allowed, as long as one finds it spinning.)

    A wait is judged when its premise held: the client entered it at least 10 ms before its sleep
    would end, with its answers predictable (at most ``MAX_LATE`` late). A loaded host can run the
    wait later, when sleeping no longer pays (rightly not done); such a round runs again."""
    x, judged, spinning = np.ones((1, 4), np.float32), 0, 0
    with _worker_at(ctx, server, [0.02]), QueueClient.attach(server.descriptor, spin_us=100_000) as c:
        _rounds(c, 8)
        assert 20 * MS <= c.predicted_ns < 1000 * MS
        for _ in range(60):
            pred, before = c._pred, c.wait_counts
            predicted, margin, late = pred.predicted_ns, MARGIN_NS + pred.oversleep_ns, pred.late
            t = c.submit({"x": x})
            entered = time.monotonic_ns()
            np.testing.assert_array_equal(c.wait(t, timeout_s=30.0)["y"], x)
            delta = {k: v - before[k] for k, v in c.wait_counts.items()}
            sleep_left = t.submit_ns + predicted - margin - entered
            if (
                delta["immediate"]
                or late.bit_count() > client_mod.MAX_LATE
                or sleep_left < MIN_TIMED_PARK_NS + 10 * MS
            ):
                continue  # the answer there already, or too late to sleep: rightly no timed park
            judged += 1
            assert delta["timed_parks"] == 1, delta  # every judged wait slept first
            assert delta["spinning"] + delta["parked"] == 1, delta
            spinning += delta["spinning"]
            if judged >= 12 and spinning:
                break
    assert judged and spinning >= 1, (judged, spinning)  # and answers found it spinning


def test_an_answer_earlier_than_predicted_is_met_and_learned_at_once(
    ctx: BaseContext, server: InferenceQueue
) -> None:
    """An answer earlier than predicted is met as any other and learned at once. Four answers at 20 ms
    teach a fresh client 20 ms; the fifth comes after 1 ms and finds it parked, or already there. (With
    no CPU of its own here the client parks at once: no predictive sleep, no spin. That the worker's
    wake, not the park's slice, ends the park is test_worker_wakes.py's.)

    A round is judged when the fifth answer was stamped done within 20 ms of its submit: a loaded host
    can stall the worker past the prediction, and that answer is then not early. Such a round runs
    again, with a fresh client (one that learned an early answer takes many rounds to unlearn it)."""
    rounds, judged = 5, 0
    with _worker_at(ctx, server, ([0.02] * 4 + [0.001]) * rounds):
        for _ in range(rounds):
            with QueueClient.attach(server.descriptor) as c:
                _rounds(c, 4)
                assert c.predicted_ns >= 20 * MS
                delta = _rounds(c, 1)
                timing = c.last_timing
                if timing["queue_wait_ns"] + timing["infer_ns"] >= 20 * MS:
                    continue  # the fifth answer came late: not earlier than predicted
                judged += 1
                assert delta["parked"] + delta["immediate"] == 1 and delta["spinning"] == 0, delta
                assert c.predicted_ns < 20 * MS  # the early answer was taken early, and learned
                break
    assert judged, "no early answer came within 20 ms of its submit on this host: nothing was judged"


def test_a_client_with_no_spin_budget_parks_without_spinning(
    ctx: BaseContext, server: InferenceQueue
) -> None:
    with _worker_at(ctx, server, [0.005]), QueueClient.attach(server.descriptor, spin_us=0) as c:
        _rounds(c, 1)  # the worker's start-up is not the wait measured
        delta = _rounds(c, 5)
    assert delta["parked"] + delta["immediate"] >= 4 and delta["futex_waits"] >= 1, delta
    # each answer ~5 ms off: a futex wait per parked answer (but one whose answer came between the
    # parked flag and the wait), on the native path made inside the core's receive_answer
    assert delta["futex_waits"] >= delta["parked"] - 1, delta


def test_a_wait_never_gives_its_cpu_away_with_sched_yield(
    ctx: BaseContext, server: InferenceQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a CPU shared with a busy task, sched_yield hands the CPU over until the next tick (4 ms at
    HZ=250): waits spin, then park (a woken nice -20 sampler preempts the busy task at once)."""

    def no_yield() -> None:
        raise AssertionError("QueueClient.wait called sched_yield")

    monkeypatch.setattr(os, "sched_yield", no_yield)
    with _worker_at(ctx, server, [0.005, 0.0002]), QueueClient.attach(server.descriptor) as c:
        delta = _rounds(c, 12)  # a 5 ms answer (a first wait, parked), then 0.2 ms ones (spun for)
    assert delta["futex_waits"] >= 1, delta  # the 5 ms wait parked (a yield would not)


def test_a_client_whose_answers_often_come_past_prediction_and_budget_stops_sleeping(
    ctx: BaseContext, server: InferenceQueue
) -> None:
    """Answers alternating 2 ms and 30 ms: half come later than the (low) prediction plus the 200 us
    spin budget, where a sleep would end in the whole spin and a park; the client then waits the plain
    way (spin, then park), without predictive sleeps."""
    with _worker_at(ctx, server, [0.002, 0.03] * 20), QueueClient.attach(server.descriptor, spin_us=200) as c:
        _rounds(c, 12)
        delta = _rounds(c, 6)
    assert delta["timed_parks"] == 0, delta
    assert delta["futex_waits"] > 0, delta  # it still parks after its spin


# -- whether a client spins at all: only on a CPU of its own -------------------------------------------


def test_the_default_spins_only_alone_on_an_isolated_cpu() -> None:
    iso = frozenset({2, 3})
    own = client_mod.choose_spin(200, {2}, iso, {})
    assert (own.spin_us, own.own_cpu) == (200, True)
    for affinity, peers, why in (
        ({0, 1}, {}, "affinity is 2 CPUs"),  # not pinned: shares whatever the scheduler gives it
        ({0}, {}, "CPU 0 is not isolated"),  # pinned, but the kernel puts other tasks there
        ({2}, {4242: frozenset({2, 3})}, "shared with the clients of pids [4242]"),  # a second client
    ):
        got = client_mod.choose_spin(200, affinity, iso, peers)
        assert (got.spin_us, got.own_cpu) == (0, False), got
        assert why in got.reason
    assert client_mod.choose_spin(200, {2}, iso, {4242: frozenset({3})}).spin_us == 200  # another CPU


def test_an_isolated_cpu_list_that_cannot_be_read_counts_as_none(tmp_path: Path) -> None:
    (tmp_path / "garbage").write_text("0-x\n")
    (tmp_path / "empty").write_text("\n")
    (tmp_path / "two").write_text("2-3\n")
    assert client_mod.isolated_cpus(str(tmp_path / "missing")) == frozenset()
    assert client_mod.isolated_cpus(str(tmp_path / "garbage")) == frozenset()
    assert client_mod.isolated_cpus(str(tmp_path / "empty")) == frozenset()
    assert client_mod.isolated_cpus(str(tmp_path / "two")) == frozenset({2, 3})


def _pinned_client(desc: QueueDescriptor, cpu: int, attached: Any, release: Any) -> None:
    os.sched_setaffinity(0, {cpu})
    with QueueClient.attach(desc):
        attached.set()
        release.wait(30)


def test_a_client_alone_on_an_isolated_cpu_spins_and_one_that_shares_it_parks(
    ctx: BaseContext, server: InferenceQueue, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The decision at attach, against the kernel's isolated list (a fixture file here: this host
    isolates nothing) and a real second client process pinned to the same CPU."""
    cpu = min(os.sched_getaffinity(0))
    iso = tmp_path / "isolated"
    iso.write_text(f"{cpu}\n")
    monkeypatch.setattr(client_mod, "ISOLATED_CPUS_PATH", str(iso))
    saved = os.sched_getaffinity(0)
    os.sched_setaffinity(0, {cpu})
    try:
        with QueueClient.attach(server.descriptor) as alone:
            assert (
                alone.spin_policy.own_cpu
                and alone.spin_policy.spin_us == server.descriptor.config.client_spin_us
            )
        attached, release = ctx.Event(), ctx.Event()  # type: ignore[attr-defined]
        peer = ctx.Process(target=_pinned_client, args=(server.descriptor, cpu, attached, release))  # type: ignore[attr-defined]
        peer.start()
        try:
            assert attached.wait(60), "the peer client did not attach"
            with QueueClient.attach(server.descriptor) as shared:
                assert (shared.spin_policy.spin_us, shared.spin_policy.own_cpu) == (0, False)
                assert f"shared with the clients of pids [{peer.pid}]" in shared.spin_policy.reason
        finally:
            release.set()
            peer.join(30)
        with QueueClient.attach(server.descriptor, spin_us=50) as given:
            assert given.spin_policy.spin_us == 50  # an explicit budget overrides the decision
    finally:
        os.sched_setaffinity(0, saved)
    with pytest.raises(QueueError, match="spin_us=-1"):
        QueueClient.attach(server.descriptor, spin_us=-1)


def test_a_client_on_a_shared_cpu_parks_through_a_slow_request(
    ctx: BaseContext, server: InferenceQueue
) -> None:
    """No CPU of its own (this test's affinity is not one isolated CPU): the wait parks on the futex,
    so its thread's CPU time over 50 ms answers is a small part of the wall time (bound generous)."""
    with _worker_at(ctx, server, [0.05]), QueueClient.attach(server.descriptor) as c:
        assert c.spin_policy.spin_us == 0 and not c.spin_policy.own_cpu, c.spin_policy
        _rounds(c, 1)  # the worker's start-up is not the wait measured
        times0 = c.wait_times
        wall0, cpu0 = time.monotonic_ns(), time.thread_time_ns()
        delta = _rounds(c, 5)
        wall, cpu = time.monotonic_ns() - wall0, time.thread_time_ns() - cpu0
        times = {k: v - times0[k] for k, v in c.wait_times.items()}
    assert delta["spinning"] == 0 and delta["timed_parks"] == 0, delta
    assert delta["parked"] + delta["immediate"] == 5 and delta["futex_waits"] >= 5, delta
    assert wall >= 5 * 50 * MS
    assert cpu < 0.2 * wall, (cpu, wall)
    # the waits' wall time went to the park (each answer ~50 ms after its submit), none to a spin
    assert delta["parked"] * 40 * MS <= times["park_ns"] <= wall and times["spin_ns"] < 5 * MS, times


def test_a_client_with_a_spin_budget_spins_for_its_answer(ctx: BaseContext, server: InferenceQueue) -> None:
    """A client that has learned nothing spins its whole budget for an answer due 20 ms after submit.

    A round is judged when the client entered its wait within 10 ms of its submit: a loaded host can
    run it later, when the answer may be there already (taken at once, rightly). Such a round runs
    again, with a fresh client."""
    x, judged = np.ones((1, 4), np.float32), 0
    with _worker_at(ctx, server, [0.02]):
        with QueueClient.attach(server.descriptor, spin_us=0) as warm:
            _rounds(warm, 1)  # the worker is up before the measured client starts
        for _ in range(10):
            with QueueClient.attach(server.descriptor, spin_us=1_000_000) as c:
                t = c.submit({"x": x})
                entered = time.monotonic_ns()
                np.testing.assert_array_equal(c.wait(t, timeout_s=30.0)["y"], x)
                delta, times = c.wait_counts, c.wait_times
            if entered - t.submit_ns >= 10 * MS:
                continue
            judged += 1
            assert delta["spinning"] == 1 and delta["futex_waits"] == 0, delta
            assert times["spin_ns"] >= 10 * MS and times["park_ns"] == 0, times  # the answer came ~20 ms in
            break
    assert judged, "no round entered its wait within 10 ms of its submit on this host"


def test_a_parked_client_whose_worker_is_killed_gets_worker_died_promptly(
    ctx: BaseContext, server: InferenceQueue
) -> None:
    """The worker claims the request and never answers (answers after 60 s); killed while the client
    is parked on it, the client raises WorkerDied within a few park slices, not at its timeout."""
    worker = ctx.Process(target=helpers.serve_at_latencies, args=(server.descriptor, [60.0], 90.0))  # type: ignore[attr-defined]
    worker.start()
    try:
        with QueueClient.attach(server.descriptor) as c:
            assert c.spin_policy.spin_us == 0
            t = c.submit({"x": np.ones((1, 4), np.float32)})
            claim_i = c._si[t.slot] + W_CLAIM_SEQ
            deadline = time.monotonic() + 60
            while c._q[claim_i] != t.seq:  # claimed: from now on only the worker can answer it
                assert time.monotonic() < deadline and worker.is_alive(), "the worker never claimed"
                time.sleep(0.01)
            killer = threading.Timer(0.3, lambda: os.kill(worker.pid or 0, signal.SIGKILL))
            killer.start()
            t0 = time.monotonic()
            with pytest.raises(WorkerDied, match="died processing"):
                c.wait(t, timeout_s=30.0)
            waited_s = time.monotonic() - t0
            killer.join()
        assert c.wait_counts["futex_waits"] >= 1
        assert waited_s < 10.0, waited_s  # no hang: far below the 30 s timeout
    finally:
        if worker.is_alive():
            worker.kill()
        worker.join(10)


def test_a_native_client_that_parks_at_once_takes_each_answer_in_one_core_call(
    ctx: BaseContext, server: InferenceQueue, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No spin budget on the native core: ``wait`` checks, parks and reads in one ``receive_answer``
    call, whether the answer came while it was parked or was there already, with none of ``_await``'s
    Python before it; the wait counts say which, as on the other paths.

    A wait for an answer due 5 ms after its submit is judged when the core call looked for it at least
    1 ms before the worker stamped it done (by the core's clock, read at the look) and went into the
    futex wait: a loaded host can stall the client past the answer, which is then rightly taken at
    once, or between the look and the futex call. Such a wait runs again."""
    if not native.available():
        pytest.skip(f"the native core is not available: {native.implementation().reason}")

    def no_await(*_: object) -> None:
        raise AssertionError("_await ran for a client that parks at once")

    x = {"x": np.ones((1, 4), np.float32)}
    with native.use(True), _worker_at(ctx, server, [0.005]), QueueClient.attach(server.descriptor) as c:
        assert c.spin_policy.spin_us == 0
        _rounds(c, 1)  # the worker's start-up, and the answer's layout learned
        calls: list[tuple[Any, ...]] = []
        looked: list[int] = []  # when each core call looked for the answer
        slept: list[bool] = []  # whether each core call's park went into the futex wait
        slices: list[tuple[Any, ...]] = []  # waits that outlasted the core call's park slice (a slow host)
        receive, park = c._receive, c._park

        def receive_seen(*a: Any) -> Any:
            calls.append(a)
            got = receive(*a)
            looked.append(got[8] or got[1])  # parked at, or (not parked) returned at: read at the look
            slept.append(got[9])
            return got

        monkeypatch.setattr(c, "_receive", receive_seen)
        monkeypatch.setattr(c, "_park", lambda *a, **k: slices.append(a) or park(*a, **k))
        monkeypatch.setattr(QueueClient, "_await", no_await)
        judged = 0
        for _ in range(20):
            before, calls[:], looked[:], slept[:], slices[:] = c.wait_counts, [], [], [], []
            t = c.submit(x)  # answered ~5 ms after its submit: found parked
            np.testing.assert_array_equal(c.wait(t, timeout_s=30.0)["y"], x["x"])
            delta = {k: v - before[k] for k, v in c.wait_counts.items()}
            assert t.stamps is not None
            if looked[0] > t.stamps[1] - MS or not slept[0]:
                # the client came to its wait late (the answer may have been there already), or a stall
                # between its look and the futex call let the park's re-check find the answer
                continue
            judged += 1
            # one core call per answer; one more to read an answer that ``_park`` saw after the first slice
            assert len(calls) == 1 + len(slices), (calls, slices)
            assert delta["parked"] == 1 and delta["immediate"] == 0 and delta["futex_waits"] >= 1, delta
            if judged >= 3:
                break
        assert judged, "no wait looked for its answer 1 ms before it came on this host: nothing was judged"
        t = c.submit(x)
        deadline = time.monotonic() + 30
        while not c.ready(t):
            assert time.monotonic() < deadline, "never answered"
            time.sleep(0.005)
        before, calls[:] = c.wait_counts, []
        np.testing.assert_array_equal(c.wait(t, timeout_s=30.0)["y"], x["x"])
        assert len(calls) == 1 and c.wait_counts["immediate"] == before["immediate"] + 1
