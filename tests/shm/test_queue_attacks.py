"""The queue tried as a hostile or unlucky user would: each test failed on the tree it fixes.

In-process and deterministic: the worker is driven claim by claim, and the "third party" writing
the segment is the owner's own mapping (``InferenceQueue._m``), which is exactly what any process
with write access to the file can do. The multi-process versions are in test_queue_adversarial.py.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import re
import struct
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lowtail.shm import payload, segments
from lowtail.shm.errors import BadConfig, BadRequest, LaneBusy, QueueTimeout, SegmentNotFound, WorkerDied
from lowtail.shm.layout import HW_DOORBELLS, HW_WORKER_PID
from lowtail.shm.queue import (
    L_RING,
    S_CLAIM_SEQ,
    S_REQ_SEQ,
    InferenceQueue,
    QueueClient,
    QueueConfig,
    QueueDescriptor,
    QueueWorker,
)
from tests.shm.helpers import NOBODY, as_nobody, echo

# Every test here runs on both hot paths: the Python reference and the native core.
pytestmark = pytest.mark.usefixtures("queue_impl")


def _x(tag: float, rows: int = 1) -> dict[str, np.ndarray[Any, Any]]:
    x = np.full((rows, 8), tag, np.float32)
    return {"x": x}


def _serve(w: QueueWorker, timeout: float = 0.5) -> list[int]:
    """Claim one batch, answer it with ``echo``; returns the lanes it held ([] if none came)."""
    b = w.claim(timeout_s=timeout)
    if b is None:
        return []
    lanes = b.lanes
    b.complete(echo(b.inputs["x"]))
    return lanes


def _round_trip(c: QueueClient, w: QueueWorker, tag: float) -> None:
    """One request through the worker, answered and checked against its own tag."""
    t = c.submit(_x(tag))
    assert _serve(w) == [c.lane]
    assert c.wait(t, timeout_s=1.0)["twice"][0, 0] == tag * 2 + 1


@contextlib.contextmanager
def _served(cfg: QueueConfig) -> Iterator[tuple[InferenceQueue, QueueWorker, QueueClient]]:
    """A queue, its worker and one client."""
    with (
        InferenceQueue.create(cfg) as s,
        QueueWorker.attach(s.descriptor) as w,
        QueueClient.attach(s.descriptor) as c,
    ):
        yield s, w, c


@pytest.fixture
def one_at_a_time() -> Iterator[InferenceQueue]:
    """A queue whose worker takes one request per batch, so the claim order is visible."""
    cfg = QueueConfig(lanes=8, slots_per_lane=4, max_batch_slots=1, min_batch_samples=1, coalesce_us=0)
    with InferenceQueue.create(cfg) as s:
        yield s


# -- 1. starvation of new lanes --------------------------------------------------------------------


def test_new_lane_is_claimed_while_a_known_lane_keeps_having_work(one_at_a_time: InferenceQueue) -> None:
    d = one_at_a_time.descriptor
    with QueueWorker.attach(d) as w, QueueClient.attach(d) as a, QueueClient.attach(d) as b:
        a.submit(_x(1.0))
        assert _serve(w) == [a.lane]  # lane a is now known to the worker
        a.submit(_x(2.0))
        tb = b.submit(_x(3.0))  # a lane the worker has not served before
        served = []
        for _ in range(4):
            a.submit(_x(4.0))  # lane a never runs dry
            served.append(_serve(w))
        assert [b.lane] in served[:2], f"lane {b.lane} not served among the first two batches: {served}"
        assert b.wait(tb, timeout_s=1.0)["twice"][0, 0] == 7.0


def test_a_lane_published_alongside_another_is_claimed_without_further_traffic(
    one_at_a_time: InferenceQueue,
) -> None:
    d = one_at_a_time.descriptor
    with QueueWorker.attach(d) as w, QueueClient.attach(d) as a, QueueClient.attach(d) as b:
        a.submit(_x(1.0))
        _serve(w)
        a.submit(_x(2.0))
        tb = b.submit(_x(3.0))
        first = _serve(w)
        second = _serve(w, timeout=0.5)  # nobody publishes anything more
        assert sorted(first + second) == sorted([a.lane, b.lane])
        b.wait(tb, timeout_s=1.0)


def test_eight_saturating_lanes_each_wait_at_most_one_round() -> None:
    """Fairness bound: with every lane full, a ready request is claimed within lanes x depth batches."""
    lanes, depth = 8, 2
    cfg = QueueConfig(
        lanes=lanes, slots_per_lane=depth, max_batch_slots=2, min_batch_samples=1, coalesce_us=0
    )
    with InferenceQueue.create(cfg) as s, QueueWorker.attach(s.descriptor) as w:
        clients = [QueueClient.attach(s.descriptor) for _ in range(lanes)]
        try:
            batch_no = 0
            submitted: dict[tuple[int, float], int] = {}
            waits: list[int] = []
            tickets: dict[int, list[Any]] = {c.lane: [] for c in clients}
            for i, c in enumerate(clients):
                for k in range(depth):
                    tag = float(i * 1000 + k)
                    tickets[c.lane].append((tag, c.submit(_x(tag))))
                    submitted[(c.lane, tag)] = batch_no
            seq = depth
            by_lane = {c.lane: c for c in clients}
            for batch_no in range(1, 200):
                b = w.claim(timeout_s=1.0)
                assert b is not None
                tags = [float(v) for v in b.inputs["x"][:, 0]]
                for lane, tag in zip(b.lanes, tags, strict=True):
                    waits.append(batch_no - submitted.pop((lane, tag)))
                b.complete(echo(b.inputs["x"]))
                for lane in b.lanes:  # each answered client refills at once: every lane stays full
                    c = by_lane[lane]
                    tag, t = tickets[lane].pop(0)
                    assert c.wait(t, timeout_s=1.0)["twice"][0, 0] == tag * 2 + 1
                    seq += 1
                    new_tag = float(lane * 1000 + seq)
                    tickets[lane].append((new_tag, c.submit(_x(new_tag))))
                    submitted[(lane, new_tag)] = batch_no
            assert max(waits) <= lanes * depth // cfg.max_batch_slots, f"max wait {max(waits)} batches"
        finally:
            for c in clients:
                c.close()


# -- 2. no pickle from shared memory; a poison request fails alone -------------------------------


def _request_region(s: InferenceQueue, lane: int, slot: int) -> int:
    geo = s._m.geo
    return geo.req_off(lane * geo.spl + slot)


class _Boom:
    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (Path.touch, (Path(self.path),))


def test_a_pickle_planted_in_a_request_header_is_not_executed(tmp_path: Path) -> None:
    marker = tmp_path / "pwned"
    cfg = QueueConfig(lanes=2, slots_per_lane=2)
    with (
        InferenceQueue.create(cfg) as s,
        QueueWorker.attach(s.descriptor) as w,
        QueueClient.attach(s.descriptor) as c,
    ):
        t = c.submit(_x(1.0))
        evil = pickle.dumps(_Boom(str(marker)))
        off = _request_region(s, c.lane, t.slot)
        struct.pack_into("<II", s._m.mem, off, len(evil), 0)
        s._m.mem[off + 8 : off + 8 + len(evil)] = evil
        assert _serve(w) == []  # the only request was bad: answered at claim, no batch
        with pytest.raises(BadRequest, match="corrupt payload header"):
            c.wait(t, timeout_s=1.0)
        assert not marker.exists(), "the worker ran code planted in shared memory"
        _round_trip(c, w, 5.0)


def test_a_poison_request_does_not_kill_restarted_workers() -> None:
    cfg = QueueConfig(lanes=2, slots_per_lane=2)
    with InferenceQueue.create(cfg) as s, QueueClient.attach(s.descriptor) as c:
        t = c.submit(_x(1.0))
        off = _request_region(s, c.lane, t.slot)
        s._m.mem[off + 8 : off + 24] = b"\xff" * 16  # garbage where the header is
        t2 = c.submit(_x(2.0))
        for _ in range(2):  # the second worker must not meet the poison again
            with QueueWorker.attach(s.descriptor) as w:
                _serve(w, timeout=0.2)
        with pytest.raises(BadRequest):
            c.wait(t, timeout_s=1.0)
        assert c.wait(t2, timeout_s=1.0)["twice"][0, 0] == 5.0


def _valid_header() -> bytes:
    layout = payload.validated_layout({"obs": np.zeros((4, 3), np.float32), "mask": np.zeros((4,), np.bool_)})
    return bytes(layout.prefix_header.tobytes()[8:])


def _mutations() -> list[tuple[str, bytes, bool]]:
    h = _valid_header()
    ext = payload.encode_header("lowtail.nd.1.2.0123456789abc", (("x", "<f4", (1, 2)),))
    return [
        ("short", h[:3], False),
        ("version", b"\x02" + h[1:], False),
        ("reserved byte", h[:3] + b"\x01" + h[4:], False),
        ("zero arrays", h[:1] + b"\x00" + h[2:], False),
        ("more arrays than present", h[:1] + b"\x05" + h[2:], False),
        ("dtype code 0", h[:4] + b"\x00" + h[5:], False),
        ("dtype code past the allow-list", h[:4] + b"\x63" + h[5:], False),
        ("rank 0", h[:5] + b"\x00" + h[6:], False),
        ("rank 9", h[:5] + b"\x09" + h[6:], False),
        ("negative dim", h[:8] + struct.pack("<q", -4) + h[16:], False),
        ("huge dim", h[:8] + struct.pack("<q", 1 << 50) + h[16:], False),
        ("trailing bytes", h + b"\x00", False),
        ("name not UTF-8", h[:24] + b"\xff" + h[25:], False),
        ("slot name without the flag", ext, False),
        (
            "control segment as slot name",
            payload.encode_header("lowtail.q.1.2.abc", (("x", "<f4", (1,)),)),
            True,
        ),
        (
            "slot name that is no segment name",
            payload.encode_header("../../etc/passwd", (("x", "<f4", (1,)),)),
            True,
        ),
        ("flag without a slot name", h, True),
    ]


@pytest.mark.parametrize(("what", "raw", "external"), _mutations(), ids=[m[0] for m in _mutations()])
def test_each_corrupt_header_field_is_a_bad_request_naming_it(what: str, raw: bytes, external: bool) -> None:
    with pytest.raises(BadRequest, match="corrupt payload header"):
        payload.decode_header(raw, external)


def test_binary_header_round_trips_every_allowed_dtype() -> None:
    spec = tuple((f"a{i}", d, (2, i + 1)) for i, d in enumerate(payload.DTYPES))
    assert payload.decode_header(payload.encode_header(None, spec), False) == (None, spec)
    assert (
        payload.decode_header(payload.encode_header("lowtail.nd.1.2.0123456789ab", spec), True)[0]
        == "lowtail.nd.1.2.0123456789ab"
    )


@pytest.mark.parametrize("dtype", [">f4", "<f16", "U3", "O", "M8[s]"])
def test_a_dtype_outside_the_allow_list_is_refused_by_the_client(dtype: str) -> None:
    with pytest.raises(BadRequest, match="expected one of bool, int8"):
        payload.describe({"x": np.zeros((1, 2), np.dtype(dtype))})


# -- 3. abandoned tickets return their slots -----------------------------------------------------


def test_tickets_dropped_after_a_timeout_return_their_slots_once_answered() -> None:
    cfg = QueueConfig(lanes=1, slots_per_lane=2)
    with (
        InferenceQueue.create(cfg) as s,
        QueueWorker.attach(s.descriptor) as w,
        QueueClient.attach(s.descriptor) as c,
    ):
        for tag in (1.0, 2.0):
            t = c.submit(_x(tag))
            with pytest.raises(QueueTimeout):
                c.wait(t, timeout_s=0.01)
            del t  # what the Ray client does on any error
        with pytest.raises(LaneBusy):  # not answered yet: the worker may still write those slots
            c.submit(_x(3.0))
        while _serve(w, timeout=0.2):
            pass
        for tag in range(16):  # both slots are back, for good
            _round_trip(c, w, float(tag))


def test_abandoned_ticket_slot_is_reused_after_the_answer_and_the_late_answer_is_not_returned() -> None:
    cfg = QueueConfig(lanes=1, slots_per_lane=1)
    with (
        InferenceQueue.create(cfg) as s,
        QueueWorker.attach(s.descriptor) as w,
        QueueClient.attach(s.descriptor) as c,
    ):
        t = c.submit(_x(1.0))
        c.abandon(t)
        with pytest.raises(LaneBusy):
            c.submit(_x(2.0))
        _serve(w)
        _round_trip(c, w, 2.0)


def test_a_predecessor_killed_before_its_doorbell_loses_no_slot() -> None:
    cfg = QueueConfig(lanes=1, slots_per_lane=1)
    with InferenceQueue.create(cfg) as s, QueueWorker.attach(s.descriptor) as w:
        dead = QueueClient.attach(s.descriptor)
        si = s._m.geo.slot(0, S_REQ_SEQ)
        s._m.q[si] += 1  # its slot stores, then death before the ring and doorbell stores
        dead.close()
        with QueueClient.attach(s.descriptor) as c:
            _round_trip(c, w, 3.0)  # the only slot: must not be quarantined forever


def test_a_worker_killed_between_claim_and_tail_does_not_answer_twice() -> None:
    cfg = QueueConfig(lanes=1, slots_per_lane=2)
    with InferenceQueue.create(cfg) as s, QueueClient.attach(s.descriptor) as c:
        t = c.submit(_x(1.0))
        q, geo = s._m.q, s._m.geo
        q[geo.slot(t.slot, S_CLAIM_SEQ)] = t.seq  # the dead worker's claim; its tail store never happened
        q[HW_WORKER_PID] = 2**22 + 12345  # a pid that is not running (no lock held)
        with QueueWorker.attach(s.descriptor) as w:
            assert w.restarted_failed == 1
            with pytest.raises(WorkerDied):
                c.wait(t, timeout_s=1.0)
            assert _serve(w, timeout=0.2) == [], "the orphan was answered WorkerDied and then run again"
            _round_trip(c, w, 2.0)


# -- 4. corrupt control words: fence the lane, serve the others, stay stoppable ------------------


@pytest.mark.parametrize("word", ["doorbell", "ring"])
def test_a_corrupt_control_word_fences_its_lane_and_the_others_go_on(word: str) -> None:
    cfg = QueueConfig(lanes=2, slots_per_lane=4, coalesce_us=0)
    with (
        InferenceQueue.create(cfg) as s,
        QueueWorker.attach(s.descriptor) as w,
        QueueClient.attach(s.descriptor) as a,
        QueueClient.attach(s.descriptor) as b,
    ):
        q, geo = s._m.q, s._m.geo
        tb = b.submit(_x(1.0))
        if word == "doorbell":
            q[HW_DOORBELLS + b.lane] = 2**63 + 7
        else:
            q[geo.lane(b.lane, L_RING)] = 2**40
        ta = a.submit(_x(2.0))
        start = time.monotonic()
        lanes: list[int] = []
        while time.monotonic() - start < 1.0:
            lanes += _serve(w, timeout=0.05)
        assert lanes == [a.lane], f"phantom or missing batches: {len(lanes)} batches, first {lanes[:10]}"
        assert w.fenced >= 1
        assert a.wait(ta, timeout_s=1.0)["twice"][0, 0] == 5.0
        with pytest.raises(BadRequest, match=f"lane {b.lane} fenced"):
            b.wait(tb, timeout_s=1.0)


@pytest.mark.parametrize("garbage", [2**63 + 7, 3], ids=["ahead", "behind"])
def test_a_lane_fenced_by_a_garbage_doorbell_fails_one_more_honest_request_then_serves(garbage: int) -> None:
    """The fence resynchronises the tail to the garbage, so the client's next doorbell is fenced once more."""
    with _served(QueueConfig(lanes=1, slots_per_lane=4, coalesce_us=0)) as (s, w, c):
        for tag in range(10):  # the client's own doorbell count is 10, far from 3
            _round_trip(c, w, float(tag))
        s._m.q[HW_DOORBELLS + c.lane] = garbage
        assert _serve(w, timeout=0.05) == []
        assert w.fenced == 1
        t = c.submit(_x(1.0))
        assert _serve(w, timeout=0.05) == []
        assert w.fenced == 2
        with pytest.raises(BadRequest, match=f"lane {c.lane} fenced: doorbell 11 with tail {garbage}"):
            c.wait(t, timeout_s=1.0)
        _round_trip(c, w, 2.0)  # the tail is back in step with the client's doorbell
        assert w.fenced == 2


# -- timeouts ---------------------------------------------------------------------------------


def test_infinite_timeouts_wait_instead_of_overflowing() -> None:
    cfg = QueueConfig(lanes=1, slots_per_lane=2, client_spin_us=0)
    with (
        InferenceQueue.create(cfg) as s,
        QueueWorker.attach(s.descriptor) as w,
        QueueClient.attach(s.descriptor) as c,
    ):
        t = c.submit(_x(1.0))
        b = w.claim(timeout_s=math.inf)
        assert b is not None
        timer = threading.Timer(0.1, lambda: b.complete(echo(b.inputs["x"])))
        timer.start()
        try:
            assert c.wait(t, timeout_s=math.inf)["twice"][0, 0] == 3.0
        finally:
            timer.join()
        with pytest.raises(Exception, match="timeout_s=nan"):
            c.wait(c.submit(_x(1.0)), timeout_s=math.nan)


# -- the descriptor crosses processes as validated bytes, never as a pickle ----------------------


def test_descriptor_round_trips_through_bytes() -> None:
    with InferenceQueue.create(QueueConfig(lanes=3, numa_node=None)) as s:
        assert QueueDescriptor.from_bytes(s.descriptor.to_bytes()) == s.descriptor


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda d: d.update(version=2), "version 2"),
        (lambda d: d.update(name="lowtail.nd.1.2.0123456789ab"), "lowtail.q.* segment name"),
        (lambda d: d.update(name="../../etc/shadow"), "lowtail.q.* segment name"),
        (lambda d: d["config"].update(lanes="16"), "lanes='16': wrong type"),
        (lambda d: d["config"].update(lanes=100000), "QueueConfig.lanes=100000"),
        (lambda d: d["config"].update(slots_per_lane=3), "slots_per_lane=3: expected a power of two"),
        (lambda d: d["config"].update(evil=1), "config keys"),
        (lambda d: d.pop("boot_id"), "keys"),
    ],
)
def test_a_tampered_descriptor_is_refused_naming_the_field(mutate: Any, expected: str) -> None:
    with InferenceQueue.create(QueueConfig(lanes=2)) as s:
        doc = json.loads(s.descriptor.to_bytes())
        mutate(doc)
        with pytest.raises(BadConfig, match=re.escape(expected)):
            QueueDescriptor.from_bytes(json.dumps(doc).encode())
    with pytest.raises(BadConfig, match="not JSON"):
        QueueDescriptor.from_bytes(pickle.dumps(s.descriptor))


# -- 5. memory returned: a lane's ndarray segments are unmapped when it changes hands ----------------


def test_worker_unmaps_a_departed_clients_ndarray_slots() -> None:
    cfg = QueueConfig(lanes=1, slots_per_lane=2, request_bytes=4096, response_bytes=4096)
    big = {"x": np.ones((64, 8192), np.float32)}  # 2 MiB: through an ndarray segment
    with InferenceQueue.create(cfg) as s, QueueWorker.attach(s.descriptor) as w:
        for _ in range(5):  # five restarted clients of the same lane
            with QueueClient.attach(s.descriptor) as c:
                t = c.submit(big)
                b = w.claim(timeout_s=1.0)
                assert b is not None
                b.complete({"y": np.zeros((64, 1), np.float32)})
                c.wait(t, timeout_s=1.0)
            assert len(w._slots_in) <= 1, "the worker keeps departed clients' slots open"


def test_attached_slots_are_bounded_by_bytes(tmp_path: Path) -> None:
    pool = payload.NdarraySegmentPool(str(tmp_path))
    slots = [pool.acquire(1 << 20) for _ in range(4)]
    try:
        attached = payload.AttachedNdarraySegments(limit_bytes=(2 << 20) + 1)
        for sl in slots:
            attached.get(sl.name, str(tmp_path))
        assert len(attached) == 2 and attached.mapped_bytes <= (2 << 20) + 1
        attached.close()
        assert attached.mapped_bytes == 0
    finally:
        pool.close()


# -- 6. other users: never sweep, never attach what another uid owns -----------------------------


def _dead_name(kind: str) -> str:
    p = subprocess.Popen(["true"])
    p.wait()  # a pid in range whose process is gone (a pid above PID_MAX is not a lowtail name)
    return f"lowtail.{kind}.{segments.pid_namespace()}.{p.pid}.deadbeef0000"


def _plant(path: Path, mode: int = 0o600) -> None:
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, mode)
    os.ftruncate(fd, 1 << 20)
    os.close(fd)


def test_a_dead_segment_of_another_user_is_neither_swept_nor_an_error(shared_dir: Path) -> None:
    dead = _dead_name("q")

    def plant_own_dead() -> None:
        with segments.private_dir_fd(str(shared_dir), create=True):
            _plant(segments.private_dir(str(shared_dir)) / dead)

    assert as_nobody(plant_own_dead) == 0
    theirs = segments.private_dir(str(shared_dir), NOBODY) / dead
    with InferenceQueue.create(QueueConfig(lanes=1, shm_dir=str(shared_dir))):
        pass
    assert theirs.exists(), "root's sweep removed another user's file"
    # and the other way round: their create must not fail on our dead segment
    ours = segments.private_dir(str(shared_dir)) / _dead_name("nd")
    _plant(ours)

    def create_as_nobody() -> None:
        with InferenceQueue.create(QueueConfig(lanes=1, shm_dir=str(shared_dir))):
            pass

    assert as_nobody(create_as_nobody) == 0
    assert ours.exists(), "the second user's sweep removed root's file"
    assert not theirs.exists(), "a user's own dead segment is swept by that user"
    ours.unlink()


def test_attach_refuses_a_segment_planted_by_another_user(shared_dir: Path) -> None:
    with InferenceQueue.create(QueueConfig(lanes=1, shm_dir=str(shared_dir))) as s:
        name = segments.segment_name("q")
        top = shared_dir / name  # where any user can create a name: never looked at
        assert as_nobody(lambda: _plant(top)) == 0
        fake = QueueDescriptor(name, s.descriptor.config, s.descriptor.hostname, s.descriptor.boot_id)
        with pytest.raises(SegmentNotFound, match="does not exist"):
            QueueClient.attach(fake)
        # in our directory only root could have put another uid's file; it is refused all the same
        inside = segments.private_dir(str(shared_dir)) / name
        top.rename(inside)
        with pytest.raises(SegmentNotFound, match=f"owned by uid {NOBODY}"):
            QueueClient.attach(fake)
        with pytest.raises(SegmentNotFound, match=f"owned by uid {NOBODY}"):
            QueueWorker.attach(fake)
        inside.unlink()


def test_attach_refuses_a_segment_with_group_or_other_bits(shared_dir: Path) -> None:
    with InferenceQueue.create(QueueConfig(lanes=1, shm_dir=str(shared_dir))) as s:
        s._m.seg.path.chmod(0o666)
        with pytest.raises(SegmentNotFound, match="mode 0o666 has bits 0o66"):
            QueueClient.attach(s.descriptor)


def test_a_closed_worker_frees_its_lock_even_while_a_batch_view_is_held() -> None:
    cfg = QueueConfig(lanes=1, slots_per_lane=2)
    with InferenceQueue.create(cfg) as s, QueueClient.attach(s.descriptor) as c:
        w = QueueWorker.attach(s.descriptor)
        c.submit(_x(1.0))
        b = w.claim(timeout_s=1.0)
        assert b is not None
        kept = b.inputs["x"]  # a zero-copy view of the segment, alive past close()
        w.close()
        with QueueWorker.attach(s.descriptor) as w2:  # a restart must not find the lock held
            assert w2.restarted_failed == 0
        del kept, b
