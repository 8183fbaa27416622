"""Figures of a validation report (matplotlib, Agg backend), returned as PNG bytes.

A probe's distribution is drawn as OSADL draws its latency plots: a histogram with both axes
logarithmic, so the rare slow samples a check fails on are visible bars, running to the maximum, with
the limits, the graded figure and the maximum marked. (A CDF hides the tail: its last 0.01% is a line
hugging 1.0, and its axis stops at 1 - 1/n.) The compare ladders keep the logit CDF: they come from the
JSON's quantile ladder, not from samples. The heat strip shows one cell per CPU, one row and one colour
scale per metric spanning the metric's limits, so a single bad core in a 166-CPU node stands out, in the
colour of its distance from the limit. No text of a figure overprints another (tests/render checks the
drawn text boxes).
"""

from __future__ import annotations

import io
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import matplotlib
import numpy as np

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


def heat_strip(
    rows: Mapping[str, Mapping[int, float]],
    title: str,
    unit: str = "ms",
    limits: Mapping[str, tuple[float, float]] | None = None,
) -> bytes:
    """One strip per metric (``deschedule p99.9``...), columns CPUs, each cell labelled with its value.
    Each row's log colour scale spans its values and its limits, with the limits marked on the colourbar,
    so a cell over the limit is drawn in the colour of "over the limit" whatever the other cells hold."""
    cpus = sorted({c for r in rows.values() for c in r})
    names = list(rows)
    fig, axes = plt.subplots(
        len(names), 1, figsize=(max(7.0, 0.55 * len(cpus) + 4), 1.3 * len(names) + 1.2), squeeze=False
    )
    step = max(1, len(cpus) // 32)
    for ax, name in zip(axes[:, 0], names, strict=True):
        row = [rows[name].get(c, math.nan) for c in cpus]
        finite = [v for v in row if not math.isnan(v) and v > 0]
        lim = (limits or {}).get(name)
        span = finite + (list(lim) if lim else [])
        lo, hi = (min(span) / 2, max(span) * 2) if span else (1e-3, 1.0)
        masked = [[_floor(v) if not math.isnan(v) else math.nan for v in row]]
        norm = LogNorm(vmin=_floor(lo), vmax=hi)
        im = ax.imshow(masked, aspect="auto", cmap="viridis", norm=norm)
        if len(cpus) <= 24:  # the value in each cell, where there is room for it
            for i, v in enumerate(row):
                if not math.isnan(v):
                    shade = "white" if norm(_floor(v)) < 0.6 else "black"
                    ax.text(i, 0, f"{v:.3g}", ha="center", va="center", fontsize=7, color=shade)
        ax.set_yticks([])
        ax.set_title(f"{name} ({unit}, log colour scale)", fontsize=8, loc="left")
        ax.set_xticks(range(0, len(cpus), step), [str(c) for c in cpus[::step]], fontsize=7)
        bar = fig.colorbar(im, ax=ax, fraction=0.05, pad=0.02)
        bar.ax.tick_params(labelsize=6)
        if lim:
            bar.ax.axhline(lim[0], color="green", lw=2)
            bar.ax.axhline(lim[1], color="red", lw=2)
            bar.set_ticks([lim[0], lim[1]], labels=[f"pass {lim[0]:g}", f"warn {lim[1]:g}"])
    axes[-1, 0].set_xlabel("CPU")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    return _png(fig)


Histogram = Sequence[tuple[float, int]]  # (value, count) pairs: rt-tests' buckets, or raw samples


def _binned(per_cpu: Mapping[int, Histogram], bins: Any) -> dict[int, Any]:
    out = {}
    for cpu, pairs in per_cpu.items():
        values = np.array([_floor(v) for v, _ in pairs], dtype=np.float64)
        counts = np.array([c for _, c in pairs], dtype=np.float64)
        out[cpu] = np.histogram(values, bins=bins, weights=counts)[0]
    return out


def histogram_figure(
    title: str,
    per_cpu: Mapping[int, Histogram],
    limits: tuple[float, float] | None,
    graded: tuple[str, float] | None,
    unit: str = "ms",
) -> Any:
    """OSADL-style: samples per latency bin, both axes log, to the maximum; limits, the graded figure
    (``("p99.9", 0.31)``) and each CPU's maximum marked. Returns the matplotlib Figure."""
    tops = {cpu: max(v for v, c in pairs if c) for cpu, pairs in per_cpu.items() if any(c for _, c in pairs)}
    lows = [v for pairs in per_cpu.values() for v, c in pairs if c and v > 0]
    lo = max(min(lows) if lows else 1e-3, 1e-5)
    top = max(tops.values(), default=1.0)
    hi = max(top, limits[1] if limits else 0.0) * 1.5
    bins = np.geomspace(lo * 0.8, hi, 80)
    fig, ax = plt.subplots(figsize=(9, 4.8))
    for cpu, counts in sorted(_binned(per_cpu, bins).items())[:MAX_LEGEND]:
        n = int(sum(c for _, c in per_cpu[cpu]))
        patch = ax.stairs(counts, bins, label=f"cpu{cpu} (n={n})", lw=1.2)
        if cpu in tops:
            ax.axvline(tops[cpu], color=patch.get_edgecolor(), ls=":", lw=1)
    if limits:
        ax.axvline(limits[0], color="green", ls="--", lw=1, label=f"pass <= {limits[0]:g} {unit}")
        ax.axvline(limits[1], color="red", ls="--", lw=1, label=f"warn <= {limits[1]:g} {unit}")
    if graded and graded[0] != "max":
        ax.axvline(
            graded[1], color="black", ls="-.", lw=1, label=f"graded {graded[0]} {graded[1]:.4g} {unit}"
        )
    worst = max(tops, key=tops.__getitem__) if tops else None
    if worst is not None:
        ax.annotate(
            f"max {tops[worst]:.4g} {unit} (CPU {worst})",
            xy=(tops[worst], 1),
            xytext=(0, 24),
            textcoords="offset points",
            ha="right",
            fontsize=8,
            arrowprops={"arrowstyle": "->"},
        )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlim(lo * 0.8, hi)
    ax.set_ylim(bottom=0.5)
    ax.set_xlabel(f"latency ({unit}, log)")
    ax.set_ylabel("samples per bin (log)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    return fig


def latency_histogram(
    title: str,
    per_cpu: Mapping[int, Histogram],
    limits: tuple[float, float] | None,
    graded: tuple[str, float] | None,
    unit: str = "ms",
) -> bytes:
    return _png(histogram_figure(title, per_cpu, limits, graded, unit))


def ratio_bars(labels: Iterable[str], before: Sequence[float], after: Sequence[float], title: str) -> bytes:
    """Before/after bars on a log axis (a throttled and an isolated CPU differ by four orders of
    magnitude)."""
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
    before: Sequence[Sequence[float]],
    after: Sequence[Sequence[float]],
    title: str,
    *,
    unit: str = "ms",
    n: tuple[int, int] = (0, 0),
    limits: tuple[float, float] | None = None,
) -> bytes:
    """The two reports' quantile ladders on a logit axis; with the sample counts, each maximum is drawn
    at 1 - 1/n (where the last sample sits) and named in the legend with n, so the tail runs to the value
    that was seen; the limits are drawn."""
    fig, ax = plt.subplots(figsize=(8, 4.5))
    for (label, ladder), count in zip((("before", before), ("after", after)), n, strict=True):
        pts = [(q, v) for q, v in ladder if 0 < q < 1]
        top = next((float(v) for q, v in ladder if q >= 1), None)
        if pts and top is not None and count > 1 and 1 - 1 / count > pts[-1][0]:
            pts.append((1 - 1 / count, top))
        if pts:
            # Both maxima in the legend, never as labels on the plot, where two close maxima overprint.
            name = f"{label}: n={count:,}, max {top:.4g} {unit}" if count > 1 and top is not None else label
            (line,) = ax.plot([_floor(v) for _, v in pts], [q for q, _ in pts], marker=".", label=name)
            if count > 1 and top is not None:
                ax.plot(
                    [_floor(pts[-1][1])], [pts[-1][0]], marker="o", ms=7, mfc="none", color=line.get_color()
                )
    if limits:
        ax.axvline(limits[0], color="green", ls="--", lw=1, label=f"pass <= {limits[0]:g} {unit}")
        ax.axvline(limits[1], color="red", ls="--", lw=1, label=f"warn <= {limits[1]:g} {unit}")
    ax.set_xscale("log")
    ax.set_yscale("logit")
    ax.set_xlabel(f"latency ({unit}, log)")
    ax.set_ylabel("fraction <= x (logit), worst CPU at each quantile")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="upper left")
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
