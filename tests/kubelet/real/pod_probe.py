"""Runs inside the Guaranteed static pod (the pod image's command): what lowtail sees and does there.

It reads the pod's cgroup cpuset with lowtail's reader, loads the host's plan (mounted read-only, as
the lowtail_k8s role mounts it), leases a CPU from the CPUs both allow, starts a pinned OpenVINO worker
on it, sends one request through the shared-memory queue from this process, and writes all of it as
JSON to /out/result.json. Then it stays up, so the kubelet keeps the CPUs assigned while the test reads
its checkpoint; the test removes the pod.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

OUT = Path("/out")


def probe() -> dict[str, Any]:
    from lowtail.node.cpuset import cgroup_cpuset
    from lowtail.node.lease import LeaseAllocator, locate_plan
    from lowtail.serve.model import ModelSpec, example_inputs, write_model
    from lowtail.serve.worker_process import WorkerConfig, WorkerProcess
    from lowtail.shm.queue import InferenceQueue, QueueClient, QueueConfig

    result: dict[str, Any] = {"affinity": sorted(os.sched_getaffinity(0))}
    cpuset = cgroup_cpuset()
    assert cpuset is not None, "no cgroup cpuset visible in the pod"
    result["cpuset"], result["cpuset_source"] = sorted(cpuset.cpus), cpuset.source
    plan, source = locate_plan()
    result["plan_isolated"], result["plan_source"] = sorted(plan.isolated), source
    allocator = LeaseAllocator(plan, allowed=cpuset.cpus, allowed_source=f"cgroup cpuset {cpuset.source}")
    result["lease_pool"] = sorted(allocator.pool)
    lease = allocator.acquire("infer:pod:probe")
    result["lease_cpu"] = lease.cpu
    model = Path("/tmp/model")
    write_model(model, ModelSpec(features=64, hidden=(128, 64), heads=(("action", 6), ("move", 8)), seed=7))
    qcfg = QueueConfig(
        lanes=2, slots_per_lane=2, request_bytes=16384, response_bytes=16384, min_batch_samples=1
    )
    with InferenceQueue.create(qcfg) as queue:
        worker = WorkerProcess.start(queue.descriptor, lease.cpu, model, WorkerConfig(name="pod"))
        try:
            worker.wait_ready(600)
            status = Path(f"/proc/{worker.pid}/status").read_text()
            allowed = next(line for line in status.splitlines() if line.startswith("Cpus_allowed_list:"))
            result["worker_cpus_allowed"] = allowed.split(":", 1)[1].strip()
            with QueueClient.attach(queue.descriptor) as client:
                got = client.start(example_inputs(64, 4, seed=1)).finish(timeout_s=120)
            result["outputs"] = {k: list(v.shape) for k, v in sorted(got.items())}
            # The worker answers first and counts the call after; a loaded CPU can preempt it in between.
            deadline = time.monotonic() + 30
            while (report := worker.report()).calls < 1 and time.monotonic() < deadline:
                time.sleep(0.005)
            result["worker_calls"], result["worker_sched_fifo"] = report.calls, report.sched_fifo
        finally:
            result["worker_exit"] = worker.stop()
    allocator.release("infer:pod:probe")
    return result


def main() -> None:
    # PID 1 of its PID namespace: SIGTERM (the kubelet stopping the pod) would be ignored by default.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    try:
        result = probe()
    except Exception:
        result = {"error": traceback.format_exc()}
    tmp = OUT / "result.json.tmp"
    tmp.write_text(json.dumps(result, indent=2))
    tmp.rename(OUT / "result.json")
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    main()
