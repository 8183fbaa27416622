"""``lowtail bench failover``: what one crash costs the other samplers, heroes and replicas.

Two heroes: ``a`` with two inference actors (replicas ``a.0``, ``a.1``), ``b`` with one; ``--samplers``
samplers at batch 1, each with one client per hero (``lowtail.actors.sampler``). Per configuration
(the hot standby on, then off) it SIGKILLs the serving worker of ``a.0`` (frozen first, so the requests
it had claimed are counted), then, once ``a.0`` serves again, kills the whole inference actor ``a.1``
(its process and its workers): failover to a healthy replica. The actor kill keeps ``a.1``'s worker
frozen for one Ray call (reported as "worker frozen"), then kills its standby, it and the actor back to
back: requests on it wait that long, and so does every game step of a sampler that waits for them,
which is the bench's doing.
Reported per sampler and hero, in a window around each kill: the longest gap between answers, the
requests that failed against those the dead worker had claimed, and the time from the kill to the first
answer of the killed replica again (its standby, or its restarted worker / actor). The window is cut to
each sampler's run (the kill call can lag its plan by seconds), and a gap target whose window a run did
not cover is reported as not decided, never as a stall. Table, JSON, PNG. A measurement, not a test:
on a shared 2-vCPU host the figures move with the load (reported).
"""

from __future__ import annotations

import argparse
import math
import os
import signal
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from lowtail.options import add_json, add_no_progress, add_plot, json_to_stdout, positive, write_json
from lowtail.render import table

if TYPE_CHECKING:
    from lowtail.demo.local import LeasePolicy
    from lowtail.node.plan import Plan

TARGET_GAP_MS = 50.0
WINDOW_BEFORE_S = 0.5  # the gap window opens this long before a kill
WINDOW_AFTER_S = 3.0  # and closes this long after it (or at the next kill)
# The samplers run this long after the planned kill: the window plus the 0.5-2.5 s by which the kill
# call lagged behind its plan on this host. A window the run does not cover is reported, not graded.
RUN_AFTER_KILL_S = WINDOW_AFTER_S + 3.0
REPLICAS = (("a", 0), ("a", 1), ("b", 0))


@dataclass
class Row:
    """One sampler and hero (or one replica of hero ``a``) around one kill."""

    config: str  # standby / no-standby
    kill: str  # worker / actor
    sampler: str
    series: str  # hero a, hero b, or replica a.0 / a.1
    longest_gap_ms: float
    answers: int
    failed: int
    # How much of the window after the kill the sampler's run covered: the kill can land late in a run
    # (Ray runs the kill call at the inference actor's nice 15), and time after the run's end is no gap.
    covered_after_s: float = WINDOW_AFTER_S


@dataclass
class Kill:
    config: str
    kill: str
    at_s: float
    claimed: int
    failed: int = 0  # in the sampler run around this kill
    first_answer_of_killed_ms: float = float("nan")  # any sampler's first answer from the killed replica
    frozen_ms: float = 0.0  # the actor kill: how long its worker was frozen to count what it claimed
    errors: dict[str, int] = field(default_factory=dict)  # the run's failed requests by class


@dataclass
class Report:
    load: list[float] = field(default_factory=list)
    rows: list[Row] = field(default_factory=list)
    kills: list[Kill] = field(default_factory=list)
    targets: dict[str, bool | None] = field(default_factory=dict)  # None: not decided (undecided says why)
    undecided: dict[str, str] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    queue_core: dict[str, str] = field(default_factory=dict)  # the queue's hot path here, and why

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def register(bench_sub: Any) -> None:
    p = bench_sub.add_parser(
        "failover", help="a worker SIGKILL and an actor kill under samplers of 2 heroes: gaps, failures"
    )
    p.add_argument("--samplers", type=positive(int), default=3, help="sampler actors (batch 1)")
    p.add_argument("--seconds", type=positive(float), default=10.0, help="sampling time per configuration")
    p.add_argument(
        "--configs", default="standby,no-standby", help="comma-separated: standby, no-standby (this order)"
    )
    add_json(p, "the full report")
    add_plot(p, "the gaps per sampler and hero")
    add_no_progress(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lowtail.errors import UsageError

    configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    if not configs or any(c not in ("standby", "no-standby") for c in configs):
        raise UsageError(f"--configs {args.configs!r}: expected standby and/or no-standby, comma-separated")
    report = Report(options={"samplers": args.samplers, "seconds": args.seconds, "configs": configs})
    for config in configs:
        say = (lambda m: None) if args.no_progress else (lambda m: print(f"  {m}", flush=True))
        measure(config, args.samplers, args.seconds, report, say)
    report.load = list(os.getloadavg())
    from lowtail.shm import native

    report.queue_core = native.implementation().to_dict()
    judge(report)
    if json_to_stdout(args):
        write_json(args.json, report.to_dict())
        return 0
    print(render(report))
    if args.json:
        write_json(args.json, report.to_dict())
    if args.plot:
        plot(report, args.plot)
    return 0


def measure(config: str, samplers: int, seconds: float, report: Report, say: Any) -> None:
    from lowtail.demo.local import lease_policy, local_ray
    from lowtail.node.cpuset import usable_cpus
    from lowtail.node.lease import node_plan

    plan, usable = node_plan(), usable_cpus()
    policy = lease_policy(plan, len(REPLICAS) + samplers, usable, strict=False)
    leasable = policy.pool if policy.pool is not None else plan.isolated & usable
    with local_ray("lt-failover-", leasable, namespace="lowtail-bench") as work:
        worker_kill, actor_kill, results = _serve_and_kill(config, samplers, seconds, work, plan, policy, say)
    kills = [
        Kill(config, "worker", float(worker_kill["at_s"]), int(worker_kill["claimed"])),
        Kill(config, "actor", actor_kill[0], actor_kill[1], frozen_ms=actor_kill[2]),
    ]
    for k, run_results in zip(kills, results, strict=True):
        k.first_answer_of_killed_ms = _rows_around(k, run_results, report.rows)
    # Each kill has its own sampler run: its failures are that run's.
    for k, run_results in zip(kills, results, strict=True):
        for r in run_results:
            for h in r.heroes.values():
                k.failed += h.failed
                for name, n in h.errors.items():
                    k.errors[name] = k.errors.get(name, 0) + n
    report.kills.extend(kills)


def _serve_and_kill(  # noqa: PLR0917 - the configuration and the node it runs on, passed down once
    config: str, samplers: int, seconds: float, work: Path, plan: Plan, policy: LeasePolicy, say: Any
) -> tuple[dict[str, Any], tuple[float, int, float], list[list[Any]]]:
    """Start the replicas and samplers on this node, kill a.0's worker then the actor a.1 under them, and
    stop everything again: the two kills and each kill's sampler run."""
    import ray

    from lowtail.actors.allocator import AllocatorConfig, stop_node_allocator
    from lowtail.actors.inference import InferenceSpec, start_inference_actors, stop_actor
    from lowtail.actors.sampler import EnvSpec, SamplerSpec, start_sampler
    from lowtail.node import cpulist
    from lowtail.serve.model import ModelSpec, write_model

    node = ray.get_runtime_context().get_node_id()
    model = work / "model"
    write_model(model, ModelSpec(features=512))
    alloc = AllocatorConfig(
        state_dir=str(work / "leases"),
        plan=plan.to_dict(),
        pool=None if policy.pool is None else cpulist.format(policy.pool),
        share=policy.share,
    )
    specs = [
        InferenceSpec(hero=h, index=i, model_dir=str(model), allocator=alloc, standby=config == "standby")
        for h, i in REPLICAS
    ]
    say(f"{config}: starting {len(specs)} inference actors and {samplers} samplers; {policy.note}")
    actors = start_inference_actors(specs, node)
    handles: list[Any] = []
    try:
        eps = ray.get([a.endpoint.remote() for a in actors])
        env = EnvSpec(features=512, rows=1, step_us=200)
        for j in range(samplers):
            spec = SamplerSpec(f"s{j}", env, allocator=alloc, timeout_s=30.0)
            handles.append(start_sampler(spec, eps, node))
        return _kill_twice(config, seconds, actors, handles, say)
    finally:
        for h in handles:
            stop_actor(h)
        for a in actors:
            stop_actor(a)
        stop_node_allocator(node, remove_state=True)


def _kill_twice(
    config: str, seconds: float, actors: list[Any], handles: list[Any], say: Any
) -> tuple[dict[str, Any], tuple[float, int, float], list[list[Any]]]:
    """Two sampler runs on the same clients: the worker kill at 30 % of the first (which ends
    RUN_AFTER_KILL_S after the planned kill); then, once a.0 serves again, the actor kill 1 s into the
    second. Without a standby a.0 is out for its whole restart (seconds on a loaded host): killing a.1
    before it serves would measure a hero with no replica at all."""
    import ray

    refs = [h.run.remote(seconds * 0.3 + RUN_AFTER_KILL_S, "async", 2) for h in handles]
    time.sleep(seconds * 0.3)
    say(f"{config}: SIGKILL of a.0's worker")
    ray.get(actors[0].kill_worker.remote())
    worker_kill = ray.get(actors[0].kills.remote())[-1]
    results = [ray.get(refs, timeout=seconds + 120)]
    wait_serving(actors[0], int(worker_kill["pid"]), timeout_s=seconds + 60)
    refs = [h.run.remote(1.0 + RUN_AFTER_KILL_S, "async", 2) for h in handles]
    time.sleep(1.0)
    say(f"{config}: kill of the whole actor a.1")
    actor_kill = kill_actor(actors[1])
    results.append(ray.get(refs, timeout=seconds + 120))
    return worker_kill, actor_kill, results


def _rows_around(k: Kill, run_results: list[Any], rows: list[Row]) -> float:
    """Append each sampler's rows (per hero, and per replica of hero a) in the window around kill ``k``;
    returns the ms from the kill to the first answer of the killed replica (nan: none)."""
    victim = 0 if k.kill == "worker" else 1  # the client's replica index of a.0 / a.1
    firsts = []
    for r in run_results:
        lo, hi = window(k.at_s, r.started_s, r.ended_s)
        covered = hi - k.at_s
        for hero, h in r.heroes.items():
            t = np.asarray(h.answer_s)
            rep = np.asarray(h.replica)
            inside = (t >= lo) & (t <= hi)
            rows.append(
                Row(
                    k.config, k.kill, r.name, f"hero {hero}", gap_ms(t, lo, hi), int(inside.sum()), 0, covered
                )
            )
            if hero != "a":
                continue
            for idx in (0, 1):
                ti = t[rep == idx]
                answers = int(((ti >= lo) & (ti <= hi)).sum())
                rows.append(
                    Row(k.config, k.kill, r.name, f"replica a.{idx}", gap_ms(ti, lo, hi), answers, 0, covered)
                )
            # answered by the killed replica again: published after the kill (its standby,
            # restarted worker or restarted actor), not an answer ready before and read late
            after = t[(rep == victim) & (np.asarray(h.sent_s) > k.at_s)]
            if after.size:
                firsts.append(float(after[0] - k.at_s))
    return 1e3 * min(firsts) if firsts else float("nan")


def wait_serving(actor: Any, killed_pid: int, timeout_s: float) -> float:
    """Wait until ``actor`` serves with a worker other than ``killed_pid``; returns when (monotonic)."""
    import ray

    deadline = time.monotonic() + timeout_s
    while True:
        st = ray.get(actor.status.remote())
        if st["worker_alive"] and st["worker_pid"] not in (None, killed_pid):
            return time.monotonic()
        if time.monotonic() > deadline:
            raise TimeoutError(f"replica a.0 did not serve again within {timeout_s:.0f} s: {st}")
        time.sleep(0.05)


def kill_actor(actor: Any) -> tuple[float, int, float]:
    """Freeze the actor's worker, count what it claimed, kill the actor process and its workers.

    Returns the kill's time, what the worker had claimed, and how long the worker was kept frozen (ms):
    requests on it wait that long, and a sampler's step with them (the bench's doing, not failover's).
    The freeze is kept short: one Ray call to count. The standby, the frozen worker and the actor are
    SIGKILLed back to back, in that order, as a crash of the actor's whole process tree would: killed
    alone first, the actor orphans its workers' process group, and the kernel then sends the stopped
    worker SIGHUP and SIGCONT (POSIX, _exit(2)), so it resumed and answered what had been counted as
    claimed (3 claimed, 0 failed on a quiet host); the standby goes first so that it cannot take over.
    """
    import ray

    st = ray.get(actor.status.remote())
    worker_pid = int(st["worker_pid"])
    actor_pid = int(ray.get(actor.ping.remote())["pid"])
    frozen = time.monotonic()
    os.kill(worker_pid, signal.SIGSTOP)
    claimed = int(ray.get(actor.queue_counts.remote())["PROCESSING"])
    at = time.monotonic()
    for pid in (st["standby_pid"], worker_pid, actor_pid):  # a crash: Ray restarts it with a new queue
        if pid:
            os.kill(int(pid), signal.SIGKILL)
    return at, claimed, 1e3 * (time.monotonic() - frozen)


def window(at_s: float, started_s: float, ended_s: float) -> tuple[float, float]:
    """The gap window around a kill at ``at_s``, cut to the sampler run's span: before its first step
    and after its last one the sampler asked nothing, so no answer was missing there."""
    return max(at_s - WINDOW_BEFORE_S, started_s), max(min(at_s + WINDOW_AFTER_S, ended_s), at_s)


def gap_ms(t: np.ndarray, lo: float, hi: float) -> float:
    inside = t[(t >= lo) & (t <= hi)]
    return float(1e3 * np.diff(np.concatenate(([lo], inside, [hi]))).max())


def judge(report: Report) -> None:
    """Grade the targets; a gap target with a window its run did not cover is not decided (None)."""

    def grade(name: str, pred: Any) -> None:
        rows = [r for r in report.rows if pred(r)]
        if not rows:
            return
        cut = [r for r in rows if r.covered_after_s < WINDOW_AFTER_S - 1e-6]
        report.targets[name] = None if cut else max(r.longest_gap_ms for r in rows) <= TARGET_GAP_MS
        if cut:
            short = min(r.covered_after_s for r in cut)
            report.undecided[name] = (
                f"a sampler's run ended {short:.2f} s after the kill, before the {WINDOW_AFTER_S} s window"
            )

    grade(
        "standby: no sampler's gap > 50 ms for any hero (worker kill)",
        lambda r: r.config == "standby" and r.kill == "worker" and r.series.startswith("hero"),
    )
    grade(
        "no standby: healthy hero's and replica's traffic never stalls > 50 ms",
        lambda r: (
            r.config == "no-standby"
            and (
                r.series == "hero b"
                or (r.kill == "worker" and r.series == "replica a.1")
                or (r.kill == "actor" and r.series == "replica a.0")
            )
        ),
    )
    for config in {k.config for k in report.kills}:
        ks = [k for k in report.kills if k.config == config]
        report.targets[f"{config}: failures == what the dead workers had claimed"] = all(
            k.failed == k.claimed for k in ks
        )


def render(report: Report) -> str:
    rows = [
        [
            r.config,
            r.kill,
            r.sampler,
            r.series,
            f"{r.longest_gap_ms:.1f}",
            r.answers,
            f"{r.covered_after_s:.2f}",
        ]
        for r in report.rows
    ]
    out = [
        table.render(
            ["config", "kill", "sampler", "series", "longest gap ms", "answers in window", "s after kill"],
            rows,
            title=f"Longest gap between answers, {WINDOW_BEFORE_S} s before to {WINDOW_AFTER_S} s after "
            "each kill",
        ),
        table.render(
            [
                "config",
                "kill",
                "claimed by the dead worker",
                "failed",
                "kill -> first answer of the killed replica ms",
                "worker frozen ms",
            ],
            [
                [
                    k.config,
                    k.kill,
                    k.claimed,
                    f"{k.failed} {k.errors or ''}",
                    "-" if math.isnan(k.first_answer_of_killed_ms) else f"{k.first_answer_of_killed_ms:.1f}",
                    f"{k.frozen_ms:.1f}" if k.kill == "actor" else "-",
                ]
                for k in report.kills
            ],
            title="Failures and recovery",
        ),
        table.render(
            ["target", "met"],
            [[k, verdict(v, report.undecided.get(k, ""))] for k, v in report.targets.items()],
            title="Targets",
        ),
        f"load average {report.load[0]:.2f} {report.load[1]:.2f} {report.load[2]:.2f}" if report.load else "",
        f"queue hot path: {report.queue_core['name']} ({report.queue_core['reason']})"
        if report.queue_core
        else "",
    ]
    return "\n\n".join(out)


def verdict(met: bool | None, why: str) -> str:
    return f"not decided: {why}" if met is None else "yes" if met else "NO"


def plot(report: Report, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 5))
    labels = [f"{r.config}\n{r.kill}\n{r.series}" for r in report.rows]
    keys = list(dict.fromkeys(labels))
    for x, key in enumerate(keys):
        ys = [r.longest_gap_ms for r, lab in zip(report.rows, labels, strict=True) if lab == key]
        ax.scatter([x] * len(ys), ys, s=18)
    ax.axhline(TARGET_GAP_MS, color="grey", ls=":", lw=0.8, label=f"target {TARGET_GAP_MS:.0f} ms")
    ax.set_xticks(range(len(keys)), keys, fontsize=6)
    ax.set_yscale("log")
    ax.set_ylabel("longest gap between answers (ms), per sampler")
    ax.set_title("lowtail bench failover: a worker SIGKILL, then an actor kill", fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
