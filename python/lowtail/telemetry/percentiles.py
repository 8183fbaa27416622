"""The package's one percentile definition: nearest rank, always with the sample count.

The q-quantile of n samples is the smallest observed value with at least q·n samples at or below it
(index ceil(q·n) - 1 of the sorted samples; numpy's ``method="inverted_cdf"``). Every reported
percentile is therefore a value that was measured, never an interpolation between two samples, and a
p99.9 of 1,000 samples is honestly the maximum but one. Every report, exporter and benchmark uses this
module; a p99.9 of fewer than ~3,000 samples is an anecdote, so the count travels with it.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # numpy is imported when first used: `lowtail --help` must not pay for it
    import numpy as np


def rank(n: int, q: float) -> int:
    """Index into n sorted samples of the nearest-rank q-quantile (0 <= q <= 1)."""
    if n < 1:
        raise ValueError(f"n={n}: expected at least one sample")
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"q={q}: expected a quantile between 0 and 1")
    # round() first: 0.7 * 10 is 7.000000000000001 in binary floating point, whose ceil would skip a rank.
    return min(n - 1, max(0, math.ceil(round(q * n, 9)) - 1))


def quantile(sorted_values: Sequence[float] | np.ndarray[Any, Any], q: float) -> float:
    """The nearest-rank q-quantile of values already sorted ascending."""
    return float(sorted_values[rank(len(sorted_values), q)])


def _sorted(values: Iterable[float] | np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    import numpy as np

    return np.sort(
        np.asarray(values if isinstance(values, np.ndarray) else list(values), dtype=np.float64).ravel()
    )


def quantiles(values: Iterable[float] | np.ndarray[Any, Any], qs: Sequence[float]) -> list[float]:
    """Nearest-rank quantiles of unsorted values (numpy sort; for the large arrays of benchmarks)."""
    arr = _sorted(values)
    return [float(arr[rank(arr.size, q)]) for q in qs]


@dataclass(frozen=True)
class Percentiles:
    """n, mean, p50/p99/p99.9 (nearest rank) and max of one series; NaN statistics when n is 0."""

    n: int
    mean: float
    p50: float
    p99: float
    p999: float
    max: float

    @classmethod
    def of(cls, values: Iterable[float] | np.ndarray[Any, Any]) -> Percentiles:
        arr = _sorted(values)
        if arr.size == 0:
            nan = math.nan
            return cls(0, nan, nan, nan, nan, nan)
        p50, p99, p999 = (float(arr[rank(arr.size, q)]) for q in (0.5, 0.99, 0.999))
        return cls(int(arr.size), float(arr.mean()), p50, p99, p999, float(arr[-1]))

    def to_dict(self) -> dict[str, float]:
        return asdict(self)
