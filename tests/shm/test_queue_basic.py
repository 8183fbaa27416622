"""The queue's protocol in one process: states, answers, batching, payload errors, ndarray segments."""

from __future__ import annotations

import os
import pickle
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from lowtail.shm import segments
from lowtail.shm.queue import (
    BadConfig,
    BadRequest,
    InferenceQueue,
    LaneBusy,
    LaneUnavailable,
    PayloadTooLarge,
    QueueClient,
    QueueConfig,
    QueueError,
    QueueTimeout,
    QueueWorker,
    RequestFailed,
    Ticket,
)
from lowtail.shm.server import ACTIVE_LANE_NS
from tests.shm.helpers import echo


@pytest.fixture
def server() -> Iterator[InferenceQueue]:
    with InferenceQueue.create(QueueConfig(lanes=4, slots_per_lane=4, coalesce_us=0)) as s:
        yield s


def lane_states(server: InferenceQueue, lane: int) -> tuple[str, ...]:
    return server.snapshot().lanes[lane].states


def test_round_trip_walks_the_predecessors_slot_states(server: InferenceQueue) -> None:
    with QueueClient.attach(server.descriptor) as c, QueueWorker.attach(server.descriptor) as w:
        assert lane_states(server, c.lane)[0] == "FREE"
        x = np.arange(24, dtype=np.float32).reshape(3, 8)
        t = c.submit({"x": x})
        assert lane_states(server, c.lane)[t.slot] == "READY"
        b = w.claim(timeout_s=1.0)
        assert b is not None and b.sizes == [3] and len(b.queue_wait_ns) == 1 and b.queue_wait_ns[0] >= 0
        assert lane_states(server, c.lane)[t.slot] == "PROCESSING"
        np.testing.assert_array_equal(b.inputs["x"], x)
        b.complete(echo(b.inputs["x"]))
        assert lane_states(server, c.lane)[t.slot] == "DONE"
        out = c.wait(t, timeout_s=1.0)
        assert lane_states(server, c.lane)[t.slot] == "FREE"
        np.testing.assert_allclose(out["twice"], x * 2 + 1)
        assert out["rowsum"].dtype == np.float64 and out["rowsum"].shape == (3, 1)
        assert c.last_timing["infer_ns"] >= 0


def test_outputs_are_copies_owned_by_the_caller(server: InferenceQueue) -> None:
    with QueueClient.attach(server.descriptor) as c, QueueWorker.attach(server.descriptor) as w:
        outs = []
        for v in (1.0, 2.0):
            t = c.submit({"x": np.full((2, 8), v, np.float32)})
            b = w.claim(1.0)
            assert b is not None
            b.complete(echo(b.inputs["x"]))
            outs.append(c.wait(t, 1.0))
        assert outs[0]["twice"][0, 0] == 3.0 and outs[1]["twice"][0, 0] == 5.0


def test_worker_merges_requests_and_splits_answers(server: InferenceQueue) -> None:
    with (
        QueueClient.attach(server.descriptor) as c1,
        QueueClient.attach(server.descriptor) as c2,
        QueueWorker.attach(server.descriptor) as w,
    ):
        xs = [np.full((n, 8), n, np.float32) for n in (1, 5, 2)]
        tickets = [
            (c1, c1.submit({"x": xs[0]})),
            (c2, c2.submit({"x": xs[1]})),
            (c1, c1.submit({"x": xs[2]})),
        ]
        b = w.claim(1.0)
        assert b is not None
        assert sorted(b.sizes) == [1, 2, 5] and b.inputs["x"].shape == (8, 8)
        b.complete(echo(b.inputs["x"]))
        for (c, t), x in zip(tickets, xs, strict=True):
            np.testing.assert_allclose(c.wait(t, 1.0)["twice"], x * 2 + 1)


def test_batches_respect_max_samples_and_max_slots() -> None:
    cfg = QueueConfig(lanes=2, slots_per_lane=8, max_batch_slots=3, max_batch_samples=10, min_batch_samples=1)
    with (
        InferenceQueue.create(cfg) as s,
        QueueClient.attach(s.descriptor) as c,
        QueueWorker.attach(s.descriptor) as w,
    ):
        ts = [c.submit({"x": np.zeros((4, 8), np.float32)}) for _ in range(5)]
        sizes = []
        while len(sizes) < 5:
            b = w.claim(1.0)
            assert b is not None
            assert b.total <= 10 and len(b) <= 3
            sizes.extend(b.sizes)
            b.complete(echo(b.inputs["x"]))
        assert sizes == [4] * 5
        for t in ts:
            c.wait(t, 1.0)


def test_a_lone_request_below_min_batch_is_not_held() -> None:
    cfg = QueueConfig(lanes=2, min_batch_samples=8, coalesce_us=100_000)
    with (
        InferenceQueue.create(cfg) as s,
        QueueClient.attach(s.descriptor) as c,
        QueueWorker.attach(s.descriptor) as w,
    ):
        c.submit({"x": np.zeros((1, 8), np.float32)})
        b = w.claim(timeout_s=1.0)
        assert b is not None and b.sizes == [1]


def test_claim_returns_none_after_its_timeout(server: InferenceQueue) -> None:
    with QueueWorker.attach(server.descriptor, idle_us=0) as w:
        assert w.claim(timeout_s=0.01) is None


def test_wait_times_out_and_the_request_can_be_waited_for_again(server: InferenceQueue) -> None:
    with QueueClient.attach(server.descriptor) as c, QueueWorker.attach(server.descriptor) as w:
        t = c.submit({"x": np.ones((1, 8), np.float32)})
        with pytest.raises(QueueTimeout, match="no answer within") as ei:
            c.wait(t, timeout_s=0.02)
        assert isinstance(ei.value, TimeoutError)
        b = w.claim(1.0)
        assert b is not None
        b.complete(echo(b.inputs["x"]))
        assert c.wait(t, 1.0)["twice"][0, 0] == 3.0
        with pytest.raises(QueueError, match="already waited"):
            c.wait(t, 1.0)


def test_non_numeric_dtype_is_rejected_naming_it(server: InferenceQueue) -> None:
    with QueueClient.attach(server.descriptor) as c:
        with pytest.raises(BadRequest, match=r"'obs' has dtype <U1"):
            c.submit({"obs": np.array(["a", "b"])})
        with pytest.raises(BadRequest, match="dtype object"):
            c.submit({"obs": np.array([object()], dtype=object)})


def test_disagreeing_batch_dimension_is_rejected_naming_sizes(server: InferenceQueue) -> None:
    with QueueClient.attach(server.descriptor) as c:
        with pytest.raises(BadRequest, match=r"'b' has 3 rows but 'a' has 2"):
            c.submit({"a": np.zeros((2, 4), np.float32), "b": np.zeros((3, 4), np.float32)})
        with pytest.raises(BadRequest, match="non-empty dict"):
            c.submit({})
        with pytest.raises(BadRequest, match="scalar"):
            c.submit({"a": np.array(1.0, np.float32)})


def test_failures_are_per_request(server: InferenceQueue) -> None:
    with QueueClient.attach(server.descriptor) as c, QueueWorker.attach(server.descriptor) as w:
        t1 = c.submit({"x": np.ones((1, 8), np.float32)})
        t2 = c.submit({"x": np.ones((2, 8), np.float32)})
        b = w.claim(1.0)
        assert b is not None and b.sizes == [1, 2]
        b.fail_request(0, "model rejected row 0")
        b.complete(echo(b.inputs["x"]))
        with pytest.raises(RequestFailed, match="model rejected row 0"):
            c.wait(t1, 1.0)
        assert c.wait(t2, 1.0)["twice"].shape == (2, 8)


def test_worker_outputs_with_wrong_batch_fail_the_batch_clearly(server: InferenceQueue) -> None:
    with QueueClient.attach(server.descriptor) as c, QueueWorker.attach(server.descriptor) as w:
        t = c.submit({"x": np.ones((3, 8), np.float32)})
        b = w.claim(1.0)
        assert b is not None
        with pytest.raises(BadRequest, match=r"leading dimension 3: got y=\(2, 1\)"):
            b.complete({"y": np.zeros((2, 1), np.float32)})
        with pytest.raises(RequestFailed, match="leading dimension 3"):
            c.wait(t, 1.0)


def test_payload_too_large_names_the_sizes() -> None:
    cfg = QueueConfig(lanes=1, slots_per_lane=2, request_bytes=4096, max_ndslot_bytes=0)
    with InferenceQueue.create(cfg) as s, QueueClient.attach(s.descriptor) as c:
        with pytest.raises(
            PayloadTooLarge, match=r"request of 8192 bytes \(x: float32\[2, 1024\]\) exceeds the 4096"
        ):
            c.submit({"x": np.zeros((2, 1024), np.float32)})
        c.submit({"x": np.zeros((2, 8), np.float32)})  # the lane still works


def test_a_refused_request_leaves_the_cached_layout_and_sends_nothing_to_an_ndarray_slot() -> None:
    """The client caches the last request layout and whether it fits inline; a request refused as too
    large must not leave that flag behind for the next request of the cached layout."""
    from lowtail.shm.payload import NdarraySegment

    cfg = QueueConfig(lanes=1, slots_per_lane=2, request_bytes=4096, max_ndslot_bytes=8192)
    small = {"x": np.ones((2, 8), np.float32)}
    with (
        InferenceQueue.create(cfg) as s,
        QueueClient.attach(s.descriptor) as c,
        QueueWorker.attach(s.descriptor) as w,
    ):
        for arrays in (small, {"x": np.zeros((4, 1024), np.float32)}, small, small):
            created = NdarraySegment.created
            try:
                t = c.submit(arrays)
            except PayloadTooLarge:
                assert arrays is not small
                continue
            b = w.claim(timeout_s=1.0)
            assert b is not None
            b.complete({"y": b.inputs["x"]})
            np.testing.assert_array_equal(c.wait(t, timeout_s=1.0)["y"], small["x"])
            assert NdarraySegment.created == created  # inline, as before the refused one


def test_large_payloads_go_through_pooled_ndarray_slots() -> None:
    cfg = QueueConfig(lanes=1, slots_per_lane=2, request_bytes=4096, response_bytes=4096)
    with (
        InferenceQueue.create(cfg) as s,
        QueueClient.attach(s.descriptor) as c,
        QueueWorker.attach(s.descriptor) as w,
    ):
        names = []
        for v in (1.0, 2.0, 3.0):
            x = np.full((4, 2048), v, np.float32)  # 32 KiB in, 32 KiB (+ rowsum) out
            t = c.submit({"x": x})
            b = w.claim(1.0)
            assert b is not None
            np.testing.assert_array_equal(b.inputs["x"], x)
            assert not b.inputs["x"].flags.owndata  # a view of the ndarray segment, not a copy
            b.complete(echo(b.inputs["x"]))
            np.testing.assert_allclose(c.wait(t, 1.0)["twice"], x * 2 + 1)
            names.append(
                {seg.name for seg in segments.list_segments() if seg.kind == "nd" and seg.pid == os.getpid()}
            )
        assert len(names[0]) == 2 and names[0] == names[1] == names[2]  # one per direction, reused
    assert not [seg for seg in segments.list_segments() if seg.kind == "nd" and seg.pid == os.getpid()]


def test_a_full_lane_says_so(server: InferenceQueue) -> None:
    with QueueClient.attach(server.descriptor) as c:
        for _ in range(4):
            c.submit({"x": np.zeros((1, 8), np.float32)})
        with pytest.raises(LaneBusy, match="all 4 slots of lane"):
            c.submit({"x": np.zeros((1, 8), np.float32)})


def test_no_free_lane_is_a_clear_error(server: InferenceQueue) -> None:
    clients = [QueueClient.attach(server.descriptor) for _ in range(4)]
    try:
        assert sorted(c.lane for c in clients) == [0, 1, 2, 3]
        with pytest.raises(LaneUnavailable, match="all 4 lanes"):
            QueueClient.attach(server.descriptor)
        clients.pop().close()
        with QueueClient.attach(server.descriptor) as again:
            assert again.lane == 3 and again.generation == 2
    finally:
        for c in clients:
            c.close()


def test_one_worker_per_queue(server: InferenceQueue) -> None:
    with (
        QueueWorker.attach(server.descriptor),
        pytest.raises(QueueError, match="already has a live worker"),
    ):
        QueueWorker.attach(server.descriptor)


def test_descriptor_is_small_and_picklable(server: InferenceQueue) -> None:
    raw = pickle.dumps(server.descriptor)
    assert len(raw) < 1024 and pickle.loads(raw) == server.descriptor


def test_segment_is_mode_0600_named_with_owner_and_unlinked_on_close() -> None:
    old = os.umask(0)
    try:
        s = InferenceQueue.create(QueueConfig(lanes=1, slots_per_lane=1))
    finally:
        os.umask(old)
    path = s.descriptor.path
    parts = segments.parse_name(path.name)
    assert parts is not None and parts.kind == "q" and parts.pid == os.getpid()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    s.close()
    assert not path.exists()


def test_bad_config_names_the_field() -> None:
    with pytest.raises(BadConfig, match=r"QueueConfig.request_bytes=1000: expected a multiple of 64"):
        QueueConfig(request_bytes=1000)
    with pytest.raises(BadConfig, match=r"min_batch_samples=20: expected 1..max_batch_samples \(16\)"):
        QueueConfig(min_batch_samples=20)


@pytest.mark.parametrize("spl", [0, 3, 6, 4095, 8192])
def test_slots_per_lane_must_be_a_power_of_two_that_divides_the_counters_wrap(spl: int) -> None:
    """A request's ring position is its number modulo the slots, and the number wraps at 2^64: with 3
    slots a doorbell left at 2^64 - 2 gave two requests in flight position 0 and one was never claimed
    (tests/shm/test_native_bounds_review.py holds the wrap with 4)."""
    with pytest.raises(BadConfig, match=rf"slots_per_lane={spl}: expected a power of two in 1\.\.4096"):
        QueueConfig(slots_per_lane=spl)
    assert QueueConfig(slots_per_lane=1).slots_per_lane == 1
    assert QueueConfig(slots_per_lane=4096).slots_per_lane == 4096


def test_attaching_a_vanished_queue_is_a_clear_error(server: InferenceQueue, tmp_path: Path) -> None:
    desc = server.descriptor
    server.close()
    with pytest.raises(QueueError, match="does not exist on this host"):
        QueueClient.attach(desc)


def test_two_phase_start_returns_before_the_answer_and_finish_collects_it(server: InferenceQueue) -> None:
    with QueueClient.attach(server.descriptor) as c, QueueWorker.attach(server.descriptor) as w:
        x = np.full((4, 8), 7.0, np.float32)
        pending = c.start({"x": x})  # returns with the request published, nothing claimed yet
        assert not pending.done()
        assert lane_states(server, c.lane)[pending.ticket.slot] == "READY"
        b = w.claim(1.0)
        assert b is not None
        b.complete(echo(b.inputs["x"]))
        assert pending.done()
        np.testing.assert_allclose(pending.finish(timeout_s=1.0)["twice"], x * 2 + 1)


@pytest.mark.parametrize("late_cols", [8, 4], ids=["same-layout", "other-layout"])
def test_worker_coalesces_up_to_min_batch_when_another_lane_is_active(late_cols: int) -> None:
    """A claim of 1 sample < min_batch_samples waits (bounded) for a lane seen within ACTIVE_LANE_NS.

    A round is judged only when it ran inside that window, from lane b's first claim to the second
    claim's return: on a loaded host a step can take longer, lane b is then rightly no longer "active
    lately", and the round runs again. Inside the window the claim cannot have waited out coalesce_us
    (twice the window), so it returned because b's late request came: of the same layout, the batch
    must hold both; of another layout (8 x 4 against 1 x 8), the held batch holds a's alone and b's is
    claimed and carried into the next batch, never merged with it."""
    cfg = QueueConfig(lanes=2, min_batch_samples=8, coalesce_us=100_000)
    assert cfg.coalesce_us * 1000 > ACTIVE_LANE_NS
    judged, late_req = 0, {"x": np.ones((8, late_cols), np.float32)}
    with (
        InferenceQueue.create(cfg) as s,
        QueueClient.attach(s.descriptor) as a,
        QueueClient.attach(s.descriptor) as b,
        QueueWorker.attach(s.descriptor) as w,
    ):
        for _ in range(20):
            start = time.monotonic_ns()
            t = b.submit({"x": np.zeros((1, 8), np.float32)})  # lane b has been active lately
            first = w.claim(1.0)
            assert first is not None
            first.complete(echo(first.inputs["x"]))
            b.wait(t, 1.0)
            ta = a.submit({"x": np.ones((1, 8), np.float32)})
            late: list[Ticket] = []
            timer = threading.Timer(0.01, lambda out=late: out.append(b.submit(late_req)))
            timer.start()
            batch = w.claim(1.0)
            inside = time.monotonic_ns() - start < ACTIVE_LANE_NS
            carried = len(w._carry)
            timer.join()
            assert batch is not None
            if inside:
                judged += 1
                if late_cols == 8:
                    assert sorted(batch.sizes) == [1, 8]
                else:
                    assert batch.sizes == [1] and carried == 1  # b's claimed in the hold, not merged
            batch.complete(echo(batch.inputs["x"]))
            if len(batch.sizes) == 1:  # b's request (carried, or not coalesced): a batch of its own
                again = w.claim(1.0)
                assert again is not None and again.sizes == [8]
                again.complete(echo(again.inputs["x"]))
            assert a.wait(ta, 1.0)["twice"].shape == (1, 8)
            assert b.wait(late[0], 1.0)["twice"].shape == (8, late_cols)
            if judged >= 3:
                break
    assert judged, "no round ran inside ACTIVE_LANE_NS on this host: nothing was judged"


def test_the_old_payload_names_are_deprecated_aliases_of_the_new() -> None:
    from lowtail.shm import payload

    for old, new in payload._DEPRECATED.items():
        with pytest.warns(DeprecationWarning, match=new):
            assert getattr(payload, old) is getattr(payload, new)
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = payload.no_such_name  # type: ignore[attr-defined]
