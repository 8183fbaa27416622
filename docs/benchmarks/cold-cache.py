"""Warm vs cold: the same claim/complete with an 8 MiB read (the model's f32 weights) between requests.

Run: `.venv/bin/python docs/benchmarks/cold-cache.py` (pins itself to CPU 1; docs/benchmarks.md quotes it)."""
import sys, time, statistics, os, gc
import numpy as np
from lowtail.shm.queue import InferenceQueue, QueueConfig, QueueClient, QueueWorker
os.sched_setaffinity(0, {1}); gc.freeze()
perf = time.perf_counter_ns
weights = np.random.rand(2 * 1024 * 1024).astype(np.float32)  # 8 MiB, as the default policy model
with InferenceQueue.create(QueueConfig()) as q:
    c = QueueClient.attach(q.descriptor); w = QueueWorker.attach(q.descriptor)
    x = {"obs": np.random.rand(16, 512).astype(np.float32)}
    out = {"logits": np.random.rand(16, 63).astype(np.float32)}
    for sweep in (False, True):
        cl, co = [], []
        for i in range(5000):
            p = c.start(x)
            if sweep:
                weights.sum()
            t1 = perf(); b = w.claim(0.0); t2 = perf()
            if sweep:
                weights.sum()
            t3 = perf(); b.complete(out); t4 = perf()
            p.finish()
            cl.append(t2 - t1); co.append(t4 - t3)
        print(f"{'after an 8 MiB sweep' if sweep else 'warm':22s} claim p50 {statistics.median(cl[500:])/1e3:5.2f} us  complete p50 {statistics.median(co[500:])/1e3:5.2f} us")
    w.close(); c.close()
