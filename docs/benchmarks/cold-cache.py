"""Warm against cold: the queue's claim and complete, alone and after an 8 MiB read between requests.

An ``infer()`` of the default policy model streams its ~8 MiB of f32 weights through the caches, so the
worker's bookkeeping after it runs with cold caches. This reproduces that without OpenVINO: the same
claim/complete in one process, with and without a sweep of 8 MiB between a request and its claim and
between the claim and the answer. Quoted in docs/benchmarks.md. Run from the repository root:
``.venv/bin/python docs/benchmarks/cold-cache.py`` (it pins itself to CPU 1).
"""

from __future__ import annotations

import gc
import os
import statistics
import time

import numpy as np

from lowtail.shm.queue import InferenceQueue, QueueClient, QueueConfig, QueueWorker


def main(requests: int = 5000) -> None:
    os.sched_setaffinity(0, {1})
    gc.freeze()
    perf = time.perf_counter_ns
    weights = np.random.rand(2 << 20).astype(np.float32)  # 8 MiB
    x = {"obs": np.random.rand(16, 512).astype(np.float32)}
    out = {"logits": np.random.rand(16, 63).astype(np.float32)}
    with InferenceQueue.create(QueueConfig()) as q, QueueClient.attach(q.descriptor) as c:
        with QueueWorker.attach(q.descriptor) as w:
            for sweep in (False, True):
                claim_ns, complete_ns = [], []
                for _ in range(requests):
                    pending = c.start(x)
                    if sweep:
                        weights.sum()
                    t1 = perf()
                    batch = w.claim(0.0)
                    t2 = perf()
                    assert batch is not None
                    if sweep:
                        weights.sum()
                    t3 = perf()
                    with batch:
                        batch.complete(out)
                    t4 = perf()
                    pending.finish()
                    claim_ns.append(t2 - t1)
                    complete_ns.append(t4 - t3)
                skip = requests // 10
                print(
                    f"{'after an 8 MiB sweep' if sweep else 'warm':22s} "
                    f"claim p50 {statistics.median(claim_ns[skip:]) / 1e3:5.2f} us  "
                    f"complete p50 {statistics.median(complete_ns[skip:]) / 1e3:5.2f} us  (n={requests - skip})"
                )


if __name__ == "__main__":
    main()
