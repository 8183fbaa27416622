"""Compare two validation reports (before and after a migration): the headline first, then every check.

Each check that both reports graded gets a word: ``worse`` when its status got worse (pass -> warn,
pass or warn -> fail) or, for a check graded on an upper limit (the probes, in ms), when its value grew
by more than the tolerance (10% by default); ``better`` for the opposite; ``same`` otherwise. A check
only one report has, or that one of them skipped, is ``not compared``. ``lowtail compare`` exits 1 when
any check is worse, so a migration that made a node worse fails its pipeline. Reports from different
hosts, lowtail versions, CPUs or probe settings are compared, with a warning line for each difference.

The headline is the number of the predecessor's write-up: p99.9 deschedule, 400-470 ms on the VMware
guest against the 0.02 ms a well-configured node gives.
"""

from __future__ import annotations

import json
import math
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from lowtail.errors import LowtailError
from lowtail.render import html, style, table
from lowtail.render.schema import stamp
from lowtail.validation import intervals, plots, report
from lowtail.validation.check import SEVERITY, Status
from lowtail.validation.intervals import fmt_interval

SCHEMA = "lowtail.validate"
SCHEMA_VERSION = 1  # the newest validate report this module reads
DEFAULT_TOLERANCE = 0.10
STATUSES = tuple(str(s) for s in Status)
WORSE, BETTER, SAME, NOT_COMPARED = "worse", "better", "same", "not compared"
NOT_MEASURED = "not measured"  # skipped in both reports: nothing to compare, nothing missing
# lowtail compare's exit statuses: 2 is a file that is not a report.
EXIT_NOT_WORSE, EXIT_WORSE, EXIT_INCOMPLETE = 0, 1, 3


class ReportFormatError(LowtailError, ValueError):
    """A file that is not a ``lowtail validate --json`` report (exit status 2)."""

    exit_code = 2


def _number(x: Any) -> bool:
    if not isinstance(x, int | float) or isinstance(x, bool):
        return False
    try:
        return math.isfinite(x)
    except OverflowError:  # an integer beyond any float (JSON allows 10**400): not a figure we wrote
        return False


def _check_shape(doc: Any, path: str | Path) -> None:
    """Every field compare reads, with its type; the first one that is wrong is named."""

    def bad(where: str, got: Any, expected: str) -> ReportFormatError:
        return ReportFormatError(
            f"{path} is not a lowtail validate report: {where} is {json.dumps(got)[:60]}, expected {expected}"
        )

    if not isinstance(doc, dict) or not {"host", "checks", "summary"} <= doc.keys():
        raise ReportFormatError(
            f"{path} is not a lowtail validate report: expected a JSON object with host, checks and summary"
        )
    if "schema" in doc and doc["schema"] != SCHEMA:
        raise bad("schema", doc["schema"], repr(SCHEMA))
    version = doc.get("schema_version", 1)
    if not isinstance(version, int) or version > SCHEMA_VERSION:
        raise bad("schema_version", version, f"at most {SCHEMA_VERSION} (a newer lowtail wrote it?)")
    for key, kind in (("host", dict), ("checks", list), ("summary", dict)):
        if not isinstance(doc[key], kind):
            raise bad(key, doc[key], "a JSON " + ("object" if kind is dict else "list"))
    for i, c in enumerate(doc["checks"]):
        if not isinstance(c, dict):
            raise bad(f"checks[{i}]", c, "an object")
        if not isinstance(c.get("name"), str) or not c["name"]:
            raise bad(f"checks[{i}].name", c.get("name"), "a check name")
        if c.get("status") not in STATUSES:
            raise bad(f"checks[{i}].status ({c['name']})", c.get("status"), "one of " + ", ".join(STATUSES))
    if doc["summary"].get("status") not in STATUSES:
        raise bad("summary.status", doc["summary"].get("status"), "one of " + ", ".join(STATUSES))
    head = doc["summary"].get("headline")
    if head is not None:
        if not isinstance(head, dict):
            raise bad("summary.headline", head, "an object")
        for key in ("p999_deschedule_ms", "n", "max_ms"):
            if not _number(head.get(key)):
                raise bad(f"summary.headline.{key}", head.get(key), "a number")


def load_report(path: str | Path) -> dict[str, Any]:
    try:
        doc = json.loads(Path(path).read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:  # ValueError: JSON, or too many digits
        raise ReportFormatError(f"cannot read report {path}: {e}") from None
    except RecursionError:
        raise ReportFormatError(f"{path} is not a lowtail validate report: nested too deeply") from None
    _check_shape(doc, path)
    return dict(doc)


def _upper_limit(c: Mapping[str, Any]) -> bool:
    """Graded on an upper limit (lower is better): every probe, and checks whose threshold says so."""
    return c.get("kind") == "probe" or "pass <=" in str(c.get("threshold", ""))


def _data(c: Mapping[str, Any]) -> dict[str, Any]:
    d = c.get("data")
    return d if isinstance(d, dict) else {}


def _interval(c: Mapping[str, Any]) -> list[float | None] | None:
    """The graded p99.9's 95% interval, as validate recorded it (None: an older report has none)."""
    ci = _data(c).get("ci")
    if not (isinstance(ci, list) and len(ci) == 2 and all(x is None or _number(x) for x in ci)):
        return None
    return [None if x is None else float(x) for x in ci]


def _tail(c: Mapping[str, Any]) -> tuple[int, list[float], float | None] | None:
    """(blocks, largest block maxima first, the median block maximum) of all the probe's CPUs together,
    for the maximum's test."""
    everything = _data(c).get("all")
    if not isinstance(everything, dict):
        return None
    n, top = everything.get("blocks", everything.get("n")), everything.get("top")
    if not (isinstance(n, int) and n > 0 and isinstance(top, list) and top and all(_number(x) for x in top)):
        return None
    mid = everything.get("block_p50")
    median = float(mid) if isinstance(mid, int | float) and _number(mid) else None
    return n, sorted((float(x) for x in top), reverse=True), median


def _status_note(bs: str, as_: str) -> str:
    return f"{bs} -> {as_}, " if bs != as_ else ""


def judge_p999(b: Mapping[str, Any], a: Mapping[str, Any], tolerance: float) -> tuple[str, str]:
    """A probe graded on a p99.9: worse or better only when the two 95% intervals do not overlap."""
    bs, as_ = str(b["status"]), str(a["status"])
    cb, ca = _interval(b), _interval(a)
    vb, va = float(b["value"]), float(a["value"])
    if cb is None or ca is None:
        side = "before" if cb is None else "after"
        return NOT_COMPARED, (
            f"{_status_note(bs, as_)}the {side} report has no interval for its p99.9 (an older lowtail "
            "wrote it): run validate again to compare values"
        )
    unit = b.get("unit") or a.get("unit") or ""
    both = f"p99.9 {_v(vb, unit)} {fmt_interval(cb, '')} -> {_v(va, unit)} {fmt_interval(ca, '')}"
    if ca[0] is not None and cb[1] is not None and ca[0] > cb[1] and va > vb * (1 + tolerance):
        times = f"{_times(va / vb)} higher" if vb > 0 else "up from 0"
        return WORSE, f"{_status_note(bs, as_)}{both}, {times}: the 95% intervals do not overlap"
    if cb[0] is not None and ca[1] is not None and cb[0] > ca[1] and vb > va * (1 + tolerance):
        times = f"{_times(vb / va)} lower" if va > 0 else "down to 0"
        return BETTER, f"{_status_note(bs, as_)}{both}, {times}: the 95% intervals do not overlap"
    return SAME, f"{_status_note(bs, as_)}within noise: {both}, the 95% intervals overlap"


def judge_max(b: Mapping[str, Any], a: Mapping[str, Any], tolerance: float) -> tuple[str, str]:
    """A maximum: worse only when more after samples exceed the before maximum than chance explains."""
    bs, as_ = str(b.get("status")), str(a.get("status"))
    tb, ta = _tail(b), _tail(a)
    if tb is None or ta is None:
        side = "before" if tb is None else "after"
        return NOT_COMPARED, (
            f"{_status_note(bs, as_)}the {side} report keeps no largest samples (an older lowtail wrote it): "
            "run validate again to compare maxima"
        )
    (nb, topb, midb), (na, topa, mida) = tb, ta
    unit = b.get("unit") or a.get("unit") or ""
    maxes = f"max {_v(topb[0], unit)} -> {_v(topa[0], unit)}"
    for word, (n1, top1), (n2, top2, mid2), grew in (
        (WORSE, (nb, topb), (na, topa, mida), "after"),
        (BETTER, (na, topa), (nb, topb, midb), "before"),
    ):
        k = intervals.count_above(top2, top1[0])
        chance = intervals.chance_above(k, n2, n1)
        # Beyond chance, a change a person would call one: half the run's blocks above the other's max.
        most = mid2 is not None and mid2 > top1[0]
        if chance <= intervals.MAX_ALPHA and most and top2[0] > top1[0] * (1 + tolerance):
            other = "before" if grew == "after" else "after"
            return word, (
                f"{_status_note(bs, as_)}{maxes}: half or more of the {n2:,} {grew} blocks of "
                f"{intervals.BLOCK} samples lie above the {other} max (median block max "
                f"{_v(mid2, unit)}; chance {chance:.1g} if nothing changed)"
            )
    ka, kb = intervals.count_above(topa, topb[0]), intervals.count_above(topb, topa[0])
    return SAME, (
        f"{_status_note(bs, as_)}within noise: {maxes}; {ka} of {na:,} after blocks above the before max, "
        f"{kb} of {nb:,} before above the after max (a change needs half of them, and more than chance)"
    )


def judge(b: Mapping[str, Any], a: Mapping[str, Any], tolerance: float) -> tuple[str, str]:
    """(word, why) for one check: worse / better / same / not compared / not measured."""
    bs, as_ = b.get("status", "absent"), a.get("status", "absent")
    if bs == as_ == Status.SKIP:
        return NOT_MEASURED, "skipped in both"
    if "absent" in (bs, as_):
        return NOT_COMPARED, f"only in the {'after' if bs == 'absent' else 'before'} report"
    if Status.SKIP in (bs, as_):
        return NOT_COMPARED, f"skipped {'before' if bs == Status.SKIP else 'after'}"
    sb, sa = SEVERITY[Status(bs)], SEVERITY[Status(as_)]
    if math.isinf(tolerance):
        if sa != sb:
            return (WORSE if sa > sb else BETTER), f"{bs} -> {as_}"
        return SAME, f"still {as_} (values not judged: --status-only)"
    numbers = _number(b.get("value")) and _number(a.get("value"))
    if b.get("kind") == "probe" and numbers:
        # A probe's status is its estimate against a limit: the estimate's noise decides, not the status.
        metric = _data(b).get("metric", "p999")
        word, why = (judge_max if metric == "max" else judge_p999)(b, a, tolerance)
        if word != NOT_COMPARED or sa == sb:
            return word, why
        return (WORSE if sa > sb else BETTER), f"{bs} -> {as_}; {why.removeprefix(_status_note(bs, as_))}"
    if sa != sb:
        return (WORSE if sa > sb else BETTER), f"{bs} -> {as_}"
    if not (numbers and _upper_limit(b)):
        return SAME, f"still {as_}"
    vb, va = float(b["value"]), float(a["value"])
    unit = b.get("unit") or a.get("unit") or ""
    if va > vb * (1 + tolerance) and va - vb > 0:
        times = f"{_times(va / vb)} higher" if vb > 0 else "up from 0"
        return WORSE, f"{_v(vb, unit)} -> {_v(va, unit)}, {times}"
    if vb > va * (1 + tolerance):
        times = f"{_times(vb / va)} lower" if va > 0 else "down to 0"
        return BETTER, f"{_v(vb, unit)} -> {_v(va, unit)}, {times}"
    return SAME, f"within {tolerance:.0%}"


def _times(r: float) -> str:
    """A factor in words' precision: 7.35x, 22,500x."""
    return f"{r:,.0f}x" if r >= 100 else f"{r:.3g}x"


def _ratio(before: Any, after: Any) -> float | None:
    if not _number(before) or not _number(after) or after <= 0:
        return None  # no ratio to a zero; both values are in the row
    return float(before) / float(after)


def _context(doc: Mapping[str, Any]) -> dict[str, Any]:
    """What must match for two reports to measure the same thing; a difference is a warning."""
    host = doc["host"]
    cpus = host.get("probe_cpus")
    settings = doc.get("settings")
    if isinstance(settings, dict):  # which checks ran is in the rows ("only in ..."), not a warning
        settings = {k: v for k, v in settings.items() if k != "checks"}
    return {
        "host": host.get("hostname"),
        "lowtail version": doc.get("lowtail_version") or (host.get("versions") or {}).get("lowtail"),
        "CPU model": host.get("cpu_model"),
        "CPUs": host.get("cpus"),
        "probe CPUs": cpus.get("cpus") if isinstance(cpus, dict) else doc["summary"].get("probe_cpus"),
        "probe settings": settings or None,
    }


def warnings(before: Mapping[str, Any], after: Mapping[str, Any]) -> list[str]:
    out = []
    cb, ca = _context(before), _context(after)
    for key, vb in cb.items():
        va = ca[key]
        if isinstance(vb, dict) and isinstance(va, dict) and vb != va:  # name only what differs
            diff = [k for k in sorted(vb.keys() | va.keys()) if vb.get(k) != va.get(k)]
            out.append(
                f"warning: {key} differ: "
                + "; ".join(
                    f"{k} before {json.dumps(vb.get(k))}, after {json.dumps(va.get(k))}" for k in diff
                )
            )
        elif vb != va:
            out.append(
                f"warning: {key} differ: before {json.dumps(vb) if vb is not None else 'not recorded'}, "
                f"after {json.dumps(va) if va is not None else 'not recorded'}"
            )
    for name, doc in (("before", before), ("after", after)):
        if doc["summary"].get("interrupted"):
            out.append(f"warning: the {name} run was interrupted: its report is partial")
    return out


def compare(
    before: dict[str, Any], after: dict[str, Any], tolerance: float = DEFAULT_TOLERANCE
) -> dict[str, Any]:
    b_checks = {c["name"]: c for c in before["checks"]}
    a_checks = {c["name"]: c for c in after["checks"]}
    names = [c["name"] for c in before["checks"]] + [n for n in a_checks if n not in b_checks]
    # Probes first (they carry the numbers), the deschedule headline at the very top.
    names.sort(key=lambda n: (n != "deschedule", (b_checks.get(n) or a_checks[n]).get("kind") != "probe"))
    rows = []
    for n in names:
        b, a = b_checks.get(n, {}), a_checks.get(n, {})
        word, why = judge(b, a, tolerance)
        rows.append(_row(n, b, a, (word, why)))
        graded = {b.get("status"), a.get("status")}.isdisjoint({None, Status.SKIP})
        both_probed = b.get("kind") == "probe" and graded
        if both_probed and _data(b).get("metric", "p999") != "max" and not math.isinf(tolerance):
            # A p99.9 says nothing about the rare stall: the maximum is judged on its own row.
            mword, mwhy = judge_max(b, a, tolerance)
            rows.append(_row(f"{n} max", b, a, (mword, mwhy), value="max"))
    hb, ha = before["summary"].get("headline"), after["summary"].get("headline")
    headline = None
    if hb and ha:
        desc = next((r for r in rows if r["name"] == "deschedule"), None)
        headline = {
            "metric": "p999_deschedule_ms",
            "before": {**hb, "ci": _interval(b_checks.get("deschedule", {}))},
            "after": {**ha, "ci": _interval(a_checks.get("deschedule", {}))},
            "ratio": _ratio(hb["p999_deschedule_ms"], ha["p999_deschedule_ms"]),
            "change": desc["change"] if desc else NOT_COMPARED,
        }
    worse = [r["name"] for r in rows if r["change"] == WORSE]
    missing = [r["name"] for r in rows if r["change"] == NOT_COMPARED]
    verdict = WORSE if worse else ("incomplete" if missing else "not worse")
    status = EXIT_WORSE if worse else (EXIT_INCOMPLETE if missing else EXIT_NOT_WORSE)
    return {
        **stamp("compare"),
        "before": {"host": before["host"].get("hostname"), "status": before["summary"]["status"]},
        "after": {"host": after["host"].get("hostname"), "status": after["summary"]["status"]},
        "tolerance": None if math.isinf(tolerance) else tolerance,
        "confidence": intervals.CONFIDENCE,
        "verdict": verdict,
        "exit_status": status,
        "worse": worse,
        "better": [r["name"] for r in rows if r["change"] == BETTER],
        "same": [r["name"] for r in rows if r["change"] == SAME],
        "not_compared": missing,
        "not_measured": [r["name"] for r in rows if r["change"] == NOT_MEASURED],
        "warnings": warnings(before, after),
        "headline": headline,
        "checks": rows,
    }


def _row(
    name: str, b: Mapping[str, Any], a: Mapping[str, Any], judged: tuple[str, str], value: str = "value"
) -> dict[str, Any]:
    word, why = judged

    def side(c: Mapping[str, Any]) -> dict[str, Any]:
        v = c.get("value")
        if value == "max":
            tail = _tail(c)
            v = tail[1][0] if tail else None
        return {"status": c.get("status", "absent"), "value": v}

    sb, sa = side(b), side(a)
    return {
        "name": name,
        "kind": (b or a).get("kind", "static"),
        "unit": (b or a).get("unit", ""),
        "before": sb,
        "after": sa,
        "ratio": _ratio(sb["value"], sa["value"]) if (b or a).get("kind") == "probe" else None,
        "change": word,
        "why": why,
        "status_changed": sb["status"] != sa["status"],
    }


def _v(x: Any, unit: str) -> str:
    if x is None:
        return "-"
    if isinstance(x, float):
        return f"{x:.4g} {unit}".strip()
    if isinstance(x, dict):
        return ", ".join(f"{k}={v}" for k, v in x.items())[:36]
    return f"{x} {unit}".strip()


HEADERS = ["check", "before", "after", "change"]
# Statuses as validate colours them; "absent" is a check only one of the two reports has.
STATUS_COLOR = {**report.STATUS_COLOR, "absent": report.STATUS_COLOR["skip"]}
CHANGE_COLOR = {
    WORSE: "#cf222e",
    BETTER: "#1a7f37",
    SAME: "#57606a",
    NOT_COMPARED: "#9a6700",
    NOT_MEASURED: "#6e7781",
}


def _headline(cmp: dict[str, Any]) -> str:
    h = cmp["headline"]
    if not h:
        return "headline p99.9 deschedule: not measured in both reports"
    b, a = h["before"], h["after"]
    change = h.get("change", NOT_COMPARED)
    word = {SAME: "same within noise", NOT_COMPARED: "values not compared"}.get(change, change)

    def one(x: dict[str, Any]) -> str:
        ci = f" {fmt_interval(x['ci'], 'ms')}" if x.get("ci") else ""
        return f"{x['p999_deschedule_ms']:.4g} ms{ci} (n={x['n']:,}, max {x['max_ms']:.4g} ms)"

    return f"headline p99.9 deschedule: {one(b)} -> {one(a)}: {word}"


def _title(cmp: dict[str, Any]) -> str:
    return (
        f"before: {cmp['before']['host']} ({cmp['before']['status']})   "
        f"after: {cmp['after']['host']} ({cmp['after']['status']})"
    )


def _verdict_line(cmp: dict[str, Any]) -> str:
    """The result in one line: the verdict word, what decided it, what could not be judged, the exit."""
    counts = [
        f"{len(cmp[k])} {w}"
        for k, w in (("same", "same within noise"), ("better", "better"), ("not_measured", "skipped in both"))
        if cmp[k]
    ]
    missing = (
        f"; {len(cmp['not_compared'])} not compared ({', '.join(cmp['not_compared'])})"
        if cmp["not_compared"]
        else ""
    )
    if cmp["worse"]:
        return f"result: WORSE after on {', '.join(cmp['worse'])}{missing} (exit {EXIT_WORSE})"
    if cmp["not_compared"]:
        k = len(cmp["not_compared"])
        were = "check was" if k == 1 else "checks were"
        return (
            f"result: INCOMPLETE, nothing compared got worse but {k} {were} "
            f"not compared ({', '.join(cmp['not_compared'])}); {', '.join(counts) or 'nothing else'} "
            f"(exit {EXIT_INCOMPLETE})"
        )
    return f"result: NOT WORSE: {', '.join(counts) or 'nothing graded'} (exit {EXIT_NOT_WORSE})"


def _verdict_color(cmp: dict[str, Any]) -> str:
    return WORSE if cmp["worse"] else (NOT_COMPARED if cmp["not_compared"] else BETTER)


def _side(r: dict[str, Any], side: str) -> str:
    s = r[side]
    return f"{s['status'].upper()} {_v(s['value'], r['unit'])}" if s["status"] != "absent" else "absent"


def render_table(cmp: dict[str, Any], width: int | None = None) -> str:
    width = width or table.terminal_width()
    # The verdict first (and again last, under the table): a person reads it before anything else.
    verdict = style.paint(_verdict_line(cmp), _verdict_color(cmp))
    out = [verdict]
    out += [line for text in (*cmp["warnings"], _headline(cmp)) for line in textwrap.wrap(text, width)]
    out.append("")
    rows = [
        [r["name"], _side(r, "before"), _side(r, "after"), f"{r['change']}: {r['why']}"]
        for r in cmp["checks"]
    ]
    out.append(table.render(HEADERS, rows, title=_title(cmp), width=width))
    out.append(verdict)
    return "\n".join(out)


def figures(before: dict[str, Any], after: dict[str, Any], cmp: dict[str, Any]) -> list[tuple[str, bytes]]:
    out = []
    probes = [
        r
        for r in cmp["checks"]
        if r["ratio"] is not None and _number(r["before"]["value"]) and _number(r["after"]["value"])
    ]
    if probes:
        title = "each probe's graded value before and after (ms, log; lower is better)"
        out.append(
            (
                title,
                plots.ratio_bars(
                    [f"{r['name']} ({_metric(before, r['name'])})" for r in probes],
                    [float(r["before"]["value"]) for r in probes],
                    [float(r["after"]["value"]) for r in probes],
                    title,
                ),
            )
        )
    ladders = []
    counts = []
    for doc in (before, after):
        d = next(
            (c for c in doc["checks"] if c["name"] == "deschedule" and isinstance(c.get("data"), dict)), None
        )
        everything = ((d or {}).get("data", {}).get("all") or {}) if d else {}
        lad = everything.get("ladder_worst_cpu")
        ladders.append(lad if isinstance(lad, list) else [])
        per_cpu = (d or {}).get("data", {}).get("per_cpu") or {}
        ns = (int(s["n"]) if _number(s.get("n")) else 0 for s in per_cpu.values() if isinstance(s, dict))
        counts.append(min(ns, default=0))
    if ladders[0] and ladders[1]:
        title = "deschedule CDF, worst CPU at each quantile"
        n = (counts[0], counts[1])
        lim = next(
            (
                c["data"].get("limits_ms")
                for c in after["checks"]
                if c["name"] == "deschedule" and c.get("data")
            ),
            None,
        )
        limits = (float(lim[0]), float(lim[1])) if isinstance(lim, list) and len(lim) == 2 else None
        out.append((title, plots.ladder_compare(ladders[0], ladders[1], title, n=n, limits=limits)))
    return out


def _metric(doc: dict[str, Any], name: str) -> str:
    c: dict[str, Any] = next((c for c in doc["checks"] if c["name"] == name), {})
    data: dict[str, Any] = c["data"] if isinstance(c.get("data"), dict) else {}
    metric = str(data.get("metric", "value"))
    return "p99.9" if metric == "p999" else metric


def render_html(before: dict[str, Any], after: dict[str, Any], cmp: dict[str, Any]) -> str:
    """The self-contained page (``compare.html.j2``): verdict, headline, every check, the plots."""
    rows = [
        {
            "name": r["name"],
            "before_status": r["before"]["status"],
            "before_value": _v(r["before"]["value"], r["unit"]),
            "after_status": r["after"]["status"],
            "after_value": _v(r["after"]["value"], r["unit"]),
            "change": r["change"],
            "why": r["why"],
            "status_changed": r["status_changed"],
        }
        for r in cmp["checks"]
    ]
    return html.render(
        "compare.html.j2",
        title="lowtail compare",
        verdict=_verdict_line(cmp),
        verdict_kind=_verdict_color(cmp),
        warnings=cmp["warnings"],
        headline=_headline(cmp),
        caption=_title(cmp),
        rows=rows,
        colors=STATUS_COLOR,
        change_colors=CHANGE_COLOR,
        images=[html.Image(alt, png) for alt, png in figures(before, after, cmp)],
    )


def render_junit(cmp: dict[str, Any]) -> str:
    """Each compared row a JUnit test case: worse a failure, not compared an error (the gate could not
    judge it), skipped in both skipped."""
    from lowtail.render import junit

    outcome = {WORSE: "failure", NOT_COMPARED: "error", NOT_MEASURED: "skipped"}
    cases = [
        junit.Case(
            r["name"],
            outcome.get(r["change"], "passed"),
            f"{r['change']}: {r['why']}",
            f"before {_side(r, 'before')}, after {_side(r, 'after')}: {r['change']}: {r['why']}",
        )
        for r in cmp["checks"]
    ]
    return junit.render("lowtail compare", f"lowtail.compare.{cmp['after']['host']}", cases)
