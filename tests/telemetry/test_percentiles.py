"""The package's one percentile definition (nearest rank) and the modules that must use it."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from lowtail.benchmarks import queue_bench
from lowtail.serve import call_stats as metrics
from lowtail.telemetry import export
from lowtail.telemetry.percentiles import Percentiles, quantile, quantiles, rank
from lowtail.validation import check


def test_nearest_rank_reports_an_observed_value_never_an_interpolation() -> None:
    # Two samples: an interpolating p50 would be 5.0, which nobody measured.
    assert quantiles([0.0, 10.0], [0.5]) == [0.0]
    assert quantiles([0.0, 10.0], [0.51]) == [10.0]


def test_p999_of_1000_samples_is_the_second_largest() -> None:
    values = list(range(1, 1001))
    p = Percentiles.of(values)
    assert (p.n, p.p50, p.p99, p.p999, p.max) == (1000, 500.0, 990.0, 999.0, 1000.0)


def test_rank_is_not_shifted_by_binary_floating_point() -> None:
    # 0.7 * 10 == 7.000000000000001: a bare ceil() would report the 8th value as the 70th percentile.
    assert rank(10, 0.7) == 6
    assert quantile([float(v) for v in range(1, 11)], 0.7) == 7.0


@pytest.mark.parametrize("q", [-0.1, 1.5, math.nan])
def test_rank_refuses_a_quantile_outside_0_1(q: float) -> None:
    with pytest.raises(ValueError, match="expected a quantile between 0 and 1"):
        rank(10, q)


def test_empty_series_has_a_count_of_zero_and_nan_statistics() -> None:
    p = Percentiles.of([])
    assert p.n == 0 and math.isnan(p.p999)


@given(st.lists(st.floats(-1e6, 1e6), min_size=1, max_size=300), st.sampled_from(check.LADDER))
def test_definition_equals_numpy_inverted_cdf(values: list[float], q: float) -> None:
    assert quantiles(values, [q]) == [float(np.quantile(values, q, method="inverted_cdf"))]


def test_every_report_and_benchmark_uses_the_one_definition() -> None:
    # Samples where an interpolating percentile differs from nearest rank at p50, p99 and p99.9.
    values = [float(v) for v in range(1, 102)] + [1e6]
    want = Percentiles.of(values)
    assert export.WindowStats.of(values) == want
    assert metrics.percentiles(values) == want
    stats = check.tail_stats(values)
    assert (stats["p50"], stats["p99"], stats["p999"]) == (want.p50, want.p99, want.p999)
    bench = queue_bench.percentiles(np.asarray(values))
    assert (bench["p50_us"], bench["p99_us"], bench["p999_us"]) == (want.p50, want.p99, want.p999)
