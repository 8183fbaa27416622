"""``lowtail tb-report LOGDIR [LOGDIR2]``: the write-up's training-run metrics from TensorBoard logs."""

from __future__ import annotations

import argparse
from typing import Any

from lowtail.errors import UsageError
from lowtail.options import add_json, json_to_stdout, write_json
from lowtail.render import console


def register(sub: Any) -> None:
    p = sub.add_parser(
        "tb-report",
        help="training-run metrics (learner wait share, samples/s, inference tails) from TensorBoard logs",
    )
    p.add_argument("logdir", metavar="LOGDIR")
    p.add_argument("logdir2", metavar="LOGDIR2", nargs="?", help="a second run to compare (after)")
    add_json(p, "the metrics (and the comparison)")
    p.set_defaults(func=run_tbreport)


def run_tbreport(args: argparse.Namespace) -> int:
    from lowtail.telemetry import tbreport
    from lowtail.telemetry.tfevents import EventFileError

    try:
        first = tbreport.load(args.logdir)
        second = tbreport.load(args.logdir2) if args.logdir2 else None
    except (EventFileError, OSError) as e:
        raise UsageError(str(e)) from None
    from lowtail.render.schema import stamp

    if second is None:
        if not json_to_stdout(args):
            print(tbreport.render(first))
        write_json(args.json, {**stamp("tb-report"), **first})
        console.wrote(args)
        return 0
    cmp = tbreport.compare(first, second)
    if not json_to_stdout(args):
        print(tbreport.render(first))
        print()
        print(tbreport.render(second))
        print()
        print(tbreport.render_compare(cmp))
    write_json(args.json, {**stamp("tb-report"), "before": first, "after": second, "compare": cmp})
    console.wrote(args)
    return 0
