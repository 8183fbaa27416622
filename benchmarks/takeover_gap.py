"""How long a SIGKILLed worker costs a closed-loop client: kill -> first answer, with and without a standby.

``measure_takeover(standby=True)`` serves the default policy model to one batch-1 client in this process,
SIGKILLs the worker after ``warm`` answers and times the first answer after the kill (requests that fail
``WorkerDied`` are sent again at once, as a sampler would). With a standby the standby answers; without
one the worker is restarted the moment the kill is done (the best a supervisor can do: no detection
delay), so the figure is spawn + imports + compile + attach. Each round uses a fresh queue and workers.
It also reports what a parked standby costs: its RSS and USS, and the segments it added in /dev/shm.
"""

from __future__ import annotations

import os
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil

from lowtail.serve.model import ModelSpec, example_inputs, write_model
from lowtail.serve.worker_process import WorkerConfig, WorkerProcess
from lowtail.shm import segments
from lowtail.shm.queue import InferenceQueue, QueueClient, QueueConfig, WorkerDied


def _one_round(xml: Path, cpu: int, standby: bool, warm: int) -> dict[str, Any]:
    cfg = QueueConfig(lanes=2, slots_per_lane=2, min_batch_samples=1)
    x = example_inputs(ModelSpec().features, 1)
    out: dict[str, Any] = {}
    with InferenceQueue.create(cfg) as queue:
        workers = [WorkerProcess.start(queue.descriptor, cpu, xml, WorkerConfig(name="gap"))]
        try:
            workers[0].wait_ready(300)
            if standby:
                workers.append(
                    WorkerProcess.start(queue.descriptor, cpu, xml, WorkerConfig(name="gap"), standby=True)
                )
                workers[1].wait_ready(300)
                mem = psutil.Process(workers[1].pid).memory_full_info()
                out["standby_rss_mib"] = mem.rss / 2**20
                out["standby_uss_mib"] = mem.uss / 2**20
                out["standby_segments"] = sum(s.pid == workers[1].pid for s in segments.list_segments())
            primary = psutil.Process(workers[0].pid).memory_full_info()
            out["primary_rss_mib"], out["primary_uss_mib"] = primary.rss / 2**20, primary.uss / 2**20
            with QueueClient.attach(queue.descriptor) as c:
                last = time.monotonic_ns()
                for _ in range(warm):
                    c.infer(x, timeout_s=30)
                    last = time.monotonic_ns()
                killed = time.monotonic_ns()  # before: the victim may be gone before kill() returns here
                os.kill(workers[0].pid, signal.SIGKILL)
                if not standby:
                    workers.append(WorkerProcess.start(queue.descriptor, cpu, xml, WorkerConfig(name="gap")))
                failed = 0
                while True:
                    try:
                        c.infer(x, timeout_s=60)
                        break
                    except WorkerDied:
                        failed += 1
                answered = time.monotonic_ns()
            if standby:
                took = workers[1].took_over_ns
                out["kill_to_lock_taken_ms"] = (took - killed) / 1e6
                first = workers[1].calls(0).rows[0]  # the standby's first engine call: its end, in s
                out["lock_to_first_call_end_ms"] = (first[0] * 1e9 - took) / 1e6
            out["kill_to_first_answer_ms"] = (answered - killed) / 1e6
            out["longest_gap_ms"] = (answered - last) / 1e6
            out["failed"] = failed
        finally:
            for w in workers:
                w.stop()
    return out


def measure_takeover(
    standby: bool, rounds: int = 5, cpu: int | None = None, warm: int = 200
) -> dict[str, Any]:
    """``rounds`` kills; per-round figures and their medians and max (milliseconds, MiB)."""
    cpu = max(os.sched_getaffinity(0)) if cpu is None else cpu
    with tempfile.TemporaryDirectory(prefix="lowtail-takeover-") as tmp:
        xml = write_model(tmp, ModelSpec())
        runs = [_one_round(xml, cpu, standby, warm) for _ in range(rounds)]
    gaps = np.array([r["kill_to_first_answer_ms"] for r in runs])
    return {
        "standby": standby,
        "n": rounds,
        "kill_to_first_answer_ms": {"p50": float(np.median(gaps)), "max": float(gaps.max())},
        "load": os.getloadavg(),
        "runs": runs,
    }


if __name__ == "__main__":
    import json
    import sys

    n = int(sys.argv[1]) if len(sys.argv) > 1 else 5
    print(json.dumps([measure_takeover(True, n), measure_takeover(False, n)], indent=1))
