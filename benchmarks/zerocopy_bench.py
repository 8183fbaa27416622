"""What a zero-copy answer saves the client: ``wait(copy=True)`` against ``wait(copy=False)`` + release.

One process drives both ends by hand (submit, claim, complete), so the answer is already there when the
client takes it and the timed part is exactly the client's taking of the answer: reading its header and
copying it out, or building views of it (then touching one element and releasing them). Two shapes: the
echo workload's answer (16 x 64 float32, inline in the response region) and a 1 MiB float32 answer
(too large for the slot: it travels in the worker's ndarray segment).
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

from lowtail.shm.queue import InferenceQueue, QueueClient, QueueConfig, QueueWorker

SHAPES = {"16x64 f32": (16, 64), "1 MiB f32": (256, 1024)}


def _take(
    c: QueueClient, w: QueueWorker, answer: np.ndarray[Any, Any], copy: bool, n: int
) -> np.ndarray[Any, Any]:
    x = {"x": np.zeros((answer.shape[0], 1), np.float32)}
    out = {"y": answer}
    took = np.empty(n, np.int64)
    for i in range(n):
        t = c.submit(x)
        b = w.claim(timeout_s=1)
        assert b is not None
        with b:
            b.complete(out)
        t0 = time.perf_counter_ns()
        if copy:
            got = c.wait(t, 1)
            got["y"][0, 0]
        else:
            held = c.wait(t, 1, copy=False)
            held["y"][0, 0]
            held.release()
        took[i] = time.perf_counter_ns() - t0
    return took


def zerocopy_rows(n: int = 2000, n_large: int = 300) -> list[dict[str, Any]]:
    """One row per shape: p50/p99 microseconds of taking the answer, copied and zero-copy, with n."""
    rows = []
    cfg = QueueConfig(lanes=1, slots_per_lane=2, coalesce_us=0)
    with (
        InferenceQueue.create(cfg) as q,
        QueueClient.attach(q.descriptor) as c,
        QueueWorker.attach(q.descriptor) as w,
    ):
        for label, shape in SHAPES.items():
            answer = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
            runs = n if answer.nbytes < 1 << 16 else n_large
            row: dict[str, Any] = {"answer": label, "bytes": answer.nbytes, "n": runs}
            for copy in (True, False):
                _take(c, w, answer, copy, min(100, runs))  # warm: views cached, ndarray segment attached
                took = _take(c, w, answer, copy, runs) / 1e3
                key = "copy" if copy else "zero_copy"
                row[f"{key}_p50_us"] = float(np.percentile(took, 50))
                row[f"{key}_p99_us"] = float(np.percentile(took, 99))
            row["saved_p50_us"] = row["copy_p50_us"] - row["zero_copy_p50_us"]
            rows.append(row)
    return rows


if __name__ == "__main__":
    for r in zerocopy_rows():
        print(r)
    print("load", os.getloadavg())
