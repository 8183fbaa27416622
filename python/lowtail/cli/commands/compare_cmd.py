"""``lowtail compare BEFORE.json AFTER.json``: two validation reports side by side, headline first."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from lowtail.cli.main import UsageError
from lowtail.cli.options import add_html, add_json, json_to_stdout, write_json


def register(sub: Any) -> None:
    p = sub.add_parser("compare", help="compare two `lowtail validate --json` reports (before/after)")
    p.add_argument("before", metavar="BEFORE.json")
    p.add_argument("after", metavar="AFTER.json")
    add_html(p, "a page with the table and plots")
    add_json(p, "the comparison")
    p.set_defaults(func=run_compare)


def run_compare(args: argparse.Namespace) -> int:
    from lowtail.validation.compare import ReportFormatError, compare, load_report, render_html, render_table

    try:
        before, after = load_report(args.before), load_report(args.after)
    except ReportFormatError as e:
        raise UsageError(str(e)) from None
    cmp = compare(before, after)
    write_json(args.json, cmp)
    if not json_to_stdout(args):
        print(render_table(cmp))
    if args.html:
        Path(args.html).write_text(render_html(before, after, cmp))
    return 0
