"""How ``lowtail bench soak`` grades (no processes): the p99.9 interval, steady windows against the
baseline, and resource growth."""

from __future__ import annotations

import math

import numpy as np

from lowtail.benchmarks.soak_bench import MIN_SAMPLES_P999, grade_resources, grade_windows, p999_interval


def test_the_p999_interval_brackets_the_quantile_and_is_open_when_too_few_samples() -> None:
    xs = np.arange(1, 10001, dtype=float)
    q, lo, hi = p999_interval(xs)
    assert q == 9990.0 and lo < q < hi <= 10000.0
    _, _, hi_small = p999_interval(np.arange(1, 501, dtype=float))
    assert math.isinf(hi_small)  # 500 samples cannot bound a p99.9 from above


def window(index: int, kind: str, xs: np.ndarray) -> dict[str, object]:
    q, lo, hi = p999_interval(np.sort(xs))
    return {"index": index, "kind": kind, "n": xs.size, "p999_ms": q, "p999_interval_ms": [lo, hi]}


def test_a_steady_window_is_worse_only_beyond_both_intervals() -> None:
    rng = np.random.default_rng(0)
    base = rng.exponential(1.0, 20000)
    same = window(5, "steady", rng.exponential(1.0, 5000))
    met, figure, why = grade_windows([same], base)
    assert met is True and not why and "1 of 1 steady windows graded, 0 above it" in figure
    slow = window(6, "steady", rng.exponential(3.0, 5000))
    met, figure, _ = grade_windows([same, slow], base)
    assert met is False and "#6" in figure


def test_too_few_samples_is_not_decided_never_met() -> None:
    rng = np.random.default_rng(1)
    met, _, why = grade_windows([], rng.exponential(1.0, MIN_SAMPLES_P999 - 1))
    assert met is None and "fewer than" in why
    small = window(3, "steady", rng.exponential(9.0, 500))
    met, _, why = grade_windows([small], rng.exponential(1.0, 20000))
    assert met is None and "no steady window" in why


def sample(fds: int, rss: int, queues: int = 4, workers: int = 8, slot_files: int = 0) -> dict[str, object]:
    return {
        "queues": queues,
        "queues_of_dead": 0,
        "slot_files": slot_files,
        "worker_processes": workers,
        "processes": {
            "10": {"role": "driver", "fds": fds, "rss": 1},
            "11": {"role": "worker", "fds": 9, "rss": rss},
        },
    }


def test_resource_growth_is_caught() -> None:
    ok = grade_resources([sample(20, 100 << 20), sample(21, 101 << 20)], workers=8, queues=4)
    assert all(v[0] is True for v in ok.values()), ok
    leak = grade_resources([sample(20, 100 << 20), sample(40, 200 << 20, slot_files=3)], workers=8, queues=4)
    assert leak["no growth of file descriptors"][0] is False
    assert "largest growth 20" in leak["no growth of file descriptors"][1]
    assert leak["no growth of worker RSS"][0] is False
    assert leak["no growth of segments and slot files"][0] is False
    orphan = grade_resources([sample(20, 1), sample(20, 1, workers=9)], workers=8, queues=4)
    assert orphan["no worker process left over"][0] is False
    one = grade_resources([sample(20, 1)], workers=8, queues=4)
    assert all(v[0] is None for v in one.values())


def test_a_baseline_whose_interval_has_no_upper_end_decides_nothing() -> None:
    """3,495 baseline samples pass the 3,000 floor, but the p99.9's interval then reaches past the
    largest sample: no window can be shown above it, so "met" would be vacuous (a 10-minute run said
    met with the upper bound inf)."""
    rng = np.random.default_rng(2)
    base = rng.exponential(1.0, 3495)
    assert math.isinf(p999_interval(np.sort(base))[2])
    far = window(7, "steady", rng.exponential(50.0, 5000))
    met, _, why = grade_windows([far], base)
    assert met is None and "no upper end" in why
