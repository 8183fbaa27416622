"""``lowtail demo ray``: a whole node in miniature, started, measured and torn down.

A local Ray, the node's lease allocator, inference actors serving a generated policy model through
the shared-memory queue, samplers stepping a synthetic game with two-phase async calls, the metrics hub
(Prometheus port, TensorBoard run); then a summary of throughput, round-trip and deschedule tails and
leases by kind. Everything it starts it stops, and everything it writes lives in a temporary directory
unless the caller names one (``--json``, ``--tb-logdir``).

On a machine whose plan isolates fewer CPUs than the demo has owners (a 2-vCPU VM isolates one), the
demo leases from all usable CPUs and lets owners share them, and says so: that is a demo override of the
allocator (``pool``/``share``), never what a real node does.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lowtail.errors import LowtailError
from lowtail.node import cpulist
from lowtail.node.cpuset import usable_cpus
from lowtail.node.lease import KINDS, node_plan
from lowtail.node.plan import Plan
from lowtail.render import console, table
from lowtail.telemetry.export import WindowStats
from lowtail.telemetry.percentiles import quantile

log = logging.getLogger(__name__)
# Ray's driver log level per verbosity: its INFO lines ("Started a local Ray instance") only with -v.
RAY_LOGGING = {console.QUIET: logging.ERROR, console.NORMAL: logging.WARNING, console.VERBOSE: logging.INFO}


class DemoError(LowtailError, RuntimeError):
    """The demo cannot run as asked (e.g. --strict-leases on a machine with too few isolated CPUs)."""


@dataclass(frozen=True)
class DemoOptions:
    seconds: float = 10.0
    actors: int = 2
    samplers: int = 2
    rows: int = 8  # samples per environment step (the batch one request carries)
    depth: int = 2  # games in flight per sampler (two-phase async)
    strict_leases: bool = False  # refuse the demo override: isolated CPUs only, one owner each
    metrics_port: int | None = None  # None: no HTTP server (nothing of lowtail's listens); 0: any free port
    tb_logdir: str | None = None
    plot: str | None = None  # PNG of the tails (round trip, deschedule, queue wait)
    features: int = 512
    # A request unanswered this long counts as an error in the summary (the samplers' QueueTimeout).
    request_timeout_s: float = 2.0
    policies: int = 1  # heroes with a policy model of their own; the actors are spread over them
    standby: bool = True  # a hot standby worker per inference actor (InferenceSpec.standby)


def hero_name(opts: DemoOptions, k: int) -> str:
    """The demo's hero names: ``demo`` alone, ``demo0``, ``demo1``, ... with several policies."""
    return "demo" if opts.policies == 1 else f"demo{k}"


@dataclass(frozen=True)
class LeasePolicy:
    pool: frozenset[int] | None
    share: int
    note: str


def lease_policy(plan: Plan, owners: int, usable: frozenset[int], strict: bool) -> LeasePolicy:
    """Isolated CPUs, one owner each, when the plan has enough; otherwise the stated demo override."""
    isolated = plan.isolated & usable
    if len(isolated) >= owners:
        return LeasePolicy(None, 1, f"leasing isolated CPUs {cpulist.format(isolated)}, one owner each")
    if strict:
        raise DemoError(
            f"{owners} owners need {owners} isolated CPUs; this node's plan isolates "
            f"{cpulist.format(isolated) or 'none'} ({len(isolated)}): "
            "run fewer actors/samplers or drop --strict-leases"
        )
    pool = (plan.isolated | plan.housekeeping) & usable
    share = math.ceil(owners / len(pool))
    sharing = "one owner each" if share == 1 else f"up to {share} owners per CPU"
    return LeasePolicy(
        frozenset(pool),
        share,
        f"DEMO OVERRIDE: this node isolates {cpulist.format(isolated) or 'no'} CPU(s) "
        f"({len(isolated)}) but the demo has {owners} owners, so it leases from CPUs "
        f"{cpulist.format(pool)} (housekeeping included), {sharing}. Real nodes lease isolated CPUs "
        "only, one owner each; latency figures from housekeeping or shared CPUs say nothing about a "
        "tuned node.",
    )


@dataclass
class DemoResult:
    options: dict[str, Any]
    lease_note: str
    seconds: float
    samples: int
    samples_per_s: float
    requests: int
    errors: dict[str, int]
    rpc_ms: WindowStats
    worker: dict[str, WindowStats]
    leases_by_kind: dict[str, list[dict[str, Any]]]
    samplers: list[dict[str, Any]]
    actors: list[dict[str, Any]]
    metrics_port: int | None
    tb_run: str | None
    plot: str | None = None
    prometheus_sample: list[str] = field(default_factory=list)
    listening: list[dict[str, Any]] = field(default_factory=list)  # TCP ports open during the run

    def to_dict(self) -> dict[str, Any]:
        return {
            "options": self.options,
            "lease_note": self.lease_note,
            "seconds": self.seconds,
            "samples": self.samples,
            "samples_per_s": self.samples_per_s,
            "requests": self.requests,
            "errors": self.errors,
            "rpc_elapsed_ms": self.rpc_ms.to_dict(),
            "worker": {k: v.to_dict() for k, v in self.worker.items()},
            "leases_by_kind": self.leases_by_kind,
            "samplers": self.samplers,
            "actors": self.actors,
            "metrics_port": self.metrics_port,
            "tb_run": self.tb_run,
            "plot": self.plot,
            "prometheus_sample": self.prometheus_sample,
            "listening": self.listening,
        }


ProgressCallback = Callable[[float, float, int], None]  # elapsed s, total s, samples so far


def run_demo(
    opts: DemoOptions, progress: ProgressCallback | None = None, model_dir: str | None = None
) -> DemoResult:
    """Run the demo. Uses the connected Ray if there is one (tests), else starts and stops a local one."""

    if opts.actors < 1 or opts.samplers < 1:
        raise DemoError(f"actors={opts.actors} samplers={opts.samplers}: expected at least 1 of each")
    if not 1 <= opts.policies <= opts.actors:
        raise DemoError(f"policies={opts.policies}: expected 1 to actors={opts.actors} (each needs an actor)")
    if opts.seconds <= 0:
        raise DemoError(f"seconds={opts.seconds}: expected a positive duration")
    plan = node_plan()
    usable = usable_cpus()  # the cgroup's cpuset: under lowtail-ray.service the mask is housekeeping
    policy = lease_policy(plan, opts.actors + opts.samplers, usable, opts.strict_leases)  # before Ray starts
    with local_ray("lt-demo-", policy.pool if policy.pool is not None else plan.isolated & usable) as work:
        return _run(opts, plan=plan, policy=policy, work=work, progress=progress, model_dir=model_dir)


@contextlib.contextmanager
def local_ray(prefix: str, leasable: frozenset[int], namespace: str = "lowtail-demo") -> Iterator[Path]:
    """A work directory, and a local single-user Ray unless one is connected already (tests): token
    auth off, its session files in the work directory, one ``lowtail_isolated_cpu`` per leasable CPU
    (what lowtail-ray.service declares). Everything is stopped and removed on exit."""
    import ray

    work = Path(tempfile.mkdtemp(prefix=prefix))
    own_ray = not ray.is_initialized()
    saved_env = {k: os.environ.get(k) for k in ("RAY_AUTH_MODE", "RAY_TMPDIR", "RAY_USAGE_STATS_ENABLED")}
    try:
        if own_ray:
            os.environ.setdefault("RAY_AUTH_MODE", "disabled")
            os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
            os.environ["RAY_TMPDIR"] = str(work)
            init: dict[str, Any] = {
                "num_cpus": max(2, os.cpu_count() or 2),
                "resources": {"lowtail_isolated_cpu": float(len(leasable))},
                "include_dashboard": False,
                "log_to_driver": False,
                "namespace": namespace,
                "logging_level": RAY_LOGGING[console.verbosity()],
            }
            log.debug("ray.init(%s) with RAY_TMPDIR=%s", init, work)
            ray.init(**init)
        yield work
    finally:
        if own_ray and ray.is_initialized():
            ray.shutdown()
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        shutil.rmtree(work, ignore_errors=True)


@dataclass
class _Observed:
    """What the run's actors and metrics hub reported, read before they are stopped."""

    leases: list[Any]
    results: list[Any]
    actor_reports: list[dict[str, Any]]
    actor_status: list[dict[str, Any]]
    worker: dict[str, Any]
    raw: dict[str, Any]
    prom_text: str
    port: int | None
    listening: list[dict[str, Any]]


def _run(
    opts: DemoOptions,
    *,
    plan: Plan,
    policy: LeasePolicy,
    work: Path,
    progress: ProgressCallback | None,
    model_dir: str | None,
) -> DemoResult:
    import ray

    from lowtail.actors.allocator import AllocatorConfig, get_node_allocator, stop_node_allocator
    from lowtail.actors.inference import stop_actor
    from lowtail.actors.metrics_hub import MetricsConfig, get_node_metrics, stop_node_metrics
    from lowtail.serve.model import ModelSpec, write_model

    node = ray.get_runtime_context().get_node_id()
    if model_dir is None:
        model_dir = str(work / "model")
        write_model(model_dir, ModelSpec(features=opts.features))
    alloc_cfg = AllocatorConfig(
        state_dir=str(work / "leases"),
        plan=plan.to_dict(),
        pool=None if policy.pool is None else cpulist.format(policy.pool),
        share=policy.share,
    )
    tb_logdir = opts.tb_logdir or str(work / "tb")
    metrics_cfg = MetricsConfig(port=opts.metrics_port, addr="127.0.0.1", tb_logdir=tb_logdir)
    alloc = get_node_allocator(node, alloc_cfg)
    hub = get_node_metrics(node, metrics_cfg)
    actors: list[Any] = []
    samplers: list[Any] = []
    try:
        _start(
            opts,
            node=node,
            model_dir=model_dir,
            alloc_cfg=alloc_cfg,
            metrics_cfg=metrics_cfg,
            actors=actors,
            samplers=samplers,
        )
        observed = _drive(opts, alloc=alloc, hub=hub, actors=actors, samplers=samplers, progress=progress)
    finally:
        for s in samplers:
            stop_actor(s)
        for a in actors:
            stop_actor(a)
        stop_node_metrics(node)
        stop_node_allocator(node, remove_state=True)
    return _summarize(opts, policy, observed)


def _start(
    opts: DemoOptions,
    *,
    node: str,
    model_dir: str,
    alloc_cfg: Any,
    metrics_cfg: Any,
    actors: list[Any],
    samplers: list[Any],
) -> None:
    """Start the inference actors, then the samplers; each is appended as soon as it exists, so the
    caller stops whatever started when a later one fails."""
    import ray

    from lowtail.actors.inference import InferenceSpec, start_inference_actors
    from lowtail.actors.sampler import EnvSpec, SamplerSpec, start_sampler

    # Actors are spread over the heroes (policies) in turn; every sampler has one client per hero.
    specs = [
        InferenceSpec(
            hero=hero_name(opts, i % opts.policies),
            index=i // opts.policies,
            model_dir=model_dir,
            allocator=alloc_cfg,
            metrics=metrics_cfg,
            standby=opts.standby,
        )
        for i in range(opts.actors)
    ]
    actors.extend(start_inference_actors(specs, node))  # in parallel: they compile at the same time
    endpoints = ray.get([a.endpoint.remote() for a in actors])
    for j in range(opts.samplers):
        sspec = SamplerSpec(
            name=f"demo-{j}",
            env=EnvSpec(features=opts.features, rows=opts.rows, seed=j),
            allocator=alloc_cfg,
            metrics=metrics_cfg,
            timeout_s=opts.request_timeout_s,
        )
        samplers.append(start_sampler(sspec, endpoints, node))


def _drive(
    opts: DemoOptions,
    *,
    alloc: Any,
    hub: Any,
    actors: list[Any],
    samplers: list[Any],
    progress: ProgressCallback | None,
) -> _Observed:
    """Run the samplers for the demo's seconds, then read every report while the actors still live."""
    import ray

    leases = ray.get(alloc.leases.remote())
    t0 = time.monotonic()
    refs = [s.run.remote(opts.seconds, "async", opts.depth) for s in samplers]
    remaining = list(refs)
    while remaining:
        _, remaining = ray.wait(remaining, num_returns=len(remaining), timeout=0.5)
        if progress is not None:
            done = sum(t["samples"] for t in ray.get(hub.totals.remote()).values())
            progress(min(time.monotonic() - t0, opts.seconds), opts.seconds, done)
    results = ray.get(refs)
    actor_reports = ray.get([a.report.remote() for a in actors])
    actor_status = ray.get([a.status.remote() for a in actors])
    ray.get(hub.flush.remote())
    return _Observed(
        leases=leases,
        results=results,
        actor_reports=actor_reports,
        actor_status=actor_status,
        worker=ray.get(hub.summary.remote()),
        raw=ray.get(hub.values.remote(["deschedule_ms", "worker_queue_wait_ms", "worker_infer_exec_ms"])),
        prom_text=ray.get(hub.render.remote()),
        port=ray.get(hub.port.remote()),
        listening=listening_ports(),  # while every worker of the run is up
    )


def _summarize(opts: DemoOptions, policy: LeasePolicy, seen: _Observed) -> DemoResult:
    """The demo's result from what the run reported, and its plot when one was asked for."""
    from lowtail.telemetry.export import window_stats

    results, raw = seen.results, seen.raw
    seconds = max(r.seconds for r in results)
    samples = sum(r.samples for r in results)
    errors: dict[str, int] = {}
    for r in results:
        for k, v in r.errors.items():
            errors[k] = errors.get(k, 0) + v
    rpc = [x for r in results for x in r.rpc_ms]
    if opts.plot:
        plot_tails(
            {
                "round trip (sampler)": np.asarray(rpc),
                "model execution (worker)": raw.get("worker_infer_exec_ms", np.zeros(0)),
                "queue wait (worker)": raw.get("worker_queue_wait_ms", np.zeros(0)),
                "deschedule = wall - CPU (worker)": raw.get("deschedule_ms", np.zeros(0)),
            },
            opts.plot,
            title=f"lowtail demo ray: {opts.samplers} samplers, {opts.actors} inference actors, "
            f"{seconds:.0f} s" + (" (DEMO OVERRIDE: shared CPUs)" if policy.pool is not None else ""),
        )
    by_kind: dict[str, list[dict[str, Any]]] = {k: [] for k in KINDS}
    for lease in seen.leases:
        by_kind[lease.kind].append({"owner": lease.owner, "cpu": lease.cpu, "placement": lease.placement})
    return DemoResult(
        options=dict(opts.__dict__),
        lease_note=policy.note,
        seconds=seconds,
        samples=samples,
        samples_per_s=samples / seconds if seconds else 0.0,
        requests=len(rpc),
        errors=errors,
        rpc_ms=window_stats({"rpc": rpc})["rpc"],
        worker=seen.worker,
        leases_by_kind=by_kind,
        samplers=[
            {"name": r.name, "cpu": r.cpu, "steps": r.steps, "samples": r.samples, "errors": r.errors}
            for r in results
        ],
        actors=[
            {**st, "isolation": rep.get("isolation", {}), "calls": rep.get("report", {}).get("calls")}
            for st, rep in zip(seen.actor_status, seen.actor_reports, strict=True)
        ],
        metrics_port=seen.port,
        tb_run=None if opts.tb_logdir is None else str(Path(opts.tb_logdir) / "model_dispatcher"),
        plot=opts.plot,
        prometheus_sample=[
            line for line in seen.prom_text.splitlines() if line.startswith("lowtail_p999_deschedule_ms{")
        ],
        listening=seen.listening,
    )


def listening_ports() -> list[dict[str, Any]]:
    """TCP ports this process and its descendants listen on: a local Ray's GCS, raylet and workers (its
    gRPC servers bind every interface, and Ray has no option to bind loopback only), and the metrics
    server when one was asked for."""
    import psutil

    me = psutil.Process()
    procs = {me.pid: me, **{c.pid: c for c in me.children(recursive=True)}}
    out = []
    for conn in psutil.net_connections("inet"):
        if conn.status != psutil.CONN_LISTEN or conn.pid not in procs or not conn.laddr:
            continue
        try:
            name = procs[conn.pid].name()
        except psutil.Error:  # ended meanwhile
            continue
        ip, port = conn.laddr  # a listening socket always has its (ip, port)
        out.append({"process": name, "pid": conn.pid, "address": ip, "port": port})
    return sorted(out, key=lambda p: (p["process"], p["port"]))


def render_listening(listening: list[dict[str, Any]], metrics_port: int | None) -> str:
    """The line that names every port the run had open."""
    where = ", ".join(
        f"{p['process']} {'[' + p['address'] + ']' if ':' in p['address'] else p['address']}:{p['port']}"
        for p in listening
    )
    metrics = (
        f"Prometheus metrics on 127.0.0.1:{metrics_port}"
        if metrics_port is not None
        else "no metrics port (--metrics-port to serve one)"
    )
    ray_part = f"local Ray listened on {where}" if where else "no listening port found"
    return f"Ports: {metrics}; {ray_part}"


def _throughput_table(result: DemoResult) -> str:
    return table.render(
        ["samples", "seconds", "samples/s", "requests", "errors"],
        [
            [
                result.samples,
                f"{result.seconds:.1f}",
                f"{result.samples_per_s:,.0f}",
                result.requests,
                ", ".join(f"{k}={v}" for k, v in result.errors.items()) or "0",
            ]
        ],
        title=f"Throughput ({result.options['samplers']} samplers, "
        f"{result.options['actors']} inference actors)",
    )


def _tails_table(result: DemoResult) -> str:
    """The samplers' round trip and every series the workers report, as tails."""
    rpc = result.rpc_ms
    rows = [["round trip (sampler)", rpc.n, *_ms(rpc.p50, rpc.p99, rpc.p999, rpc.max)]]
    for series, label in (
        ("queue_wait_ms", "queue wait per request (sampler)"),
        ("infer_exec_ms", "engine time of its call (sampler)"),
        ("client_overhead_ms", "client overhead (sampler)"),
        ("worker_infer_exec_ms", "model execution per call (worker)"),
        ("worker_queue_wait_ms", "longest queue wait per call (worker)"),
        ("deschedule_ms", "deschedule = wall - CPU"),
        ("run_delay_ms", "run_delay growth"),
    ):
        s = result.worker.get(series)
        if s is not None:
            rows.append([label, s.n, *_ms(s.p50, s.p99, s.p999, s.max)])
    return table.render(
        ["series", "n", "p50 ms", "p99 ms", "p99.9 ms", "max ms"], rows, title="Latency and deschedule tails"
    )


def _leases_table(result: DemoResult) -> str:
    return table.render(
        ["kind", "leases", "owner -> cpu (placement)"],
        [
            [k, len(v), ", ".join(f"{x['owner']}->{x['cpu']} ({x['placement']})" for x in v) or "-"]
            for k, v in result.leases_by_kind.items()
        ],
        title="Leases by kind",
    )


def _actors_table(result: DemoResult) -> str:
    owners_per_cpu: dict[int, int] = {}
    for leases in result.leases_by_kind.values():
        for x in leases:
            owners_per_cpu[x["cpu"]] = owners_per_cpu.get(x["cpu"], 0) + 1
    return table.render(
        ["actor", "cpu", "worker restarts", "standby pid", "worker threads (checked)"],
        [
            [a["owner"], a["cpu"], a["restarts"], a.get("standby_pid") or "-", _pinning(a, owners_per_cpu)]
            for a in result.actors
        ],
        title="Inference actors",
    )


def render(result: DemoResult) -> str:
    """The summary tables ``lowtail demo ray`` prints."""
    parts = [
        result.lease_note,
        _throughput_table(result),
        _tails_table(result),
        _leases_table(result),
        _actors_table(result),
        render_listening(result.listening, result.metrics_port),
    ]
    if result.plot:
        parts.append(f"Tail plot: {result.plot}")
    if result.tb_run:
        parts.append(f"TensorBoard run: {result.tb_run}")
    return "\n\n".join(parts)


def _pinning(actor: dict[str, Any], owners_per_cpu: dict[int, int]) -> str:
    """What the worker's check found, in words: its threads' CPU affinity, and whether other lease owners
    share that CPU (the demo override). Pinned is not isolated: a shared CPU still runs the others."""
    rep = actor.get("isolation") or {}
    if not rep:
        return "-"
    if not rep.get("ok"):
        return str(rep.get("detail", "-"))
    text = f"all {rep.get('threads', '?')} threads pinned to CPU {actor['cpu']}"
    others = owners_per_cpu.get(actor["cpu"], 1) - 1
    return text + (f"; {others} other lease owner(s) on that CPU (demo override)" if others > 0 else "")


def _ms(*values: float) -> list[str]:
    return ["-" if math.isnan(v) else f"{v:.3f}" for v in values]


def plot_tails(series: dict[str, np.ndarray], path: str, title: str) -> None:
    """Exceedance curves (fraction of calls slower than x, log-log): the tail is the right-hand end."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.5))
    for label, values in series.items():
        v = np.sort(values[values > 0])
        if v.size == 0:
            continue
        frac = 1.0 - np.arange(v.size) / v.size
        p999 = quantile(v, 0.999)
        ax.step(
            v, frac, where="post", label=f"{label}: n={values.size}, p99.9 {p999:.3f} ms, max {v[-1]:.3f} ms"
        )
    for q in (1e-2, 1e-3):
        ax.axhline(q, color="grey", lw=0.6, ls=":")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("milliseconds")
    ax.set_ylabel("fraction of calls slower")
    ax.set_title(title, fontsize=10)
    ax.legend(fontsize=8, loc="lower left")
    ax.grid(True, which="major", lw=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
