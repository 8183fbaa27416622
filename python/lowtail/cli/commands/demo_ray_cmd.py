"""``lowtail demo ray``: local Ray, lease allocator, inference actors and samplers, for N seconds."""

from __future__ import annotations

import argparse
from typing import Any

from lowtail.errors import UsageError
from lowtail.options import (
    add_json,
    add_no_progress,
    add_plot,
    json_to_stdout,
    output_dir,
    positive,
    write_json,
)
from lowtail.render.schema import stamp


def demo_subparsers(sub: Any) -> Any:
    """The ``demo`` command's subcommands, created by whichever demo module registers first."""
    parser = sub.choices.get("demo")
    if parser is None:
        parser = sub.add_parser("demo", help="self-contained demonstrations (see lowtail demo -h)")
        parser.set_defaults(func=lambda args: parser.print_help() or 2)
    if not hasattr(parser, "lowtail_demos"):
        parser.lowtail_demos = parser.add_subparsers(dest="demo", metavar="DEMO")
    return parser.lowtail_demos


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        port = -1
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a TCP port 0-65535 (0: any free port)")
    return port


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
    # --heroes was this option's first name; it counted rows, never heroes (--policies counts those).
    p.add_argument(
        "--rows", "--heroes", dest="rows", type=positive(int), default=8, help="samples per request"
    )
    p.add_argument("--depth", type=positive(int), default=2, help="requests in flight per sampler")
    p.add_argument(
        "--policies",
        type=positive(int),
        default=1,
        help="heroes with a policy of their own (actors spread over them; one client per hero per sampler)",
    )
    p.add_argument("--no-standby", action="store_true", help="no hot standby worker per inference actor")
    p.add_argument(
        "--strict-leases",
        action="store_true",
        help="lease isolated CPUs only, one owner each, as a real node does (fails on a small machine)",
    )
    p.add_argument(
        "--metrics-port",
        type=_port,
        metavar="PORT",
        help="serve Prometheus metrics on 127.0.0.1:PORT, 0 for any free port (default: no metrics server)",
    )
    p.add_argument(
        "--tb-logdir",
        metavar="DIR",
        type=output_dir(),
        help="keep the TensorBoard run here (default: a temporary directory, removed at the end)",
    )
    # The CLI convention (lowtail.options): output paths are checked before Ray starts.
    add_json(p, "the summary")
    add_plot(p, "the latency and deschedule tails")
    add_no_progress(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from lowtail.demo.local import DemoError, DemoOptions, render, run_demo
    from lowtail.render import console
    from lowtail.render.progress import Progress

    opts = DemoOptions(
        seconds=args.seconds,
        actors=args.actors,
        samplers=args.samplers,
        rows=args.rows,
        depth=args.depth,
        strict_leases=args.strict_leases,
        metrics_port=args.metrics_port,
        tb_logdir=args.tb_logdir,
        plot=args.plot,
        policies=args.policies,
        standby=not args.no_standby,
    )
    try:
        bar = Progress("demo ray", opts.seconds, enabled=not args.no_progress)
        result = run_demo(opts, progress=lambda elapsed, _total, n: bar.update(elapsed, f"samples {n}"))
        bar.finish(f"samples {result.samples}")
    except DemoError as e:
        raise UsageError(str(e)) from None
    if not json_to_stdout(args):
        print(render(result))
    write_json(args.json, {**stamp("demo.ray"), **result.to_dict()})
    console.wrote(args)
    return 0
