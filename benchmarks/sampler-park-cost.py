#!/usr/bin/env python3
"""What a parked request costs its sampler's CPU: the floor of a sleep and its wake-up, and a queue round
trip whose answer comes at once against one that comes after the engine's time.

    benchmarks/sampler-park-cost.py [--busy-us 0,700] [--requests N] [--idle-spinner] [--json FILE]

A sampler that shares its CPU parks on the futex for every answer (``QueueClient.spin_policy``), so each
request pays a sleep and a wake-up besides its own code. This measures, on CPU 0 (the samplers' CPU in
``bench serve``), with the thread's CPU clock and ``getrusage(RUSAGE_THREAD)``:

- ``sleep``: ``time.sleep`` of 20 us to 3 ms in a loop: a sleep and its wake-up and nothing else (no
  other work, a few cache lines): the least any parked request can cost here;
- ``queue``: one client (``bench queue``'s request, 16 x 512 float32 in, 16 x 64 out) against a worker
  process on CPU 1 that holds each request ``busy`` us before it answers (0: at once; 700: about the
  default model's batch-16 call), the client parking on each answer. The same code with the answer
  20 us away against 700 us away shows what the time between requests costs it (its caches and the
  vCPU halted meanwhile).

``--idle-spinner`` keeps a SCHED_IDLE busy loop on CPU 0 during the queue runs, so the vCPU never halts
(it runs whenever the sampler does not). Needs 2 CPUs (0 and 1).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import resource
import statistics
import subprocess
import sys
import time
from typing import Any

import numpy as np


def _thread_cpu() -> tuple[int, float, float, int]:
    ru = resource.getrusage(resource.RUSAGE_THREAD)
    return time.thread_time_ns(), ru.ru_utime, ru.ru_stime, ru.ru_nvcsw


def _per(before: tuple[int, float, float, int], n: int) -> dict[str, float]:
    after = _thread_cpu()
    return {
        "cpu_us": (after[0] - before[0]) / n / 1e3,
        "user_us": (after[1] - before[1]) / n * 1e6,
        "sys_us": (after[2] - before[2]) / n * 1e6,
        "vol_cs": (after[3] - before[3]) / n,
    }


def sleep_floor(sleep_us: int, n: int) -> dict[str, float]:
    before = _thread_cpu()
    for _ in range(n):
        time.sleep(sleep_us / 1e6)
    return _per(before, n)


def _worker(desc: Any, busy_us: int, stop: Any) -> None:
    from lowtail.shm.server import QueueWorker

    os.sched_setaffinity(0, {1})
    with QueueWorker.attach(desc) as w:
        while not stop.is_set():
            b = w.claim(timeout_s=0.05)
            if b is None:
                continue
            with b:
                end = time.perf_counter_ns() + busy_us * 1000
                while time.perf_counter_ns() < end:  # the engine's time on its own CPU
                    pass
                b.complete({"act": b.inputs["obs"][:, :64]})


def _split(c: Any, x: dict[str, np.ndarray], n: int) -> dict[str, float]:
    """Where a request's CPU goes, per request (medians over ``n`` more requests): ``user_side_us``, the
    wall time of the client's own code (the round trip's wall less the wall time parked: submit, the
    check before parking, the answer's read; the thread runs on alone meanwhile, so it is its CPU),
    and ``in_park_us``, the thread's CPU less that: what the park's futex wait, the switch out and the
    wake-up cost it. Each thread-CPU clock read is a system call (~0.6 us), half of it in each part."""
    cpu, user_side = [], []
    clock, cpu_clock = time.monotonic_ns, time.thread_time_ns
    for _ in range(n):
        park0 = c.wait_times["park_ns"]
        c0, t0 = cpu_clock(), clock()
        c.start(x).finish(timeout_s=30.0)
        t1, c1 = clock(), cpu_clock()
        cpu.append(c1 - c0)
        user_side.append(t1 - t0 - (c.wait_times["park_ns"] - park0))
    med = statistics.median
    return {
        "user_side_us": med(user_side) / 1e3,
        "in_park_us": med([a - b for a, b in zip(cpu, user_side, strict=True)]) / 1e3,
    }


def queue_round_trips(busy_us: int, n: int) -> dict[str, Any]:
    from lowtail.shm import native
    from lowtail.shm.client import QueueClient
    from lowtail.shm.queue import InferenceQueue, QueueConfig

    ctx = multiprocessing.get_context("spawn")
    stop = ctx.Event()
    with InferenceQueue.create(QueueConfig(request_bytes=65536, response_bytes=32768)) as q:
        proc = ctx.Process(target=_worker, args=(q.descriptor, busy_us, stop))
        proc.start()
        try:
            with QueueClient.attach(q.descriptor) as c:
                x = {"obs": np.ones((16, 512), np.float32)}
                for _ in range(300):  # the worker's start-up and the client's warm-up
                    c.start(x).finish(timeout_s=30.0)
                counts0 = c.wait_counts
                before, t0 = _thread_cpu(), time.perf_counter_ns()
                for _ in range(n):
                    c.start(x).finish(timeout_s=30.0)
                out: dict[str, Any] = _per(before, n)
                out["wall_us"] = (time.perf_counter_ns() - t0) / n / 1e3
                out["parked"] = (c.wait_counts["parked"] - counts0["parked"]) / n
                out |= _split(c, x, n)
                out["spin_policy"] = c.spin_policy.reason
        finally:
            stop.set()
            proc.join(10)
            if proc.is_alive():
                proc.kill()
                proc.join()
    out["core"] = native.implementation().name
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--busy-us", default="0,700", help="the worker's hold per request, us (default 0,700)")
    ap.add_argument("--requests", type=int, default=3000, help="round trips per run (default 3000)")
    ap.add_argument("--idle-spinner", action="store_true", help="a SCHED_IDLE loop on CPU 0 meanwhile")
    ap.add_argument("--json", help="also write the rows as JSON here")
    args = ap.parse_args()
    if not {0, 1} <= os.sched_getaffinity(0):
        raise SystemExit("needs CPUs 0 and 1 (the samplers' and the worker's)")
    try:
        busy = [int(v) for v in args.busy_us.split(",") if v.strip()]
    except ValueError:
        raise SystemExit(f"--busy-us {args.busy_us!r}: expected comma-separated microseconds") from None
    if args.requests < 1 or not busy or min(busy) < 0:
        raise SystemExit("--requests and --busy-us: expected positive counts and microseconds >= 0")
    os.sched_setaffinity(0, {0})
    rows: list[dict[str, Any]] = []
    for us in (20, 100, 800, 3000):
        rows.append({"run": f"sleep {us} us", **sleep_floor(us, max(200, int(1.5e6 / (us + 60))))})
    spinner = None
    if args.idle_spinner:
        loop = [sys.executable, "-c", "while True: pass"]
        spinner = subprocess.Popen(["chrt", "--idle", "0", "taskset", "-c", "0", *loop])
    try:
        for us in busy:
            rows.append({"run": f"queue, answer after {us} us", **queue_round_trips(us, args.requests)})
    finally:
        if spinner is not None:
            spinner.kill()
            spinner.wait()
    for r in rows:
        extra = ""
        if "wall_us" in r:
            extra = (
                f", wall {r['wall_us']:.0f} us, parked {r['parked']:.2f}, {r['core']}; median: the client's "
                f"code {r['user_side_us']:.1f} us, the park {r['in_park_us']:.1f} us"
            )
        print(
            f"{r['run']:<28} cpu {r['cpu_us']:6.1f} us (user {r['user_us']:5.1f}, sys {r['sys_us']:5.1f}), "
            f"{r['vol_cs']:.2f} voluntary switches{extra}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"load": os.getloadavg(), "idle_spinner": args.idle_spinner, "rows": rows}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
