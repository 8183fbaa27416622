"""Probes that measure lowtail's own runtime parts: the shared-memory queue round trip, the pinned
inference worker, and the NUMA placement of a bound segment.

They use ``lowtail.queue`` (the queue issue) and ``lowtail.worker`` / ``lowtail.model`` (the worker
issue), built alongside this module. When a part is not installed the probe is a skip whose reason names
the missing module, never a pass.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import time
from typing import Any

from lowtail import cpulist

from .check import Check, Status, skip
from .probes import ProbeOptions, grade


def _missing(*modules: str) -> str | None:
    for name in modules:
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except ModuleNotFoundError:
            return name
    return None


def _two_cpus(opts: ProbeOptions) -> tuple[int, int] | None:
    """Worker and client CPUs: two selected CPUs, else the main (housekeeping) CPU and one selected."""
    cpus = sorted(opts.cpus)
    if len(cpus) >= 2:
        return cpus[0], cpus[1]
    if cpus and opts.main_cpu not in cpus:
        return cpus[0], opts.main_cpu
    return None


def _echo_worker(desc: Any, cpu: int, stop: Any) -> None:
    """The queue's consumer for the round trip: pinned, returns its inputs as outputs."""
    os.sched_setaffinity(0, {cpu})
    queue = importlib.import_module("lowtail.queue")
    worker = queue.QueueWorker.attach(desc)
    try:
        while not stop.is_set():
            batch = worker.claim(timeout=0.05)
            if batch is not None:
                batch.complete({"out": batch.inputs["obs"]})
    finally:
        worker.close()


def probe_shm_rtt(opts: ProbeOptions) -> Check:
    missing = _missing("lowtail.queue")
    if missing:
        return skip("shm_rtt", f"{missing} is not installed (the shared-memory queue issue)", kind="probe")
    pair = _two_cpus(opts)
    if pair is None:
        return skip("shm_rtt", "needs two CPUs: the worker's and the client's", kind="probe")
    import multiprocessing as mp

    import numpy as np

    queue = importlib.import_module("lowtail.queue")
    worker_cpu, client_cpu = pair
    ctx = mp.get_context("spawn")
    stop = ctx.Event()
    cfg = queue.QueueConfig(lanes=2, slots_per_lane=4, request_bytes=4096, response_bytes=4096)
    samples: list[float] = []
    saved = os.sched_getaffinity(0)
    with queue.InferenceQueue.create(cfg) as server:
        proc = ctx.Process(target=_echo_worker, args=(server.descriptor, worker_cpu, stop), daemon=True)
        proc.start()
        try:
            os.sched_setaffinity(0, {client_cpu})
            obs = np.zeros((1, 64), dtype=np.float32)
            with queue.QueueClient.attach(server.descriptor) as client:
                for _ in range(200):  # warm-up: worker start, page faults, first futex waits
                    client.infer({"obs": obs}, timeout=5.0)
                for _ in range(opts.samples):
                    t0 = time.perf_counter_ns()
                    client.infer({"obs": obs}, timeout=5.0)
                    samples.append((time.perf_counter_ns() - t0) / 1e6)
        finally:
            os.sched_setaffinity(0, saved)
            stop.set()
            proc.join(timeout=5)
            if proc.is_alive():
                proc.kill()
                proc.join()
    check = grade("shm_rtt", {client_cpu: samples}, opts.limit("shm_rtt"), "queue round trip")
    check.evidence.insert(
        0, f"client on CPU {client_cpu}, echo worker on CPU {worker_cpu}; 1 x 64 float32 request, closed loop"
    )
    check.data["worker_cpu"] = worker_cpu
    return check


def probe_inference(opts: ProbeOptions) -> Check:
    missing = _missing("lowtail.worker", "lowtail.model")
    if missing:
        return skip(
            "inference", f"{missing} is not installed (the pinned inference worker issue)", kind="probe"
        )
    return skip(
        "inference",
        "lowtail.worker is present but exposes no measurement entry point this validator knows "
        "(expected lowtail.worker.measure_pinned)",
        kind="probe",
    )


def probe_numa(opts: ProbeOptions) -> Check:
    missing = _missing("lowtail.queue")
    if missing:
        return skip("numa", f"{missing} is not installed (the queue's NUMA helpers)", kind="probe")
    queue = importlib.import_module("lowtail.queue")
    placement = getattr(queue, "page_nodes", None)
    if placement is None:
        return skip("numa", "lowtail.queue has no page_nodes() helper to read page placement", kind="probe")
    return Check("numa", Status.SKIP, reason="not wired", kind="probe", evidence=[cpulist.format(opts.cpus)])
