"""The runs of ``lowtail bench serve`` (see ``serve_bench``): the bare loop, the served designs through
the queue and a pinned worker, the same behind the Ray inference actor, and the sampler processes that
drive them. Each design returns a ``DesignResult``; a design that fails returns one carrying its error.
"""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lowtail.node.signals import deaf_to_ctrl_c
from lowtail.serve import call_stats as metrics
from lowtail.serve.pinning import (
    SchedFifo,
    pin_thread_to_cpu,
    raise_priority,
    rt_budget_share,
    set_timer_slack_ns,
    start_pinned,
)

REPORT_GRACE_S = 120.0  # a sampler or the bare loop that has not reported this long after its window failed
BREAKDOWN = ("claim_us", "check_us", "fifo_us", "answer_us", "measure_us", "record_us", "overhead_us")
# The futex wakes of parked samplers, on their own (part of answer_us, not a stage of their own): the
# system calls' time, the lanes woken, and the overhead without them, which the worker's target grades.
WAKES = ("wake_us", "woken", "overhead_less_wakes_us")
# One round trip, stage by stage, from the stamps every answer already carries (``Ticket.stamps``,
# ``RequestTiming``; CLOCK_MONOTONIC in both processes), in us:
# - copy_in: ``submit`` entered -> its submit stamp (layout check, slot, the request's copy-in);
# - to_claim: submit stamp -> the worker's claim stamp (publication, the worker's wake-up or spin,
#   its poll, the claim; and queueing behind other lanes' requests);
# - worker: claim -> answer stamp minus the engine call (decode, merge, input check, SCHED_FIFO,
#   split, the answer's copy; per call, shared by the requests that rode in it);
# - compute: the engine call's infer() wall time;
# - to_client: answer stamp -> the client saw it (publication, the client's spin or futex wake-up);
# - copy_out: the client saw it -> ``wait`` returned (the answer's copy-out).
# Not stamped separately: the worker's wake-up from its claim (one stamp covers both: to_claim), and
# the publish of the answer from its copy (both in worker; ``--breakdown``'s answer_us per call).
STAGES = ("copy_in_us", "to_claim_us", "worker_us", "compute_us", "to_client_us", "copy_out_us")


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
    stages: bool = False  # samplers record each round trip's STAGES (--breakdown; ~1 us per request)
    coalesce: tuple[int, int] | None = None  # traffic designs: (min_batch_samples, coalesce_us) or defaults
    # How samplers call: "one-call" (``infer_or_pending``, what the actors' ``InferenceClient.infer`` makes)
    # or "two-phase" (``start`` then ``finish``; --compare-two-phase).
    sampler_call: str = "one-call"

    def observations(self, seed: int, samples: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        return {self.input_name: rng.standard_normal((samples, self.features), dtype=np.float32)}


@dataclass(frozen=True)
class Traffic:
    """One served design: ``samplers`` processes each sending ``per_request`` samples per request."""

    samplers: int
    per_request: int
    coalesce: bool  # the traffic designs: the worker batches 8-16 samples from many requests

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
    stages_us: dict[str, metrics.Percentiles] = field(default_factory=dict)  # STAGES, per request
    worker_rss_mib: float = float("nan")
    queue_mib: float = float("nan")  # the queue's control segment (slots, request and response regions)
    fifo_switches_per_call: float = float("nan")  # scheduling-policy system calls per engine call
    fifo_cooldowns: int = 0  # SCHED_FIFO holds cut short to stay inside the RT budget
    # The samplers' own cost: CPU time per request of the thread that submits and waits (submit, wait,
    # read the answer; spinning and parking included; these samplers have no environment step) and
    # how busy it kept the sampler CPUs. 16 closed-loop samplers on one vCPU can need more than that
    # CPU has (bench serve's traffic designs on a 2-vCPU host). The spin budget their clients chose
    # (QueueClient.spin_policy; -1: none reported) and why.
    sampler_cpu_us_per_request: float = float("nan")
    sampler_cpus_busy: float = float("nan")
    sampler_spin_us: int = -1
    sampler_spin_reason: str = ""
    sampler_cpu_count: int = 0  # the CPUs the samplers shared (their affinity)
    # Where that CPU went, per request (SAMPLER_COSTS; empty when no sampler reported them).
    sampler_costs: dict[str, float] = field(default_factory=dict)
    # A coalescing traffic design's ceilings on this host, from the run's own figures (all but the
    # worker's count lowtail's cost as zero): serve_report.traffic_limits. Empty for the other designs.
    limits: dict[str, float] = field(default_factory=dict)
    round: int = 1  # --rounds: each round measures bare and every design again, in the same order
    # The row's variant in its label: the ladder's model ("1 ms", --model-ms) or the samplers' spin
    # ("spin 200 us", --compare-spin-us); "" for a default row.
    size: str = ""
    note: str = ""
    error: str = ""  # why the design failed (its numbers then cover the samplers that did report)

    @property
    def label(self) -> str:
        if self.design == "bare":
            base = "bare (limit)"
        else:
            base = self.design if self.design.startswith("traffic") else f"{self.design} x{self.samplers}"
        return f"{base} @{self.size}" if self.size else base

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["label"] = self.label
        d["latency_ms"] = self.latency_ms.to_dict()
        d["deschedule_ms"] = self.deschedule_ms.to_dict()
        d["breakdown_us"] = metrics.percentiles_dict(self.breakdown_us)
        d["stages_us"] = metrics.percentiles_dict(self.stages_us)
        return d


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


# Where a sampler thread's CPU goes, per request (``--breakdown``'s sampler table; sums over the
# samplers divided by their requests): user and system time, voluntary context switches (each a park's
# sleep), involuntary ones (preempted), the time runnable but waiting for its CPU, the wall time spent
# spinning and parked, what share of the answers found the client parked, and the measuring loop's own
# CPU (its clock reads and lists, timed on its own after the window: not the queue's). ``code_us``: the
# window's wall time outside the parks, the client's code (and the loop) as it ran, mostly alone (the
# involuntary switches say how often not); the CPU beyond it is the parks' sleep, switch and wake-up,
# which getrusage's tick-sampled user/system split spreads over both.
SAMPLER_COSTS = (
    "user_us",
    "sys_us",
    "code_us",
    "vol_cs",
    "invol_cs",
    "run_delay_us",
    "spin_us",
    "park_us",
    "parked",
    "loop_us",
)


def _thread_costs() -> tuple[int, int, int, int, int]:
    """The calling thread's (user ns, system ns, voluntary and involuntary context switches, ns runnable
    but not running); the last is 0 where the kernel keeps no schedstat."""
    import resource

    ru = resource.getrusage(resource.RUSAGE_THREAD)
    try:
        with open("/proc/thread-self/schedstat") as f:
            delay = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        delay = 0
    return int(ru.ru_utime * 1e9), int(ru.ru_stime * 1e9), ru.ru_nvcsw, ru.ru_nivcsw, delay


def _loop_ns(stages: bool, client: Any, last: Any, n: int = 20_000) -> int:
    """This thread's CPU per pass of the measuring loop without the request (its clock read, the list
    appends, with ``stages`` the stage tuple of ``last``, the loop's last request): the part of ``cpu_ns``
    that is the harness's."""
    perf, lat, rows = time.perf_counter_ns, [], []
    c0 = time.thread_time_ns()
    t = perf()
    for _ in range(n):
        t1 = perf()
        lat.append(t1 - t)
        t = t1
        if stages:
            rows.append(request_stages(client, last))
    return (time.thread_time_ns() - c0) // n


def _window_costs(
    client: Any, before: tuple[Any, Any, Any], stages: bool, last: Any, n: int, *, wall_ns: int
) -> dict[str, int]:
    """A sampler's costs over its window (SAMPLER_COSTS' sums): ``before`` is its client's wait counts
    and times and ``_thread_costs()`` at the window's start, ``wall_ns`` the window's wall time."""
    counts0, times0, th0 = before
    th1, times1, counts1 = _thread_costs(), client.wait_times, client.wait_counts
    keys = ("user_ns", "sys_ns", "vol_cs", "invol_cs", "run_delay_ns")
    costs = dict(zip(keys, (b - a for a, b in zip(th0, th1, strict=True)), strict=True))
    costs |= {k: times1[k] - times0[k] for k in times0}
    costs |= {k: counts1[k] - counts0[k] for k in counts0}
    costs["loop_ns"] = _loop_ns(stages, client, last) * n
    costs["code_ns"] = wall_ns - costs["park_ns"]
    return costs


def _sampler_child(*, setup: Setup, desc: Any, samples: int, warmup: float, seed: int, conn: Any) -> None:
    """A closed-loop sampler; whatever goes wrong is sent back as its report's error."""
    lat: list[int] = []
    stages: list[tuple[int, ...]] = []
    cpu_ns = 0
    costs: dict[str, int] = {}
    spin: tuple[int, str] = (-1, "")
    start = t = time.perf_counter_ns()
    start_mono = time.monotonic()
    try:
        from lowtail.shm.queue import QueueClient

        raise_priority(-20)  # in production a sampler owns an isolated core; here it shares with others
        x = setup.observations(seed, samples)
        duration = setup.duration
        perf = time.perf_counter_ns
        with QueueClient.attach(desc, spin_us=setup.client_spin_us) as client:
            spin = (client.spin_policy.spin_us, client.spin_policy.reason)
            end = perf() + int(warmup * 1e9)
            while perf() < end:
                client.start(x).finish(timeout_s=10.0)
            start_mono = time.monotonic()
            # This thread's CPU (the one that submits and waits), not the process's: a sampler has
            # no environment step here, so all of it is the request's cost.
            counts0, times0, th0 = client.wait_counts, client.wait_times, _thread_costs()
            cpu0 = time.thread_time_ns()
            start = perf()
            got, t = _requests(client, x, setup, (start, start + int(duration * 1e9)), lat=lat, stages=stages)
            cpu_ns = time.thread_time_ns() - cpu0
            costs = _window_costs(
                client, (counts0, times0, th0), setup.stages, got, len(lat), wall_ns=t - start
            )
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
            "spin": spin,
            "costs": costs,
            "stages_ns": stages,
            "error": error,
        }
    )
    conn.close()


def _requests(
    client: Any,
    x: Any,
    setup: Setup,
    window: tuple[int, int],
    *,
    lat: list[int],
    stages: list[tuple[int, ...]],
) -> tuple[Any, int]:
    """A sampler's measured requests over ``window`` (start, end: ``perf_counter_ns``), each one's
    latency into ``lat`` and, with ``setup.stages``, its STAGES into ``stages``. Returns the last one's
    result (outputs or Pending) and when it ended."""
    from lowtail.shm.queue import Pending

    t, end = window
    one_call, send, infer = setup.sampler_call == "one-call", client.start, client.infer_or_pending
    perf, got = time.perf_counter_ns, None
    while t < end:
        if one_call:
            got = infer(x, 10.0)
            if isinstance(got, Pending):  # (a sleep first, or an error: the Pending's way)
                got.finish(timeout_s=10.0)
        else:
            got = send(x)  # the two-phase client: start, then finish
            got.finish(timeout_s=10.0)
        t1 = perf()
        lat.append(t1 - t)
        t = t1
        if setup.stages:
            stages.append(request_stages(client, got))
    return got, t


def request_stages(client: Any, got: Any) -> tuple[int, int, int, int, int, int]:
    """STAGES of one answered request, in ns (see STAGES): ``got`` is its Pending, or the outputs of
    ``client``'s last ``infer_or_pending``, whose copy-in is the call's time before publication and its
    copy-out the time after the answer was seen. Zeros when it has no stamps."""
    if type(got) is dict:
        entered, submit, claim, done, seen, end, engine = client.last_call_stamps
        return (submit - entered, claim - submit, done - claim - engine, engine, seen - done, end - seen)
    ticket = got.ticket
    st = ticket.stamps
    if st is None:
        return (0, 0, 0, 0, 0, 0)
    claim, done, engine, _call, seen, end = st
    submit = ticket.submit_ns
    return (ticket.copy_in_ns, claim - submit, done - claim - engine, engine, seen - done, end - seen)


# ---- designs ---------------------------------------------------------------------------------------


def _ms(ns: list[int] | np.ndarray) -> np.ndarray:
    return np.asarray(ns, dtype=np.float64) / 1e6


def _reap(procs: list[Any], at_once: bool = False) -> None:
    """Join the children (killed after 10 s, or at once when the run is being interrupted)."""
    for p in procs:
        if p.pid is None:  # never started
            continue
        p.join(0 if at_once else 10)
        if p.is_alive():
            p.kill()
            p.join()


def run_bare(setup: Setup) -> DesignResult:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_bare_child, args=(setup, child), daemon=True)
    batch = setup.batch
    interrupted = False
    try:
        with deaf_to_ctrl_c():  # a Ctrl-C meanwhile is raised as it ends, and reaps the child below
            start_pinned(proc, setup.cpu)
        child.close()
        if not parent.poll(setup.duration + REPORT_GRACE_S):
            raise RuntimeError(f"the bare loop did not report within {setup.duration + REPORT_GRACE_S:g} s")
        try:
            r = parent.recv()
        except EOFError:
            raise RuntimeError("the bare loop died before reporting (see its traceback above)") from None
    except KeyboardInterrupt:
        interrupted = True
        raise
    finally:
        _reap([proc], at_once=interrupted)
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
    if traffic.coalesce:  # up to 16 samples and 16 requests per batch; the minimum: --coalesce or 8
        lo, us = setup.coalesce or (QueueConfig.min_batch_samples, QueueConfig.coalesce_us)
        return QueueConfig(
            lanes=max(4, traffic.samplers),
            slots_per_lane=4,
            request_bytes=size,
            response_bytes=size,
            min_batch_samples=lo,
            coalesce_us=us,
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
                with deaf_to_ctrl_c():  # a Ctrl-C meanwhile is raised as it ends: p is in procs by then
                    p.start()
                    procs.append(p)
            finally:
                os.sched_setaffinity(0, saved)
            child.close()
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
    except KeyboardInterrupt:
        _reap(procs, at_once=True)
        raise
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
    res.sampler_cpu_count = len(setup.sampler_cpus)
    res.sampler_costs = sampler_costs(ok)
    # Every sampler's own choice: on one isolated CPU the first to attach spins, the others park.
    spins = sorted({(int(r["spin"][0]), str(r["spin"][1])) for r in ok})
    res.sampler_spin_us = max(us for us, _ in spins)
    res.sampler_spin_reason = "; ".join(why for _, why in spins)
    res.samples = samples
    res.samples_per_s = samples / elapsed
    res.latency_ms = metrics.percentiles(lat)
    rows = [st for r in ok for st in r.get("stages_ns", [])]
    if rows:
        us = np.asarray(rows, dtype=np.float64) / 1e3
        res.stages_us = {name: metrics.percentiles(us[:, i]) for i, name in enumerate(STAGES)}
    res.note = f"{note}, samplers on CPUs {sorted(setup.sampler_cpus)}"
    if len(calls):
        wall_ms, engine_ms = calls[:, col["wall_ms"]], calls[:, col["engine_wall_ms"]]
        res.deschedule_ms = metrics.percentiles(calls[:, col["deschedule_ms"]])
        res.engine_ms_mean = float(engine_ms.mean())
        res.engine_batch_mean = float(calls[:, col["batch"]].mean())
        res.breakdown_us = metrics.summarize(calls, BREAKDOWN + WAKES)
        res.overhead_us_mean = res.breakdown_us["overhead_us"].mean
        res.worker_busy = float(wall_ms.sum() / 1000 / (hi - lo))
    return res


def sampler_costs(reports: list[dict[str, Any]]) -> dict[str, float]:
    """SAMPLER_COSTS per request over the samplers' reports (those without costs left out)."""
    got = [r["costs"] for r in reports if r.get("costs") and r["requests"]]
    n = sum(r["requests"] for r in reports if r.get("costs") and r["requests"])
    if not n:
        return {}

    def total(key: str) -> float:
        return float(sum(c.get(key, 0) for c in got))

    out = {
        k.replace("_ns", "_us"): total(k) / 1e3 / n for k in ("user_ns", "sys_ns", "code_ns", "run_delay_ns")
    }
    out |= {k: total(k) / n for k in ("vol_cs", "invol_cs")}
    out |= {"spin_us": total("spin_ns") / 1e3 / n, "park_us": total("park_ns") / 1e3 / n}
    out["parked"] = total("parked") / n
    out["loop_us"] = total("loop_ns") / 1e3 / n
    return {k: out[k] for k in SAMPLER_COSTS}


def run_served(setup: Setup, traffic: Traffic) -> DesignResult:
    """The queue and the pinned worker, owned by this process."""
    from lowtail.serve.worker_process import WorkerConfig, WorkerProcess
    from lowtail.shm.queue import InferenceQueue

    with InferenceQueue.create(_queue_config(setup, traffic)) as queue:
        # Warnings only: the worker's info lines would land on the progress bar.
        config = WorkerConfig(name="bench", max_batch=16, fifo_scope=setup.fifo_scope, log_level="WARNING")
        worker = WorkerProcess.start(queue.descriptor, setup.cpu, setup.model, config)  # deaf to Ctrl-C
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
    from lowtail.node.lease import node_plan
    from lowtail.serve.worker_process import WorkerConfig

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
        worker=WorkerConfig(name="bench-ray", max_batch=16, fifo_scope=setup.fifo_scope, log_level="WARNING"),
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
    r.breakdown_us = {k: metrics.Percentiles(**pct[k]) for k in BREAKDOWN + WAKES if k in pct}
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
