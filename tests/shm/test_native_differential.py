"""The native core against the Python reference: every pairing of client and worker path runs the same
random streams, and the answers, errors, slot states and counters must be identical, and so must each
batch's composition: the lanes its requests came from, in the order the poll took them, and their sizes
(the round-robin's fairness and the batch limits, applied by the Python poll or the core's).

A stream mixes request sizes (inline and ndarray-segment payloads, contiguous or strided inputs), answers
copied out or held zero-copy, batch shapes (several requests merged
into one call, a batch cut by the sample limit), withdrawals before and after the claim, a client that
leaves with requests in flight (its successor's lane gen fences them), and a worker that stops holding
a claimed batch (the next worker answers what it had claimed). One process drives both sides step by
step, so the order of events is the same on every path; only the implementation differs.
"""

from __future__ import annotations

import random
import re
import struct
from contextlib import ExitStack
from typing import Any

import numpy as np
import pytest

from lowtail.shm import native
from lowtail.shm.client import HeldOutputs
from lowtail.shm.queue import InferenceQueue, QueueClient, QueueConfig, QueueWorker

pytestmark = pytest.mark.skipif(not native.available(), reason=native.implementation().reason)

PATHS = [(c, w) for c in (False, True) for w in (False, True)]
SEEDS = range(6)
# 4 lanes of 4 slots, batches cut at 4 requests or 12 samples: small enough that the streams fill them
CONFIG = QueueConfig(
    lanes=4, slots_per_lane=4, request_bytes=4096, response_bytes=4096, coalesce_us=0,
    max_batch_slots=4, max_batch_samples=12, min_batch_samples=1,
)  # fmt: skip


def _model(x: np.ndarray[Any, Any]) -> dict[str, np.ndarray[Any, Any]]:
    return {"y": x * 3.0 - 1.0, "n": x.sum(axis=1, keepdims=True).astype(np.float64)}


def _outcome(fn: Any) -> Any:
    try:
        out = fn()
    except Exception as e:  # the error's type and text are part of what must agree
        text = re.sub(r"lowtail\.q\.[\w.]+", "<queue>", str(e).split(" (pid")[0])  # a name per queue
        return ("error", type(e).__name__, re.sub(r"within [\d.]+ s", "within <t> s", text))  # a clock read
    if isinstance(out, dict):
        return ("ok", {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in sorted(out.items())})
    if isinstance(out, HeldOutputs):  # zero-copy: read, then the slot given back
        got = {k: (v.dtype.str, v.shape, v.tobytes()) for k, v in sorted(out.items())}
        out.release()
        return ("held", got)
    return ("value", out)


def _state(q: InferenceQueue) -> Any:
    snap = q.snapshot()
    return [(ln.lane, ln.gen, ln.states) for ln in snap.lanes], snap.counts


def _attach(desc: Any, use_native: bool, what: type) -> Any:
    with native.use(use_native):
        x = what.attach(desc, 0) if what is QueueClient else what.attach(desc)
    assert (x._m.native is not None) == use_native
    return x


def _submit_some(
    rnd: random.Random,
    clients: list[QueueClient],
    n: int,
    widths: list[int],
    *,
    tag: int,
    log: list[Any],
    strided: float = 0.0,
) -> list[tuple[QueueClient, Any]]:
    """``n`` requests from random clients, of random rows and widths (a ``strided`` share of them
    strided views), each logged; the tickets."""
    tickets: list[tuple[QueueClient, Any]] = []
    for _ in range(n):
        c = rnd.choice(clients)
        rows, width = rnd.choice([1, 2, 3, 5, 8]), rnd.choice(widths)
        x = np.full((rows, width), float(tag + len(tickets)), np.float32)
        if strided and rnd.random() < strided:  # a strided view: the core leaves its copy to Python
            x = np.repeat(x, 2, axis=1)[:, ::2]
        t = _outcome(lambda c=c, x=x: c.submit({"x": x}))
        if t[0] == "value":
            tickets.append((c, t[1]))
        log.append(("submit", t if t[0] == "error" else "ok"))
    return tickets


def run_stream(seed: int, client_native: bool, worker_native: bool) -> list[Any]:
    """Run stream ``seed`` with the given paths; returns the log of every outcome and state."""
    rnd = random.Random(seed)
    log: list[Any] = []
    with InferenceQueue.create(CONFIG) as q:
        desc = q.descriptor
        clients = [_attach(desc, client_native, QueueClient) for _ in range(3)]
        worker = _attach(desc, worker_native, QueueWorker)
        try:
            for step in range(40):
                op = rnd.random()
                # width 200 x 8 rows x 4 B: past the slot, an ndarray segment
                tickets = _submit_some(
                    rnd, clients, rnd.randint(1, 7), [4, 16, 200], tag=step * 10, log=log, strided=0.15
                )
                for c, t in tickets:
                    if rnd.random() < 0.2:
                        log.append(("withdraw", _outcome(lambda c=c, t=t: c.withdraw(t))))
                if op < 0.1 and tickets:
                    # the worker stops holding a claimed batch; the next one answers what it claimed
                    b = worker.claim(0.2)
                    log.append(("claimed", None if b is None else (b.lanes, b.sizes)))
                    worker.close()
                    worker = _attach(desc, worker_native, QueueWorker)
                elif op < 0.2 and tickets:
                    # a client leaves with requests in flight; a new one takes its lane
                    i = rnd.randrange(len(clients))
                    clients[i].close()
                    clients[i] = _attach(desc, client_native, QueueClient)
                    tickets = [(c, t) for c, t in tickets if c._closed is False]
                while True:
                    b = worker.claim(0.01)
                    if b is None:
                        break
                    with b:
                        log.append(("batch", b.lanes, b.sizes, worker.withdrawn))
                        for c, t in tickets:
                            if not t.consumed and rnd.random() < 0.1:  # too late: it runs
                                log.append(("late withdraw", _outcome(lambda c=c, t=t: c.withdraw(t))))
                        if rnd.random() < 0.1:
                            b.fail("model error")
                        else:
                            b.complete(_model(b.inputs["x"]))
                for c, t in tickets:
                    if not t.consumed:
                        copy = rnd.random() < 0.8  # else zero-copy (HeldOutputs)
                        log.append(("answer", _outcome(lambda c=c, t=t, cp=copy: c.wait(t, 1.0, copy=cp))))
                        log.append(("stamps", t.stamps is not None and t.timing is not None))
                log.append(("state", _state(q), [c.wait_counts for c in clients]))
        finally:
            for c in clients:
                c.close()
            worker.close()
    return log


@pytest.mark.parametrize("seed", SEEDS)
def test_every_pairing_gives_the_same_answers_and_states(seed: int) -> None:
    logs = {pair: run_stream(seed, *pair) for pair in PATHS}
    reference = logs[(False, False)]
    assert any(e[0] == "batch" for e in reference)  # the stream did serve something
    for pair, log in logs.items():
        assert len(log) == len(reference), pair
        for i, (got, want) in enumerate(zip(log, reference, strict=True)):
            assert got == want, f"client native={pair[0]} worker native={pair[1]}: event {i} differs"


def _answer_with_header(client_native: bool, edit: Any) -> Any:
    """A slot's second answer whose header another process changed after the worker wrote it (``edit``
    gets the response region's bytes), read by a client that cached the slot's first answer's layout."""
    cfg = QueueConfig(lanes=1, slots_per_lane=1, request_bytes=4096, response_bytes=4096)
    with InferenceQueue.create(cfg) as q:
        client = _attach(q.descriptor, client_native, QueueClient)
        worker = _attach(q.descriptor, False, QueueWorker)
        try:
            out = []
            for k in (2.0, 3.0):
                t = client.submit({"x": np.arange(32, dtype=np.float32).reshape(4, 8)})
                b = worker.claim(1.0)
                assert b is not None
                with b:
                    b.complete({"y": b.inputs["x"] * k})
                if k == 3.0:
                    off = client._resp_off[t.slot]
                    edit(client._m.buf[off : off + 4096])
                out.append(_outcome(lambda t=t: client.wait(t, 1.0)))
            return out
        finally:
            client.close()
            worker.close()


def _reshape(region: np.ndarray[Any, Any]) -> None:
    """The same bytes as an (8, 4) array: a header of the same length with other dims."""
    from lowtail.shm import payload

    head = payload.encode_header(None, (("y", "<f4", (8, 4)),))
    region[: 8 + len(head)] = np.frombuffer(struct.pack("<II", len(head), 0) + head, np.uint8)


def _bad_dtype(region: np.ndarray[Any, Any]) -> None:
    region[12] = 0xEE  # the first array's dtype code


@pytest.mark.parametrize("edit", [_reshape, _bad_dtype], ids=["other-dims", "bad-dtype"])
def test_a_header_changed_after_the_cached_one_is_parsed_again_on_both_client_paths(edit: Any) -> None:
    native_out = _answer_with_header(True, edit)
    python_out = _answer_with_header(False, edit)
    assert native_out == python_out
    assert native_out[0][0] == "ok" and native_out[1][0] == ("ok" if edit is _reshape else "error")
    if edit is _reshape:
        assert native_out[1][1]["y"][1] == (8, 4)


def run_garbage_stream(seed: int, worker_native: bool) -> list[Any]:
    """Honest clients, and garbage written into the lanes' doorbells and ring entries between their
    requests (as a hostile process sharing the segment would): the worker's poll must fence, claim and
    batch the same way on both paths. Returns the log of batches, answers, fences and states."""
    from lowtail.shm.layout import HW_DOORBELLS, L_RING

    rnd = random.Random(seed)
    log: list[Any] = []
    with InferenceQueue.create(CONFIG) as q, ExitStack() as stack:  # closed in reverse: worker, then clients
        words, geo = q._m.q, q._m.geo
        clients = [stack.enter_context(_attach(q.descriptor, False, QueueClient)) for _ in range(3)]
        worker = stack.enter_context(_attach(q.descriptor, worker_native, QueueWorker))
        for step in range(30):
            tickets = _submit_some(rnd, clients, rnd.randint(1, 6), [4], tag=step * 10, log=log)
            if rnd.random() < 0.4:
                lane = rnd.choice(clients).lane
                if rnd.random() < 0.5:
                    head = int(words[HW_DOORBELLS + lane])
                    words[HW_DOORBELLS + lane] = rnd.choice(
                        [0, head + geo.spl + 1, 2**63 + 7, max(head - 1, 0)]
                    )
                else:
                    at = geo.lane(lane, L_RING) + rnd.randrange(geo.spl)
                    words[at] = rnd.choice([geo.spl, 99, 2**40])
            while (b := worker.claim(0.005)) is not None:
                with b:
                    log.append(("batch", b.lanes, b.sizes))
                    b.complete(_model(b.inputs["x"]))
            for c, t in tickets:
                if not t.consumed:
                    log.append(("answer", _outcome(lambda c=c, t=t: c.wait(t, 0.05))))
            log.append(("state", _state(q), worker.fenced))
    return log


@pytest.mark.parametrize("seed", SEEDS)
def test_garbage_control_words_are_fenced_and_batched_the_same_on_both_paths(seed: int) -> None:
    reference, got = run_garbage_stream(seed, False), run_garbage_stream(seed, True)
    assert any(e[0] == "batch" for e in reference) and reference[-1][2] > 0  # it served and it fenced
    assert len(got) == len(reference)
    for i, (g, want) in enumerate(zip(got, reference, strict=True)):
        assert g == want, f"event {i} differs"
