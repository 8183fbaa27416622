"""How ``lowtail bench soak`` grades (no processes): quantile intervals, the steady windows' tails
against the baseline (met, not met, and each way of "not decided"), the report's verdict first, and
resource growth."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lowtail.benchmarks.soak_bench import (
    TAIL_TARGET,
    Window,
    grade_resources,
    grade_windows,
    headline,
    min_samples,
    plot,
    quantile_interval,
    render,
    summarize_window,
    write_html,
)


def test_the_interval_brackets_the_quantile_and_is_open_when_too_few_samples() -> None:
    xs = np.arange(1, 10001, dtype=float)
    q, lo, hi = quantile_interval(xs)
    assert q == 9990.0 and lo < q < hi <= 10000.0
    _, _, hi_small = quantile_interval(np.arange(1, 501, dtype=float))
    assert math.isinf(hi_small)  # 500 samples cannot bound a p99.9 from above
    assert (min_samples(0.999), min_samples(0.99)) == (10_000, 1_000)


def window(index: int, kind: str, xs: np.ndarray) -> dict[str, Any]:
    return summarize_window(Window(index, kind, 0.0, 1.0, latencies_ms=list(xs)), [])


def run(
    base: list[np.ndarray], steady: list[np.ndarray]
) -> tuple[dict[str, Any], list[dict[str, Any]], np.ndarray]:
    windows = [window(i + 1, "baseline", xs) for i, xs in enumerate(base)]
    windows += [window(len(base) + 2 * i + 2, "steady", xs) for i, xs in enumerate(steady)]
    pooled = np.concatenate(base) if base else np.empty(0)
    return grade_windows(windows, pooled), windows, pooled


rng = np.random.default_rng(0)


def exp(scale_ms: float, n: int) -> np.ndarray:
    return rng.exponential(scale_ms, n)


def test_windows_as_the_baseline_are_met_at_p99_when_too_small_for_a_p999() -> None:
    # the soak's default windows: ~3,400 samples, 3 above a p99.9, 34 above a p99
    g, _, _ = run([exp(10, 3400) for _ in range(4)], [exp(10, 3400) for _ in range(3)])
    assert g["met"] is True and g["percentile"] == "p99", g
    assert (
        "graded at p99 (not p99.9" in g["figure"]
        and "3 of 3 steady windows graded, 0 above it" in g["figure"]
    )


def test_a_window_with_a_worse_tail_is_not_met_and_named() -> None:
    g, _, _ = run([exp(10, 3400) for _ in range(4)], [exp(10, 3400), exp(30, 3400)])
    assert g["met"] is False and "1 above it (#8 " in g["figure"], g


def test_windows_large_enough_are_graded_at_p999() -> None:
    base = [exp(10, 12_000) for _ in range(2)]
    g, _, _ = run(base, [exp(10, 12_000)])
    assert g["met"] is True and g["percentile"] == "p99.9" and "(not p99.9" not in g["figure"], g
    g, _, _ = run(base, [exp(10, 12_000), exp(25, 12_000)])
    assert g["met"] is False and g["percentile"] == "p99.9", g


def test_a_baseline_too_small_to_read_is_not_decided() -> None:
    g, _, _ = run([exp(10, 600) for _ in range(4)], [exp(100, 5000)])
    assert g["met"] is None and "fewer than two with the 1,000 samples a p99 needs" in g["why"], g
    g, _, _ = run([exp(10, 5000)], [exp(100, 5000)])  # one window: its spread cannot be read
    assert g["met"] is None and "fewer than two" in g["why"], g


def test_a_baseline_whose_windows_disagree_is_not_decided() -> None:
    """A host that moves 5x between fault-free windows: pooled, the baseline's bound sits high and a
    window 3x worse than the quiet part would pass as "met"."""
    base = [exp(10, 3400), exp(10, 3400), exp(50, 3400), exp(50, 3400)]
    g, _, _ = run(base, [exp(30, 3400)])
    assert g["met"] is None and "the baseline's own windows disagree at p99" in g["why"], g
    assert g["bound_ms"] is None


def test_a_starved_baseline_is_not_decided() -> None:
    """The last Python 10-minute run: its baseline p99.9 was 1,364 ms, its clients more than a second
    late; nothing could be shown above it, and the old grading said "met"."""
    base = [np.minimum(exp(300, 3400), 1200.0) + 2 for _ in range(4)]
    g, _, _ = run(base, [np.minimum(exp(400, 3400), 1200.0) for _ in range(3)])
    assert g["met"] is None and "reaches the 1 s after which a late client skips sends" in g["why"], g


def test_no_steady_window_large_enough_is_not_decided() -> None:
    g, _, _ = run([exp(10, 3400) for _ in range(4)], [exp(90, 500), exp(90, 900)])
    assert g["met"] is None and "no steady window with the 1,000 samples a p99 needs" in g["why"], g
    assert g["bound_ms"] is not None


def report_of(g: dict[str, Any], windows: list[dict[str, Any]]) -> dict[str, Any]:
    hard = {"target": "no answer is another request's", "met": True, "figure": "0 wrong", "why": ""}
    tail = {"target": TAIL_TARGET, "met": g["met"], "figure": g["figure"], "why": g["why"]}
    return {
        "verdict": "passed",
        "steady_tails": g,
        "targets": [hard, tail],
        "outcomes": {"answered": 10},
        "errors": {},
        "cut_by_client_kill": 0,
        "claimed_by_killed_workers": 0,
        "sends_skipped_by_late_clients": 0,
        "windows": windows,
        "faults": [{"kind": "worker", "at_s": 5.5, "window": 5}],
        "settings": {"minutes": 1},
        "host": {"load_before": [1.0, 1.0, 1.0], "load_after": [1.0, 1.0, 1.0], "cpus": 2},
        "path": "python",
    }


@pytest.mark.parametrize(
    ("steady_scale", "word"), [(10, "met"), (30, "NOT MET"), (None, "not decided: no steady window")]
)
def test_the_tails_verdict_comes_first_in_text_html_and_plot(
    tmp_path: Path, steady_scale: float | None, word: str
) -> None:
    steady = [exp(steady_scale, 3400)] if steady_scale else [exp(10, 200)]
    g, windows, _ = run([exp(10, 3400) for _ in range(4)], steady)
    report = report_of(g, windows)
    first = render(report).splitlines()[0]
    assert first == headline(report) and first.startswith("soak: PASSED; hard targets 1 of 1 met")
    assert first.split("steady windows' tails")[1].split(": ", 1)[1].startswith(word), first
    html = tmp_path / "soak.html"
    write_html(str(html), report)
    page = html.read_text()
    assert page.index(headline(report).split(";")[0]) < page.index("Targets") < page.index("Windows")
    png = tmp_path / "soak.png"
    plot(report, str(png))
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert json.loads(json.dumps(report))["steady_tails"]["met"] is g["met"]


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
