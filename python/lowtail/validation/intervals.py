"""How far a measured tail could move by chance: distribution-free intervals for a percentile, and a
test for the maximum. ``compare`` calls a change only when these say it is not noise.

Percentile (p99.9). Of n independent samples, the number K that lie above the true q-quantile is
Binomial(n, 1 - q), whatever the distribution. So the j-th largest sample lies above the quantile with
probability P(K >= j), and a pair of order statistics bounds it with a probability computed exactly:
the lower end is the j-th largest sample with P(K >= j) <= alpha/2, the upper end the j-th largest with
P(K < j) <= alpha/2. When even the maximum is not above the quantile often enough (P(K = 0) > alpha/2,
for a p99.9 below ~3,700 samples) the interval has no upper end: n samples cannot bound the p99.9 from
above, and the report says "open" instead of inventing a number.

Maximum. A maximum has no distribution-free interval at all (nothing bounds how far the true tail
reaches), but two runs can be compared without one: if both draw from the same distribution, every
ordering of their pooled samples is equally likely, and the chance that at least k of the after run's
n_a samples exceed the largest of the before run's n_b is prod_{i<k} (n_a - i) / (n_a + n_b - i)
(about 2^-k for equal n). Samples taken back to back are not independent (one stall delays several
in a row), so the test counts blocks of ``BLOCK`` consecutive samples, each by its maximum: a stall
counts once. And a shared host drifts between two runs minutes apart (measured here: up to 12 of 30
blocks of an unchanged host's second run above the first run's maximum), so beyond chance the test asks
for a change a person would call one. A maximum is called worse only when at least half the after
run's blocks lie above the before maximum, and so many that chance explains it less than ``MAX_ALPHA``
of the time; better, likewise, the other way round.

The percentile's interval assumes independent samples; a stall spanning several samples makes it
somewhat too narrow, never too wide (a p99.9 of 30,000 rests on 30 samples, so one stall moves it
little). docs/validation.md argues the
choice against a bootstrap (which cannot say anything about a maximum and is unreliable this far in
the tail).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence

CONFIDENCE = 0.95
# A gate makes many comparisons (every probe, both directions, every pipeline run): the maximum's test
# calls a change by chance once in a thousand, below the ~0.5% at which two separated 95% intervals do.
MAX_ALPHA = 0.001
TOP = 32  # largest block maxima kept in a report: enough for the maximum's test between unequal runs
BLOCK = 100  # samples in a row per block: longer than the stalls that delay several samples in a row


def _binom_pmfs(n: int, p: float) -> Iterator[float]:
    """P(X = 0), P(X = 1), ... for X ~ Binomial(n, p), in log space (n of 10^6, p of 1e-3 stay exact)."""
    lp, lq, lg_n1 = math.log(p), math.log1p(-p), math.lgamma(n + 1)
    for i in range(n + 1):
        yield math.exp(lg_n1 - math.lgamma(i + 1) - math.lgamma(n - i + 1) + i * lp + (n - i) * lq)


def quantile_ranks(n: int, q: float, confidence: float = CONFIDENCE) -> tuple[int | None, int | None]:
    """Indices into n samples sorted ascending of the interval's ends for the q-quantile;
    None where the samples cannot bound it (below the minimum, above the maximum)."""
    if n < 1:
        raise ValueError(f"n={n}: expected at least one sample")
    if not 0.0 < q < 1.0:
        raise ValueError(f"q={q}: expected a quantile strictly between 0 and 1")
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence={confidence}: expected a probability strictly between 0 and 1")
    half = (1.0 - confidence) / 2
    # K = samples above the quantile ~ Binomial(n, 1 - q). The j-th largest sample (index n - j) lies
    # below the quantile iff K < j, above it iff K >= j.
    upper_j = 0  # the largest j with P(K < j) <= half: P(K <= upper_j - 1) <= half
    lower_j: int | None = None  # the smallest j with P(K >= j) <= half: P(K <= j - 1) >= 1 - half
    cdf = 0.0
    for k, pmf in enumerate(_binom_pmfs(n, 1.0 - q)):
        cdf += pmf
        if cdf <= half:
            upper_j = k + 1
        if cdf >= 1.0 - half:
            lower_j = k + 1
            break
    upper = n - upper_j if upper_j >= 1 else None
    lower = n - lower_j if lower_j is not None and lower_j <= n else None
    return lower, upper


def quantile_interval(
    n: int, q: float, at: Callable[[int], float], confidence: float = CONFIDENCE
) -> list[float | None]:
    """[low, high] of the q-quantile; ``at(i)`` is the i-th smallest sample (0-based). None: open."""
    lo, hi = quantile_ranks(n, q, confidence)
    return [None if lo is None else at(lo), None if hi is None else at(hi)]


def upper_median(maxima_desc: Sequence[float]) -> float:
    """The ceil(m/2)-th largest of m block maxima: above a value, at least half the blocks are."""
    return maxima_desc[(len(maxima_desc) + 1) // 2 - 1]


def block_maxima(samples: Sequence[float], block: int = BLOCK) -> list[float]:
    """The maximum of each run of ``block`` samples in time order (the last run may be shorter),
    largest first."""
    return sorted((max(samples[i : i + block]) for i in range(0, len(samples), block)), reverse=True)


def chance_above(k: int, n_after: int, n_before: int) -> float:
    """P(at least k of n_after samples exceed the maximum of n_before) when both come from one
    distribution."""
    if k <= 0:
        return 1.0
    if k > n_after:
        return 0.0
    p = 1.0
    for i in range(k):
        p *= (n_after - i) / (n_after + n_before - i)
    return p


def needed_above(n_after: int, n_before: int, alpha: float = MAX_ALPHA) -> int | None:
    """The fewest after samples above the before maximum that chance explains at most ``alpha`` of the
    time; None when even all of them would not (tiny runs)."""
    for k in range(1, n_after + 1):
        if chance_above(k, n_after, n_before) <= alpha:
            return k
    return None


def count_above(top: Sequence[float], threshold: float) -> int:
    """How many of the largest samples (``top``, largest first) lie above ``threshold``."""
    return sum(1 for x in top if x > threshold)


def fmt_interval(ci: Sequence[float | None] | None, unit: str = "ms") -> str:
    """``[3.1, 9.8] ms``, ``[3.1, open] ms``: the one way an interval is written."""
    if not ci:
        return "no interval"
    lo, hi = ci[0], ci[1]

    def one(x: float | None, open_word: str) -> str:
        return open_word if x is None else f"{x:.4g}"

    return f"[{one(lo, 'open')}, {one(hi, 'open')}] {unit}".strip()
