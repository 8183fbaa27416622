"""The record every validation check produces, its verdicts, and tail statistics.

A check is ``name``, ``status`` (pass, warn, fail or skip), the measured ``value``, the ``threshold`` it
was judged against, and ``evidence`` (what was read or measured, so a person can verify the verdict).
A skip always carries its ``reason``. Percentiles always come with their sample count and the maximum:
a p99.9 of 200 samples is one sample, and says so.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from lowtail.errors import LowtailError
from lowtail.telemetry.percentiles import rank as _rank
from lowtail.validation import intervals


class Status(StrEnum):
    PASS = "pass"
    WARN = "warn"
    FAIL = "fail"
    SKIP = "skip"


# Worst first: a summary is as bad as its worst check.
SEVERITY = {Status.FAIL: 3, Status.WARN: 2, Status.PASS: 1, Status.SKIP: 0}


def worst(statuses: Iterable[Status]) -> Status:
    return max(statuses, key=SEVERITY.__getitem__, default=Status.SKIP)


@dataclass
class Check:
    name: str
    status: Status
    value: Any = None
    threshold: str = ""
    evidence: list[str] = field(default_factory=list)
    reason: str = ""  # why it was skipped, or the one-line cause of a warn/fail
    kind: str = "static"  # "static" or "probe"
    unit: str = ""
    data: dict[str, Any] = field(default_factory=dict)  # structured detail (per-CPU stats...)
    # Raw samples per CPU, for the plots of the HTML report; too large for the JSON.
    samples: dict[int, list[float]] = field(default_factory=dict, repr=False)
    # ... or, for rt-tests, their histograms per CPU as (value, count) pairs, overflows at the maximum.
    histograms: dict[int, list[tuple[float, int]]] = field(default_factory=dict, repr=False)

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "kind": self.kind,
            "status": str(self.status),
            "value": self.value,
            "unit": self.unit,
            "threshold": self.threshold,
            "evidence": list(self.evidence),
        }
        if self.reason:
            out["reason"] = self.reason
        if self.data:
            out["data"] = self.data
        return out


def fmt(x: Any) -> str:
    """The one rounding of a figure wherever it is shown (table, reason, headline, HTML, plot titles):
    4 significant digits, so 0.02038, 8.038 and 470.1 each read the same everywhere."""
    if isinstance(x, float):
        return f"{x:.4g}"
    return str(x)


def skip(name: str, reason: str, kind: str = "static") -> Check:
    return Check(name=name, status=Status.SKIP, reason=reason, kind=kind)


class ThresholdError(LowtailError, ValueError):
    """A threshold given on the command line that is not ``PASS_MAX:WARN_MAX`` with PASS <= WARN."""


@dataclass(frozen=True)
class Limits:
    """Upper bounds: a value <= pass_max passes, <= warn_max warns, above fails."""

    pass_max: float
    warn_max: float

    def grade(self, value: float) -> Status:
        if value <= self.pass_max:
            return Status.PASS
        if value <= self.warn_max:
            return Status.WARN
        return Status.FAIL

    def describe(self, unit: str) -> str:
        return f"pass <= {self.pass_max:g} {unit}, warn <= {self.warn_max:g} {unit}, fail above"

    @classmethod
    def parse(cls, text: str) -> Limits:
        a, sep, b = text.partition(":")
        try:
            lo, hi = float(a), float(b if sep else a)
        except ValueError:
            raise ThresholdError(
                f"threshold {text!r}: expected PASS_MAX:WARN_MAX in ms, e.g. 0.1:1"
            ) from None
        if not (0 <= lo <= hi) or math.isnan(lo) or math.isnan(hi):
            raise ThresholdError(f"threshold {text!r}: expected 0 <= PASS_MAX <= WARN_MAX")
        return cls(lo, hi)


# Quantiles kept in the JSON for each distribution, dense in the tail: enough to redraw a CDF and to
# compare two reports without the raw samples.
LADDER: tuple[float, ...] = (
    0.0,
    0.1,
    0.25,
    0.5,
    0.75,
    0.9,
    0.95,
    0.99,
    0.995,
    0.999,
    0.9995,
    0.9999,
    1.0,
)


def tail_stats(samples: Sequence[float], over: float | None = None) -> dict[str, Any]:
    """n, mean, p50, p90, p99, p999, max (nearest rank: every percentile is an observed value), the
    p99.9's 95% interval and the largest samples (what ``compare`` needs to tell a change from noise)."""
    xs = sorted(samples)
    n = len(xs)
    if n == 0:
        return {"n": 0}
    maxima = intervals.block_maxima(samples)
    out: dict[str, Any] = {
        "n": n,
        "mean": round(math.fsum(xs) / n, 6),
        "p50": xs[_rank(n, 0.5)],
        "p90": xs[_rank(n, 0.9)],
        "p99": xs[_rank(n, 0.99)],
        "p999": xs[_rank(n, 0.999)],
        "max": xs[-1],
        "ladder": [[q, xs[_rank(n, q)]] for q in LADDER],
        "p999_ci": intervals.quantile_interval(n, 0.999, xs.__getitem__),
        # The largest maximum of each block of samples taken in a row: one stall that delays several
        # samples in a row counts once in the maximum's test.
        "top": maxima[: intervals.TOP],
        "blocks": len(maxima),
        "block_p50": intervals.upper_median(maxima),
    }
    if over is not None:
        out["over"] = sum(1 for x in xs if x > over)
        out["over_threshold"] = over
    return out


def histogram_stats(
    hist: Mapping[int | str, int], maximum: float, overflow: int = 0, divisor: float = 1.0
) -> dict[str, Any]:
    """The same statistics from a histogram of integer buckets (cyclictest, oslat).

    ``overflow`` samples fell beyond the last bucket; they rank at the reported maximum, so a percentile
    that lands among them is the maximum (an upper bound, never an underestimate).
    """
    buckets = sorted((int(k), int(v)) for k, v in hist.items() if int(v) > 0)
    n = sum(v for _, v in buckets) + overflow
    if n == 0:
        return {"n": 0}

    def at_index(i: int) -> float:
        seen = 0
        for value, count in buckets:
            seen += count
            if seen > i:
                return value / divisor
        return maximum / divisor

    def at(q: float) -> float:
        return at_index(_rank(n, q))

    top: list[float] = [maximum / divisor] * min(overflow, intervals.TOP)
    for value, count in reversed(buckets):
        top += [value / divisor] * min(count, intervals.TOP - len(top))
    if top:
        top[0] = max(top[0], maximum / divisor)  # the maximum is a sample, whichever bucket it fell in

    total = math.fsum(k * v for k, v in buckets) + overflow * maximum
    return {
        "n": n,
        "mean": round(total / divisor / n, 6),
        "p50": at(0.5),
        "p90": at(0.9),
        "p99": at(0.99),
        "p999": at(0.999),
        "max": maximum / divisor,
        "ladder": [[q, at(q) if q < 1 else maximum / divisor] for q in LADDER],
        "p999_ci": intervals.quantile_interval(n, 0.999, at_index),
        "top": top,
        "blocks": n,  # a histogram has no time order: every sample is its own block
        "block_p50": at(0.5),
    }


def pooled_top(per_cpu: Mapping[Any, dict[str, Any]]) -> dict[str, Any]:
    """n, blocks and the largest block maxima of all CPUs together (each CPU's largest hold the pooled
    largest)."""
    tops = sorted((x for s in per_cpu.values() for x in s.get("top") or []), reverse=True)
    medians = [float(s["block_p50"]) for s in per_cpu.values() if "block_p50" in s]
    return {
        "n": sum(int(s.get("n", 0)) for s in per_cpu.values()),
        "blocks": sum(int(s.get("blocks", s.get("n", 0))) for s in per_cpu.values()),
        "top": tops[: intervals.TOP],
        # The smallest CPU's: at least half of that CPU's blocks lie above it (conservative for all).
        "block_p50": min(medians) if medians else None,
    }


def worst_cpu_interval(per_cpu_sorted: Mapping[Any, Sequence[float]], q: float = 0.999) -> list[float | None]:
    """The interval of the worst CPU's q-quantile (what a probe is graded on): each CPU's interval at
    confidence 1 - alpha/CPUs (Bonferroni), so all hold together at 95%, and then the largest ends."""
    k = max(1, len(per_cpu_sorted))
    conf = 1.0 - (1.0 - intervals.CONFIDENCE) / k
    ends = [
        intervals.quantile_interval(len(xs), q, xs.__getitem__, conf) for xs in per_cpu_sorted.values() if xs
    ]
    if not ends:
        return [None, None]
    lows = [e[0] for e in ends if e[0] is not None]
    highs = [e[1] for e in ends]
    return [max(lows) if lows else None, None if None in highs else max(h for h in highs if h is not None)]


def merge_ladders(per_cpu: Mapping[Any, dict[str, Any]]) -> list[list[float]]:
    """A conservative all-CPU ladder: at each quantile the worst CPU's value."""
    ladders = [s["ladder"] for s in per_cpu.values() if s.get("n")]
    if not ladders:
        return []
    return [[q, max(lad[i][1] for lad in ladders)] for i, q in enumerate(LADDER)]


def graded(
    name: str,
    value: float,
    limits: Limits,
    *,
    unit: str,
    what: str,
    evidence: list[str],
    why: str,
    kind: str = "static",
    data: dict[str, Any] | None = None,
) -> Check:
    """A check graded on one number; ``why`` becomes the reason only when it did not pass."""
    status = limits.grade(value)
    return Check(
        name,
        status,
        value,
        f"{limits.describe(unit)} {what}",
        evidence,
        "" if status is Status.PASS else why,
        kind=kind,
        unit=unit,
        data=data or {},
    )
