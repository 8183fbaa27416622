"""Render a validation report: a terminal table, JSON, and a self-contained HTML page with plots.

The HTML embeds its PNGs as base64 ``data:`` URIs, so the one file can be fetched from a node by
Ansible and opened anywhere.
"""

from __future__ import annotations

import base64
import html
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lowtail.render import table
from lowtail.validation import plots
from lowtail.validation.check import Check, Status
from lowtail.validation.runner import Report

STATUS_COLOR = {"pass": "#1a7f37", "warn": "#9a6700", "fail": "#cf222e", "skip": "#6e7781"}
HEAT_METRIC = {"deschedule": "p999", "timer": "p999", "shm_rtt": "p999", "cyclictest": "max", "oslat": "max"}


def _fmt_value(c: dict[str, Any]) -> str:
    v = c.get("value")
    if v is None:
        return "-"
    if isinstance(v, float):
        text = f"{v:.4g}"
    elif isinstance(v, dict):
        text = ", ".join(f"{k}={x}" for k, x in v.items())
    else:
        text = str(v)
    return f"{text} {c.get('unit', '')}".strip()


def _why(c: dict[str, Any]) -> str:
    if c.get("reason"):
        return str(c["reason"])
    ev = [str(e) for e in c.get("evidence") or []]
    worst_cpu = (c.get("data") or {}).get("worst_cpu")
    if worst_cpu is not None:  # a probe that passed: its worst CPU's percentiles, with n and max
        line = next((e for e in ev if e.startswith(f"cpu{worst_cpu}:")), None)
        if line:
            return line
    return ev[0] if ev else ""


def render_table(report: dict[str, Any], width: int = 90) -> str:
    rows = []
    for c in report["checks"]:
        why = _why(c)
        rows.append(
            [
                c["name"],
                c["status"].upper(),
                _fmt_value(c)[:40],
                why if len(why) <= width else why[: width - 3] + "...",
            ]
        )
    s = report["summary"]
    h = report["host"]
    title = (
        f"lowtail validate on {h.get('hostname')} ({h.get('cpu_model')}, kernel {h.get('kernel') or '-'}), "
        f"probe CPUs {s.get('probe_cpus') or '-'}"
    )
    out = [table.render(["check", "status", "value", "why / evidence"], rows, title=title), ""]
    counts = ", ".join(f"{n} {k}" for k, n in s["counts"].items() if n)
    out.append(f"result: {s['status'].upper()} ({counts})")
    head = s.get("headline")
    if head:
        out.append(
            f"headline: p999 deschedule {head['p999_deschedule_ms']:.4f} ms on CPU {head['cpu']} "
            f"(n={head['n']}, max {head['max_ms']:.3f} ms); the source document: 400-470 ms on VMware with "
            "sched_rt_runtime_us=500000, 0.02 ms at 950000"
        )
    return "\n".join(out)


def write_json(report: Report, path: str | Path) -> None:
    Path(path).write_text(json.dumps(report.to_dict(), indent=2) + "\n")


def _img(png: bytes, alt: str) -> str:
    data = base64.b64encode(png).decode()
    alt = html.escape(alt)
    return (
        f'<figure><img alt="{alt}" src="data:image/png;base64,{data}"><figcaption>{alt}</figcaption></figure>'
    )


def _limits(c: Check) -> tuple[float, float] | None:
    lim = c.data.get("limits_ms")
    return (float(lim[0]), float(lim[1])) if lim else None


def figures(checks: Sequence[Check]) -> list[tuple[str, bytes]]:
    out: list[tuple[str, bytes]] = []
    heat: dict[str, dict[int, float]] = {}
    for c in checks:
        if c.name == "leased_threads" and c.status is not Status.SKIP:
            title = f"leased_threads: other threads on leased CPUs ({c.status}, worst {c.value} ms/s)"
            out.append((title, plots.offender_bars(c.data["leased_cpus"], c.data["window_s"], title)))
        if c.kind != "probe" or c.status is Status.SKIP or "per_cpu" not in c.data:
            continue
        per_cpu = c.data["per_cpu"]
        metric = HEAT_METRIC.get(c.name, "p999")
        heat[f"{c.name} {metric}"] = {int(cpu): float(s[metric]) for cpu, s in per_cpu.items() if s.get("n")}
        ladders = {int(cpu): s["ladder"] for cpu, s in per_cpu.items() if s.get("ladder")}
        title = f"{c.name}: latency CDF per CPU ({c.status}, {c.data.get('metric', 'p999')} {c.value} ms)"
        out.append((title, plots.latency_cdf(title, c.samples or None, ladders, _limits(c))))
    if heat:
        out.append(("Per-CPU heat strip (ms)", plots.heat_strip(heat, "per-CPU tail latency (ms)")))
    return out


def render_html(report: Report) -> str:
    d = report.to_dict()
    s, h = d["summary"], d["host"]
    esc = html.escape
    rows = []
    for c in d["checks"]:
        color = STATUS_COLOR[c["status"]]
        evidence = "".join(f"<li>{esc(str(e))}</li>" for e in c.get("evidence", []))
        rows.append(
            f"<tr><td>{esc(c['name'])}</td>"
            f"<td style='color:{color};font-weight:bold'>{c['status'].upper()}</td>"
            f"<td>{esc(_fmt_value(c))}</td><td>{esc(c.get('threshold', ''))}</td>"
            f"<td>{esc(_why(c))}<details><summary>evidence</summary><ul>{evidence}</ul>"
            "</details></td></tr>"
        )
    head = s.get("headline")
    headline = (
        f"<p class=head>p999 deschedule <b>{head['p999_deschedule_ms']:.4f} ms</b> on CPU {head['cpu']} "
        f"(n={head['n']}, max {head['max_ms']:.3f} ms). Source document: 400-470 ms on VMware with "
        "sched_rt_runtime_us=500000; 0.02 ms at 950000.</p>"
        if head
        else ""
    )
    host_rows = "".join(
        f"<tr><th>{esc(k)}</th><td>{esc(json.dumps(v) if isinstance(v, dict | list) else str(v))}</td></tr>"
        for k, v in h.items()
        if k != "plan"
    )
    imgs = "".join(_img(png, title) for title, png in figures(report.checks))
    color = STATUS_COLOR.get(s["status"], "#000")
    return f"""<!doctype html>
<html><head><meta charset="utf-8"><title>lowtail validate: {esc(str(h.get("hostname")))}</title>
<style>
body {{ font-family: system-ui, sans-serif; margin: 2em; max-width: 1200px; }}
table {{ border-collapse: collapse; margin-bottom: 1.5em; }}
td, th {{ border: 1px solid #d0d7de; padding: 4px 8px; text-align: left; vertical-align: top; }}
td {{ font-size: 13px; }}
.status {{ font-size: 1.6em; color: {color}; font-weight: bold; }}
figure {{ margin: 1em 0; }} img {{ max-width: 100%; }}
</style></head><body>
<h1>lowtail validate: {esc(str(h.get("hostname")))}</h1>
<p class=status>{s["status"].upper()}</p>
<p>{", ".join(f"{n} {k}" for k, n in s["counts"].items())}; probe CPUs {esc(str(s.get("probe_cpus")))}</p>
{headline}
<h2>Checks</h2>
<table><tr><th>check</th><th>status</th><th>value</th><th>threshold</th><th>why</th></tr>
{"".join(rows)}</table>
<h2>Plots</h2>
{imgs or "<p>no probe ran</p>"}
<h2>Host</h2>
<table>{host_rows}</table>
</body></html>
"""


def write_html(report: Report, path: str | Path) -> None:
    Path(path).write_text(render_html(report))
