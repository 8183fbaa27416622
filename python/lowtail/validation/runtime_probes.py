"""Probes that measure lowtail's own runtime parts: the shared-memory queue round trip, the pinned
inference worker, and the NUMA placement of a bound segment.

They use ``lowtail.shm.queue`` and ``lowtail.serve.worker_process`` / ``lowtail.serve.model``, built alongside
this module. When a part is not installed the probe is a skip whose reason names
the missing module, never a pass.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import shlex
import subprocess
import sys
import time
from typing import Any

from lowtail.node import cpulist
from lowtail.node.process import end_child
from lowtail.render.progress import Progress
from lowtail.validation.check import Check, Status, skip, tail_stats
from lowtail.validation.probes import ProbeError, ProbeOptions, grade

log = logging.getLogger(__name__)


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


def _start_echo_server(worker_cpu: int, client_cpu: int, descriptor: bytes) -> subprocess.Popen[bytes]:
    """The echo server pinned to ``worker_cpu``, attached to the queue and ready."""
    cmd = [sys.executable, "-m", "lowtail.validation.echo_server", str(worker_cpu)]
    log.debug("running %s (client on CPU %d)", shlex.join(cmd), client_cpu)
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(descriptor)
        proc.stdin.close()
        if proc.stdout.readline().strip() != b"ready":
            raise ProbeError(f"the shm_rtt echo worker on CPU {worker_cpu} exited with {proc.wait()}")
    except BaseException:
        _stop(proc)
        raise
    return proc


def _stop(proc: subprocess.Popen[bytes]) -> None:
    end_child(proc)
    if proc.stdout:
        proc.stdout.close()


def _round_trips(
    queue: Any, descriptor: Any, client_cpu: int, worker_cpu: int, opts: ProbeOptions
) -> list[float]:
    """``opts.samples`` closed-loop round trips (ms) from ``client_cpu``, after a warm-up."""
    import numpy as np

    samples: list[float] = []
    saved = os.sched_getaffinity(0)
    try:
        os.sched_setaffinity(0, {client_cpu})
        obs = np.zeros((1, 64), dtype=np.float32)
        bar = Progress(f"shm_rtt cpus {client_cpu}->{worker_cpu}", opts.samples, enabled=opts.progress)
        with queue.QueueClient.attach(descriptor) as client:
            for _ in range(200):  # warm-up: page faults, first futex waits
                client.infer({"obs": obs}, timeout_s=5.0)
            for i in range(opts.samples):
                t0 = time.perf_counter_ns()
                client.infer({"obs": obs}, timeout_s=5.0)
                samples.append((time.perf_counter_ns() - t0) / 1e6)
                if i % 500 == 0:
                    bar.update(i)
        bar.finish()
    finally:
        os.sched_setaffinity(0, saved)
    return samples


def probe_shm_rtt(opts: ProbeOptions) -> Check:
    missing = _missing("lowtail.shm.queue")
    if missing:
        return skip(
            "shm_rtt",
            f"{missing} is not installed (lowtail's shared-memory queue, which the round trip runs through)",
            kind="probe",
        )
    pair = _two_cpus(opts)
    if pair is None:
        return skip("shm_rtt", "needs two CPUs: the worker's and the client's", kind="probe")
    queue = importlib.import_module("lowtail.shm.queue")
    worker_cpu, client_cpu = pair
    cfg = queue.QueueConfig(lanes=2, slots_per_lane=4, request_bytes=4096, response_bytes=4096)
    with queue.InferenceQueue.create(cfg) as server:
        proc = _start_echo_server(worker_cpu, client_cpu, server.descriptor.to_bytes())
        try:
            samples = _round_trips(queue, server.descriptor, client_cpu, worker_cpu, opts)
        finally:
            _stop(proc)
    check = grade("shm_rtt", {client_cpu: samples}, opts.limit("shm_rtt"), "queue round trip")
    check.evidence.insert(
        0, f"client on CPU {client_cpu}, echo worker on CPU {worker_cpu}; 1 x 64 float32 request, closed loop"
    )
    check.data["worker_cpu"] = worker_cpu
    return check


INFERENCE_MAX_CPUS = 4  # a worker compiles the model once per CPU: a spread sample, not every core
INFERENCE_BATCH = 16  # a full engine batch (QueueConfig.max_batch_samples)
INFERENCE_STEP = 25  # calls between two moves of the progress bar (a call is about a millisecond)


def spread(cpus: frozenset[int], k: int) -> list[int]:
    """Up to ``k`` CPUs evenly spread over the sorted selection (first and last included)."""
    ordered = sorted(cpus)
    if len(ordered) <= k:
        return ordered
    return (
        sorted({ordered[round(i * (len(ordered) - 1) / (k - 1))] for i in range(k)}) if k > 1 else ordered[:1]
    )


def _worker_figures(m: Any, col: dict[str, int]) -> tuple[dict[str, Any], str]:
    """What one CPU's measurement adds beside its deschedule samples, and the evidence note for it."""
    rows = m.rows
    wall = tail_stats([float(x) for x in rows[:, col["wall_ms"]]])
    iso = m.isolation
    extra = {
        "wall_ms_p50": wall["p50"],
        "wall_ms_p999": wall["p999"],
        "wall_ms_max": wall["max"],
        "run_delay_ms_total": round(float(rows[:, col["run_delay_ms"]].sum()), 3),
        "nonvoluntary_switches": int(rows[:, col["nivcsw"]].sum()),
        "sched_fifo": bool(m.report.sched_fifo),
        "threads": iso.threads,
        "isolated": bool(iso.ok),
        "isolation": iso.detail,
    }
    note = (
        f"; wall p50 {extra['wall_ms_p50']:.3f} p999 {extra['wall_ms_p999']:.3f} ms, "
        f"sched_fifo={extra['sched_fifo']}, {iso.threads} threads, isolation: {iso.detail}"
    )
    return extra, note


def _measure_each_cpu(
    worker: Any, cpus: list[int], client_cpu: int | None, calls: int, progress: Progress
) -> tuple[dict[int, list[float]], dict[int, dict[str, Any]], dict[int, str]]:
    """Measure the pinned worker on each CPU in turn: deschedule samples, figures and notes per CPU."""
    col = importlib.import_module("lowtail.serve.call_stats").COL
    per_cpu: dict[int, list[float]] = {}
    notes: dict[int, str] = {}
    extra: dict[int, dict[str, Any]] = {}
    for i, cpu in enumerate(cpus):
        quiet = worker.WorkerConfig(name="measure", log_level="WARNING")  # info lines would break the bar
        base = i * calls
        progress.phase(base, f"CPU {cpu}: compiling the model")
        log.debug("measure_pinned on CPU %d: %d calls of batch %d, client CPU %s", cpu, calls,
                  INFERENCE_BATCH, client_cpu)  # fmt: skip

        def advance(k: int, base: int = base, cpu: int = cpu) -> None:
            if k % INFERENCE_STEP == 0 or k == calls:
                progress.update(base + k, f"CPU {cpu}: {k}/{calls} calls")

        m = worker.measure_pinned(
            cpu, client_cpu=client_cpu, batch=INFERENCE_BATCH, calls=calls, config=quiet, on_call=advance
        )
        per_cpu[cpu] = [float(x) for x in m.rows[:, col["deschedule_ms"]]]
        extra[cpu], notes[cpu] = _worker_figures(m, col)
    progress.finish()
    return per_cpu, extra, notes


def probe_inference(opts: ProbeOptions) -> Check:
    """The pinned OpenVINO worker on the generated model: per engine call, the deschedule (wall - process
    CPU) graded on p99.9, with wall time, run_delay, switches and isolation alongside."""
    missing = _missing("lowtail.serve.worker_process", "lowtail.serve.model", "lowtail.shm.queue")
    if missing:
        return skip(
            "inference",
            f"{missing} is not installed (lowtail's pinned OpenVINO inference worker and the shared-memory "
            "queue it serves)",
            kind="probe",
        )
    worker = importlib.import_module("lowtail.serve.worker_process")
    if getattr(worker, "measure_pinned", None) is None:
        return skip(
            "inference", "lowtail.serve.worker_process has no measure_pinned() entry point", kind="probe"
        )
    cpus = spread(opts.cpus, INFERENCE_MAX_CPUS)
    client_cpu = opts.main_cpu if opts.main_cpu not in cpus else None
    calls = opts.samples  # each a batch of 16 through the queue, the worker and OpenVINO
    # Counted in calls (the bar's ETA then holds once the first CPU's model is compiled); each CPU
    # first compiles its model, named as a phase so a long compile does not look like a hang.
    progress = Progress(f"inference cpus {cpulist.format(cpus)}", len(cpus) * calls, enabled=opts.progress)
    per_cpu, extra, notes = _measure_each_cpu(worker, cpus, client_cpu, calls, progress)
    check = grade(
        "inference",
        per_cpu,
        opts.limit("inference"),
        "inference deschedule",
        lambda cpu: (extra[cpu], notes[cpu]),
    )
    check.evidence.insert(
        0,
        f"lowtail.serve.worker_process pinned on each CPU, generated model, "
        f"{calls} calls of batch {INFERENCE_BATCH} "
        f"through the queue from CPU {client_cpu if client_cpu is not None else 'unpinned'}; "
        "deschedule = wall - process CPU per engine call (the write-up's formula)",
    )
    not_isolated = [c for c in cpus if not extra[c]["isolated"]]
    if not_isolated and check.status is Status.PASS:
        check.status = Status.WARN
        check.reason = f"worker not isolated on CPU {cpulist.format(not_isolated)}: " + "; ".join(
            extra[c]["isolation"] for c in not_isolated
        )
    return check


def probe_numa(opts: ProbeOptions) -> Check:
    """Create the runtime's default queue segment bound to each NUMA node that has probe CPUs, and read
    where its pages really are (move_pages with no target nodes: a report that faults nothing in)."""
    missing = _missing("lowtail.shm.queue", "lowtail.shm.numa")
    if missing:
        return skip("numa", f"{missing} is not installed (the queue's NUMA helpers)", kind="probe")
    queue = importlib.import_module("lowtail.shm.queue")
    numa = importlib.import_module("lowtail.shm.numa")
    nodes = sorted(n for n in numa.online_nodes() if numa.node_cpus(n) & opts.cpus)
    evidence: list[str] = []
    per_node: dict[str, dict[str, int]] = {}
    misplaced = 0
    total = 0
    for node in nodes:
        with queue.InferenceQueue.create(queue.QueueConfig(numa_node=node)) as q:
            pages = dict(q.placement())
            size = q.nbytes
        n_pages = sum(pages.values())
        on_node = pages.get(f"node{node}", 0)
        total += n_pages
        misplaced += n_pages - on_node
        per_node[str(node)] = pages
        evidence.append(
            f"node {node}: {size / (1 << 20):.1f} MiB queue segment bound with mbind, pre-faulted; "
            f"pages {pages}"
        )
    value = f"{total - misplaced} of {total} pages on their bound node"
    threshold = "every page of a bound segment on its node"
    if misplaced == 0:
        return Check("numa", Status.PASS, value, threshold, evidence, kind="probe", data={"pages": per_node})
    return Check(
        "numa",
        Status.FAIL,
        value,
        threshold,
        evidence,
        reason=f"{misplaced} pages not on the node their segment is bound to (or not present)",
        kind="probe",
        data={"pages": per_node},
    )
