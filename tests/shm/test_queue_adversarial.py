"""The queue under attack with real processes: many staggered clients, kills at each
store of the publication protocol, garbage written by a third process, a real OpenVINO worker fed
a poison request. Every test checks the invariants: no hang, no lost slot, no double or crossed
answer, the other lanes go on."""

from __future__ import annotations

import contextlib
import dis
import os
import signal
import struct
import time
from collections.abc import Iterator
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lowtail.shm import payload
from lowtail.shm.errors import BadRequest, LaneBusy, WorkerDied
from lowtail.shm.queue import S_CLAIM_SEQ, InferenceQueue, QueueClient, QueueConfig, QueueWorker
from tests.shm import helpers

# Every test here runs on both hot paths: the Python reference and the native core.
pytestmark = pytest.mark.usefixtures("queue_impl")

REQ = 16384
# The largest uint8 payload that fits a request slot inline, from the format itself: one byte more
# goes through an ndarray segment.
INLINE_MAX = REQ - payload.align(8 + len(payload.encode_header(None, (("x", "|u1", (1, 1)),))))


def _stop(p: Any) -> None:
    if p.is_alive():
        p.terminate()
        p.join(10)
    if p.is_alive():
        p.kill()
        p.join(5)


@pytest.fixture
def identity(ctx: BaseContext) -> Iterator[tuple[InferenceQueue, Any]]:
    cfg = QueueConfig(lanes=12, slots_per_lane=4, request_bytes=REQ, response_bytes=REQ)
    with InferenceQueue.create(cfg) as s:
        w = ctx.Process(target=helpers.identity_worker, args=(s.descriptor,))  # type: ignore[attr-defined]
        w.start()
        deadline = time.monotonic() + 60
        while not s.snapshot().worker_alive:
            assert time.monotonic() < deadline and w.is_alive(), "worker never attached"
            time.sleep(0.01)
        try:
            yield s, w
        finally:
            _stop(w)


def test_inline_max_is_the_edge_of_the_request_slot() -> None:
    layout = payload.validated_layout({"x": np.zeros((1, INLINE_MAX), np.uint8)})
    assert layout.inline_end == REQ
    assert payload.validated_layout({"x": np.zeros((1, INLINE_MAX + 1), np.uint8)}).inline_end > REQ


def test_hammer_eight_staggered_clients_every_answer_is_its_own(
    ctx: BaseContext, identity: tuple[InferenceQueue, Any]
) -> None:
    s, worker = identity
    rng = np.random.default_rng(11)
    n, clients = 120, 8
    out = ctx.Queue()  # type: ignore[attr-defined]
    procs = []
    for cid in range(clients):
        sizes = [int(v) for v in rng.integers(8, 3 * REQ, n - 2)] + [INLINE_MAX, INLINE_MAX + 1]
        rng.shuffle(sizes)
        procs.append(
            ctx.Process(target=helpers.hammer_client, args=(s.descriptor, cid, 0.15 * cid, sizes, out))  # type: ignore[attr-defined]
        )
    for p in procs:
        p.start()
    try:
        rows = sorted(out.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            _stop(p)
    print("\nclient answered errored mismatched never")
    for row in rows:
        print("  ".join(str(v) for v in row))
    assert worker.is_alive()
    for cid, answered, errored, mismatched, never in rows:
        assert (answered, errored, mismatched, never) == (n, 0, 0, 0), f"client {cid}: {rows}"
    assert s.snapshot().counts["PROCESSING"] == 0


def test_a_client_killed_at_each_line_of_submit_loses_no_slot(ctx: BaseContext) -> None:
    cfg = QueueConfig(lanes=1, slots_per_lane=2, request_bytes=4096, response_bytes=4096)
    lines = _lines(QueueClient.submit)  # a kill point before each store of the protocol
    assert len(lines) > 20
    with InferenceQueue.create(cfg) as s, QueueWorker.attach(s.descriptor) as w:
        for line in lines:
            ready = ctx.Queue()  # type: ignore[attr-defined]
            p = ctx.Process(target=helpers.die_at_line, args=(s.descriptor, "submit", line, ready))  # type: ignore[attr-defined]
            p.start()
            ready.get(timeout=60)
            p.join(5)
            _stop(p)
            # The lane is free again (the kernel dropped the dead client's lock). Whatever the dead
            # client left: its request runs at most once, a new client gets both slots back (one
            # maybe after that answer) and a correct answer for each.
            stale = 0
            with QueueClient.attach(s.descriptor) as c:
                xs = [helpers.tagged(7, line * 10 + k, 64, np.random.default_rng(k)) for k in range(2)]
                ts: list[Any] = []
                deadline = time.monotonic() + 10
                while len(ts) < 2 or not all(c.ready(t) for t in ts):
                    assert time.monotonic() < deadline, f"killed at line {line}: no answer or a lost slot"
                    if len(ts) < 2:
                        with contextlib.suppress(LaneBusy):  # until the dead client's request is answered
                            ts.append(c.submit({"x": xs[len(ts)]}))
                    b = w.claim(timeout_s=0.02)
                    if b is not None:
                        stale += sum(bytes(row[:4]) != struct.pack("<I", 7) for row in b.inputs["x"])
                        b.complete({"y": b.inputs["x"]})
                for x, t in zip(xs, ts, strict=True):
                    assert bytes(c.wait(t, timeout_s=1.0)["y"]) == bytes(x), f"killed at line {line}"
                assert w.claim(timeout_s=0.05) is None, f"killed at line {line}: a request came back"
            assert stale <= 1, f"killed at line {line}: the dead client's request ran {stale} times"


def _lines(func: Any) -> list[int]:
    code = func.__code__
    lines = {i.positions.lineno for i in dis.get_instructions(code) if i.positions and i.positions.lineno}
    return sorted(lines - {code.co_firstlineno})


@pytest.mark.parametrize("func", ["_take", "_answer"])
def test_a_worker_killed_at_each_line_of_claim_or_answer_answers_at_most_once(
    ctx: BaseContext, func: str
) -> None:
    cfg = QueueConfig(lanes=1, slots_per_lane=2, request_bytes=4096, response_bytes=4096)
    with InferenceQueue.create(cfg) as s, QueueClient.attach(s.descriptor) as c:
        for line in _lines(getattr(QueueWorker, func)):
            x = helpers.tagged(9, line, 64, np.random.default_rng(line))
            t = c.submit({"x": x})
            p = ctx.Process(target=helpers.worker_dies_at_line, args=(s.descriptor, func, line))  # type: ignore[attr-defined]
            p.start()
            p.join(10)  # dead at the line, or (a line not reached) it answered and we stop it
            _stop(p)
            claimed_by_dead = s._m.q[s._m.geo.slot(t.slot, S_CLAIM_SEQ)] == t.seq
            with QueueWorker.attach(s.descriptor) as w2:
                runs = 0
                while (b := w2.claim(timeout_s=0.05)) is not None:
                    runs += len(b)
                    b.complete({"y": b.inputs["x"]})
                if claimed_by_dead:
                    assert runs == 0, f"{func} line {line}: a claimed request ran again"
                else:
                    assert runs == 1, f"{func} line {line}: an unclaimed request was not served"
                try:
                    assert bytes(c.wait(t, timeout_s=5.0)["y"]) == bytes(x), f"{func} line {line}"
                except WorkerDied:
                    assert claimed_by_dead, f"{func} line {line}: WorkerDied for a request never claimed"
                for k in range(2):  # both slots are usable: nothing was lost
                    xk = helpers.tagged(9, 1000 + k, 64, np.random.default_rng(k))
                    tk = c.submit({"x": xk})
                    b = w2.claim(timeout_s=1.0)
                    assert b is not None
                    b.complete({"y": b.inputs["x"]})
                    assert bytes(c.wait(tk, timeout_s=5.0)["y"]) == bytes(xk)


@pytest.mark.parametrize("field", ["header", "doorbell", "ring", "slot", "payload"])
def test_garbage_from_a_third_process_fences_one_lane_and_the_others_go_on(
    ctx: BaseContext, identity: tuple[InferenceQueue, Any], field: str
) -> None:
    s, worker = identity
    with QueueClient.attach(s.descriptor) as victim, QueueClient.attach(s.descriptor) as good:
        for k in range(3):  # the victim lane has requests in flight when the garbage starts
            victim.submit({"x": helpers.tagged(1, k, 100, np.random.default_rng(k))})
        fuzz = ctx.Process(target=helpers.fuzz_lane, args=(s.descriptor, field, victim.lane, 2.0, 5))  # type: ignore[attr-defined]
        fuzz.start()
        rng = np.random.default_rng(3)
        answered = 0
        try:
            # At least 2 s, and for as long as the fuzzer writes (it may start late on a loaded host).
            start = time.monotonic()
            while time.monotonic() - start < 2.0 or (fuzz.is_alive() and time.monotonic() - start < 60):
                x = helpers.tagged(2, answered, int(rng.integers(8, 2 * REQ)), rng)
                assert bytes(good.infer({"x": x}, timeout_s=10.0)["y"]) == bytes(x)
                answered += 1
        finally:
            fuzz.join(30)
            _stop(fuzz)
        assert answered > 10 and worker.is_alive()
        assert fuzz.exitcode == 0
    worker.terminate()  # stays stoppable after the garbage
    worker.join(10)
    assert worker.exitcode == 0


def test_a_real_openvino_worker_answers_a_poison_request_with_an_error_and_serves_the_next(
    small_model: Path,
) -> None:
    from lowtail.serve.model import example_inputs
    from lowtail.serve.worker_process import WorkerConfig, WorkerProcess

    cfg = QueueConfig(
        lanes=2, slots_per_lane=2, request_bytes=16384, response_bytes=16384, min_batch_samples=1
    )
    with InferenceQueue.create(cfg) as s:
        w = WorkerProcess.start(
            s.descriptor, max(os.sched_getaffinity(0)), small_model, WorkerConfig(name="p")
        )
        try:
            w.wait_ready(120)
            with QueueClient.attach(s.descriptor) as c:
                assert c.infer(example_inputs(64, 2), timeout_s=30)["value"].shape == (2, 1)
                # Freeze the worker, plant a poison header in a published request, let it go.
                os.kill(w.pid, signal.SIGSTOP)
                try:
                    t = c.submit(example_inputs(64, 2))
                    off = s._m.geo.req_off(c.lane * s._m.geo.spl + t.slot)
                    struct.pack_into("<II", s._m.mem, off, 12, 0)
                    s._m.mem[off + 8 : off + 20] = b"\x01\x01\x00\x00\x63\x09\x05\x00garb"
                finally:
                    os.kill(w.pid, signal.SIGCONT)
                with pytest.raises(BadRequest, match="corrupt payload header"):
                    c.wait(t, timeout_s=30)
                assert c.infer(example_inputs(64, 3), timeout_s=30)["value"].shape == (3, 1)
            assert w.alive()
        finally:
            assert w.stop() == 0
