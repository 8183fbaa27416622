"""Process bodies for the queue tests (top-level functions so that forkserver/spawn children import them)."""

from __future__ import annotations

import contextlib
import os
import signal
import struct
import sys
import time
from collections.abc import Iterator
from typing import Any

import numpy as np

from lowtail.shm import native
from lowtail.shm.queue import InferenceQueue, QueueClient, QueueConfig, QueueDescriptor, QueueWorker


def with_path(use_native: bool, target: Any, *args: Any) -> None:
    """Run ``target(*args)`` with the hot path the parent test chose (``lowtail.shm.native.use``)."""
    from lowtail.shm import native

    with native.use(use_native):
        target(*args)


@contextlib.contextmanager
def native_pair(
    slots_per_lane: int = 2, idle_us: int | None = None
) -> Iterator[tuple[QueueClient, QueueWorker]]:
    """A client and a worker on the native path of a two-lane queue that holds no batch for coalescing."""
    cfg = QueueConfig(lanes=2, slots_per_lane=slots_per_lane, coalesce_us=0)
    with (
        native.use(True),
        InferenceQueue.create(cfg) as q,
        QueueClient.attach(q.descriptor) as c,
        QueueWorker.attach(q.descriptor, idle_us=idle_us) as w,
    ):
        yield c, w


def echo(x: np.ndarray[Any, Any]) -> dict[str, np.ndarray[Any, Any]]:
    """The worker's model in tests: outputs that depend on every input row, with a different width."""
    return {
        "twice": x * 2.0 + 1.0,
        "rowsum": x.sum(axis=1, keepdims=True).astype(np.float64),
    }


def filled(tag: float, rows: int = 2) -> dict[str, np.ndarray[Any, Any]]:
    """A request ``x`` of ``rows`` x 4 float32, every value ``tag``: its answer says whose it is."""
    return {"x": np.full((rows, 4), tag, np.float32)}


def batches_until_term(w: Any, run_s: float) -> Iterator[Any]:
    """The batches worker ``w`` claims until SIGTERM or ``run_s`` seconds."""
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    end = time.monotonic() + run_s
    while not stop and time.monotonic() < end:
        b = w.claim(timeout_s=0.05)
        if b is not None:
            yield b


def echo_server(
    desc: QueueDescriptor, cpu: int | None = None, run_s: float = 60.0, delay_s: float = 0.0
) -> None:
    """Serve ``echo`` until SIGTERM or ``run_s``; a ``delay_s`` inference keeps requests PROCESSING."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    w = QueueWorker.attach(desc)
    try:
        for b in batches_until_term(w, run_s):
            with b:
                if delay_s:
                    time.sleep(delay_s)
                b.complete(echo(b.inputs["x"]))
    finally:
        w.close()


def checking_client(desc: QueueDescriptor, seed: int, n: int, out: Any) -> None:
    """Send ``n`` requests of random batch sizes and values; check each answer against its own request."""
    rng = np.random.default_rng(seed)
    bad = 0
    with QueueClient.attach(desc) as c:
        pending = []
        for i in range(n):
            b = int(rng.integers(1, 17))
            x = rng.standard_normal((b, 8)).astype(np.float32)
            x[:, 0] = seed * 100000 + i  # tags the request: a crossed answer cannot pass
            if i % 3 == 0:
                pending.append((x, c.start({"x": x})))  # keep up to a few in flight
                if len(pending) < 3:
                    continue
                xs, p = pending.pop(0)
                got = p.finish(timeout_s=10)
            else:
                xs, got = x, c.infer({"x": x}, timeout_s=10)
            bad += not _matches(xs, got)
        for xs, p in pending:
            bad += not _matches(xs, p.finish(timeout_s=10))
    out.put((seed, n, bad))


def _matches(x: np.ndarray[Any, Any], got: dict[str, np.ndarray[Any, Any]]) -> bool:
    want = echo(x)
    return set(got) == set(want) and all(
        got[k].shape == want[k].shape and got[k].dtype == want[k].dtype and np.allclose(got[k], want[k])
        for k in want
    )


def submit_and_hang(desc: QueueDescriptor, ready: Any) -> None:
    """Register, submit one request, tell the parent, then wait forever (the parent kills us)."""
    c = QueueClient.attach(desc)
    c.submit({"x": np.ones((2, 8), np.float32)})
    ready.put(c.lane)
    time.sleep(60)


def wait_for_answer(desc: QueueDescriptor, timeout: float, out: Any) -> None:
    """Submit one request and report what waiting for it raised (or 'ok'), how long it took, and when
    it ended (CLOCK_MONOTONIC, one clock for every process here)."""
    with QueueClient.attach(desc) as c:
        t = c.submit({"x": np.ones((1, 8), np.float32)})
        out.put(("submitted", c.lane))
        start = time.monotonic()
        try:
            c.wait(t, timeout_s=timeout)
            result = "ok"
        except Exception as e:
            result = f"{type(e).__name__}: {e}"
        end = time.monotonic()
        out.put((result, end - start, end))


def attach_and_exit(desc: QueueDescriptor) -> None:
    """Attach as a client, do one request's worth of nothing, and exit normally."""
    c = QueueClient.attach(desc)
    c.close()


def identity_worker(desc: QueueDescriptor, run_s: float = 120.0) -> None:
    """Answer every request with its own bytes (``y`` = ``x``) until SIGTERM or ``run_s``."""
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    end = time.monotonic() + run_s
    with QueueWorker.attach(desc) as w:
        while not stop and time.monotonic() < end:
            b = w.claim(timeout_s=0.05)
            if b is not None:
                with b:
                    b.complete({"y": b.inputs["x"]})


def tagged(cid: int, seq: int, n: int, rng: np.random.Generator) -> np.ndarray[Any, Any]:
    """A 1 x n uint8 request whose first 8 bytes are the client id and sequence number."""
    x = rng.integers(0, 256, (1, max(n, 8)), np.uint8)
    x[0, :8] = np.frombuffer(struct.pack("<II", cid, seq), np.uint8)
    return x


def hammer_client(desc: QueueDescriptor, cid: int, start_s: float, sizes: list[int], out: Any) -> None:
    """Attach after ``start_s``, send one request per size (up to 3 in flight), check each answer
    byte for byte against its own request; report (cid, answered, errored, mismatched, never)."""
    time.sleep(start_s)
    rng = np.random.default_rng(cid)
    answered = errored = mismatched = 0
    with QueueClient.attach(desc) as c:
        inflight: list[tuple[np.ndarray[Any, Any], Any]] = []

        def settle(x: np.ndarray[Any, Any], t: Any) -> None:
            nonlocal answered, errored, mismatched
            try:
                got = c.wait(t, timeout_s=30.0)["y"]
            except Exception:
                errored += 1
                return
            answered += 1
            mismatched += not (got.dtype == x.dtype and got.shape == x.shape and bytes(got) == bytes(x))

        for seq, n in enumerate(sizes):
            x = tagged(cid, seq, n, rng)
            inflight.append((x, c.submit({"x": x})))
            if len(inflight) >= 3:
                settle(*inflight.pop(0))
        for x, t in inflight:
            settle(x, t)
    out.put((cid, answered, errored, mismatched, len(sizes) - answered - errored))


def _killer(code: Any, line_no: int) -> Any:
    """A ``sys.settrace`` tracer that SIGKILLs this process when ``code`` reaches ``line_no``."""

    def tracer(frame: Any, event: str, arg: Any) -> Any:
        if frame.f_code is code:
            if event == "line" and frame.f_lineno == line_no:
                os.kill(os.getpid(), signal.SIGKILL)
            return tracer
        return None

    return tracer


def die_at_line(desc: QueueDescriptor, func: str, line_no: int, ready: Any) -> None:
    """Attach a client, then SIGKILL ourselves when ``QueueClient.<func>`` reaches ``line_no``."""
    import sys

    from lowtail.shm import queue as queue_mod

    c = QueueClient.attach(desc)
    ready.put(c.lane)
    ready.close()
    ready.join_thread()  # flushed before we may kill ourselves
    sys.settrace(_killer(getattr(queue_mod.QueueClient, func).__code__, line_no))
    c.submit({"x": np.ones((1, 8), np.uint8)})
    sys.settrace(None)
    # The line was never reached (a branch not taken): die as the parent would have killed us, now
    # rather than after its join timeout (5 s for each such line).
    os.kill(os.getpid(), signal.SIGKILL)


def fuzz_lane(desc: QueueDescriptor, field: str, lane: int, seconds: float, seed: int) -> None:
    """Write random garbage into one class of ``lane``'s words for ``seconds`` (a third process)."""
    from lowtail.shm import layout
    from lowtail.shm import queue as qm

    rng = np.random.default_rng(seed)
    m = qm._attach(desc)
    q, geo = m.q, m.geo
    end = time.monotonic() + seconds
    try:
        while time.monotonic() < end:
            v = int(rng.integers(0, 2**63)) if rng.random() < 0.5 else int(rng.integers(0, 64))
            k = int(rng.integers(0, geo.spl))
            g = lane * geo.spl + k
            if field == "header":
                q[layout.HW_WORKER_SLEEP if rng.random() < 0.5 else layout.HW_WORKER_EPOCH] = v
            elif field == "doorbell":
                q[layout.HW_DOORBELLS + lane] = v
            elif field == "ring":
                q[geo.lane(lane, qm.L_RING) + k] = v
            elif field == "slot":
                word = int(rng.choice([qm.S_REQ_SEQ, qm.S_REQ_LEN, qm.S_REQ_STATE, qm.S_SUBMIT_NS]))
                q[geo.slot(g, word)] = v
            else:  # the payload header of a request region
                off = geo.req_off(g) + int(rng.integers(0, 64))
                m.mem[off : off + 8] = rng.integers(0, 256, 8, np.uint8).tobytes()
            time.sleep(0.0005)
    finally:
        del q
        m.close()


def worker_dies_at_line(desc: QueueDescriptor, func: str, line_no: int) -> None:
    """Serve ``y = x`` and SIGKILL ourselves when ``QueueWorker.<func>`` reaches ``line_no``."""
    import sys

    from lowtail.shm import queue as queue_mod

    with QueueWorker.attach(desc) as w:
        sys.settrace(_killer(getattr(queue_mod.QueueWorker, func).__code__, line_no))
        end = time.monotonic() + 30
        while time.monotonic() < end:
            b = w.claim(timeout_s=0.05)
            if b is not None:
                with b:
                    b.complete({"y": b.inputs["x"]})
                # Answered without reaching the line (a branch the request did not take): die as the
                # parent would have killed us, now rather than after its join timeout (10 s a line).
                sys.settrace(None)
                os.kill(os.getpid(), signal.SIGKILL)


def serve_at_latencies(desc: QueueDescriptor, latencies_s: list[float], seconds: float) -> None:
    """Serve ``y = x``, the k-th answer published ``latencies_s[k]`` (the last one from then on) after
    its request's submit, busy-waiting the last stretch: the client meets waits it can predict."""
    with QueueWorker.attach(desc) as w:
        end = time.monotonic() + seconds
        k = 0
        while time.monotonic() < end:
            b = w.claim(timeout_s=0.05)
            if b is None:
                continue
            latency_ns = int(latencies_s[min(k, len(latencies_s) - 1)] * 1e9)
            k += 1
            due = b.claimed_ns - b.queue_wait_ns[0] + latency_ns  # the request's submit_ns + latency
            if due - time.monotonic_ns() > 2_000_000:
                time.sleep((due - time.monotonic_ns() - 1_000_000) / 1e9)
            while time.monotonic_ns() < due:
                pass
            with b:
                b.complete({"y": b.inputs["x"]})


NOBODY = 65534  # the second uid of the other-user tests (nobody, present on every distribution)


def as_nobody(fn: Any) -> int:
    """Run ``fn`` in a forked child as uid/gid 65534; returns its exit status (0 = fn returned)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.setgroups([])
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            fn()
            code = 0
        except BaseException as e:  # the parent reads the exit code; print what happened for it
            print(f"as nobody: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def hold_ndslot(desc: QueueDescriptor, out: Any) -> None:
    """Submit one request through an ndarray segment, report the slot's name, then wait to be killed."""
    c = QueueClient.attach(desc)
    c.submit({"x": np.full((16, 64), 9.0, np.float32)})
    out.put(next(iter(c._nd_req.values())).name)
    time.sleep(60)


# Every queue implementation the behaviour tests run on (``queue_impl`` in conftest.py): its name and the
# module that exposes the queue's public names (InferenceQueue, QueueClient, QueueWorker, WorkerStandby,
# the errors). Another implementation of the same protocol adds itself here; child processes resolve
# the name again (``impl_module``), so a process body takes the name, never the module.
# "native" is the same module on the native core (lowtail.shm.native): the path is chosen per mapping.
QUEUE_IMPLEMENTATIONS = {"python": "lowtail.shm.queue", "native": "lowtail.shm.queue"}


def impl_module(impl: str) -> Any:
    """The module of ``impl``, with the mappings attached from now on on its hot path (in a child for
    good; in the test's process the ``queue_impl`` fixture restores the path when the test ends)."""
    import importlib

    from lowtail.shm import native

    native._forced[0] = impl == "native"
    return importlib.import_module(QUEUE_IMPLEMENTATIONS[impl])


def wide_answer_server(impl: str, desc: QueueDescriptor, width: int, ready: Any, run_s: float = 60.0) -> None:
    """Answer ``{"y": x[:, :1] repeated to width columns}``, as the serving loop does: a batch whose
    answer fails is logged and the next one claimed (the loop never dies of one batch)."""
    w = impl_module(impl).QueueWorker.attach(desc)
    ready.put(os.getpid())
    try:
        for b in batches_until_term(w, run_s):
            try:
                with b:
                    x = b.inputs["x"]
                    b.complete({"y": np.repeat(x[:, :1].astype(np.float32), width, axis=1)})
            except Exception as e:  # the serving loop's rule: one batch fails alone
                print(f"batch failed: {type(e).__name__}: {e}", file=sys.stderr)
    finally:
        w.close()


def hold_then_close_then_read(  # noqa: PLR0917 - a process body: multiprocessing passes args positionally
    impl: str, desc: QueueDescriptor, tag: float, out: Any, read: Any, drop: Any
) -> None:
    """Take a zero-copy answer, close the client (the end of its with block), read the kept array when
    ``read`` is set, drop it when ``drop`` is: reports the lane, the sum read, and that it dropped it."""
    import gc

    q = impl_module(impl)
    with q.QueueClient.attach(desc) as c:
        lane = c.lane
        y = c.wait(c.submit({"x": np.full((2, 4), tag, np.float32)}), 10, copy=False)["y"]
    out.put(("closed", lane))
    read.wait(30)
    out.put(("read", float(y.sum()), y.shape))
    drop.wait(30)
    del y
    gc.collect()
    out.put(("dropped", lane))


def serve_lanes_at_latencies(
    desc: QueueDescriptor, latencies_by_lane: dict[int, list[float]], seconds: float
) -> None:
    """Serve ``y = x`` as ``serve_at_latencies`` does, with a list of latencies per lane: the k-th
    request of lane L answered ``latencies_by_lane[L][k]`` (the last one from then on; a lane not
    listed: at once) after its submit. A batch is held until its time while the worker claims and
    answers others, so one lane's late answer delays no other lane's; a batch that merged several
    lanes' requests is answered at the latest of their times."""
    with QueueWorker.attach(desc) as w:
        end = time.monotonic() + seconds
        taken: dict[int, int] = {}
        held: list[tuple[int, Any]] = []  # (when to answer it, the batch)
        while time.monotonic() < end:
            now = time.monotonic_ns()
            for due, b in [h for h in held if h[0] <= now]:
                held.remove((due, b))
                with b:
                    b.complete({"y": b.inputs["x"]})
            until = min((due for due, _ in held), default=now + 50_000_000)
            b = w.claim(timeout_s=max(0.0, min(0.05, (until - time.monotonic_ns()) / 1e9)))
            if b is None:
                continue
            due = 0
            for lane, queue_wait_ns in zip(b.lanes, b.queue_wait_ns, strict=True):
                latencies, k = latencies_by_lane.get(lane, [0.0]), taken.get(lane, 0)
                taken[lane] = k + 1
                latency_ns = int(latencies[min(k, len(latencies) - 1)] * 1e9)
                due = max(due, b.claimed_ns - queue_wait_ns + latency_ns)  # its submit_ns + latency
            held.append((due, b))


def serve_then_hold(desc: QueueDescriptor, hold_tag: float, holds: int, seconds: float) -> None:
    """Answer ``y = x`` at once, except a batch with a request whose first value is ``hold_tag``:
    claimed and held unanswered (a worker stuck in its inference). Once it holds ``holds`` requests it
    claims nothing more: it holds them, and its lock, until SIGKILLed (or ``seconds``)."""
    end = time.monotonic() + seconds
    with QueueWorker.attach(desc) as w:
        held: list[Any] = []
        while sum(len(b) for b in held) < holds and time.monotonic() < end:
            b = w.claim(timeout_s=0.05)
            if b is None:
                continue
            if (b.inputs["x"][:, 0] == hold_tag).any():
                held.append(b)
                continue
            with b:
                b.complete({"y": b.inputs["x"]})
        time.sleep(max(0.0, end - time.monotonic()))
