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


def targets_table(targets: list[dict[str, Any]]) -> html.Section:
    rows = [[verdict(t), t["target"], t.get("figure", t.get("ratio", "-"))] for t in targets]
    return html.Section("Targets", table=html.Table(["verdict", "target", "measured"], rows))


def _flat(prefix: str, v: Any) -> list[list[str]]:
    if isinstance(v, dict):
        return [row for k, x in v.items() for row in _flat(f"{prefix}.{k}" if prefix else str(k), x)]
    if isinstance(v, list | tuple):
        return [[prefix, ", ".join(str(x) for x in v) or "-"]]
    return [[prefix, "-" if v in (None, "") else str(v)]]


def write_bench_html(path: str, title: str, report: dict[str, Any], sections: list[html.Section]) -> None:
    extra = []
    for key, heading in (("settings", "Settings"), ("workload", "Workload and settings"), ("host", "Host")):
        if isinstance(report.get(key), dict):
            extra.append(
                html.Section(heading, table=html.Table(["setting", "value"], _flat("", report[key])))
            )
    write_text(path, html.report(title, [*sections, *extra], data=json_safe(report)))
