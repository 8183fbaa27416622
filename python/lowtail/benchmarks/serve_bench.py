"""``lowtail bench serve``: the bare OpenVINO loop on one pinned core against the same model served.

The limit is a process pinned to one CPU calling ``infer()`` on batches of B samples back to back. The
served designs put the same model in a pinned worker (``lowtail.serve.worker``) behind the shared-memory
queue, driven by sampler processes in a closed loop (throughput is what the design sustains; latency is
the sampler's submit-to-result time, which includes queueing behind the other samplers):

- ``served xN``: N samplers each submitting batches of B samples (one request per engine call);
- ``traffic NxK``: the predecessor's traffic: N samplers each sending K observations per step
  with the two-phase client (``start`` then ``finish``), the worker coalescing them into engine batches
  of 8-16 samples (the queue's defaults: ``min_batch_samples`` 8, ``max_batch_samples`` 16).

Reported per design: samples/s and served/bare (bare at batch B), sampler-side latency p50/p99/p99.9/max
with n, the mean engine batch, the worker's deschedule p99.9 (wall - CPU per engine call) with n, the
worker's cost per engine call beyond ``infer()`` and, with ``--breakdown``, where that cost goes (the
per-stage columns of ``lowtail.serve.metrics.CALL_FIELDS``), the worker's RSS and the segment sizes.

A design that fails (a sampler error, a worker that does not start) becomes a row with its error; the
other rows are kept and the JSON is always written.
"""

from __future__ import annotations

import argparse
import io
import json
import math
import multiprocessing
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lowtail.cli.main import UsageError
from lowtail.cli.options import (
    add_html,
    add_json,
    add_no_progress,
    add_plot,
    json_to_stdout,
    positive,
    write_json,
)
from lowtail.render import table
from lowtail.render.progress import Progress
from lowtail.serve import metrics
from lowtail.serve.config import FIFO_SCOPES
from lowtail.serve.model import ModelSpec, ModelSpecError, feature_input, find_model_xml, write_model
from lowtail.serve.pinning import (
    SchedFifo,
    pin_thread_to_cpu,
    raise_priority,
    rt_budget_share,
    set_timer_slack_ns,
    start_pinned,
)

TARGET_RATIO = 0.95  # served x2 and x4 at batch 16 (issue 14)
TRAFFIC_TARGET_RATIO = 0.85  # predecessor traffic, 16 samplers x 1 observation
OVERHEAD_TARGET_US = 20.0
REPORT_GRACE_S = 120.0  # a sampler or the bare loop that has not reported this long after its window failed
BREAKDOWN = ("claim_us", "check_us", "fifo_us", "answer_us", "measure_us", "record_us", "overhead_us")


@dataclass(frozen=True)
class Setup:
    model: Path
    cpu: int  # the engine's CPU, bare and served
    batch: int  # samples per engine call of the bare loop and per request of the "served" design
    input_name: str
    features: int
    duration: float
    sampler_cpus: frozenset[int]
    fifo_scope: str = "work"  # the worker's WorkerConfig.fifo_scope; the bare loop does the same
    client_spin_us: int | None = None  # QueueClient.attach(spin_us=...); None: the queue's default

    def observations(self, seed: int, samples: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        return {self.input_name: rng.standard_normal((samples, self.features), dtype=np.float32)}


@dataclass(frozen=True)
class Traffic:
    """One served design: ``samplers`` processes each sending ``per_request`` samples per request."""

    samplers: int
    per_request: int
    coalesce: bool  # the predecessor's traffic: the worker batches 8-16 samples from many requests

    @property
    def label(self) -> str:
        return f"traffic {self.samplers}x{self.per_request}" if self.coalesce else f"served x{self.samplers}"


@dataclass
class DesignResult:
    design: str
    samplers: int
    batch: int  # samples per request (per engine call for bare)
    duration_s: float = float("nan")
    samples: int = 0
    samples_per_s: float = float("nan")
    latency_ms: metrics.Percentiles = field(default_factory=lambda: metrics.percentiles([]))
    deschedule_ms: metrics.Percentiles = field(default_factory=lambda: metrics.percentiles([]))
    ratio_to_bare: float = float("nan")
    engine_ms_mean: float = float("nan")  # infer() per call
    engine_batch_mean: float = float("nan")  # samples per engine call
    overhead_us_mean: float = float("nan")  # per engine call in the worker beyond infer()
    worker_busy: float = 1.0  # share of the window the engine core spent handling calls
    breakdown_us: dict[str, metrics.Percentiles] = field(default_factory=dict)
    worker_rss_mib: float = float("nan")
    queue_mib: float = float("nan")  # the queue's control segment (slots, request and response regions)
    fifo_switches_per_call: float = float("nan")  # scheduling-policy system calls per engine call
    fifo_cooldowns: int = 0  # SCHED_FIFO holds cut short to stay inside the RT budget
    # The samplers' own cost: CPU time per request (submit, wait, read the answer; spinning and parking
    # included) and how busy it kept the sampler CPUs. 16 closed-loop samplers on one vCPU can need
    # more than that CPU has (bench serve's traffic designs on a 2-vCPU host).
    sampler_cpu_us_per_request: float = float("nan")
    sampler_cpus_busy: float = float("nan")
    round: int = 1  # --rounds: each round measures bare and every design again, in the same order
    note: str = ""
    error: str = ""  # why the design failed (its numbers then cover the samplers that did report)

    @property
    def label(self) -> str:
        if self.design == "bare":
            return "bare (limit)"
        return self.design if self.design.startswith("traffic") else f"{self.design} x{self.samplers}"

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["label"] = self.label
        d["latency_ms"] = self.latency_ms.to_dict()
        d["deschedule_ms"] = self.deschedule_ms.to_dict()
        d["breakdown_us"] = metrics.percentiles_dict(self.breakdown_us)
        return d


def register(bench_sub: Any) -> None:
    p = bench_sub.add_parser(
        "serve", help="bare OpenVINO loop vs queue + pinned worker (samplers x batch, predecessor traffic)"
    )
    # The CLI convention (lowtail.cli.options): --json FILE or '-', --plot, --seconds (old names: aliases).
    add_json(p, "the full report (always, even on errors)")
    add_plot(p, "throughput and latency per design", old="--png", dest="png")
    add_html(p)
    p.add_argument("--quick", action="store_true", help="2 s per design instead of 10 s")
    p.add_argument(
        "--seconds",
        "--duration",
        dest="duration",
        type=positive(float),
        help="seconds per design (default 10, 2 with --quick)",
    )
    add_no_progress(p)
    p.add_argument("--batch", type=int, default=16, help="samples per request and per bare engine call")
    p.add_argument("--samplers", default="1,2,4", help="sampler counts of the batch-per-request design")
    p.add_argument(
        "--traffic",
        default="8x1,16x1,8x4,16x4",
        help="predecessor traffic designs SAMPLERSxOBSERVATIONS (the worker coalesces to 8-16); '' for none",
    )
    p.add_argument("--breakdown", action="store_true", help="print where the worker's time goes per call")
    p.add_argument(
        "--rounds",
        type=positive(int),
        default=1,
        help="measure bare and every design this many times, interleaved; targets use the median ratio",
    )
    p.add_argument(
        "--client-spin-us",
        type=int,
        help="samplers spin this long for an answer before parking (default: the queue's, 200); a "
        "spinning sampler needs no futex wake-up from the worker",
    )
    p.add_argument("--model", metavar="DIR", help="OpenVINO IR to serve (default: build the policy model)")
    p.add_argument("--cpu", type=int, help="CPU for the engine (default: the highest CPU allowed)")
    p.add_argument("--ray", action="store_true", help="also serve through the Ray inference actor")
    p.add_argument(
        "--fifo-scope",
        choices=FIFO_SCOPES,
        default="work",
        help="the worker's SCHED_FIFO scope (WorkerConfig.fifo_scope): while requests keep coming, "
        "around each batch (the predecessor's toggle), or through idle spins too; the bare loop, never idle, "
        "toggles per call only under 'call'",
    )
    p.set_defaults(func=run)


# ---- child processes -------------------------------------------------------------------------------


def _bare_child(setup: Setup, conn: Any) -> None:
    from lowtail.serve.engine import Engine

    # The same treatment as the worker, so the only difference between the designs is the serving.
    pin_thread_to_cpu(setup.cpu)
    raise_priority(-20)
    set_timer_slack_ns(1)
    fifo = SchedFifo(1, budget_share=rt_budget_share())
    fifo.detect()
    engine = Engine(setup.model, max_batch=setup.batch)
    x = setup.observations(0, setup.batch)
    duration = setup.duration
    per_call = setup.fifo_scope == "call"
    for _ in range(20):
        engine.infer(x)
    perf, ptime = time.perf_counter_ns, time.process_time_ns
    wall: list[int] = []
    cpu_ns: list[int] = []
    start = perf()
    end = start + int(duration * 1e9)
    t = start
    while t < end:
        c0 = ptime()
        fifo.enter()
        engine.infer(x)
        if per_call:
            fifo.leave()
        t1, c1 = perf(), ptime()
        wall.append(t1 - t)
        cpu_ns.append(c1 - c0)
        t = t1
    conn.send({"calls": len(wall), "elapsed_ns": t - start, "wall_ns": wall, "cpu_ns": cpu_ns})
    conn.close()


def _sampler_child(*, setup: Setup, desc: Any, samples: int, warmup: float, seed: int, conn: Any) -> None:
    """A closed-loop sampler; whatever goes wrong is sent back as its report's error."""
    lat: list[int] = []
    cpu_ns = 0
    start = t = time.perf_counter_ns()
    start_mono = time.monotonic()
    try:
        from lowtail.shm.queue import QueueClient

        raise_priority(-20)  # in production a sampler owns an isolated core; here it shares with others
        x = setup.observations(seed, samples)
        duration = setup.duration
        perf = time.perf_counter_ns
        with QueueClient.attach(desc, spin_us=setup.client_spin_us) as client:
            end = perf() + int(warmup * 1e9)
            while perf() < end:
                client.start(x).finish(timeout_s=10.0)
            start_mono = time.monotonic()
            cpu0 = time.process_time_ns()
            start = t = perf()
            end = start + int(duration * 1e9)
            while t < end:
                client.start(x).finish(timeout_s=10.0)  # the predecessor's two-phase client
                t1 = perf()
                lat.append(t1 - t)
                t = t1
            cpu_ns = time.process_time_ns() - cpu0
        error = ""
    except BaseException as e:  # every failure becomes the sampler's row, never a hang
        error = "".join(traceback.format_exception_only(type(e), e)).strip()
    conn.send(
        {
            "requests": len(lat),
            "elapsed_ns": t - start,
            "lat_ns": lat,
            "window": (start_mono, time.monotonic()),
            "cpu_ns": cpu_ns,
            "error": error,
        }
    )
    conn.close()


# ---- designs ---------------------------------------------------------------------------------------


def _ms(ns: list[int] | np.ndarray) -> np.ndarray:
    return np.asarray(ns, dtype=np.float64) / 1e6


def _reap(procs: list[Any]) -> None:
    for p in procs:
        p.join(10)
        if p.is_alive():
            p.kill()
            p.join()


def run_bare(setup: Setup) -> DesignResult:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_bare_child, args=(setup, child), daemon=True)
    start_pinned(proc, setup.cpu)
    child.close()
    batch = setup.batch
    try:
        if not parent.poll(setup.duration + REPORT_GRACE_S):
            raise RuntimeError(f"the bare loop did not report within {setup.duration + REPORT_GRACE_S:g} s")
        try:
            r = parent.recv()
        except EOFError:
            raise RuntimeError("the bare loop died before reporting (see its traceback above)") from None
    finally:
        _reap([proc])
    wall = _ms(r["wall_ns"])
    desched = np.maximum(0.0, wall - _ms(r["cpu_ns"]))
    elapsed = r["elapsed_ns"] / 1e9
    return DesignResult(
        design="bare",
        samplers=0,
        batch=batch,
        duration_s=elapsed,
        samples=r["calls"] * batch,
        samples_per_s=r["calls"] * batch / elapsed,
        latency_ms=metrics.percentiles(wall),
        deschedule_ms=metrics.percentiles(desched),
        ratio_to_bare=1.0,
        engine_ms_mean=float(wall.mean()),
        engine_batch_mean=float(batch),
        note=f"infer() back to back on CPU {setup.cpu}",
    )


def request_bytes(samples: int, features: int) -> int:
    """A request/response slot that holds ``samples`` float32 rows of ``features`` inline, with headers."""
    payload = samples * features * 4 + 4096
    return payload + -payload % 64


def _queue_config(setup: Setup, traffic: Traffic) -> Any:
    from lowtail.shm.queue import QueueConfig

    size = request_bytes(max(traffic.per_request, setup.batch), setup.features)
    if traffic.coalesce:  # the queue's defaults: min 8, max 16 samples, up to 16 requests per batch
        return QueueConfig(
            lanes=max(4, traffic.samplers), slots_per_lane=4, request_bytes=size, response_bytes=size
        )
    return QueueConfig(
        lanes=max(4, traffic.samplers),
        slots_per_lane=4,
        request_bytes=size,
        response_bytes=size,
        max_batch_samples=setup.batch,
        min_batch_samples=1,
        max_batch_slots=max(1, traffic.samplers),
    )


def _drive(setup: Setup, descriptor: Any, traffic: Traffic) -> list[dict[str, Any]]:
    """Run the samplers against a queue; one report each (a sampler that failed reports its error)."""
    ctx = multiprocessing.get_context("spawn")
    warmup = min(1.0, setup.duration / 4)
    procs, conns = [], []
    try:
        for i in range(traffic.samplers):
            parent, child = ctx.Pipe(duplex=False)
            kw = {"setup": setup, "desc": descriptor, "samples": traffic.per_request, "warmup": warmup}
            p = ctx.Process(target=_sampler_child, kwargs={**kw, "seed": i, "conn": child}, daemon=True)
            saved = os.sched_getaffinity(0)
            os.sched_setaffinity(0, setup.sampler_cpus)
            try:
                p.start()
            finally:
                os.sched_setaffinity(0, saved)
            child.close()
            procs.append(p)
            conns.append(parent)
        deadline = time.monotonic() + setup.duration + warmup + REPORT_GRACE_S
        results = []
        for i, c in enumerate(conns):
            try:
                if c.poll(max(0.0, deadline - time.monotonic())):
                    results.append(c.recv())
                    continue
                why = "no report before the deadline"
            except EOFError:
                why = f"exited with code {procs[i].exitcode} without reporting"
            results.append({"requests": 0, "elapsed_ns": 0, "lat_ns": [], "error": f"sampler {i}: {why}"})
        return results
    finally:
        _reap(procs)


def _worker_rss_mib(pid: int) -> float:
    import psutil

    try:
        return float(psutil.Process(pid).memory_info().rss) / 2**20
    except psutil.Error:
        return float("nan")


def _served_result(
    design: str,
    *,
    setup: Setup,
    traffic: Traffic,
    results: list[dict[str, Any]],
    calls: np.ndarray,
    note: str,
) -> DesignResult:
    errors = [f"sampler {i}: {r['error']}" for i, r in enumerate(results) if r.get("error")]
    ok = [r for r in results if not r.get("error") and r["requests"]]
    res = DesignResult(design=design, samplers=traffic.samplers, batch=traffic.per_request)
    res.error = "; ".join(errors)
    if not ok:
        res.note = note
        res.error = res.error or "no sampler completed a request"
        return res
    lat = np.concatenate([_ms(r["lat_ns"]) for r in ok])
    elapsed = max(r["elapsed_ns"] for r in ok) / 1e9
    samples = sum(r["requests"] for r in ok) * traffic.per_request
    # The worker's calls inside the samplers' measured windows (their warm-up excluded).
    lo, hi = min(r["window"][0] for r in ok), max(r["window"][1] for r in ok)
    col = metrics.COL
    t_end = calls[:, col["t_end_s"]]
    calls = calls[(t_end >= lo) & (t_end <= hi)]
    res.duration_s = elapsed
    res.sampler_cpu_us_per_request = sum(r["cpu_ns"] for r in ok) / 1e3 / sum(r["requests"] for r in ok)
    res.sampler_cpus_busy = sum(r["cpu_ns"] for r in ok) / 1e9 / elapsed / len(setup.sampler_cpus)
    res.samples = samples
    res.samples_per_s = samples / elapsed
    res.latency_ms = metrics.percentiles(lat)
    res.note = f"{note}, samplers on CPUs {sorted(setup.sampler_cpus)}"
    if len(calls):
        wall_ms, engine_ms = calls[:, col["wall_ms"]], calls[:, col["engine_wall_ms"]]
        res.deschedule_ms = metrics.percentiles(calls[:, col["deschedule_ms"]])
        res.engine_ms_mean = float(engine_ms.mean())
        res.engine_batch_mean = float(calls[:, col["batch"]].mean())
        res.breakdown_us = metrics.summarize(calls, BREAKDOWN)
        res.overhead_us_mean = res.breakdown_us["overhead_us"].mean
        res.worker_busy = float(wall_ms.sum() / 1000 / (hi - lo))
    return res


def run_served(setup: Setup, traffic: Traffic) -> DesignResult:
    """The queue and the pinned worker, owned by this process."""
    from lowtail.serve.worker import WorkerConfig, WorkerProcess
    from lowtail.shm.queue import InferenceQueue

    with InferenceQueue.create(_queue_config(setup, traffic)) as queue:
        config = WorkerConfig(name="bench", max_batch=16, fifo_scope=setup.fifo_scope)
        worker = WorkerProcess.start(queue.descriptor, setup.cpu, setup.model, config)
        try:
            worker.wait_ready(120)
            results = _drive(setup, queue.descriptor, traffic)
            report = worker.report(0)
            calls = worker.calls(0).rows
            rss = _worker_rss_mib(worker.pid)
        finally:
            worker.stop()
        queue_mib = queue.nbytes / 2**20
    note = f"queue + pinned worker on CPU {setup.cpu}"
    res = _served_result(
        traffic.label.split(" x")[0], setup=setup, traffic=traffic, results=results, calls=calls, note=note
    )
    res.worker_rss_mib, res.queue_mib = rss, queue_mib
    res.fifo_switches_per_call = report.fifo_switches / max(report.calls, 1)
    res.fifo_cooldowns = report.fifo_cooldowns
    return res


def run_ray_served(setup: Setup, traffic: Traffic, work: Path) -> DesignResult:
    """The same, hosted by the Ray inference actor: it leases the CPU, owns the queue, spawns the worker.

    Samplers attach to the endpoint's queue exactly as ``InferenceClient`` does; Ray is not on the hot
    path. The worker's side comes from the actor's ``report`` (percentiles over every call the worker
    served, the samplers' warm-up included; the core's busy share is not reported for this design).
    """
    import ray

    from lowtail.actors.allocator import AllocatorConfig, get_node_allocator, stop_node_allocator
    from lowtail.actors.inference import InferenceSpec, start_inference_actor, stop_actor
    from lowtail.lease import node_plan
    from lowtail.serve.worker import WorkerConfig

    node = ray.get_runtime_context().get_node_id()
    # The allocator leases exactly the bench's engine CPU (a demo-style pool override), so the actor's
    # worker lands where the bare loop ran.
    alloc = AllocatorConfig(state_dir=str(work / "leases"), plan=node_plan().to_dict(), pool=str(setup.cpu))
    get_node_allocator(node, alloc)
    spec = InferenceSpec(
        hero="bench",
        index=traffic.samplers,
        model_dir=str(setup.model),
        allocator=alloc,
        queue=_queue_config(setup, traffic),
        worker=WorkerConfig(name="bench-ray", max_batch=16, fifo_scope=setup.fifo_scope),
    )
    actor = start_inference_actor(spec, node)
    try:
        endpoint = ray.get(actor.endpoint.remote())
        if endpoint.cpu != setup.cpu:
            raise RuntimeError(f"the actor leased CPU {endpoint.cpu}, expected {setup.cpu}")
        results = _drive(setup, endpoint.descriptor, traffic)
        worker = ray.get(actor.report.remote())["report"]
    finally:
        stop_actor(actor)
        stop_node_allocator(node, remove_state=True)
    note = f"Ray inference actor (lease, queue, worker) on CPU {setup.cpu}"
    no_rows = np.zeros((0, len(metrics.CALL_FIELDS)))
    r = _served_result("ray actor", setup=setup, traffic=traffic, results=results, calls=no_rows, note=note)
    pct = worker["percentiles"]
    r.deschedule_ms = metrics.Percentiles(**pct["deschedule_ms"])
    r.engine_ms_mean = pct["engine_wall_ms"]["mean"]
    r.engine_batch_mean = pct["batch"]["mean"]
    r.overhead_us_mean = pct["overhead_us"]["mean"]
    r.breakdown_us = {k: metrics.Percentiles(**pct[k]) for k in BREAKDOWN}
    r.worker_busy = float("nan")
    return r


def _start_ray(work: Path) -> None:
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local, single-user cluster
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["RAY_TMPDIR"] = str(work)  # Ray's session files go away with the work dir
    ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False)


def _attempt(label: str, fn: Any, *args: Any) -> DesignResult:
    """Run one design; an exception becomes its row instead of ending the benchmark."""
    try:
        result: DesignResult = fn(*args)
        return result
    except Exception as e:  # the other designs' rows must survive
        detail = "".join(traceback.format_exception_only(type(e), e)).strip()
        print(f"  {label} failed: {detail}", file=sys.stderr, flush=True)
        design, _, samplers = label.partition(" x")
        return DesignResult(design=design, samplers=int(samplers or 0), batch=0, error=detail)


# ---- report ----------------------------------------------------------------------------------------


def _f(v: float, spec: str) -> str:
    return "-" if math.isnan(v) else format(v, spec)


def _short(error: str, width: int = 70) -> str:
    """The first error of a row, shortened for the terminal (the JSON has all of them)."""
    if not error:
        return ""
    first, _, rest = error.partition("; ")
    more = f" (+{rest.count('; ') + 1} more)" if rest else ""
    return "ERROR " + (first if len(first) <= width else first[: width - 3] + "...") + more


def _fmt(p: metrics.Percentiles) -> list[str]:
    return [_f(p.p50, ".3f"), _f(p.p99, ".3f"), _f(p.p999, ".3f"), _f(p.max, ".3f"), str(p.n)]


def _row_label(r: DesignResult, rounds: int) -> str:
    return f"{r.label} #{r.round}" if rounds > 1 else r.label


def render_table(results: list[DesignResult]) -> str:
    rows = []
    rounds = max(r.round for r in results)
    for r in results:
        rows.append(
            [
                _row_label(r, rounds),
                str(r.batch),
                _f(r.samples_per_s, ",.0f"),
                _f(r.ratio_to_bare, ".3f"),
                *_fmt(r.latency_ms),
                _f(r.engine_batch_mean, ".1f"),
                _f(r.deschedule_ms.p999, ".3f"),
                str(r.deschedule_ms.n),
                _f(r.engine_ms_mean, ".3f"),
                _f(r.overhead_us_mean, ".0f"),
                _f(r.worker_busy, ".0%"),
                _f(r.sampler_cpu_us_per_request, ".0f"),
                _f(r.sampler_cpus_busy, ".0%"),
                _short(r.error),
            ]
        )
    headers = ["design", "req", "samples/s", "vs bare", "lat p50 ms", "p99", "p99.9", "max", "n"]
    headers += ["eng batch", "desched p99.9 ms", "n calls", "infer ms", "+us/call", "core busy"]
    headers += ["sampler us/req", "sampler CPUs busy", "error"]
    return table.render(headers, rows, title=f"lowtail bench serve: bare at batch {results[0].batch}")


def render_rounds(results: list[DesignResult]) -> str:
    ratios = ratios_by_design(results)
    n = max(len(v) for v in ratios.values()) if ratios else 0
    rows = [
        [
            label,
            *[f"{x:.3f}" for x in got],
            *[""] * (n - len(got)),
            f"{_median(got):.3f}",
            f"{min(got):.3f}-{max(got):.3f}",
        ]
        for label, got in ratios.items()
    ]
    headers = ["design", *[f"round {i + 1}" for i in range(n)], "median", "range"]
    return table.render(headers, rows, title="served/bare per round (each against its own round's bare loop)")


def render_breakdown(results: list[DesignResult]) -> str:
    rows = []
    rounds = max(r.round for r in results)
    for r in results:
        if not r.breakdown_us:
            continue
        rows.append(
            [_row_label(r, rounds), str(r.breakdown_us["overhead_us"].n)]
            + [f"{b.p50:.1f}/{b.mean:.1f}/{b.p99:.0f}" for b in (r.breakdown_us[k] for k in BREAKDOWN)]
            + [_f(r.fifo_switches_per_call, ".2f"), str(r.fifo_cooldowns)]
            + [_f(r.worker_rss_mib, ".0f"), _f(r.queue_mib, ".2f")]
        )
    headers = [
        "design",
        "n calls",
        *[k.removesuffix("_us") for k in BREAKDOWN],
        "FIFO sw/call",
        "cooldowns",
        "RSS MiB",
        "queue MiB",
    ]
    return table.render(
        headers, rows, title="worker cost per engine call beyond infer(), us p50/mean/p99 (CALL_FIELDS)"
    )


def plot(results: list[DesignResult]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    last = max(r.round for r in results)
    results = [r for r in results if r.round == last]  # one round per bar; every round is in the JSON
    labels = [r.label for r in results]
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4.5))
    colors = ["#555"] + ["#c33" if r.error else "#3a7" for r in results[1:]]
    a.bar(labels, [0 if math.isnan(r.samples_per_s) else r.samples_per_s for r in results], color=colors)
    bare = results[0].samples_per_s
    a.axhline(bare * TARGET_RATIO, color="r", ls="--", lw=1, label=f"{TARGET_RATIO:.0%} of bare")
    a.axhline(bare * TRAFFIC_TARGET_RATIO, color="orange", ls=":", lw=1, label=f"{TRAFFIC_TARGET_RATIO:.0%}")
    a.set_ylabel("samples/s")
    a.set_title(
        f"throughput (bare at batch {results[0].batch}; red = error)"
        + (f", round {last}" if last > 1 else "")
    )
    a.legend()
    xs = np.arange(len(results))
    for i, (q, name) in enumerate([("p50", "p50"), ("p99", "p99"), ("p999", "p99.9")]):
        b.bar(xs + (i - 1) * 0.27, [getattr(r.latency_ms, q) for r in results], 0.27, label=name)
    b.set_xticks(xs, labels)
    b.set_yscale("log")
    b.set_ylabel("ms per call / request")
    b.set_title("latency (n in the JSON)")
    b.legend()
    served = [r for r in results if r.breakdown_us]
    bottom = np.zeros(len(served))
    for k in BREAKDOWN[:-1]:
        v = np.array([r.breakdown_us[k].mean for r in served])
        c.bar([r.label for r in served], v, bottom=bottom, label=k.removesuffix("_us"))
        bottom += v
    c.axhline(OVERHEAD_TARGET_US, color="r", ls="--", lw=1, label=f"target {OVERHEAD_TARGET_US:g} us")
    c.set_ylabel("us per engine call (mean)")
    c.set_title("worker cost beyond infer()")
    c.legend(fontsize=7)
    for ax in (a, b, c):
        ax.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def json_safe(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # strict JSON has no NaN
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)):
        return [json_safe(x) for x in v]
    return v


def parse_traffic(text: str) -> list[Traffic]:
    out = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            n, k = (int(x) for x in part.lower().split("x"))
        except ValueError:
            raise UsageError(f"--traffic {text!r}: expected SAMPLERSxOBSERVATIONS like 16x1,8x4") from None
        if not (1 <= n <= 64 and 1 <= k <= 16):
            raise UsageError(f"--traffic {part!r}: expected 1..64 samplers x 1..16 observations")
        out.append(Traffic(n, k, coalesce=True))
    return out


def ratios_by_design(results: list[DesignResult]) -> dict[str, list[float]]:
    """served/bare of every round, per design label (each round against its own bare loop)."""
    out: dict[str, list[float]] = {}
    for r in results:
        if r.design != "bare":
            out.setdefault(r.label, []).append(r.ratio_to_bare)
    return out


def _median(values: list[float]) -> float:
    return float(np.median(values)) if values else float("nan")


def _spread(values: list[float]) -> str:
    if len(values) < 2:
        return f"{_median(values):.3f}"
    return f"{_median(values):.3f}, median of {len(values)} rounds, {min(values):.3f}-{max(values):.3f}"


def verdicts(results: list[DesignResult], batch: int) -> list[str]:
    """The issue's targets, each stated as met or NOT met with the figure that decides it.

    With several rounds a ratio target is decided by the median of the rounds' ratios (each round's
    served designs against that round's bare loop), and the range is printed next to it.
    """
    ratios = ratios_by_design(results)
    by = {r.label: r for r in results}  # the last round's result per label
    lines = []
    for n in (2, 4):
        got = ratios.get(f"served x{n}")
        if got:
            ok = _median(got) >= TARGET_RATIO
            lines.append(
                f"served x{n} >= {TARGET_RATIO:.0%} of bare at batch {batch}: "
                f"{'met' if ok else 'NOT met'} ({_spread(got)})"
            )
    got = ratios.get("traffic 16x1")
    if got:
        ok = _median(got) >= TRAFFIC_TARGET_RATIO
        runs = [r for r in results if r.label == "traffic 16x1"]
        per_req = _median([r.sampler_cpu_us_per_request for r in runs])
        lines.append(
            f"traffic 16x1 >= {TRAFFIC_TARGET_RATIO:.0%} of bare: {'met' if ok else 'NOT met'} "
            f"({_spread(got)}; mean engine batch {_median([r.engine_batch_mean for r in runs]):.1f}; "
            f"the samplers used {per_req:.0f} us of CPU per request, "
            f"{_median([r.sampler_cpus_busy for r in runs]):.0%} of their CPUs)"
        )
    over: dict[str, list[float]] = {}
    for r in results:
        if r.breakdown_us and r.design == "served":
            over.setdefault(r.label, []).append(r.overhead_us_mean)
    if over:
        worst = max(over, key=lambda k: _median(over[k]))
        value = _median(over[worst])
        ok = value <= OVERHEAD_TARGET_US
        lines.append(
            f"worker overhead beyond infer() <= {OVERHEAD_TARGET_US:g} us (mean, worst served design): "
            f"{'met' if ok else 'NOT met'} ({value:.1f} us, {by[worst].label})"
        )
    failed = [r.label for r in results if r.error]
    if failed:
        lines.append(f"designs with errors: {', '.join(failed)}")
    return lines


def run(args: argparse.Namespace) -> int:
    if args.batch < 1:
        raise UsageError(f"--batch {args.batch}: expected >= 1")
    try:
        counts = [int(x) for x in args.samplers.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--samplers {args.samplers!r}: expected counts like 1,2,4") from None
    if any(c < 1 or c > 64 for c in counts):
        raise UsageError(f"--samplers {args.samplers!r}: expected counts in 1..64")
    designs = [Traffic(n, args.batch, coalesce=False) for n in counts] + parse_traffic(args.traffic)
    if not designs:
        raise UsageError("--samplers and --traffic are both empty: nothing to serve")
    duration = args.duration or (2.0 if args.quick else 10.0)
    allowed = os.sched_getaffinity(0)
    cpu = max(allowed) if args.cpu is None else args.cpu
    if cpu not in allowed:
        raise UsageError(f"--cpu {cpu}: expected one of the CPUs this process may use, {sorted(allowed)}")
    sampler_cpus = (allowed - {cpu}) or allowed
    load_before = os.getloadavg()
    results: list[DesignResult] = []
    report: dict[str, Any] = {
        "benchmark": "serve",
        "command": "lowtail " + " ".join(sys.argv[1:]) if sys.argv else "",
        "cpu": cpu,
        "sampler_cpus": sorted(sampler_cpus),
        "batch": args.batch,
        "fifo_scope": args.fifo_scope,
        "client_spin_us": args.client_spin_us,
        "duration_s": duration,
        "targets": {
            "served_vs_bare": TARGET_RATIO,
            "traffic_16x1_vs_bare": TRAFFIC_TARGET_RATIO,
            "overhead_us": OVERHEAD_TARGET_US,
        },
        "note": "served/traffic: queue + pinned worker owned by the benchmark process"
        + ("; ray actor: the same hosted by lowtail's Ray inference actor" if args.ray else ""),
    }
    try:
        with tempfile.TemporaryDirectory(prefix="lowtail-bench-") as tmp:
            if args.model:
                try:
                    model = find_model_xml(args.model)
                except FileNotFoundError as e:
                    raise UsageError(str(e)) from None
            else:
                model = write_model(tmp, ModelSpec())
            try:
                name, features = feature_input(model)
            except ModelSpecError as e:
                raise UsageError(str(e)) from None
            report["model"] = str(model) if args.model else "built: " + json.dumps(ModelSpec().to_dict())
            if args.client_spin_us is not None and not 0 <= args.client_spin_us <= 1_000_000:
                raise UsageError(f"--client-spin-us {args.client_spin_us}: expected 0..1000000")
            setup = Setup(
                model,
                cpu,
                args.batch,
                name,
                features,
                duration,
                frozenset(sampler_cpus),
                args.fifo_scope,
                args.client_spin_us,
            )
            rounds = args.rounds
            total = rounds * (1 + len(designs)) + (len(designs) if args.ray else 0)
            bar = Progress(f"bench serve ({duration:g} s per design)", total, enabled=not args.no_progress)
            # Rounds interleave the designs, so a slow minute of a shared host hits one round of each
            # rather than every round of one design.
            for rnd in range(1, rounds + 1):
                tag = f"round {rnd}/{rounds}: " if rounds > 1 else ""
                bar.update(len(results), tag + "bare loop")
                results.append(_attempt("bare", run_bare, setup))
                for t in designs:
                    bar.update(len(results), tag + t.label)
                    results.append(_attempt(t.label, run_served, setup, t))
                for r in results[-1 - len(designs) :]:
                    r.round = rnd
            if args.ray:
                import ray

                bar.update(len(results), "starting a local Ray")
                own = not ray.is_initialized()
                if own:
                    _start_ray(Path(tmp))
                try:
                    for t in designs:
                        bar.update(len(results), f"Ray actor, {t.label}")
                        label = f"ray actor x{t.samplers}"
                        results.append(_attempt(label, run_ray_served, setup, t, Path(tmp)))
                finally:
                    if own:
                        ray.shutdown()
            bar.finish()
    finally:
        _finish(args, report, results, load_before)
    return 1 if any(r.error for r in results) else 0


def _finish(
    args: argparse.Namespace,
    report: dict[str, Any],
    results: list[DesignResult],
    load_before: tuple[float, ...],
) -> None:
    """Print and write whatever was measured: also when a design failed or the run was interrupted."""
    bare = float("nan")
    for r in results:  # each round's designs against the bare loop measured just before them
        if r.design == "bare":
            bare = r.samples_per_s
        else:
            r.ratio_to_bare = r.samples_per_s / bare
    load_after = os.getloadavg()
    report["host"] = {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": load_after}
    report["results"] = [r.to_dict() for r in results]
    lines = verdicts(results, args.batch) if results else ["no design finished"]
    report["verdicts"] = lines
    host = f"SCHED_FIFO scope {args.fifo_scope}; host: {os.cpu_count()} CPUs, 1-min load average "
    host += f"{load_before[0]:.1f} before, {load_after[0]:.1f} after"
    write_json(args.json, json_safe(report))
    if not results or json_to_stdout(args):
        return
    text = render_table(results)
    if args.rounds > 1:
        text += "\n\n" + render_rounds(results)
    if args.breakdown:
        text += "\n\n" + render_breakdown(results)
    print(text)
    print("\n".join(lines))
    print(host)
    if results[0].design == "bare" and (args.png or args.html):
        png = plot(results)
        if args.png:
            Path(args.png).write_bytes(png)
        if args.html:
            from lowtail.render import html

            section = html.Section(
                "Results",
                text=text + "\n" + "\n".join(lines) + f"\n{host}",
                images=[html.Image("throughput, latency and worker cost", png)],
            )
            Path(args.html).write_text(html.report("lowtail bench serve", [section], data=json_safe(report)))
