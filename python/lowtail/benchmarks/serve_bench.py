"""``lowtail bench serve``: the bare OpenVINO loop on one pinned core against the same model served.

The limit is a process pinned to one CPU calling ``infer()`` on batches of B samples back to back. The
served design is the same model in a pinned worker (``lowtail.serve.worker``) behind the shared-memory queue,
driven by 1, 2 and 4 sampler processes that each submit batches of B samples and wait for the result
(closed loop: throughput is what the design sustains; the latency is the sampler's submit-to-result
time, which includes queueing behind the other samplers' batches).

Reported per design: samples/s, sampler-side latency p50/p99/p99.9/max with n, the worker's deschedule
p99.9 (wall - CPU per engine call) with n, and served/bare throughput. Target: at B=16 the served
throughput is at least 90% of bare.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import multiprocessing
import os
import tempfile
import time
from dataclasses import asdict, dataclass
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
from lowtail.serve.model import ModelSpec, ModelSpecError, feature_input, find_model_xml, write_model
from lowtail.serve.pinning import (
    SchedFifo,
    pin_thread_to_cpu,
    raise_priority,
    set_timer_slack_ns,
    start_pinned,
)

TARGET_RATIO = 0.90


@dataclass(frozen=True)
class Setup:
    model: Path
    cpu: int  # the engine's CPU, bare and served
    batch: int
    input_name: str
    features: int
    duration: float
    sampler_cpus: frozenset[int]
    fifo_scope: str = "call"  # the worker's WorkerConfig.fifo_scope; the bare loop does the same

    def observations(self, seed: int) -> dict[str, np.ndarray]:
        rng = np.random.default_rng(seed)
        return {self.input_name: rng.standard_normal((self.batch, self.features), dtype=np.float32)}


@dataclass
class DesignResult:
    design: str
    samplers: int
    batch: int
    duration_s: float
    samples: int
    samples_per_s: float
    latency_ms: metrics.Percentiles  # per call (bare) or per request, sampler side (served)
    deschedule_ms: metrics.Percentiles  # per engine call
    ratio_to_bare: float = float("nan")
    engine_ms_mean: float = float("nan")  # infer() per call
    overhead_us_mean: float = 0.0  # per engine call in the worker beyond infer(): claim not included
    worker_busy: float = 1.0  # share of the window the engine core spent handling calls
    note: str = ""

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["latency_ms"] = self.latency_ms.to_dict()
        d["deschedule_ms"] = self.deschedule_ms.to_dict()
        return d


def register(bench_sub: Any) -> None:
    p = bench_sub.add_parser("serve", help="bare OpenVINO loop vs queue + pinned worker (1, 2, 4 samplers)")
    # The CLI convention (lowtail.cli.options): --json FILE or '-', --plot, --seconds (old names: aliases).
    add_json(p, "the full report")
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
    p.add_argument("--batch", type=int, default=16, help="samples per request and per engine call")
    p.add_argument("--samplers", default="1,2,4", help="sampler process counts to run")
    p.add_argument("--model", metavar="DIR", help="OpenVINO IR to serve (default: build the policy model)")
    p.add_argument("--cpu", type=int, help="CPU for the engine (default: the highest CPU allowed)")
    p.add_argument("--ray", action="store_true", help="also serve through the Ray inference actor")
    p.add_argument(
        "--fifo-scope",
        choices=("call", "busy"),
        default="call",
        help="SCHED_FIFO around each batch (the seed's toggle, default) or for whole busy periods",
    )
    p.set_defaults(func=run)


# ---- child processes -------------------------------------------------------------------------------


def _bare_child(setup: Setup, conn: Any) -> None:
    from lowtail.serve.engine import Engine

    # The same treatment as the worker, so the only difference between the designs is the serving.
    pin_thread_to_cpu(setup.cpu)
    raise_priority(-20)
    set_timer_slack_ns(1)
    fifo = SchedFifo(1)
    fifo.detect()
    engine = Engine(setup.model, max_batch=setup.batch)
    x = setup.observations(0)
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


def _sampler_child(setup: Setup, desc: Any, warmup: float, seed: int, conn: Any) -> None:
    from lowtail.shm.queue import QueueClient

    raise_priority(-20)  # in production a sampler owns an isolated core; here it shares with other work
    x = setup.observations(seed)
    duration = setup.duration
    perf = time.perf_counter_ns
    lat: list[int] = []
    with QueueClient.attach(desc) as client:
        end = perf() + int(warmup * 1e9)
        while perf() < end:
            client.infer(x, timeout=10.0)
        start_mono = time.monotonic()
        start = perf()
        end = start + int(duration * 1e9)
        t = start
        while t < end:
            client.infer(x, timeout=10.0)
            t1 = perf()
            lat.append(t1 - t)
            t = t1
        end_mono = time.monotonic()
    conn.send(
        {"requests": len(lat), "elapsed_ns": t - start, "lat_ns": lat, "window": (start_mono, end_mono)}
    )
    conn.close()


# ---- designs ---------------------------------------------------------------------------------------


def _ms(ns: list[int] | np.ndarray) -> np.ndarray:
    return np.asarray(ns, dtype=np.float64) / 1e6


def run_bare(setup: Setup) -> DesignResult:
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_bare_child, args=(setup, child), daemon=True)
    start_pinned(proc, setup.cpu)
    child.close()
    batch = setup.batch
    try:
        if not parent.poll(setup.duration + 120):
            raise RuntimeError("bare loop did not report")
        r = parent.recv()
    finally:
        proc.join(10)
        if proc.is_alive():
            proc.kill()
            proc.join()
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
        note=f"infer() back to back on CPU {setup.cpu}",
    )


def _queue_config(setup: Setup, samplers: int) -> Any:
    from lowtail.shm.queue import QueueConfig

    payload = setup.batch * setup.features * 4 + 4096
    payload += -payload % 64
    return QueueConfig(
        lanes=max(4, samplers),
        slots_per_lane=4,
        request_bytes=payload,
        response_bytes=payload,
        max_batch_samples=setup.batch,
        min_batch_samples=1,
        max_batch_slots=max(1, samplers),
    )


def _drive(setup: Setup, descriptor: Any, samplers: int) -> list[dict[str, Any]]:
    """Run ``samplers`` closed-loop sampler processes against a queue; their reports."""
    ctx = multiprocessing.get_context("spawn")
    warmup = min(1.0, setup.duration / 4)
    procs, conns = [], []
    try:
        for i in range(samplers):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_sampler_child, args=(setup, descriptor, warmup, i, child), daemon=True)
            saved = os.sched_getaffinity(0)
            os.sched_setaffinity(0, setup.sampler_cpus)
            try:
                p.start()
            finally:
                os.sched_setaffinity(0, saved)
            child.close()
            procs.append(p)
            conns.append(parent)
        results = []
        for c in conns:
            if not c.poll(setup.duration + warmup + 120):
                raise RuntimeError("a sampler did not report")
            results.append(c.recv())
        return results
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()


def _served_result(
    design: str, *, setup: Setup, samplers: int, results: list[dict[str, Any]], calls: np.ndarray, note: str
) -> DesignResult:
    lat = np.concatenate([_ms(r["lat_ns"]) for r in results])
    elapsed = max(r["elapsed_ns"] for r in results) / 1e9
    samples = sum(r["requests"] for r in results) * setup.batch
    # The worker's calls inside the samplers' measured windows (their warm-up excluded).
    lo, hi = min(r["window"][0] for r in results), max(r["window"][1] for r in results)
    col = metrics.COL
    t_end = calls[:, col["t_end_s"]]
    calls = calls[(t_end >= lo) & (t_end <= hi)]
    mean_batch = float(calls[:, col["batch"]].mean()) if len(calls) else float("nan")
    wall_ms, engine_ms = calls[:, col["wall_ms"]], calls[:, col["engine_wall_ms"]]
    return DesignResult(
        design=design,
        samplers=samplers,
        batch=setup.batch,
        duration_s=elapsed,
        samples=samples,
        samples_per_s=samples / elapsed,
        latency_ms=metrics.percentiles(lat),
        deschedule_ms=metrics.percentiles(calls[:, col["deschedule_ms"]]),
        engine_ms_mean=float(engine_ms.mean()) if len(calls) else float("nan"),
        overhead_us_mean=float((wall_ms - engine_ms).mean() * 1000) if len(calls) else float("nan"),
        worker_busy=float(wall_ms.sum() / 1000 / (hi - lo)) if len(calls) else float("nan"),
        note=f"{note}, samplers on CPUs {sorted(setup.sampler_cpus)}, mean engine batch {mean_batch:.1f}",
    )


def run_served(setup: Setup, samplers: int) -> DesignResult:
    """The queue and the pinned worker, owned by this process."""
    from lowtail.serve.worker import WorkerConfig, WorkerProcess
    from lowtail.shm.queue import InferenceQueue

    with InferenceQueue.create(_queue_config(setup, samplers)) as queue:
        config = WorkerConfig(name="bench", max_batch=setup.batch, fifo_scope=setup.fifo_scope)
        worker = WorkerProcess.start(queue.descriptor, setup.cpu, setup.model, config)
        try:
            worker.wait_ready(120)
            results = _drive(setup, queue.descriptor, samplers)
            calls = worker.calls(0).rows
        finally:
            worker.stop()
    note = f"queue + pinned worker on CPU {setup.cpu}"
    return _served_result("served", setup=setup, samplers=samplers, results=results, calls=calls, note=note)


def run_ray_served(setup: Setup, samplers: int, work: Path) -> DesignResult:
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
        index=samplers,
        model_dir=str(setup.model),
        allocator=alloc,
        queue=_queue_config(setup, samplers),
        worker=WorkerConfig(name="bench-ray", max_batch=setup.batch, fifo_scope=setup.fifo_scope),
    )
    actor = start_inference_actor(spec, node)
    try:
        endpoint = ray.get(actor.endpoint.remote())
        if endpoint.cpu != setup.cpu:
            raise RuntimeError(f"the actor leased CPU {endpoint.cpu}, expected {setup.cpu}")
        results = _drive(setup, endpoint.descriptor, samplers)
        worker = ray.get(actor.report.remote())["report"]
    finally:
        stop_actor(actor)
        stop_node_allocator(node, remove_state=True)
    note = f"Ray inference actor (lease, queue, worker) on CPU {setup.cpu}"
    no_rows = np.zeros((0, len(metrics.CALL_FIELDS)))
    r = _served_result("ray actor", setup=setup, samplers=samplers, results=results, calls=no_rows, note=note)
    pct = worker["percentiles"]
    r.deschedule_ms = metrics.Percentiles(**pct["deschedule_ms"])
    r.engine_ms_mean = pct["engine_wall_ms"]["mean"]
    r.overhead_us_mean = (pct["wall_ms"]["mean"] - pct["engine_wall_ms"]["mean"]) * 1000
    r.worker_busy = float("nan")
    r.note = r.note.replace("mean engine batch nan", f"mean engine batch {pct['batch']['mean']:.1f}")
    return r


def _start_ray(work: Path) -> None:
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a local, single-user cluster
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ["RAY_TMPDIR"] = str(work)  # Ray's session files go away with the work dir
    ray.init(num_cpus=max(2, os.cpu_count() or 2), include_dashboard=False, log_to_driver=False)


# ---- report ----------------------------------------------------------------------------------------


def _fmt(p: metrics.Percentiles) -> list[str]:
    return [f"{p.p50:.3f}", f"{p.p99:.3f}", f"{p.p999:.3f}", f"{p.max:.3f}", str(p.n)]


def render_table(results: list[DesignResult]) -> str:
    rows = []
    for r in results:
        label = "bare (limit)" if r.design == "bare" else f"{r.design} x{r.samplers}"
        rows.append(
            [
                label,
                f"{r.samples_per_s:,.0f}",
                f"{r.ratio_to_bare:.3f}",
                *_fmt(r.latency_ms),
                f"{r.deschedule_ms.p999:.3f}",
                str(r.deschedule_ms.n),
                f"{r.engine_ms_mean:.3f}",
                f"{r.overhead_us_mean:.0f}",
                "-" if np.isnan(r.worker_busy) else f"{r.worker_busy:.0%}",
            ]
        )
    headers = ["design", "samples/s", "vs bare", "lat p50 ms", "p99", "p99.9", "max", "n"]
    return table.render(
        [*headers, "desched p99.9 ms", "n calls", "infer ms", "+us/call", "core busy"],
        rows,
        title=f"lowtail bench serve: batch {results[0].batch}",
    )


def plot(results: list[DesignResult]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["bare" if r.design == "bare" else f"{r.design} x{r.samplers}" for r in results]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    a.bar(labels, [r.samples_per_s for r in results], color=["#555"] + ["#3a7"] * (len(results) - 1))
    bare = results[0].samples_per_s
    a.axhline(bare * TARGET_RATIO, color="r", ls="--", lw=1, label=f"{TARGET_RATIO:.0%} of bare")
    a.set_ylabel("samples/s")
    a.set_title(f"throughput, batch {results[0].batch}")
    a.legend()
    xs = np.arange(len(results))
    for i, (q, name) in enumerate([("p50", "p50"), ("p99", "p99"), ("p999", "p99.9")]):
        b.bar(xs + (i - 1) * 0.27, [getattr(r.latency_ms, q) for r in results], 0.27, label=name)
    b.set_xticks(xs, labels)
    b.set_yscale("log")
    b.set_ylabel("ms per call / request")
    b.set_title("latency (n in the JSON)")
    b.legend()
    for ax in (a, b):
        ax.tick_params(axis="x", labelrotation=30)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def run(args: argparse.Namespace) -> int:
    if args.batch < 1:
        raise UsageError(f"--batch {args.batch}: expected >= 1")
    try:
        counts = [int(x) for x in args.samplers.split(",")]
    except ValueError:
        raise UsageError(f"--samplers {args.samplers!r}: expected counts like 1,2,4") from None
    if not counts or any(c < 1 or c > 64 for c in counts):
        raise UsageError(f"--samplers {args.samplers!r}: expected counts in 1..64")
    duration = args.duration or (2.0 if args.quick else 10.0)
    allowed = os.sched_getaffinity(0)
    cpu = max(allowed) if args.cpu is None else args.cpu
    if cpu not in allowed:
        raise UsageError(f"--cpu {cpu}: expected one of the CPUs this process may use, {sorted(allowed)}")
    sampler_cpus = (allowed - {cpu}) or allowed
    load_before = os.getloadavg()
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
        setup = Setup(
            model, cpu, args.batch, name, features, duration, frozenset(sampler_cpus), args.fifo_scope
        )
        designs = 1 + len(counts) * (2 if args.ray else 1)
        bar = Progress(f"bench serve ({duration:g} s per design)", designs, enabled=not args.no_progress)
        bar.update(0, "bare loop")
        results = [run_bare(setup)]
        for n in counts:
            bar.update(len(results), f"served, {n} sampler(s)")
            results.append(run_served(setup, n))
        if args.ray:
            import ray

            bar.update(len(results), "starting a local Ray")
            own = not ray.is_initialized()
            if own:
                _start_ray(Path(tmp))
            try:
                for n in counts:
                    bar.update(len(results), f"Ray inference actor, {n} sampler(s)")
                    results.append(run_ray_served(setup, n, Path(tmp)))
            finally:
                if own:
                    ray.shutdown()
        bar.finish()
    bare = results[0].samples_per_s
    for r in results[1:]:
        r.ratio_to_bare = r.samples_per_s / bare
    text = render_table(results)
    best = max(r.ratio_to_bare for r in results[1:])
    verdict = "met" if best >= TARGET_RATIO else "NOT met"
    summary = (
        f"target served >= {TARGET_RATIO:.0%} of bare at batch {args.batch}: {verdict} (best {best:.1%})"
    )
    load_after = os.getloadavg()
    host = f"SCHED_FIFO scope {args.fifo_scope}; host: {os.cpu_count()} CPUs, 1-min load average "
    host += f"{load_before[0]:.1f} before"
    host += f", {load_after[0]:.1f} after"
    if not json_to_stdout(args):
        print(text)
        print(summary)
        print(host)
    report = {
        "benchmark": "serve",
        "model": str(model) if args.model else "built: " + json.dumps(ModelSpec().to_dict()),
        "cpu": cpu,
        "sampler_cpus": sorted(sampler_cpus),
        "batch": args.batch,
        "fifo_scope": args.fifo_scope,
        "duration_s": duration,
        "target_ratio": TARGET_RATIO,
        "best_ratio": best,
        "target_met": best >= TARGET_RATIO,
        "host": {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": load_after},
        "results": [r.to_dict() for r in results],
        "note": "served: queue + pinned worker owned by the benchmark process"
        + ("; ray actor: the same hosted by lowtail's Ray inference actor" if args.ray else ""),
    }
    write_json(args.json, report)
    if args.png or args.html:
        png = plot(results)
        if args.png:
            Path(args.png).write_bytes(png)
        if args.html:
            img = base64.b64encode(png).decode()
            Path(args.html).write_text(
                f"<!doctype html><meta charset=utf-8><title>lowtail bench serve</title>"
                f"<h1>lowtail bench serve</h1><pre>{text}\n{summary}\n{host}</pre>"
                f'<img alt="throughput and latency" src="data:image/png;base64,{img}">\n'
            )
    return 0
