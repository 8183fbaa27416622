"""Process bodies for the queue tests (top-level functions so that forkserver/spawn children import them)."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import numpy as np

from lowtail.shm.queue import QueueClient, QueueDescriptor, QueueWorker


def echo(x: np.ndarray[Any, Any]) -> dict[str, np.ndarray[Any, Any]]:
    """The worker's model in tests: outputs that depend on every input row, with a different width."""
    return {
        "twice": x * 2.0 + 1.0,
        "rowsum": x.sum(axis=1, keepdims=True).astype(np.float64),
    }


def echo_worker(
    desc: QueueDescriptor, cpu: int | None = None, run_s: float = 60.0, delay_s: float = 0.0
) -> None:
    """Serve ``echo`` until SIGTERM or ``run_s``; a ``delay_s`` inference keeps requests PROCESSING."""
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    stop = False

    def on_term(*_: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_term)
    w = QueueWorker.attach(desc)
    end = time.monotonic() + run_s
    try:
        while not stop and time.monotonic() < end:
            b = w.claim(timeout=0.05)
            if b is None:
                continue
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
                got = p.finish(timeout=10)
            else:
                xs, got = x, c.infer({"x": x}, timeout=10)
            bad += not _matches(xs, got)
        for xs, p in pending:
            bad += not _matches(xs, p.finish(timeout=10))
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
    """Submit one request and report what waiting for it raised (or 'ok') and how long it took."""
    with QueueClient.attach(desc) as c:
        t = c.submit({"x": np.ones((1, 8), np.float32)})
        out.put(("submitted", c.lane))
        start = time.monotonic()
        try:
            c.wait(t, timeout=timeout)
            result = "ok"
        except Exception as e:
            result = f"{type(e).__name__}: {e}"
        out.put((result, time.monotonic() - start))


def attach_and_exit(desc: QueueDescriptor) -> None:
    """Attach as a client, do one request's worth of nothing, and exit normally."""
    c = QueueClient.attach(desc)
    c.close()
