"""``lowtail demo ray``: local Ray, lease allocator, inference actors and samplers, for N seconds."""

from __future__ import annotations

import argparse
import math
from typing import Any

from lowtail.cli.main import UsageError
from lowtail.cli.options import add_json, add_no_progress, add_plot, json_to_stdout, positive, write_json
from lowtail.render import table


def demo_subparsers(sub: Any) -> Any:
    """The ``demo`` command's subcommands, created by whichever demo module registers first."""
    parser = sub.choices.get("demo")
    if parser is None:
        parser = sub.add_parser("demo", help="self-contained demonstrations (see lowtail demo -h)")
        parser.set_defaults(func=lambda args: parser.print_help() or 2)
    if not hasattr(parser, "lowtail_demos"):
        parser.lowtail_demos = parser.add_subparsers(dest="demo", metavar="DEMO")
    return parser.lowtail_demos


def register(sub: Any) -> None:
    p = demo_subparsers(sub).add_parser(
        "ray",
        help="run inference actors and samplers on a local Ray for a while and summarize",
        description="Start a local Ray, the node's lease allocator, inference actors and samplers; run for "
        "N seconds and summarize throughput, latency and deschedule tails and leases; stop everything.",
    )
    p.add_argument("--seconds", type=positive(float), default=10.0, help="how long samplers run")
    p.add_argument("--actors", type=positive(int), default=2, help="inference actors")
    p.add_argument("--samplers", type=positive(int), default=2, help="sampler actors")
    p.add_argument("--heroes", type=positive(int), default=8, help="samples per request")
    p.add_argument("--depth", type=positive(int), default=2, help="requests in flight per sampler")
    p.add_argument(
        "--strict-leases",
        action="store_true",
        help="lease isolated CPUs only, one owner each, as a real node does (fails on a small machine)",
    )
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port on 127.0.0.1 (0: any free)")
    p.add_argument("--tb-logdir", help="keep the TensorBoard run here (default: a temporary directory)")
    # The CLI convention (lowtail.cli.options): output paths are checked before Ray starts.
    add_json(p, "the summary")
    add_plot(p, "the latency and deschedule tails")
    add_no_progress(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lowtail.actors.demo import DemoError, DemoOptions, run_demo
    from lowtail.render.progress import Progress

    opts = DemoOptions(
        seconds=args.seconds,
        actors=args.actors,
        samplers=args.samplers,
        heroes=args.heroes,
        depth=args.depth,
        strict_leases=args.strict_leases,
        metrics_port=args.metrics_port,
        tb_logdir=args.tb_logdir,
        plot=args.plot,
    )
    try:
        bar = Progress("demo ray", opts.seconds, enabled=not args.no_progress)
        result = run_demo(opts, progress=lambda elapsed, _total, n: bar.update(elapsed, f"samples {n}"))
        bar.finish(f"samples {result.samples}")
    except DemoError as e:
        raise UsageError(str(e)) from None
    if json_to_stdout(args):
        write_json(args.json, result.to_dict())
        return 0
    print(result.lease_note)
    print()
    rpc = result.rpc_ms
    print(
        table.render(
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
            title=f"Throughput ({args.samplers} samplers, {args.actors} inference actors)",
        )
    )
    print()
    rows = [["round trip (sampler)", rpc.n, *_ms(rpc.p50, rpc.p99, rpc.p999, rpc.max)]]
    for series, label in (
        ("infer_exec_ms", "model execution (worker)"),
        ("queue_wait_ms", "queue wait (worker)"),
        ("deschedule_ms", "deschedule = wall - CPU"),
        ("run_delay_ms", "run_delay growth"),
    ):
        s = result.worker.get(series)
        if s is not None:
            rows.append([label, s.n, *_ms(s.p50, s.p99, s.p999, s.max)])
    print(table.render(["ms", "n", "p50", "p99", "p999", "max"], rows, title="Latency and deschedule tails"))
    print()
    print(
        table.render(
            ["kind", "leases", "owner -> cpu (placement)"],
            [
                [k, len(v), ", ".join(f"{x['owner']}->{x['cpu']} ({x['placement']})" for x in v) or "-"]
                for k, v in result.leases_by_kind.items()
            ],
            title="Leases by kind",
        )
    )
    print()
    print(
        table.render(
            ["actor", "cpu", "worker restarts", "isolation"],
            [
                [a["owner"], a["cpu"], a["restarts"], a.get("isolation", {}).get("detail", "-")]
                for a in result.actors
            ],
            title="Inference actors",
        )
    )
    if result.plot:
        print(f"\nTail plot: {result.plot}")
    if result.tb_run:
        print(f"\nTensorBoard run: {result.tb_run}")
    if args.json:
        write_json(args.json, result.to_dict())
        print(f"JSON summary: {args.json}")
    return 0


def _ms(*values: float) -> list[str]:
    return ["-" if math.isnan(v) else f"{v:.3f}" for v in values]
