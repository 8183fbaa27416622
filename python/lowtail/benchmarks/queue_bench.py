"""``lowtail bench queue``: lowtail's queue side by side with the designs it replaces, same echo workload.

A request of 16 x 512 float32 and a response of 16 x 64 float32, round trips timed closed-loop from the
client (each request sent when the previous answer arrived), client and server pinned to different
CPUs when there are two. Reports p50/p99/p99.9/max with the sample count per transport, ratios against
lowtail, requests/s with 4 concurrent clients for lowtail and the predecessor system's design, and the
design targets with met / not met (a p99.9 target only with enough samples: lowtail.validation.evidence).
Output: a terminal table, JSON (``--json``), a latency plot (``--plot``) and an HTML report with the
targets, the tables and the plot (``--html``). ``--check`` exits 1 when a target is not met.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import importlib.metadata
import io
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from lowtail.benchmarks.co_tenant import co_tenants
from lowtail.benchmarks.queue_transports import (
    MISSING,
    PEER_PACKAGES,
    PRIORITIES,
    TRANSPORTS,
    Transport,
    fairness,
    lowtail_config,
    prepare,
    restore_priority,
    throughput,
)
from lowtail.benchmarks.report import add_check, exit_code, shown, targets_table, verdict, write_bench_html
from lowtail.errors import UsageError
from lowtail.options import add_html, add_json, add_plot, json_to_stdout, write_json, write_text
from lowtail.render import console, table
from lowtail.render.progress import Progress
from lowtail.render.schema import stamp
from lowtail.shm import native
from lowtail.telemetry.percentiles import quantiles
from lowtail.validation.evidence import shortfall

ORDER = [
    "lowtail",
    "lowtail_python",
    "iceoryx2_busy",
    "iceoryx2_waitset",
    "seed_flock_poll",
    "mp_pipe",
    "tcp_pickle",
    "ray_actor",
    "spin_floor",
    "native_floor",
]
# Round trips per transport: >= 10,000 for lowtail and the floor (a p99.9 needs thousands), fewer for the
# slow baselines (seed_flock_poll at ~1 ms per round trip, Ray at ~0.5-1 ms).
FULL_N = {
    "lowtail": 20000,
    "lowtail_python": 20000,
    "iceoryx2_busy": 20000,
    "iceoryx2_waitset": 20000,
    "spin_floor": 20000,
    "native_floor": 20000,
    "seed_flock_poll": 5000,
    "mp_pipe": 10000,
    "tcp_pickle": 10000,
    "ray_actor": 3000,
}
QUICK_N = {
    "lowtail": 300,
    "lowtail_python": 300,
    "iceoryx2_busy": 300,
    "iceoryx2_waitset": 300,
    "spin_floor": 300,
    "native_floor": 300,
    "seed_flock_poll": 100,
    "mp_pipe": 200,
    "tcp_pickle": 200,
    "ray_actor": 50,
}
WARMUP = {"quick": 20, "full": 500}


def register(sub: Any) -> None:
    p = sub.add_parser(
        "queue", help="the shared-memory queue vs the predecessor system's flock+poll queue, pipes, TCP, Ray"
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="a smoke run with few round trips (CI; its p99.9 targets are not decided: too few samples)",
    )
    add_check(p)
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    # The CLI convention (lowtail.options): --json FILE or '-', --plot, --samples (old names: aliases).
    add_json(p, "the report")
    add_plot(p, "the latency distributions", old="--png", dest="png")
    add_html(p)
    p.add_argument(
        "--transports",
        default=",".join(n for n in ORDER if n in TRANSPORTS),
        help=f"comma-separated subset of {','.join(ORDER)} (default: all whose package imports; "
        "iceoryx2_* need the optional group 'peer')",
    )
    p.add_argument(
        "--co-tenant",
        action="store_true",
        help="run a busy loop at normal priority pinned on the client's and the server's CPU through the "
        "measurement (lowtail.benchmarks.co_tenant): a shared host, reproducibly",
    )
    p.add_argument(
        "--samples",
        "--n",
        dest="n",
        type=int,
        help="round trips per transport (default: per transport, fewer with --quick)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        help="measure every transport this many times, interleaved (round after round): the table pools "
        "every round's samples, the JSON keeps each round, and lowtail against iceoryx2_busy is decided on "
        "the rounds it was ahead in (>= 9 of 10; needs --rounds 10 or more)",
    )
    p.add_argument("--clients", type=int, default=4, help="concurrent clients for the throughput run")
    p.add_argument(
        "--throughput-seconds",
        type=float,
        help="duration of each throughput run (default: 3, 0.5 with --quick)",
    )
    p.add_argument(
        "--fairness-clients",
        type=int,
        default=8,
        help="saturating clients for the fairness figure (0 skips it)",
    )
    p.add_argument(
        "--priority",
        choices=PRIORITIES,
        default="nice",
        help="given alike to every client and server: nice (-20), fifo (SCHED_FIFO 50, needs two "
        "CPUs: keeps a shared machine's other tenants from preempting the measurement) or normal",
    )
    p.set_defaults(func=run)


def percentiles(samples_us: np.ndarray[Any, Any]) -> dict[str, float | int]:
    p50, p99, p999 = quantiles(samples_us, [0.5, 0.99, 0.999])
    return {
        "n": int(samples_us.size),
        "p50_us": round(float(p50), 2),
        "p99_us": round(float(p99), 2),
        "p999_us": round(float(p999), 2),
        "max_us": round(float(samples_us.max()), 2),
    }


def _cpus() -> tuple[int | None, int | None]:
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        return cpus[0], cpus[1]
    return None, None


def _sched_counters() -> tuple[int, int]:
    """The calling thread's run_delay (ns runnable but not running) and involuntary context switches."""
    run_delay = int(Path("/proc/thread-self/schedstat").read_text().split()[1])
    invol = 0
    for line in Path("/proc/thread-self/status").read_text().splitlines():
        if line.startswith("nonvoluntary_ctxt_switches:"):
            invol = int(line.split()[1])
    return run_delay, invol


def _timer_interrupts() -> dict[int, int]:
    """Local timer interrupts so far per CPU (the ``LOC`` row of /proc/interrupts; {} where absent)."""
    try:
        for line in Path("/proc/interrupts").read_text().splitlines():
            if line.lstrip().startswith("LOC:"):
                counts = line.split()[1:]
                return {cpu: int(c) for cpu, c in enumerate(counts) if c.isdigit()}
    except OSError:
        pass
    return {}


def _gc_collections() -> int:
    return sum(int(s["collections"]) for s in gc.get_stats())


def measure(
    t: Transport, n: int, warmup: int, progress: Progress
) -> tuple[np.ndarray[Any, Any], dict[str, Any]]:
    rng = np.random.default_rng(1)
    obs = rng.standard_normal((16, 512)).astype(np.float32)
    want = np.ascontiguousarray(obs[:, :64])
    for _ in range(warmup):
        t.round_trip({"obs": obs})
    out = t.round_trip({"obs": obs})
    if not np.array_equal(out["logits"], want):
        raise RuntimeError(f"{t.name}: the echo answer does not match the request")
    samples = np.empty(n, np.int64)
    clock = time.perf_counter_ns
    step = max(1, n // 10)
    delay0, invol0 = _sched_counters()
    irq0, gc0 = _timer_interrupts(), _gc_collections()
    for i in range(n):
        t0 = clock()
        t.round_trip({"obs": obs})
        samples[i] = clock() - t0
        if (i + 1) % step == 0:
            progress.update(i + 1, f"{i + 1}/{n}")
    progress.finish()
    delay1, invol1 = _sched_counters()
    irq1, gc1 = _timer_interrupts(), _gc_collections()
    sched: dict[str, Any] = {
        "client_run_delay_ms": round((delay1 - delay0) / 1e6, 3),
        "client_involuntary_switches": invol1 - invol0,
        # The tail's share of the host: each local timer interrupt (the 4 ms tick of a busy CPU)
        # stalls whichever round trip it lands in by tens of us on a nested-virtualised guest.
        "timer_interrupts_per_cpu": {cpu: irq1[cpu] - irq0[cpu] for cpu in irq1 if cpu in irq0},
        "client_gc_collections": gc1 - gc0,
    }
    counts = getattr(getattr(t, "client", None), "wait_counts", None)
    if isinstance(counts, dict):
        sched["client_wait_counts"] = counts  # lowtail: where the answers found the client
    return samples / 1000.0, sched


FAIRNESS_DEPTH = 2  # requests each fairness client keeps in flight: every lane always has one ready


def fairness_report(per_client: list[tuple[np.ndarray[Any, Any], int]], seconds: float) -> dict[str, Any]:
    """Queue wait (submit to claim) of a ready request while the other lanes are served."""
    waits = [w / 1000.0 for w, _ in per_client]
    every = np.concatenate([w for w in waits if w.size]) if any(w.size for w in waits) else np.zeros(0)
    clients = [
        {
            "client": i,
            "answered": int(w.size),
            "unanswered": unanswered,
            **({"wait_p50_us": round(float(np.percentile(w, 50)), 1),
                "wait_p999_us": round(float(np.percentile(w, 99.9)), 1),
                "wait_max_us": round(float(w.max()), 1)} if w.size else {}),
        }
        for i, (w, (_, unanswered)) in enumerate(zip(waits, per_client, strict=True))
    ]  # fmt: skip
    out: dict[str, Any] = {
        "clients": len(per_client),
        "depth": FAIRNESS_DEPTH,
        "seconds": seconds,
        "per_client": clients,
        "starved_clients": sum(1 for c in clients if c["answered"] == 0),
    }
    if every.size:
        out.update(percentiles(every))
        counts = [c["answered"] for c in clients]
        out["min_over_max_answered"] = round(min(counts) / max(counts), 3) if max(counts) else 0.0
    return out


# (target, the other transport, the statistic, the factor, inverse: lowtail / other must be <= factor)
TARGETS: tuple[tuple[str, str, str, float, bool], ...] = (
    ("lowtail p50 within 2x of spin_floor", "spin_floor", "p50_us", 2.0, True),
    # The native two-process floor (C on both sides, the same copies): what the hardware allows here.
    ("lowtail p50 within 1.5x of native_floor", "native_floor", "p50_us", 1.5, True),
    ("lowtail p99.9 within 2x of native_floor", "native_floor", "p999_us", 2.0, True),
    ("lowtail p50 >= 40x lower than seed_flock_poll", "seed_flock_poll", "p50_us", 40.0, False),
    ("lowtail p50 >= 30x lower than seed_flock_poll", "seed_flock_poll", "p50_us", 30.0, False),
    ("lowtail p50 >= 20x lower than ray_actor", "ray_actor", "p50_us", 20.0, False),
    ("lowtail p99.9 >= 10x lower than seed_flock_poll", "seed_flock_poll", "p999_us", 10.0, False),
    ("lowtail p50 within 10x of spin_floor", "spin_floor", "p50_us", 10.0, True),
    # The best production peer, in the same run: at or below it (lowtail / iceoryx2 <= 1).
    ("lowtail p50 at or below iceoryx2_busy's", "iceoryx2_busy", "p50_us", 1.0, True),
    ("lowtail p99.9 at or below iceoryx2_busy's", "iceoryx2_busy", "p999_us", 1.0, True),
    ("lowtail p50 at or below iceoryx2_waitset's", "iceoryx2_waitset", "p50_us", 1.0, True),
    ("lowtail p99.9 at or below iceoryx2_waitset's", "iceoryx2_waitset", "p999_us", 1.0, True),
)
QUANTILE = {"p50_us": 0.5, "p99_us": 0.99, "p999_us": 0.999}


def _too_few(key: str, *rows: dict[str, Any]) -> str:
    """The evidence rule (lowtail.validation.evidence) for a target on a percentile of these rows."""
    return next((why for r in rows if (why := shortfall(int(r["n"]), QUANTILE[key]))), "")


def targets(res: dict[str, dict[str, Any]], priority: str = "fifo") -> list[dict[str, Any]]:
    """The design targets, each with the measured ratio and whether it is met (None: not decided, and
    ``why`` says why: not measured, too few samples for the percentile, or decided under fifo only)."""
    out: list[dict[str, Any]] = []
    lt = res.get("lowtail")
    for desc, name, key, need, inverse in TARGETS:
        other = res.get(name)
        if lt is None or other is None:
            out.append({"target": desc, "ratio": None, "met": None, "why": "not measured"})
            continue
        r = float(other[key]) / float(lt[key])
        measured = (1.0 / r) if inverse else r  # inverse: lowtail / floor
        met = measured <= need if inverse else measured >= need
        short = _too_few(key, lt, other)
        out.append(
            {"target": desc, "ratio": round(measured, 2), "met": None if short else bool(met), "why": short}
        )
    # p99.9 within 3x of lowtail's own p50: a target under --priority fifo only (at nice the other
    # tenants' CPU time is the tail); shown at every priority, decided at fifo.
    own = round(float(lt["p999_us"]) / float(lt["p50_us"]), 2) if lt else None
    if lt is None:
        why = "not measured"
    elif priority != "fifo":  # before the sample count: more samples at this priority decide nothing
        why = "decided under --priority fifo only"
    else:
        why = _too_few("p999_us", lt)
    out.append({
        "target": "lowtail p99.9 within 3x of its own p50 under --priority fifo",
        "ratio": own,
        "met": None if why or own is None else bool(own <= 3.0),
        "why": why,
    })  # fmt: skip
    return out


ROUNDS_NEEDED = 10
ROUNDS_AHEAD = 0.9


def rounds_target(rounds: list[dict[str, dict[str, Any]]]) -> list[dict[str, Any]]:
    """lowtail ahead of iceoryx2_busy at p50 and p99.9 in at least 9 of 10 interleaved rounds (a share of
    90% of ``--rounds`` >= 10), each round's p99.9 resting on enough samples."""
    desc = "lowtail ahead of iceoryx2_busy at p50 and p99.9 in >= 9 of 10 interleaved rounds"
    both = [r for r in rounds if "lowtail" in r and "iceoryx2_busy" in r]
    if not both:
        return [{"target": desc, "ratio": None, "met": None, "why": "not measured"}]
    ahead = sum(
        r["lowtail"]["p50_us"] < r["iceoryx2_busy"]["p50_us"]
        and r["lowtail"]["p999_us"] < r["iceoryx2_busy"]["p999_us"]
        for r in both
    )
    why = next((w for r in both if (w := _too_few("p999_us", r["lowtail"], r["iceoryx2_busy"]))), "")
    if not why and len(both) < ROUNDS_NEEDED:
        why = f"{len(both)} rounds, need at least {ROUNDS_NEEDED} (--rounds)"
    met = None if why else ahead >= ROUNDS_AHEAD * len(both)
    share = round(ahead / len(both), 2)
    return [{"target": desc, "ratio": share, "figure": f"{ahead}/{len(both)} rounds", "met": met, "why": why}]


Table = tuple[str, list[str], list[list[Any]]]  # (title, headers, rows)


def tables(report: dict[str, Any]) -> list[Table]:
    """(title, headers, rows) of each table: the terminal and the HTML show the same."""
    parts = [_round_trip_table(report["transports"])]
    tp = report.get("throughput", {})
    if tp:
        parts.append(_throughput_table(tp))
    fair = report.get("fairness")
    if fair:
        parts.append(_fairness_table(fair))
    parts.append(_targets_table(report["targets"]))
    return parts


def _round_trip_table(res: dict[str, Any]) -> Table:
    """One row per transport measured, in ORDER, with its tails against lowtail's."""
    lt = res.get("lowtail")
    rows = []
    for name in ORDER:
        r = res.get(name)
        if r is None:
            continue
        x50 = f"{r['p50_us'] / lt['p50_us']:.1f}x" if lt else "-"
        x999 = f"{r['p999_us'] / lt['p999_us']:.1f}x" if lt else "-"
        delay = r.get("client_run_delay_ms")
        rows.append([name, r["n"], r["p50_us"], r["p99_us"], r["p999_us"], r["max_us"], x50, x999, delay])
    return (
        "round trip, 16x512 float32 in, 16x64 float32 out (closed loop)",
        [
            "transport",
            "n",
            "p50 us",
            "p99 us",
            "p99.9 us",
            "max us",
            "p50 vs lowtail",
            "p99.9 vs lowtail",
            "client run_delay ms",
        ],
        rows,
    )


def _throughput_table(tp: dict[str, Any]) -> Table:
    """Requests per second of each transport, against lowtail's."""
    base = tp.get("lowtail", {}).get("requests_per_s")
    trows = [
        [
            k,
            v["clients"],
            round(v["requests_per_s"]),
            f"{v['requests_per_s'] / base:.2f}x" if base else "-",
        ]
        for k, v in tp.items()
    ]
    return ("throughput", ["transport", "clients", "requests/s", "vs lowtail"], trows)


def _fairness_table(fair: dict[str, Any]) -> Table:
    """Each saturating client's answered, unanswered and queue waits, then all of them."""
    frows = [
        [c["client"], c["answered"], c["unanswered"], c.get("wait_p50_us", "-"),
         c.get("wait_p999_us", "-"), c.get("wait_max_us", "-")]
        for c in fair["per_client"]
    ]  # fmt: skip
    lost = sum(c["unanswered"] for c in fair["per_client"])
    frows.append(["all", fair.get("n", 0), lost, fair.get("p50_us", "-"), fair.get("p999_us", "-"),
                  fair.get("max_us", "-")])  # fmt: skip
    return (
        f"fairness: queue wait of a ready request, {fair['clients']} saturating clients x "
        f"{fair['depth']} in flight, {fair['seconds']} s (starved: {fair['starved_clients']})",
        ["client", "answered", "unanswered", "wait p50 us", "wait p99.9 us", "wait max us"],
        frows,
    )


def _targets_table(targets: list[dict[str, Any]]) -> Table:
    """The targets shown (see ``shown``), each with its figure or ratio and its verdict."""
    keep, note = shown(targets)
    trows = [
        [t["target"], t.get("figure") or ("-" if t["ratio"] is None else f"{t['ratio']}x"), verdict(t)]
        for t in keep
    ]
    return ("targets" + note, ["target", "measured", "verdict"], trows)


def render_tables(report: dict[str, Any]) -> str:
    core = report.get("workload", {}).get("queue_core")
    head = f"queue hot path: {core['name']} ({core['reason']})\n\n" if core else ""
    return head + "\n\n".join(table.render(h, rows, title=t) for t, h, rows in tables(report))


def plot(samples: dict[str, np.ndarray[Any, Any]], report: dict[str, Any]) -> bytes:
    """Latency distributions: the survival function (share of round trips slower than x), log-log."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fair = report.get("fairness")
    fig, axes = plt.subplots(1, 3 if fair else 2, figsize=(19 if fair else 13, 5))
    ax1, ax2 = axes[0], axes[1]
    for name in ORDER:
        xs = samples.get(name)
        if xs is None:
            continue
        s = np.sort(xs)
        surv = 1.0 - np.arange(s.size) / s.size
        ax1.loglog(s, surv, label=f"{name} (n={s.size})", drawstyle="steps-post")
    ax1.set_xlabel("round trip (us)")
    ax1.set_ylabel("share of round trips slower than x")
    ax1.set_title("latency distribution (tail to the lower right)")
    ax1.grid(True, which="both", alpha=0.3)
    ax1.legend(fontsize=8, loc="lower left")  # the tail runs to the lower right: keep it uncovered
    names = [n for n in ORDER if n in samples]
    ax2.boxplot([samples[n] for n in names], whis=(1, 99), showfliers=False)
    ax2.set_xticks(range(1, len(names) + 1), names, rotation=20, fontsize=8)
    ax2.set_yscale("log")
    ax2.set_ylabel("round trip (us); whiskers p1-p99")
    ax2.set_title("per transport")
    ax2.grid(True, axis="y", which="both", alpha=0.3)
    if fair:
        ax3 = axes[2]
        rows = fair["per_client"]
        lanes = [c["client"] for c in rows]
        ax3.bar(lanes, [c.get("wait_p999_us", 0.0) for c in rows], label="p99.9", color="tab:red")
        ax3.bar(lanes, [c.get("wait_p50_us", 0.0) for c in rows], label="p50", color="tab:blue")
        for c in rows:
            ax3.annotate(f"n={c['answered']}", (c["client"], c.get("wait_p999_us", 0.0)), ha="center",
                         va="bottom", fontsize=7)  # fmt: skip
        ax3.set_xlabel("client (lane)")
        ax3.set_yscale("log")  # p50 (us) and p99.9 (up to ms on a loaded host) on one axis
        ax3.set_ylabel("queue wait of a ready request (us)")
        ax3.set_title(f"fairness: {fair['clients']} saturating clients")
        ax3.legend(fontsize=8)
        ax3.grid(True, axis="y", alpha=0.3)
    w = report["workload"]
    fig.suptitle(f"lowtail bench queue: {w['request']} -> {w['response']}, client CPU {w['client_cpu']}, "
                 f"worker CPU {w['worker_cpu']}")  # fmt: skip
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def write_html(path: str, report: dict[str, Any], png: bytes) -> None:
    """The report page: targets met / not met, the tables, the plots, workload and host, the JSON folded."""
    from lowtail.render import html

    targets_ = [
        {**t, "figure": t.get("figure") or ("-" if t["ratio"] is None else f"{t['ratio']}x")}
        for t in report["targets"]
    ]
    sections = [targets_table(targets_)]
    sections += [html.Section(t, table=html.Table(h, rows)) for t, h, rows in tables(report)[:-1]]
    sections.append(html.Section("Plots", images=[html.Image("latency distributions", png)]))
    write_bench_html(path, "lowtail bench queue", report, sections)


def run(args: argparse.Namespace) -> int:
    names = _checked_transports(args)
    client_cpu, worker_cpu = _cpus()
    prio = args.priority if os.geteuid() == 0 else "normal"
    if prio == "fifo" and worker_cpu is None:
        raise UsageError("--priority fifo needs two CPUs (a SCHED_FIFO spinner would starve its peer on one)")
    mode = "quick" if args.quick else "full"
    seconds = args.throughput_seconds or (0.5 if args.quick else 3.0)
    report = _new_report(client_cpu, worker_cpu, prio, mode)
    tenant_cpus = sorted({c for c in (client_cpu, worker_cpu) if c is not None})
    tenant_cpus = tenant_cpus or [min(os.sched_getaffinity(0))]
    tenants = contextlib.ExitStack()
    if args.co_tenant:
        report["workload"]["co_tenant"] = {"cpus": tenant_cpus, "priority": "SCHED_OTHER nice 0", "pids": []}
    samples: dict[str, np.ndarray[Any, Any]] = {}
    saved = os.sched_getaffinity(0)
    saved_nice = os.getpriority(os.PRIO_PROCESS, 0)
    try:
        try:
            if args.co_tenant:  # before the first transport starts, stopped after the last run
                report["workload"]["co_tenant"]["pids"] = tenants.enter_context(co_tenants(tenant_cpus))
            _round_trips(
                args, names, report, samples, (client_cpu, worker_cpu, prio), saved=(saved, saved_nice)
            )
            restore_priority(saved_nice)  # the parent only coordinates the throughput runs
            os.sched_setaffinity(0, saved)
            _throughput_and_fairness(args, names, report, seconds, (client_cpu, worker_cpu, prio))
        finally:
            tenants.close()  # the co-tenant loops end here, Ctrl-C and errors included
            restore_priority(saved_nice)
            os.sched_setaffinity(0, saved)
        report["complete"] = True
    except KeyboardInterrupt:  # keep the transports that finished; exit 130 below
        report["interrupted"] = True
    report["targets"] = targets(report["transports"], prio) + rounds_target(report["rounds"])
    _write_outputs(args, report, samples)
    return 130 if report["interrupted"] else exit_code(args, report["targets"])


def _checked_transports(args: argparse.Namespace) -> list[str]:
    """The transports asked for, and every option a run would otherwise trip over late."""
    names = [n.strip() for n in args.transports.split(",") if n.strip()]
    if absent := [n for n in names if n in MISSING]:
        pkgs = sorted({PEER_PACKAGES[n] for n in absent})
        raise UsageError(
            f"--transports {','.join(absent)}: needs the Python package {', '.join(pkgs)}, which does not "
            f"import ({MISSING[absent[0]]}); install it with: pip install 'lowtail[peer]' "
            "(in a checkout: .venv/bin/pip install -c python/constraints.txt iceoryx2)"
        )
    unknown = [n for n in names if n not in TRANSPORTS]
    if unknown or not names:
        raise UsageError(f"--transports {args.transports!r}: unknown {unknown}; expected a subset of {ORDER}")
    if args.n is not None and args.n < 10:
        raise UsageError(f"--samples {args.n}: expected at least 10 round trips")
    if args.fairness_clients < 0:
        raise UsageError(f"--fairness-clients {args.fairness_clients}: expected 0 (skip) or more")
    if args.rounds < 1:
        raise UsageError(f"--rounds {args.rounds}: expected at least 1")
    if args.clients < 1:
        raise UsageError(f"--clients {args.clients}: expected at least 1")
    return names


def _new_report(client_cpu: int | None, worker_cpu: int | None, prio: str, mode: str) -> dict[str, Any]:
    cfg = lowtail_config()
    return {
        **stamp("bench.queue"),
        "complete": False,  # true once every transport and run finished
        "interrupted": False,
        "workload": {
            "request": "obs: float32[16, 512] (32 KiB)",
            "response": "logits: float32[16, 64] (4 KiB)",
            "echo": "logits = obs[:, :64]",
            "loop": "closed: one request in flight per client, each sent when the previous answer arrived",
            "client_cpu": client_cpu,
            "worker_cpu": worker_cpu,
            "priority": {"nice": "nice -20", "fifo": "SCHED_FIFO 50", "normal": "unchanged"}[prio],
            "mode": mode,
            "lowtail_config": {"request_bytes": cfg.request_bytes, "response_bytes": cfg.response_bytes,
                               "client_spin_us": cfg.client_spin_us, "worker_idle_us": cfg.worker_idle_us},
            "host": platform.node(),
            "loadavg_at_start": Path("/proc/loadavg").read_text().split()[:3],
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "iceoryx2": None if "iceoryx2_busy" in MISSING else importlib.metadata.version("iceoryx2"),
            # the queue's hot path in this process (its worker, spawned, decides the same way)
            "queue_core": native.implementation().to_dict(),
        },
        "transports": {},
        "rounds": [],  # each round's percentiles per transport (--rounds), in the order they ran
    }  # fmt: skip


Where = tuple[int | None, int | None, str]  # client CPU, worker CPU, priority


def _round_trips(
    args: argparse.Namespace,
    names: list[str],
    report: dict[str, Any],
    samples: dict[str, np.ndarray[Any, Any]],
    where: Where,
    *,
    saved: tuple[set[int], int],
) -> None:
    """Each round runs every transport in ORDER; the samples of all rounds so far pool per transport."""
    client_cpu, worker_cpu, prio = where
    mode = "quick" if args.quick else "full"
    counts = QUICK_N if args.quick else FULL_N
    per_round: dict[str, list[np.ndarray[Any, Any]]] = {}
    for rnd in range(args.rounds):
        tag = f"round {rnd + 1}/{args.rounds} " if args.rounds > 1 else ""
        report["rounds"].append({})
        for i, name in enumerate(n for n in ORDER if n in names):
            n = args.n or counts[name]
            t = TRANSPORTS[name](worker_cpu, prio)
            console.info(f"{tag}[{i + 1}/{len(names)}] {name}: starting", sys.stderr)
            try:
                t.start()  # before pinning: servers (and Ray's daemons) must not inherit our CPU
                prepare(client_cpu, prio)
                label = f"{tag}[{i + 1}/{len(names)}] {name}: round trips"
                bar = Progress(label, n, enabled=not args.no_progress)
                got, sched = measure(t, n, WARMUP[mode], bar)
            finally:
                t.stop()
            per_round.setdefault(name, []).append(got)
            report["rounds"][-1][name] = percentiles(got)
            # every round's samples together: the table, the plot and the ratio targets
            samples[name] = np.concatenate(per_round[name])
            report["transports"][name] = {**percentiles(samples[name]), **sched}
        restore_priority(saved[1])  # between rounds the parent only coordinates
        os.sched_setaffinity(0, saved[0])


def _throughput_and_fairness(
    args: argparse.Namespace, names: list[str], report: dict[str, Any], seconds: float, where: Where
) -> None:
    client_cpu, worker_cpu, prio = where
    report["throughput"] = {}
    for kind in ("lowtail", "seed_flock_poll"):
        if kind in names:
            console.info(f"throughput: {kind} with {args.clients} clients for {seconds} s", sys.stderr)
            rps = throughput(kind, args.clients, seconds, worker_cpu, client_cpu, prio)
            report["throughput"][kind] = {
                "clients": args.clients,
                "seconds": seconds,
                "requests_per_s": round(rps, 1),
            }
    if "lowtail" in names and args.fairness_clients > 0:
        console.info(f"fairness: {args.fairness_clients} saturating clients for {seconds} s", sys.stderr)
        per_client = fairness(args.fairness_clients, FAIRNESS_DEPTH, seconds, worker_cpu, client_cpu, prio)
        report["fairness"] = fairness_report(per_client, seconds)


def _write_outputs(args: argparse.Namespace, report: dict[str, Any], samples: dict[str, Any]) -> None:
    if not json_to_stdout(args):  # the table first: a file that cannot be written never hides it
        print(render_tables(report))
        if report["interrupted"]:
            print("INTERRUPTED: a partial run; the transports above finished before Ctrl-C")
    write_json(args.json, report)
    if samples and (args.png or args.html):
        png = plot(samples, report)
        if args.png:
            write_text(args.png, png)
        if args.html:
            write_html(args.html, report, png)
