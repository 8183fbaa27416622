"""``lowtail compare BEFORE.json AFTER.json``: two validation reports side by side, headline first.

Exit status: 0 not worse (every check graded in either report was compared, none got worse), 1 worse
on at least one check (a probe's 95% interval lies wholly above the before one's, or its maximum is
exceeded by more samples than chance explains, and the value grew by more than ``--tolerance``; a
static check's status got worse), 2 a file is not a validate report (the message names the file and
the field), 3 incomplete: nothing compared got worse, but a check graded in one report could not be
compared with the other (skipped or absent there, or an older report without intervals).
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from lowtail.options import add_html, add_json, json_to_stdout, output_path, write_json, write_text


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
        help="compare two `lowtail validate --json` reports (exit 0 not worse, 1 worse, 2 not a report, "
        "3 incomplete)",
        description=__doc__.splitlines()[0].replace("``", "`"),
    )
    p.add_argument("before", metavar="BEFORE.json")
    p.add_argument("after", metavar="AFTER.json")
    add_html(p, "a page with the table and plots")
    add_json(p, "the comparison")
    p.add_argument(
        "--junit",
        metavar="FILE",
        type=output_path(),
        help="write each compared check as a JUnit XML test case (worse a failure, not compared an error)",
    )
    p.add_argument(
        "--tolerance",
        type=_percent,
        default=10.0,
        metavar="PCT",
        help="a change must also exceed this many percent to count, however clear the intervals "
        "(default: 10)",
    )
    p.add_argument(
        "--status-only",
        action="store_true",
        help="judge only status changes: values may move (exit 1 only when a status got worse)",
    )
    p.set_defaults(func=run_compare)


def run_compare(args: argparse.Namespace) -> int:
    from lowtail.render import console
    from lowtail.validation.compare import compare, load_report, render_html, render_junit, render_table

    before, after = load_report(args.before), load_report(args.after)
    cmp = compare(before, after, tolerance=float("inf") if args.status_only else args.tolerance / 100)
    if not json_to_stdout(args):
        print(render_table(cmp))
    else:
        for w in cmp["warnings"]:
            print(w, file=sys.stderr)
    notes = sys.stderr if json_to_stdout(args) else sys.stdout
    write_json(args.json, cmp)
    if args.json and args.json != "-":
        console.info(f"JSON report: {args.json}", notes)
    if args.html:
        write_text(args.html, render_html(before, after, cmp))
        console.info(f"HTML report: {args.html}", notes)
    if args.junit:
        write_text(args.junit, render_junit(cmp))
        console.info(f"JUnit report: {args.junit}", notes)
    return int(cmp["exit_status"])
