"""Figures of a validation report (matplotlib, Agg backend), returned as PNG bytes.

The CDF uses a logit y-axis so p50, p99, p99.9 and p99.99 get equal room: a tail plotted on a linear
axis is a line hugging 1.0. The heat strip shows one cell per CPU and metric, so a single bad core in
a 166-CPU node stands out.
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
from matplotlib.colors import LogNorm

MAX_LEGEND = 12


def _png(fig: Any) -> bytes:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight")
    plt.close(fig)
    return buf.getvalue()


def _floor(x: float) -> float:
    return max(x, 1e-5)  # log axes: a 0 ms sample is drawn at 10 ns


def latency_cdf(
    title: str,
    per_cpu: Mapping[int, Sequence[float]] | None,
    ladders: Mapping[int, Sequence[Sequence[float]]] | None,
    limits: tuple[float, float] | None,
    unit: str = "ms",
) -> bytes:
    """One CDF line per CPU, from raw samples when present, else from the report's quantile ladder."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    lines = 0
    if per_cpu:
        for cpu, xs in sorted(per_cpu.items()):
            n = len(xs)
            if n == 0:
                continue
            ys = [(i + 0.5) / n for i in range(n)]
            ax.step([_floor(x) for x in sorted(xs)], ys, where="post", lw=1, label=f"cpu{cpu} (n={n})")
            lines += 1
    elif ladders:
        for cpu, ladder in sorted(ladders.items()):
            pts = [(q, v) for q, v in ladder if 0 < q < 1]
            ax.plot([_floor(v) for _, v in pts], [q for q, _ in pts], marker=".", lw=1, label=f"cpu{cpu}")
            lines += 1
    if limits:
        ax.axvline(limits[0], color="green", ls="--", lw=1, label=f"pass <= {limits[0]:g} {unit}")
        ax.axvline(limits[1], color="red", ls="--", lw=1, label=f"warn <= {limits[1]:g} {unit}")
    ax.set_xscale("log")
    ax.set_yscale("logit")
    ax.set_xlabel(f"latency ({unit}, log)")
    ax.set_ylabel("fraction of samples <= x (logit)")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    if lines <= MAX_LEGEND:
        ax.legend(fontsize=7, loc="lower right")
    return _png(fig)


def heat_strip(rows: Mapping[str, Mapping[int, float]], title: str, unit: str = "ms") -> bytes:
    """Rows are metrics (``deschedule p999``...), columns CPUs, colour the value on a log scale."""
    cpus = sorted({c for r in rows.values() for c in r})
    names = list(rows)
    grid = [[rows[n].get(c, math.nan) for c in cpus] for n in names]
    finite = [v for r in grid for v in r if not math.isnan(v) and v > 0]
    lo, hi = (min(finite), max(finite)) if finite else (1e-3, 1.0)
    if hi <= lo:
        hi = lo * 10
    fig, ax = plt.subplots(figsize=(max(6.0, 0.35 * len(cpus) + 2), 0.6 * len(names) + 1.5))
    masked = [[_floor(v) if not math.isnan(v) else math.nan for v in r] for r in grid]
    im = ax.imshow(masked, aspect="auto", cmap="viridis", norm=LogNorm(vmin=_floor(lo), vmax=hi))
    ax.set_yticks(range(len(names)), names)
    step = max(1, len(cpus) // 32)
    ax.set_xticks(range(0, len(cpus), step), [str(c) for c in cpus[::step]], fontsize=7)
    ax.set_xlabel("CPU")
    ax.set_title(title)
    fig.colorbar(im, ax=ax, label=f"{unit} (log)")
    return _png(fig)


def ratio_bars(labels: Iterable[str], before: Sequence[float], after: Sequence[float], title: str) -> bytes:
    """Before/after bars on a log axis (the document's gap is four orders of magnitude)."""
    names = list(labels)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(names) + 2), 4.5))
    xs = range(len(names))
    w = 0.4
    ax.bar([x - w / 2 for x in xs], [_floor(v) for v in before], w, label="before")
    ax.bar([x + w / 2 for x in xs], [_floor(v) for v in after], w, label="after")
    ax.set_xticks(list(xs), names, rotation=20, ha="right", fontsize=8)
    ax.set_yscale("log")
    ax.set_ylabel("ms (log)")
    ax.set_title(title)
    ax.grid(True, axis="y", which="both", alpha=0.3)
    ax.legend()
    return _png(fig)


def ladder_compare(
    before: Sequence[Sequence[float]], after: Sequence[Sequence[float]], title: str, unit: str = "ms"
) -> bytes:
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for label, ladder in (("before", before), ("after", after)):
        pts = [(q, v) for q, v in ladder if 0 < q < 1]
        if pts:
            ax.plot([_floor(v) for _, v in pts], [q for q, _ in pts], marker=".", label=label)
    ax.set_xscale("log")
    ax.set_yscale("logit")
    ax.set_xlabel(f"latency ({unit}, log)")
    ax.set_ylabel("fraction <= x (logit), worst CPU at each quantile")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    return _png(fig)


def offender_bars(leased: Mapping[str, Mapping[str, Any]], window_s: float, title: str) -> bytes:
    """leased_threads: per leased CPU, its top foreign threads' run time in ms per second of the window,
    so the one daemon stealing a worker's core is named in the picture."""
    labels, values = [], []
    for cpu, d in sorted(leased.items(), key=lambda kv: int(kv[0])):
        for t in d["top"]:
            labels.append(f"CPU {cpu}: {t['comm']} [{t['pid']}/{t['tid']}]")
            values.append(t["ms"] / max(window_s, 1e-9))
    fig, ax = plt.subplots(figsize=(8.0, 0.35 * max(len(labels), 1) + 1.5))
    ax.barh(range(len(labels)), values, color="tab:red")
    ax.set_yticks(range(len(labels)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel("foreign run time on the leased CPU (ms per second)")
    ax.set_title(title if labels else title + " (none)")
    ax.grid(True, axis="x", alpha=0.3)
    return _png(fig)
