"""``lowtail compare BEFORE.json AFTER.json``: two validation reports side by side, headline first.

Exit status: 0 the after report is not worse on any check both graded, 1 it is worse on one (a status
got worse, or a value graded on an upper limit grew by more than ``--tolerance``), 2 a file is not a
validate report (the message names the file and the field).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lowtail.options import add_html, add_json, json_to_stdout, write_json, write_text


def _percent(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a percentage like 10") from None
    if not 0 <= value <= 1e6:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a percentage >= 0")
    return value


def register(sub: Any) -> None:
    p = sub.add_parser(
        "compare",
        help="compare two `lowtail validate --json` reports (exit 0 not worse, 1 worse, 2 not a report)",
        description=__doc__.splitlines()[0].replace("``", "`"),
    )
    p.add_argument("before", metavar="BEFORE.json")
    p.add_argument("after", metavar="AFTER.json")
    add_html(p, "a page with the table and plots")
    add_json(p, "the comparison")
    p.add_argument(
        "--tolerance",
        type=_percent,
        default=10.0,
        metavar="PCT",
        help="a graded value may grow this many percent and still be 'same' (the status must not get worse)",
    )
    p.add_argument(
        "--status-only",
        action="store_true",
        help="judge only status changes: values may move (exit 1 only when a status got worse)",
    )
    p.set_defaults(func=run_compare)


def run_compare(args: argparse.Namespace) -> int:
    from lowtail.validation.compare import compare, load_report, render_html, render_table

    before, after = load_report(args.before), load_report(args.after)
    cmp = compare(before, after, tolerance=float("inf") if args.status_only else args.tolerance / 100)
    if not json_to_stdout(args):
        print(render_table(cmp))
    else:
        for w in cmp["warnings"]:
            print(w, file=sys.stderr)
    write_json(args.json, cmp)
    if args.html:
        write_text(args.html, render_html(before, after, cmp))
    return 1 if cmp["worse"] else 0
