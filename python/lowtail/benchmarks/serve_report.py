"""The rendering of ``lowtail bench serve`` (see ``serve_bench``): the terminal tables, the targets with
met / not met, the plot and the HTML report, from the runs' ``DesignResult`` rows."""

from __future__ import annotations

import io
import math
from typing import Any

import numpy as np

from lowtail.benchmarks.serve_run import BREAKDOWN, SAMPLER_COSTS, STAGES, WAKES, DesignResult
from lowtail.render import table
from lowtail.serve import call_stats as metrics

TARGET_RATIO = 0.95  # served x2 and x4 at batch 16
TRAFFIC_TARGET_RATIO = 0.85  # traffic 16x1: 16 samplers x 1 observation
OVERHEAD_TARGET_US = 20.0
SAMPLER_CPU_TARGET_US = 20.0  # per batch-1 request (traffic 16x1), samplers on a CPU they share


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


def result_tables(results: list[DesignResult]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, headers, rows) of the two per-design tables: what the samplers saw, and what it cost the
    worker and the samplers (two tables, so each fits a terminal)."""
    rounds = max(r.round for r in results)
    seen = []
    cost = []
    for r in results:
        label = _row_label(r, rounds)
        seen.append(
            [
                label,
                str(r.batch),
                _f(r.samples_per_s, ",.0f"),
                _f(r.ratio_to_bare, ".3f"),
                *_fmt(r.latency_ms),
            ]
        )
        seen[-1].append(_short(r.error))
        cost.append(
            [
                label,
                _f(r.engine_batch_mean, ".1f"),
                _f(r.deschedule_ms.p999, ".3f"),
                str(r.deschedule_ms.n),
                _f(r.engine_ms_mean, ".3f"),
                _f(r.overhead_us_mean, ".0f"),
                _f(r.worker_busy, ".0%"),
                _f(r.sampler_cpu_us_per_request, ".0f"),
                _f(r.sampler_cpus_busy, ".0%"),
                "-" if r.sampler_spin_us < 0 else str(r.sampler_spin_us),
            ]
        )
    seen_h = ["design", "req", "samples/s", "vs bare", "p50 ms", "p99 ms", "p99.9 ms", "max ms", "n", "error"]
    cost_h = ["design", "engine batch", "desched p99.9 ms", "n calls", "infer ms", "+us/call", "core busy"]
    cost_h += ["sampler us/req", "sampler CPUs busy", "sampler spin us"]
    return [
        (
            f"lowtail bench serve: throughput and sampler latency (bare at batch {results[0].batch})",
            seen_h,
            seen,
        ),
        ("the worker's engine calls and the samplers' CPU", cost_h, cost),
    ]


def render_table(results: list[DesignResult]) -> str:
    return "\n\n".join(table.render(h, rows, title=t) for t, h, rows in result_tables(results))


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


def breakdown_tables(results: list[DesignResult]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, headers, rows): the worker's cost per engine call beyond infer(), stage by stage (us
    p50/mean/p99, CALL_FIELDS), split in two tables so each fits a terminal, then its scheduling and
    memory."""
    rounds = max(r.round for r in results)
    served = [r for r in results if r.breakdown_us]
    half = (len(BREAKDOWN) + 1) // 2

    def stages(keys: tuple[str, ...]) -> list[list[str]]:
        return [
            [_row_label(r, rounds), str(r.breakdown_us["overhead_us"].n)]
            + [f"{b.p50:.1f}/{b.mean:.1f}/{b.p99:.0f}" for b in (r.breakdown_us[k] for k in keys)]
            for r in served
        ]

    names = [k.removesuffix("_us") for k in BREAKDOWN]
    title = "worker cost per engine call beyond infer(), us p50/mean/p99"
    rest = [
        [
            _row_label(r, rounds),
            _f(r.fifo_switches_per_call, ".2f"),
            str(r.fifo_cooldowns),
            _f(r.worker_rss_mib, ".0f"),
            _f(r.queue_mib, ".2f"),
        ]
        for r in served
    ]
    return [
        (f"{title}, 1 of 2", ["design", "n calls", *names[:half]], stages(BREAKDOWN[:half])),
        (f"{title}, 2 of 2", ["design", "n calls", *names[half:]], stages(BREAKDOWN[half:])),
        *wake_table(served, rounds),
        (
            "the worker's scheduling and memory",
            ["design", "FIFO sw/call", "cooldowns", "RSS MiB", "queue MiB"],
            rest,
        ),
    ]


def wake_table(served: list[DesignResult], rounds: int) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, headers, rows): the futex wakes of parked samplers on their own (a part of answer), and
    the worker's overhead with and without them (the target grades the latter), us p50/mean/p99."""

    def pct(p: metrics.Percentiles) -> str:
        return f"{_f(p.p50, '.1f')}/{_f(p.mean, '.1f')}/{_f(p.p99, '.0f')}"

    rows = [
        [
            _row_label(r, rounds),
            str(b["wake_us"].n),
            pct(b["wake_us"]),
            _f(b["woken"].mean, ".2f"),
            pct(b["overhead_us"]),
            pct(b["overhead_less_wakes_us"]),
        ]
        for r in served
        for b in (r.breakdown_us,)
        if all(k in b for k in WAKES)
    ]
    if not rows:
        return []
    title = "wakes of parked samplers (part of answer), overhead with and without them, us p50/mean/p99"
    headers = ["design", "n calls", "wake", "lanes woken/call", "overhead", "overhead less wakes"]
    return [(title, headers, rows)]


def stage_table(results: list[DesignResult]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, headers, rows): one round trip, stage by stage (serve_run.STAGES), us p50/mean."""
    rounds = max(r.round for r in results)
    rows = [
        [_row_label(r, rounds), str(r.stages_us[STAGES[0]].n)]
        + [f"{p.p50:.0f}/{p.mean:.0f}" for p in (r.stages_us[k] for k in STAGES)]
        for r in results
        if r.stages_us
    ]
    if not rows:
        return []
    title = "one round trip by stage, us p50/mean (copy-in, to claim, worker, compute, to client, copy-out)"
    return [(title, ["design", "n", *(k.removesuffix("_us") for k in STAGES)], rows)]


def sampler_table(results: list[DesignResult]) -> list[tuple[str, list[str], list[list[str]]]]:
    """(title, headers, rows): where a sampler thread's CPU goes per request (serve_run.SAMPLER_COSTS)."""
    rounds = max(r.round for r in results)
    rows = [
        [_row_label(r, rounds), _f(r.sampler_cpu_us_per_request, ".1f")]
        + [_f(c[k], ".2f" if k in ("vol_cs", "invol_cs", "parked") else ".1f") for k in SAMPLER_COSTS]
        for r in results
        for c in (r.sampler_costs,)
        if c
    ]
    if not rows:
        return []
    title = (
        "a sampler's CPU per request: user, system, wall us outside the parks (its code), context "
        "switches (voluntary: parks), waiting for its CPU, wall us spinning and parked, share of answers "
        "that found it parked, the loop's own us"
    )
    return [(title, ["design", "cpu us", *(k.removesuffix("_us") for k in SAMPLER_COSTS)], rows)]


def render_breakdown(results: list[DesignResult]) -> str:
    tables = breakdown_tables(results) + stage_table(results) + sampler_table(results)
    return "\n\n".join(table.render(h, rows, title=t) for t, h, rows in tables)


def plot(results: list[DesignResult]) -> bytes:
    """Three panels of the last round: throughput against its targets, latency per call or request, and
    the worker's cost beyond infer() against its target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    last = max(r.round for r in results)
    results = [r for r in results if r.round == last]  # one round per bar; every round is in the JSON
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(18, 4.8))  # room for two legends beside their panels
    _throughput_panel(a, results, last)
    _latency_panel(b, results)
    _cost_panel(c, results)
    for ax in (a, b, c):
        ax.tick_params(axis="x", labelrotation=30)
        plt.setp(ax.get_xticklabels(), ha="right", rotation_mode="anchor")  # each label ends at its bar
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _throughput_panel(a: Any, results: list[DesignResult], last: int) -> None:
    colors = ["#555"] + ["#c33" if r.error else "#3a7" for r in results[1:]]
    a.bar(
        [r.label for r in results],
        [0 if math.isnan(r.samples_per_s) else r.samples_per_s for r in results],
        color=colors,
    )
    bare = results[0].samples_per_s
    a.axhline(bare * TARGET_RATIO, color="r", ls="--", lw=1, label=f"{TARGET_RATIO:.0%} of bare")
    a.axhline(bare * TRAFFIC_TARGET_RATIO, color="orange", ls=":", lw=1, label=f"{TRAFFIC_TARGET_RATIO:.0%}")
    # A traffic design's ceilings on this host (traffic_limits): ticks across its bar.
    marks = (
        ("batches", "_", 900, "engine at its batches"),
        ("worker", "x", 80, "worker at its batches"),
        ("full_batches", "v", 80, "full batches"),
    )
    for key, marker, size, what in marks:
        at = [(i, r.limits[key] * bare) for i, r in enumerate(results) if key in r.limits]
        if at:
            xy = zip(*at, strict=True)
            a.scatter(*xy, marker=marker, s=size, color="k", zorder=3, label=f"ceiling: {what}")
    a.set_ylabel("samples/s")
    a.set_title(
        f"throughput (bare at batch {results[0].batch}; red = error)"
        + (f", round {last}" if last > 1 else "")
    )
    a.legend(fontsize=8, markerscale=0.6)


def _latency_panel(b: Any, results: list[DesignResult]) -> None:
    xs = np.arange(len(results))
    for i, (q, name) in enumerate([("p50", "p50"), ("p99", "p99"), ("p999", "p99.9")]):
        b.bar(xs + (i - 1) * 0.27, [getattr(r.latency_ms, q) for r in results], 0.27, label=name)
    b.set_xticks(xs, [r.label for r in results])
    b.set_yscale("log")
    b.set_ylabel("ms per call / request")
    counts = [r.latency_ms.n for r in results]
    n = f"n={min(counts):,}" if min(counts) == max(counts) else f"n={min(counts):,}-{max(counts):,}"
    # No latency target grades this benchmark (its targets are throughput and worker cost): the line is
    # the bare loop's own p50 per engine call, the floor a served request adds its cost to.
    floor = results[0].latency_ms.p50
    if not math.isnan(floor):
        b.axhline(floor, color="k", ls=":", lw=1, label=f"bare p50 {floor:.3g} ms (floor)")
    b.set_title(f"latency per call / request ({n} per bar group)\nno latency target; the line: bare p50")
    b.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the bars, never on them


def _cost_panel(c: Any, results: list[DesignResult]) -> None:
    served = [r for r in results if r.breakdown_us]
    bottom = np.zeros(len(served))
    for k in BREAKDOWN[:-1]:
        v = np.array([r.breakdown_us[k].mean for r in served])
        c.bar([r.label for r in served], v, bottom=bottom, label=k.removesuffix("_us"))
        bottom += v
    c.axhline(OVERHEAD_TARGET_US, color="r", ls="--", lw=1, label=f"target {OVERHEAD_TARGET_US:g} us")
    c.set_ylabel("us per engine call (mean)")
    c.set_title("worker cost beyond infer()")
    c.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))  # beside the stacks, never on them


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


def targets(results: list[DesignResult], batch: int) -> list[dict[str, Any]]:
    """The design targets, each met or not (``met``) with the figure that decides it.

    With several rounds a ratio target is decided by the median of the rounds' ratios (each round's
    served designs against that round's bare loop), and the range is given next to it. A throughput
    ratio or a mean is not a percentile: the sample rule of lowtail.validation.evidence does not apply.
    """
    ratios = ratios_by_design(results)
    out: list[dict[str, Any]] = []
    for n in (2, 4):
        got = ratios.get(f"served x{n}")
        if got:
            out.append(
                {
                    "target": f"served x{n} >= {TARGET_RATIO:.0%} of bare at batch {batch}",
                    "met": bool(_median(got) >= TARGET_RATIO),
                    "figure": _spread(got),
                }
            )
    got = ratios.get("traffic 16x1")
    if got:
        runs = [r for r in results if r.label == "traffic 16x1"]
        per_req = _median([r.sampler_cpu_us_per_request for r in runs])
        out.append(
            {
                "target": f"traffic 16x1 >= {TRAFFIC_TARGET_RATIO:.0%} of bare",
                "met": bool(_median(got) >= TRAFFIC_TARGET_RATIO),
                "figure": f"{_spread(got)}; mean engine batch "
                f"{_median([r.engine_batch_mean for r in runs]):.1f}; the samplers used {per_req:.0f} us "
                "of CPU per request, "
                f"{_median([r.sampler_cpus_busy for r in runs]):.0%} of their CPUs{_limits_text(runs)}",
                "limits": [r.limits for r in runs],
            }
        )
    if got:
        out.append(_sampler_cpu_target(runs))
    over = _overhead_target(results)
    if over:
        out.append(over)
    return out


def _overhead_target(results: list[DesignResult]) -> dict[str, Any] | None:
    """The worker's overhead beyond infer() per call, p50 of the worst served design, without the futex
    wakes of parked samplers (reported on their own: a halted vCPU's wake-up is the scheduler's price);
    the figure gives it with the wakes and the mean too. A run whose rows lack the wake columns (a
    worker of an older release, under Ray) is graded with the wakes in, and says so."""
    over: dict[str, list[tuple[float, float, float, float]]] = {}
    for r in results:
        b = r.breakdown_us
        if b and r.design == "served":
            own = b.get("overhead_less_wakes_us", b["overhead_us"])
            wake = b["wake_us"].p50 if "wake_us" in b else float("nan")
            over.setdefault(r.label, []).append((own.p50, own.mean, b["overhead_us"].p50, wake))
    if not over:
        return None
    med = {k: [_median([v[i] for v in got]) for i in range(4)] for k, got in over.items()}
    worst = max(med, key=lambda k: med[k][0])
    p50, mean, with_wakes, wake = med[worst]
    rounds = f", median of {len(over[worst])} rounds" if len(over[worst]) > 1 else ""
    what = "without the wakes of parked samplers" if not math.isnan(wake) else "wakes not reported: included"
    return {
        "target": f"worker overhead beyond infer() <= {OVERHEAD_TARGET_US:g} us "
        "(p50, worst served design, without the wakes of parked samplers)",
        "met": bool(p50 <= OVERHEAD_TARGET_US),
        "figure": f"{p50:.1f} us p50 {what} (mean {mean:.1f}), {worst}{rounds}; with the wakes "
        f"{with_wakes:.1f} us p50, the wakes {_f(wake, '.1f')} us p50",
    }


def traffic_limits(run: DesignResult, bare: DesignResult) -> dict[str, float]:
    """What this host lets a coalescing traffic design reach, as fractions of ``bare``'s samples/s,
    from the run's own figures; all but ``worker`` count lowtail's own cost as zero. ``{}`` when a
    figure is missing.

    - ``batches``: the engine alone at the batches the run made (a call of 8 costs more per sample
      than one of 16): the served engine's samples per second of ``infer()`` over the bare loop's.
    - ``worker``: the worker alone at those batches: ``infer()`` plus its own work per call beyond the
      claim (answer, checks, bookkeeping; the claim, which holds the coalescing wait, left out), as if
      requests were always waiting for it. Only with the per-stage figures (``breakdown_us``).
    - ``sampler_cpu``: the samplers' CPU alone: ``c`` shared CPUs at ``S`` us per request.
    - ``full_batches``: every request of one full batch in flight at once, as closed-loop samplers
      waiting for the same call are: the engine then idles while they resubmit one after another on
      their shared CPUs, ``E / (E + n * S / c)``, ``E`` the bare call and ``n`` requests per batch.
    - ``sampler_us_for_target``: the ``S`` at which ``full_batches`` reaches TRAFFIC_TARGET_RATIO.

    The last two only where the samplers can fill a batch (``traffic 16x1``, not ``1x1``).

    Batches of half the requests let the samplers work while the engine runs, and are held to the
    lower of ``worker`` (``batches`` without it) and ``sampler_cpu``; full batches are held to
    ``full_batches`` and ``worker``. What a run reads below them is queueing and the wake-ups.
    """
    rate0, s_us, c = bare.samples_per_s, run.sampler_cpu_us_per_request, run.sampler_cpu_count
    figures = (rate0, s_us, run.engine_ms_mean, run.engine_batch_mean)
    if c < 1 or run.batch < 1 or any(math.isnan(v) or v <= 0 for v in figures):
        return {}
    period_us = bare.batch / rate0 * 1e6  # one bare call of a full batch, with its loop
    per_batch = bare.batch / run.batch
    out = {"batches": run.engine_batch_mean / (run.engine_ms_mean / 1e3) / rate0}
    claim = run.breakdown_us.get("claim_us")
    if claim is not None and claim.n and not math.isnan(run.overhead_us_mean):
        work_us = max(0.0, run.overhead_us_mean - claim.mean)
        out["worker"] = run.engine_batch_mean / (run.engine_ms_mean / 1e3 + work_us / 1e6) / rate0
    out["sampler_cpu"] = c * 1e6 / s_us * run.batch / rate0
    if run.samplers >= per_batch:  # fewer samplers than a batch's requests never fill one
        out["full_batches"] = period_us / (period_us + per_batch * s_us / c)
        out["sampler_us_for_target"] = c * period_us * (1 / TRAFFIC_TARGET_RATIO - 1) / per_batch
    return out


def _limits_text(runs: list[DesignResult]) -> str:
    """The median of the runs' ``traffic_limits``, as the sentence the 16x1 target's figure ends with."""
    got = [r.limits for r in runs if r.limits]
    if not got:
        return ""
    lim = {k: _median([g[k] for g in got if k in g]) for k in got[0]}
    batch = _median([r.engine_batch_mean for r in runs])
    worker = f" ({lim['worker']:.2f} adding the worker's own work per call)" if "worker" in lim else ""
    full = (
        f", {lim['full_batches']:.2f} with full batches (those reach {TRAFFIC_TARGET_RATIO:.2f} at "
        f"{lim['sampler_us_for_target']:.0f} us of sampler CPU per request)"
        if "full_batches" in lim
        else ""
    )
    return (
        f"; this host's ceilings: {lim['batches']:.2f} from the engine at its "
        f"batches of {batch:.1f}{worker}, {lim['sampler_cpu']:.2f} from the samplers' CPU{full}"
    )


def _sampler_cpu_target(runs: list[DesignResult]) -> dict[str, Any]:
    """Sampler CPU per batch-1 request on a shared CPU: decided only when the samplers' clients found
    their CPU shared (a client with a CPU of its own spins on purpose, and that CPU is nobody else's)."""
    target = (
        f"sampler CPU <= {SAMPLER_CPU_TARGET_US:g} us per request at batch 1 on a shared CPU (traffic 16x1)"
    )
    value = _median([r.sampler_cpu_us_per_request for r in runs])
    spin = ", ".join(sorted({r.sampler_spin_reason for r in runs if r.sampler_spin_reason})) or "not reported"
    figure = f"{value:.1f} us (median of {len(runs)} runs); the clients: {spin}"
    if math.isnan(value):
        return {"target": target, "met": None, "why": "no sampler reported its CPU", "figure": figure}
    if any(r.sampler_spin_us != 0 for r in runs):
        why = "the samplers spun (a CPU of their own, or --client-spin-us): not the shared-CPU case"
        return {"target": target, "met": None, "why": why, "figure": figure}
    return {"target": target, "met": bool(value <= SAMPLER_CPU_TARGET_US), "figure": figure}


def verdicts(results: list[DesignResult], batch: int) -> list[str]:
    """Each target as one line, "met", "NOT met" or "not decided" with its figure; then the designs
    that failed."""

    def word(t: dict[str, Any]) -> str:
        return f"not decided: {t['why']}" if t["met"] is None else "met" if t["met"] else "NOT met"

    lines = [f"{t['target']}: {word(t)} ({t['figure']})" for t in targets(results, batch)]
    failed = [r.label for r in results if r.error]
    if failed:
        lines.append(f"designs with errors: {', '.join(failed)}")
    return lines


def write_html(
    path: str,
    report: dict[str, Any],
    results: list[DesignResult],
    png: bytes | None,
    extra: list[tuple[str, list[str], list[list[str]]]] | None = None,
) -> None:
    """The report page: the targets met / not met, the tables (``extra`` first: the model-size
    ladder's), the plot, the settings and host, the JSON folded."""
    from lowtail.benchmarks.report import targets_table, write_bench_html
    from lowtail.render import html

    sections = [targets_table(report.get("targets_met", []))]
    tables = (
        (extra or [])
        + result_tables(results)
        + (breakdown_tables(results) if any(r.breakdown_us for r in results) else [])
        + stage_table(results)
        + sampler_table(results)
    )
    sections += [html.Section(t, table=html.Table(h, rows)) for t, h, rows in tables]
    if png:
        sections.append(
            html.Section("Plots", images=[html.Image("throughput, latency and worker cost", png)])
        )
    write_bench_html(path, "lowtail bench serve", report, sections)
