"""What every ``lowtail bench`` report shares: strict JSON, the targets table, ``--check`` and the HTML
page (targets met / not met first, then the tables and plots, the run's settings and host, and the JSON
folded away with a download link)."""

from __future__ import annotations

import argparse
import math
from typing import Any

from lowtail.options import write_text
from lowtail.render import html


def json_safe(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # strict JSON has no NaN
    if isinstance(v, dict):
        return {k: json_safe(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [json_safe(x) for x in v]
    return v


def add_check(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--check",
        action="store_true",
        help="exit 1 when a target is not met (without it a benchmark exits 0 whatever the targets)",
    )


def exit_code(args: argparse.Namespace, targets: list[dict[str, Any]]) -> int:
    """0, or 1 under ``--check`` when a decided target was not met (an undecided one is not a miss)."""
    return 1 if getattr(args, "check", False) and any(t.get("met") is False for t in targets) else 0


def verdict(t: dict[str, Any]) -> str:
    if t.get("met") is None:
        return f"not decided: {t['why']}" if t.get("why") else "not decided"
    return "met" if t["met"] else "NOT MET"


# Targets a run could not have decided by its own choice (a transport not asked for, a fifo-only target
# at another priority): kept in the JSON, left out of the tables a person reads.
NOT_ASKED = ("not measured", "decided under --priority fifo only")


def shown(targets: list[dict[str, Any]]) -> tuple[list[dict[str, Any]], str]:
    """The targets to show, and a note naming how many were left out and why ('' when none)."""
    keep = [t for t in targets if t.get("why") not in NOT_ASKED]
    left = len(targets) - len(keep)
    note = f" ({left} not shown: not asked for by this run's --transports or --priority; all in the JSON)"
    return keep, note if left else ""


def targets_table(targets: list[dict[str, Any]]) -> html.Section:
    keep, note = shown(targets)
    rows = [[verdict(t), t["target"], t.get("figure", t.get("ratio", "-"))] for t in keep]
    return html.Section("Targets" + note, table=html.Table(["verdict", "target", "measured"], rows))


def _flat(prefix: str, v: Any) -> list[list[str]]:
    if isinstance(v, dict):
        return [row for k, x in v.items() for row in _flat(f"{prefix}.{k}" if prefix else str(k), x)]
    if isinstance(v, list | tuple):
        return [[prefix, ", ".join(str(x) for x in v) or "-"]]
    return [[prefix, "-" if v in (None, "") else str(v)]]


def overall(report: dict[str, Any]) -> str:
    """The page's first line: the targets' verdict in one line, and what it does to the exit status."""
    targets = report.get("targets")
    if not isinstance(targets, list) or not targets:
        return "no targets graded: this benchmark measures, it does not judge"
    counts = [
        f"{sum(1 for t in targets if t.get('met') is value)} {word}"
        for value, word in ((False, "NOT MET"), (True, "met"), (None, "not decided"))
    ]
    missed = any(t.get("met") is False for t in targets)
    head = "result: TARGETS NOT MET" if missed else "result: no target missed"
    return (
        f"{head} ({', '.join(counts)} of {len(targets)}); the exit status follows the targets only "
        "under --check"
    )


def write_bench_html(path: str, title: str, report: dict[str, Any], sections: list[html.Section]) -> None:
    extra = []
    for key, heading in (("settings", "Settings"), ("workload", "Workload and settings"), ("host", "Host")):
        if isinstance(report.get(key), dict):
            extra.append(
                html.Section(heading, table=html.Table(["setting", "value"], _flat("", report[key])))
            )
    page = html.report(title, [*sections, *extra], summary=[overall(report)], data=json_safe(report))
    write_text(path, page)
