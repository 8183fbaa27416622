"""How many samples a percentile verdict needs: the one rule every report that grades a percentile uses.

A nearest-rank p99.9 of n samples rests on the n/1000 samples beyond it; below 1,000 samples it is the
maximum. For a pass to claim "the p99.9 is within the limit", the samples must bound the p99.9 at all:
the largest of n independent samples lies above the true q-quantile with probability 1 - q^n (each
sample falls below it with probability q). We ask for 95%, so

    n >= ln(0.05) / ln(q)        p99.9: 2,995 samples,  p99: 299,  p50: 5.

Below that, even the maximum may sit under the true percentile more than once in twenty runs, and the
check cannot pass: a would-be pass is a warn saying "too few samples". A warn or fail stays what it is
(the samples over the limit were observed). The rule is distribution-free (it assumes only independent
samples), which is what a latency tail with an unknown shape needs. docs/validation.md states it.
"""

from __future__ import annotations

import math

CONFIDENCE = 0.95  # the chance that the largest sample bounds the graded percentile


def min_samples(q: float, confidence: float = CONFIDENCE) -> int:
    """The least n whose maximum is an upper bound of the q-quantile with ``confidence`` (0 < q < 1)."""
    if not 0.0 < q < 1.0:
        raise ValueError(f"q={q}: expected a quantile strictly between 0 and 1")
    return math.ceil(math.log(1.0 - confidence) / math.log(q))


def label(q: float) -> str:
    """``p99.9`` for 0.999: the one spelling of a percentile in messages."""
    return "p" + f"{q * 100:.4f}".rstrip("0").rstrip(".")


def beyond(n: int, q: float) -> int:
    """Samples ranked above the nearest-rank q-quantile of n (what a p99.9 "rests on")."""
    return max(0, n - math.ceil(round(q * n, 9)))


def shortfall(n: int, q: float) -> str:
    """ "" when n samples suffice for a verdict on the q-quantile, else the warning that says why not."""
    need = min_samples(q)
    if n >= need:
        return ""
    return f"too few samples for {label(q)}: n={n:,}, need at least {need:,}"
