"""Compare two validation reports (before and after a migration): the headline first, then every check.

The headline is the document's number: p99.9 deschedule, 400-470 ms on the VMware guest against the
0.02 ms a well-configured node gives. Ratios are before / after, so "x 20000" means twenty thousand
times lower after.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lowtail.errors import LowtailError
from lowtail.render import html, table
from lowtail.validation import plots, report


class ReportFormatError(LowtailError, ValueError):
    """A file that is not a ``lowtail validate --json`` report."""


def load_report(path: str | Path) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ReportFormatError(f"cannot read report {path}: {e}") from None
    if not isinstance(doc, dict) or not {"host", "checks", "summary"} <= doc.keys():
        raise ReportFormatError(
            f"{path} is not a lowtail validate report: expected a JSON object with host, checks and summary"
        )
    return doc


def _ratio(before: Any, after: Any) -> float | None:
    if not isinstance(before, int | float) or not isinstance(after, int | float):
        return None
    if after <= 0:
        return None  # no ratio to a zero; both values are in the row
    return float(before) / float(after)


def _fmt_ratio(r: float | None) -> str:
    if r is None:
        return "-"
    if r == float("inf"):
        return "inf"
    return f"x {r:.3g}"


def compare(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    b_checks = {c["name"]: c for c in before["checks"]}
    a_checks = {c["name"]: c for c in after["checks"]}
    names = [c["name"] for c in before["checks"]] + [n for n in a_checks if n not in b_checks]
    # Probes first (they carry the numbers), the deschedule headline at the very top.
    names.sort(key=lambda n: (n != "deschedule", (b_checks.get(n) or a_checks[n]).get("kind") != "probe"))
    rows = []
    for n in names:
        b, a = b_checks.get(n, {}), a_checks.get(n, {})
        rows.append(
            {
                "name": n,
                "kind": (b or a).get("kind", "static"),
                "unit": (b or a).get("unit", ""),
                "before": {"status": b.get("status", "absent"), "value": b.get("value")},
                "after": {"status": a.get("status", "absent"), "value": a.get("value")},
                "ratio": _ratio(b.get("value"), a.get("value")) if (b or a).get("kind") == "probe" else None,
            }
        )
    hb, ha = before["summary"].get("headline"), after["summary"].get("headline")
    headline = None
    if hb and ha:
        headline = {
            "metric": "p999_deschedule_ms",
            "before": hb,
            "after": ha,
            "ratio": _ratio(hb["p999_deschedule_ms"], ha["p999_deschedule_ms"]),
        }
    return {
        "before": {"host": before["host"].get("hostname"), "status": before["summary"]["status"]},
        "after": {"host": after["host"].get("hostname"), "status": after["summary"]["status"]},
        "headline": headline,
        "checks": rows,
    }


def _v(x: Any, unit: str) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4g} {unit}".strip()
    if isinstance(x, dict):
        return ", ".join(f"{k}={v}" for k, v in x.items())[:36]
    return f"{x} {unit}".strip()


HEADERS = ["check", "before", "value", "after", "value", "before/after"]
# Statuses as validate colours them; "absent" is a check only one of the two reports has.
STATUS_COLOR = {**report.STATUS_COLOR, "absent": report.STATUS_COLOR["skip"]}


def _headline(cmp: dict[str, Any]) -> str:
    h = cmp["headline"]
    if not h:
        return "headline p999 deschedule: not measured in both reports"
    return (
        f"headline p999 deschedule: {h['before']['p999_deschedule_ms']:.4g} ms (n={h['before']['n']}, "
        f"max {h['before']['max_ms']:.4g} ms) -> {h['after']['p999_deschedule_ms']:.4g} ms "
        f"(n={h['after']['n']}, max {h['after']['max_ms']:.4g} ms): {_fmt_ratio(h['ratio'])} lower"
    )


def _title(cmp: dict[str, Any]) -> str:
    return (
        f"before: {cmp['before']['host']} ({cmp['before']['status']})   "
        f"after: {cmp['after']['host']} ({cmp['after']['status']})"
    )


def render_table(cmp: dict[str, Any]) -> str:
    out = [_headline(cmp), ""]
    rows = [
        [
            r["name"],
            r["before"]["status"],
            _v(r["before"]["value"], r["unit"]),
            r["after"]["status"],
            _v(r["after"]["value"], r["unit"]),
            _fmt_ratio(r["ratio"]),
        ]
        for r in cmp["checks"]
    ]
    out.append(table.render(HEADERS, rows, title=_title(cmp)))
    return "\n".join(out)


def figures(before: dict[str, Any], after: dict[str, Any], cmp: dict[str, Any]) -> list[tuple[str, bytes]]:
    out = []
    probes = [
        r
        for r in cmp["checks"]
        if r["ratio"] is not None
        and isinstance(r["before"]["value"], int | float)
        and isinstance(r["after"]["value"], int | float)
    ]
    if probes:
        title = "probe tails before and after (ms, log)"
        out.append(
            (
                title,
                plots.ratio_bars(
                    [r["name"] for r in probes],
                    [float(r["before"]["value"]) for r in probes],
                    [float(r["after"]["value"]) for r in probes],
                    title,
                ),
            )
        )
    ladders = []
    for doc in (before, after):
        d = next((c for c in doc["checks"] if c["name"] == "deschedule" and "data" in c), None)
        ladders.append(d["data"]["all"].get("ladder_worst_cpu", []) if d else [])
    if ladders[0] and ladders[1]:
        title = "deschedule CDF, worst CPU at each quantile"
        out.append((title, plots.ladder_compare(ladders[0], ladders[1], title)))
    return out


def render_html(before: dict[str, Any], after: dict[str, Any], cmp: dict[str, Any]) -> str:
    """The self-contained page (``compare.html.j2``): headline, every check before and after, the plots."""
    rows = [
        {
            "name": r["name"],
            "before_status": r["before"]["status"],
            "before_value": _v(r["before"]["value"], r["unit"]),
            "after_status": r["after"]["status"],
            "after_value": _v(r["after"]["value"], r["unit"]),
            "ratio": _fmt_ratio(r["ratio"]),
        }
        for r in cmp["checks"]
    ]
    return html.render(
        "compare.html.j2",
        title="lowtail compare",
        headline=_headline(cmp),
        caption=_title(cmp),
        headers=HEADERS,
        rows=rows,
        colors=STATUS_COLOR,
        images=[html.Image(alt, png) for alt, png in figures(before, after, cmp)],
    )
