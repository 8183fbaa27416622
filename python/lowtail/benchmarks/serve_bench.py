"""``lowtail bench serve``: the bare OpenVINO loop on one pinned core against the same model served.

The limit is a process pinned to one CPU calling ``infer()`` on batches of B samples back to back. The
served designs put the same model in a pinned worker (``lowtail.serve.worker_process``) behind the
shared-memory queue, driven by sampler processes in a closed loop (throughput is what the design sustains;
latency is the sampler's submit-to-result time, which includes queueing behind the other samplers):

- ``served xN``: N samplers each submitting batches of B samples (one request per engine call);
- ``traffic NxK``: the predecessor system's traffic: N samplers each sending K observations per step,
  the worker coalescing them into engine batches
  of 8-16 samples (the queue's defaults: ``min_batch_samples`` 8, ``max_batch_samples`` 16; ``--coalesce``
  sets the minimum and the window). Each traffic row also gives the host's ceilings for it, from its own
  figures (``serve_report.traffic_limits``): what the engine allows at the batches it ran, and the worker
  with its own work per call, what the samplers' CPU allows, and what full batches allow when the
  samplers resubmit on a shared CPU.

Reported per design: samples/s and served/bare (bare at batch B), sampler-side latency p50/p99/p99.9/max
with n, the mean engine batch, the worker's deschedule p99.9 (wall - CPU per engine call) with n, the
worker's cost per engine call beyond ``infer()`` and, with ``--breakdown``, where that cost goes (the
per-stage columns of ``lowtail.serve.call_stats.CALL_FIELDS``), the worker's RSS and the segment sizes.

Samplers make the queue's one call per request (``QueueClient.infer_or_pending``, what the actors'
``InferenceClient.infer`` makes); ``--compare-two-phase`` runs each design again with the two-phase
client (``start`` then ``finish``) in the same round.

Every design also reports the samplers' own CPU per request (the thread that submits and waits) and
the spin budget their clients chose (``QueueClient.spin_policy``: they park unless alone on an
isolated CPU). ``--breakdown`` adds one round trip by stage from the answers' stamps
(``serve_run.STAGES``). ``--model-ms`` replaces the designs with a model-size ladder
(``lowtail.benchmarks.serve_ladder``): per size, the bare loop and served x4.

A design that fails (a sampler error, a worker that does not start) becomes a row with its error; the
other rows are kept and the JSON is always written.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import sys
import tempfile
import textwrap
from pathlib import Path
from typing import Any

from lowtail.benchmarks import serve_ladder
from lowtail.benchmarks.report import add_check, exit_code, json_safe
from lowtail.benchmarks.serve_report import (
    OVERHEAD_TARGET_US,
    TARGET_RATIO,
    TRAFFIC_TARGET_RATIO,
    plot,
    render_breakdown,
    render_rounds,
    render_table,
    targets,
    traffic_limits,
    verdicts,
    write_html,
)
from lowtail.benchmarks.serve_run import (
    DesignResult,
    Setup,
    Traffic,
    _attempt,
    _start_ray,
    run_bare,
    run_ray_served,
    run_served,
)
from lowtail.errors import UsageError
from lowtail.options import (
    add_html,
    add_json,
    add_no_progress,
    add_plot,
    json_to_stdout,
    positive,
    write_json,
    write_text,
)
from lowtail.render import table
from lowtail.render.progress import Progress
from lowtail.render.schema import stamp
from lowtail.serve.config import FIFO_SCOPES
from lowtail.serve.model import ModelSpec, ModelSpecError, feature_input, find_model_xml, write_model
from lowtail.shm import native


def register(bench_sub: Any) -> None:
    p = bench_sub.add_parser(
        "serve", help="bare OpenVINO loop vs queue + pinned worker (samplers x batch, predecessor traffic)"
    )
    _add_run_options(p)
    _add_design_options(p)
    _add_engine_options(p)
    p.set_defaults(func=run)


def _add_run_options(p: argparse.ArgumentParser) -> None:
    """How long each design runs and where the report goes."""
    # The CLI convention (lowtail.options): --json FILE or '-', --plot, --seconds (old names: aliases).
    add_json(p, "the full report (always, even on errors)")
    add_plot(p, "throughput and latency per design", old="--png", dest="png")
    add_html(p)
    p.add_argument(
        "--quick",
        action="store_true",
        help="2 s of measurement per design instead of 10 s; each design also starts a worker and "
        "compiles the model, so a quick run of the default 8 designs takes a minute or two",
    )
    p.add_argument(
        "--seconds",
        "--duration",
        dest="duration",
        type=positive(float),
        help="seconds per design (default 10, 2 with --quick)",
    )
    add_no_progress(p)
    add_check(p)


def _add_design_options(p: argparse.ArgumentParser) -> None:
    """The designs served, how often, and how their samplers wait."""
    p.add_argument("--batch", type=int, default=16, help="samples per request and per bare engine call")
    p.add_argument("--samplers", default="1,2,4", help="sampler counts of the batch-per-request design")
    p.add_argument(
        "--traffic",
        default="8x1,16x1,8x4,16x4",
        help="predecessor traffic designs SAMPLERSxOBSERVATIONS (the worker coalesces to 8-16); '' for none",
    )
    p.add_argument(
        "--coalesce",
        metavar="MIN:US",
        help="the traffic designs' batching: the worker waits up to US microseconds for MIN samples "
        "while other lanes are active (QueueConfig min_batch_samples:coalesce_us; default: the "
        "queue's, 8:200); e.g. 16:2000 for full batches",
    )
    p.add_argument(
        "--breakdown",
        action="store_true",
        help="print where the worker's time goes per call, and one round trip stage by stage (the "
        "samplers then record every request's stamps, ~1 us of their CPU each)",
    )
    p.add_argument(
        "--rounds",
        type=positive(int),
        default=1,
        help="measure bare and every design (with --model-ms: every size) this many times, interleaved; "
        "targets use the median ratio",
    )
    p.add_argument(
        "--compare-spin-us",
        type=int,
        metavar="N",
        help="also run every served design with samplers spinning N us, right after it in the same "
        "round (rows labelled '@spin N us'; the targets are decided on the default rows)",
    )
    p.add_argument(
        "--compare-two-phase",
        action="store_true",
        help="also run every served design with samplers that call in two phases (start, then finish) "
        "instead of the one call (infer_or_pending, what InferenceClient.infer makes), right after it in "
        "the same round (rows labelled '@two-phase'; the targets are decided on the default rows)",
    )
    p.add_argument(
        "--client-spin-us",
        type=int,
        help="samplers spin this long for an answer before parking (default: the queue's, 200); a "
        "spinning sampler needs no futex wake-up from the worker",
    )


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    """The model, the engine's CPU and how the worker is scheduled."""
    p.add_argument("--model", metavar="DIR", help="OpenVINO IR to serve (default: build the policy model)")
    p.add_argument(
        "--model-ms",
        metavar="MS,...",
        help="a model-size ladder instead of the designs: per size (CPU ms per batch-16 call on the "
        "engine CPU, e.g. 0.1,1,16.6; models built and calibrated here), the bare loop and served x4 "
        "(served/bare, the worker's overhead and its share of a call, sampler p50/p99.9)",
    )
    p.add_argument("--cpu", type=int, help="CPU for the engine (default: the highest CPU allowed)")
    p.add_argument("--ray", action="store_true", help="also serve through the Ray inference actor")
    p.add_argument(
        "--fifo-scope",
        choices=FIFO_SCOPES,
        default="work",
        help="the worker's SCHED_FIFO scope (WorkerConfig.fifo_scope): while requests keep coming, "
        "around each batch (the predecessor system's toggle), or through idle spins too; the bare loop, "
        "never idle, toggles per call only under 'call'",
    )


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


def parse_coalesce(text: str | None) -> tuple[int, int] | None:
    """``--coalesce MIN:US`` as (min_batch_samples, coalesce_us); None for the queue's defaults."""
    if text is None:
        return None
    from lowtail.shm.queue import QueueConfig

    try:
        lo, us = (int(x) for x in text.split(":"))
    except ValueError:
        raise UsageError(f"--coalesce {text!r}: expected MIN:US like 16:2000") from None
    largest = QueueConfig.max_batch_samples  # the traffic designs keep the queue's largest batch
    if not 1 <= lo <= largest:
        raise UsageError(f"--coalesce {text!r}: expected MIN in 1..{largest} (the largest batch)")
    if not 0 <= us <= 100_000:
        raise UsageError(f"--coalesce {text!r}: expected US in 0..100000 (a bounded window)")
    return lo, us


def _designs(args: argparse.Namespace) -> tuple[list[Traffic], tuple[int, int] | None, list[float]]:
    """The designs to serve, the traffic designs' batching and the ladder's sizes (empty: no ladder),
    each option checked."""
    if args.batch < 1:
        raise UsageError(f"--batch {args.batch}: expected >= 1")
    try:
        counts = [int(x) for x in args.samplers.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--samplers {args.samplers!r}: expected counts like 1,2,4") from None
    if any(c < 1 or c > 64 for c in counts):
        raise UsageError(f"--samplers {args.samplers!r}: expected counts in 1..64")
    designs = [Traffic(n, args.batch, coalesce=False) for n in counts] + parse_traffic(args.traffic)
    coalesce = parse_coalesce(args.coalesce)
    sizes_ms: list[float] = []
    if args.model_ms is not None:
        if args.model:
            raise UsageError("--model-ms builds its own models: expected it without --model")
        try:
            sizes_ms = serve_ladder.parse_model_ms(args.model_ms)
        except ValueError as e:
            raise UsageError(str(e)) from None
        designs = [Traffic(serve_ladder.LADDER_SAMPLERS, args.batch, coalesce=False)]
    if not designs:
        raise UsageError("--samplers and --traffic are both empty: nothing to serve")
    return designs, coalesce, sizes_ms


def _engine_cpu(args: argparse.Namespace) -> tuple[int, set[int]]:
    """The engine's CPU and the samplers' CPUs (the others this process may use, or all if none)."""
    allowed = os.sched_getaffinity(0)
    cpu = max(allowed) if args.cpu is None else args.cpu
    if cpu not in allowed:
        raise UsageError(f"--cpu {cpu}: expected one of the CPUs this process may use, {sorted(allowed)}")
    return cpu, (allowed - {cpu}) or allowed


def _new_report(
    args: argparse.Namespace,
    cpu: int,
    sampler_cpus: set[int],
    coalesce: tuple[int, int] | None,
    duration: float,
) -> dict[str, Any]:
    return {
        **stamp("bench.serve"),
        "complete": False,  # true only once every design ran; an error or Ctrl-C leaves it false
        "interrupted": False,
        "benchmark": "serve",
        "command": "lowtail " + " ".join(sys.argv[1:]) if sys.argv else "",
        "cpu": cpu,
        "sampler_cpus": sorted(sampler_cpus),
        "batch": args.batch,
        "fifo_scope": args.fifo_scope,
        "client_spin_us": args.client_spin_us,
        "compare_spin_us": args.compare_spin_us,
        "compare_two_phase": args.compare_two_phase,
        # how samplers call (the default rows): QueueClient.infer_or_pending, one core call per request
        "sampler_call": "one-call",
        # the traffic designs' (min_batch_samples, coalesce_us); null: the queue's defaults
        "coalesce": list(coalesce) if coalesce else None,
        "duration_s": duration,
        "targets": {
            "served_vs_bare": TARGET_RATIO,
            "traffic_16x1_vs_bare": TRAFFIC_TARGET_RATIO,
            "overhead_us": OVERHEAD_TARGET_US,
        },
        "note": "served/traffic: queue + pinned worker owned by the benchmark process"
        + ("; ray actor: the same hosted by lowtail's Ray inference actor" if args.ray else ""),
    }


def _model(args: argparse.Namespace, tmp: str) -> tuple[Path, str, int]:
    """The model to serve (``--model``, or the policy model built in ``tmp``) with its input's name and
    width; a model OpenVINO cannot read is a usage error naming it."""
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
    except RuntimeError as e:  # OpenVINO's own: a truncated or mismatched .bin, a broken .xml
        why = next((ln for ln in reversed(str(e).splitlines()) if ln.strip()), str(e)).strip()
        raise UsageError(f"--model {args.model}: OpenVINO cannot read {model}: {why}") from None
    return model, name, features


def _run_rounds(
    args: argparse.Namespace, setup: Setup, designs: list[Traffic], results: list[DesignResult], bar: Progress
) -> None:
    """Bare, then every design (and its spinning twin), ``--rounds`` times. Rounds interleave the designs,
    so a slow minute of a shared host hits one round of each rather than every round of one design."""
    rounds = args.rounds
    for rnd in range(1, rounds + 1):
        tag = f"round {rnd}/{rounds}: " if rounds > 1 else ""
        bar.phase(len(results), tag + "bare loop")
        results.append(_attempt("bare", run_bare, setup))
        first = len(results) - 1
        for t in designs:
            bar.phase(len(results), tag + t.label)
            results.append(_attempt(t.label, run_served, setup, t))
            if args.compare_spin_us is not None:
                spun = dataclasses.replace(setup, client_spin_us=args.compare_spin_us)
                bar.phase(len(results), f"{tag}{t.label}, spinning {args.compare_spin_us} us")
                results.append(_attempt(t.label, run_served, spun, t))
                results[-1].size = f"spin {args.compare_spin_us} us"
            if args.compare_two_phase:
                bar.phase(len(results), f"{tag}{t.label}, two-phase samplers")
                results.append(
                    _attempt(t.label, run_served, dataclasses.replace(setup, sampler_call="two-phase"), t)
                )
                results[-1].size = "two-phase"
        for r in results[first:]:
            r.round = rnd


def _run_ray_designs(
    setup: Setup, designs: list[Traffic], results: list[DesignResult], bar: Progress, tmp: Path
) -> None:
    """Every design once more through the Ray inference actor, on a local Ray unless one is up."""
    import ray

    bar.phase(len(results), "starting a local Ray")
    own = not ray.is_initialized()
    if own:
        _start_ray(tmp)
    try:
        for t in designs:
            bar.phase(len(results), f"Ray actor, {t.label}")
            label = f"ray actor x{t.samplers}"
            results.append(_attempt(label, run_ray_served, setup, t, tmp))
    finally:
        if own:
            ray.shutdown()


def _measure(
    args: argparse.Namespace,
    report: dict[str, Any],
    results: list[DesignResult],
    *,
    designs: list[Traffic],
    sizes_ms: list[float],
    cpu: int,
    sampler_cpus: frozenset[int],
    duration: float,
    coalesce: tuple[int, int] | None,
) -> None:
    """Load the model, then run the ladder or the designs, appending each result as it comes."""
    with tempfile.TemporaryDirectory(prefix="lowtail-bench-") as tmp:
        model, name, features = _model(args, tmp)
        report["model"] = str(model) if args.model else "built: " + json.dumps(ModelSpec().to_dict())
        for opt in ("client_spin_us", "compare_spin_us"):
            v = getattr(args, opt)
            if v is not None and not 0 <= v <= 1_000_000:
                raise UsageError(f"--{opt.replace('_', '-')} {v}: expected 0..1000000")
        setup = Setup(
            model,
            cpu,
            args.batch,
            name,
            features,
            duration,
            sampler_cpus,
            args.fifo_scope,
            args.client_spin_us,
            stages=args.breakdown,
            coalesce=coalesce,
        )
        if sizes_ms:
            _run_ladder(args, report, results, setup, sizes_ms, Path(tmp))
            return
        variants = 1 + (args.compare_spin_us is not None) + args.compare_two_phase
        total = args.rounds * (1 + variants * len(designs)) + (len(designs) if args.ray else 0)
        bar = Progress(f"bench serve ({duration:g} s per design)", total, enabled=not args.no_progress)
        _run_rounds(args, setup, designs, results, bar)
        if args.ray:
            _run_ray_designs(setup, designs, results, bar, Path(tmp))
        bar.finish()


def run(args: argparse.Namespace) -> int:
    designs, coalesce, sizes_ms = _designs(args)
    duration = args.duration or (2.0 if args.quick else 10.0)
    cpu, sampler_cpus = _engine_cpu(args)
    load_before = os.getloadavg()
    results: list[DesignResult] = []
    report = _new_report(args, cpu, sampler_cpus, coalesce, duration)
    try:
        _measure(
            args,
            report,
            results,
            designs=designs,
            sizes_ms=sizes_ms,
            cpu=cpu,
            sampler_cpus=frozenset(sampler_cpus),
            duration=duration,
            coalesce=coalesce,
        )
        report["complete"] = True
    except KeyboardInterrupt:
        report["interrupted"] = True  # the designs that finished are kept; main() exits 130
        raise
    except UsageError as e:
        report["error"] = str(e)
        raise
    finally:
        _finish(args, report, results, load_before)
    if any(r.error for r in results):
        return 1  # a design that failed is a failed run (its row says why)
    return exit_code(args, report["targets_met"])


def _against_bare(results: list[DesignResult]) -> None:
    """Each round's designs against the bare loop measured just before them."""
    bare: DesignResult | None = None
    for r in results:
        if r.design == "bare":
            bare = r
        elif bare is not None:
            r.ratio_to_bare = r.samples_per_s / bare.samples_per_s
            if r.design.startswith("traffic"):
                r.limits = traffic_limits(r, bare)


def _verdicts(args: argparse.Namespace, report: dict[str, Any], results: list[DesignResult]) -> list[str]:
    """The targets met (into the report) and the verdict lines, the ladder's first."""
    report["targets_met"] = targets(results, args.batch) if results else []
    lines = verdicts(results, args.batch) if results else ["no design finished"]
    if "ladder" in report:
        rows = serve_ladder.ladder_rows(results, report["ladder"]["sizes"])
        report["ladder"]["rows"] = rows
        ladder_t = serve_ladder.ladder_targets(rows)
        report["targets_met"] += ladder_t
        lines = [*(f"{t['target']}: {_word(t)} ({t['figure']})" for t in ladder_t), *lines]
    if report["interrupted"]:
        lines.insert(0, "INTERRUPTED: a partial run; the designs below finished before Ctrl-C")
    return lines


def _print_tables(
    args: argparse.Namespace, report: dict[str, Any], results: list[DesignResult], lines: list[str], host: str
) -> None:
    text = render_table(results)
    if args.rounds > 1:
        text += "\n\n" + render_rounds(results)
    if args.breakdown:
        text += "\n\n" + render_breakdown(results)
    if "ladder" in report:
        title, headers, body = serve_ladder.ladder_table(report["ladder"]["rows"])
        text += "\n\n" + table.render(headers, body, title=title)
    print(text)
    width = table.terminal_width()
    print("\n".join(textwrap.fill(line, width, subsequent_indent="  ") for line in [*lines, host]))


def _write_plots(args: argparse.Namespace, report: dict[str, Any], results: list[DesignResult]) -> None:
    ladder = report.get("ladder")
    png = serve_ladder.ladder_plot(ladder["rows"]) if ladder else plot(results)
    if args.png:
        write_text(args.png, png)
    if args.html:
        extra = [serve_ladder.ladder_table(ladder["rows"])] if ladder else []
        write_html(args.html, report, results, png, extra)


def _finish(
    args: argparse.Namespace,
    report: dict[str, Any],
    results: list[DesignResult],
    load_before: tuple[float, ...],
) -> None:
    """Print and write whatever was measured: also when a design failed or the run was interrupted (the
    table first, then the files, so a file that cannot be written never hides the result)."""
    _against_bare(results)
    load_after = os.getloadavg()
    report["host"] = {
        "name": platform.node(),
        "cpus": os.cpu_count(),
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in load_after],
        # the queue's hot path in this process (its workers and samplers decide the same way)
        "queue_core": native.implementation().to_dict(),
    }
    keys: tuple[str, ...] = ("command", "model", "cpu", "sampler_cpus", "batch", "fifo_scope")
    keys += (
        "client_spin_us",
        "compare_spin_us",
        "compare_two_phase",
        "sampler_call",
        "coalesce",
        "duration_s",
    )
    report["settings"] = {k: report[k] for k in keys if k in report} | {"rounds": args.rounds}
    report["results"] = [r.to_dict() for r in results]
    lines = _verdicts(args, report, results)
    report["verdicts"] = lines
    host = f"SCHED_FIFO scope {args.fifo_scope}; host: {os.cpu_count()} CPUs, 1-min load average "
    host += (
        f"{load_before[0]:.1f} before, {load_after[0]:.1f} after; queue hot path: {native.implementation()}"
    )
    if results and not json_to_stdout(args):
        _print_tables(args, report, results, lines, host)
    write_json(args.json, json_safe(report))
    if results and results[0].design == "bare" and (args.png or args.html):
        _write_plots(args, report, results)


def _word(t: dict[str, Any]) -> str:
    return f"not decided: {t['why']}" if t["met"] is None else "met" if t["met"] else "NOT met"


def _run_ladder(  # noqa: PLR0917 - the run's state, passed down once
    args: argparse.Namespace,
    report: dict[str, Any],
    results: list[DesignResult],
    setup: Setup,
    sizes_ms: list[float],
    tmp: Path,
) -> None:
    """Calibrate a model per size on the engine CPU, then run bare and served x4 on each, ``--rounds``
    times: each round runs every size, so a slow minute of a shared host hits one round of each size
    (served/bare at 16.6 ms spread 0.906-1.036 over three rounds here; a row is its median round)."""
    rounds = args.rounds
    bar = Progress(
        f"bench serve --model-ms ({setup.duration:g} s per design)",
        1 + 2 * len(sizes_ms) * rounds,
        enabled=not args.no_progress,
    )
    bar.phase(0, f"calibrating the models on CPU {setup.cpu}")
    sizes = serve_ladder.calibrate_all(sizes_ms, setup.cpu, args.batch, tmp / "calibrate")
    report["ladder"] = {"sizes": sizes, "samplers": serve_ladder.LADDER_SAMPLERS, "rounds": rounds}
    report["model"] = "built per size: " + ", ".join(f"{s['tag']}: hidden {s['hidden']}" for s in sizes)
    traffic = Traffic(serve_ladder.LADDER_SAMPLERS, args.batch, coalesce=False)
    models = {
        size["tag"]: write_model(tmp / f"ladder-{size['width']}", serve_ladder.spec_of(size["width"]))
        for size in sizes
    }
    for rnd in range(1, rounds + 1):
        tag = f"round {rnd}/{rounds}: " if rounds > 1 else ""
        for size in sizes:
            sized = dataclasses.replace(setup, model=models[size["tag"]])
            bar.phase(len(results) + 1, f"{tag}{size['tag']}: bare loop")
            bare = _attempt("bare", run_bare, sized)
            bar.phase(len(results) + 2, f"{tag}{size['tag']}: {traffic.label}")
            served = _attempt(traffic.label, run_served, sized, traffic)
            for r in (bare, served):
                r.size, r.round = size["tag"], rnd
            results += [bare, served]
    bar.finish()
