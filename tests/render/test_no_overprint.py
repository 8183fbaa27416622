"""Figures say n, unit, limit and the deciding value, and no text overprints another: each figure is
rendered and the boxes of its drawn texts (titles, labels, ticks, legends, annotations) must not meet."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from lowtail.validation import plots


def _texts(fig: Any) -> list[tuple[str, Any]]:
    """The texts a draw of ``fig`` really draws (a tick label outside the view limits exists, with a
    stale position, but is never drawn), with their boxes."""
    from matplotlib.text import Text

    drawn: dict[int, Any] = {}
    draw = Text.draw

    def record(self: Any, renderer: Any) -> Any:
        drawn[id(self)] = self
        return draw(self, renderer)

    Text.draw = record  # type: ignore[method-assign]
    try:
        fig.canvas.draw()
    finally:
        Text.draw = draw  # type: ignore[method-assign]
    renderer = fig.canvas.get_renderer()
    out = []
    for t in drawn.values():
        if t.get_visible() and t.get_text().strip() and t.get_figure() is not None:
            box = t.get_window_extent(renderer)
            if box.width > 0 and box.height > 0:
                out.append((t.get_text(), box))
    return out


def overprints(fig: Any) -> list[tuple[str, str]]:
    """Pairs of drawn texts whose boxes overlap by more than a pixel each way."""
    texts = _texts(fig)
    bad = []
    for (a, ba), (b, bb) in itertools.combinations(texts, 2):
        w = min(ba.x1, bb.x1) - max(ba.x0, bb.x0)
        h = min(ba.y1, bb.y1) - max(ba.y0, bb.y0)
        if w > 1 and h > 1:
            bad.append((a, b))
    return bad


@pytest.fixture
def drawn(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The figures the plots module would have turned into PNGs, kept open to inspect."""
    figs: list[Any] = []
    monkeypatch.setattr(plots, "_png", lambda fig: figs.append(fig) or b"")
    yield figs
    import matplotlib.pyplot as plt

    for f in figs:
        plt.close(f)


def _all_text(fig: Any) -> str:
    return " ".join(t for t, _ in _texts(fig))


def test_the_overprint_check_catches_two_labels_at_one_place(drawn: list[Any]) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    ax.annotate("before max 4.05 ms", xy=(0.5, 0.5))
    ax.annotate("after max 4.10 ms", xy=(0.5, 0.5))
    assert overprints(fig) == [("before max 4.05 ms", "after max 4.10 ms")]
    plt.close(fig)


def test_compare_cdf_names_both_maxima_with_n_and_draws_the_limits_without_overprinting(
    drawn: list[Any],
) -> None:
    ladder = [[0.5, 0.01], [0.9, 0.02], [0.99, 0.05], [0.999, 4.05], [1.0, 9.1]]
    after = [[0.5, 0.01], [0.9, 0.02], [0.99, 0.05], [0.999, 4.10], [1.0, 9.2]]  # maxima side by side
    plots.ladder_compare(ladder, after, "deschedule CDF", n=(3000, 3000), limits=(0.1, 1.0))
    (fig,) = drawn
    assert overprints(fig) == []
    text = _all_text(fig)
    assert "before: n=3,000, max 9.1 ms" in text and "after: n=3,000, max 9.2 ms" in text
    assert "pass <= 0.1 ms" in text and "warn <= 1 ms" in text and "latency (ms, log)" in text


def test_heat_strip_colours_a_failing_cell_by_its_limit_and_labels_it(drawn: list[Any]) -> None:
    rows = {"deschedule p99.9": {1: 0.02, 2: 4.0, 3: 0.03}, "cyclictest max": {1: 0.01, 2: 0.02, 3: 0.5}}
    limits = {"deschedule p99.9": (0.1, 1.0), "cyclictest max": (0.05, 0.2)}
    plots.heat_strip(rows, "per-CPU tail (ms)", limits=limits)
    (fig,) = drawn
    assert overprints(fig) == []
    text = _all_text(fig)
    assert (
        "4" in text.split() and "pass 0.1" in text and "warn 1" in text and "(ms, log colour scale)" in text
    )
    # The failing cell is at the top of its scale, the passing ones low: the scale spans the limits.
    image = fig.axes[0].images[0]
    norm = image.norm
    assert norm(4.0) > 0.8 and norm(0.02) < 0.4


def test_one_cpu_on_its_own_gets_a_scale_that_still_spans_the_limits(drawn: list[Any]) -> None:
    plots.heat_strip({"deschedule p99.9": {1: 4.0, 2: 3.9}}, "t", limits={"deschedule p99.9": (0.1, 1.0)})
    norm = drawn[0].axes[0].images[0].norm
    assert norm.vmin <= 0.05 and norm(4.0) > 0.8  # was 4..40 ms: a failing 4 ms drawn as "low"


def test_the_validate_histogram_has_n_limits_and_the_graded_value_without_overprinting(
    drawn: list[Any],
) -> None:
    rng = random.Random(1)
    series = {1: [(0.01 + rng.expovariate(100), 1) for _ in range(3000)]}
    title = "deschedule: PASS, graded on the worst CPU's p99.9 = 0.07 ms; max 0.1 ms; n=3000"
    fig = plots.histogram_figure(title, series, (0.1, 1.0), ("p99.9", 0.07))
    assert overprints(fig) == []
    text = _all_text(fig)
    assert "cpu1 (n=3000)" in text and "pass <= 0.1 ms" in text and "graded p99.9 0.07 ms" in text
    assert "latency (ms, log)" in text


# ---- the bench figures: built inside plot() from a run's results, kept open here to inspect ---------


@pytest.fixture
def kept(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The figures a bench's plot() closes after saving its PNG, kept open instead."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figs: list[Any] = []
    close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: figs.append(fig))
    yield figs
    for f in figs:
        close(f)


def _serve_results() -> list[Any]:
    from lowtail.benchmarks.serve_run import DesignResult
    from lowtail.serve.call_stats import percentiles

    rng = random.Random(7)

    def lat(base: float, n: int) -> Any:
        return percentiles([base * (1 + rng.expovariate(4)) for _ in range(n)])

    def breakdown() -> dict[str, Any]:
        return {k: percentiles([2.0 + rng.random() for _ in range(50)]) for k in serve_breakdown()}

    bare = DesignResult("bare", 0, 16, samples_per_s=20_000.0, latency_ms=lat(0.8, 4000))
    served = [
        DesignResult("served", n, 16, samples_per_s=19_500.0 - 300 * n, latency_ms=lat(0.9, 4000),
                     ratio_to_bare=0.97, breakdown_us=breakdown(), overhead_us_mean=12.0)
        for n in (2, 4)
    ]  # fmt: skip
    traffic = DesignResult("traffic", 16, 1, samples_per_s=17_000.0, latency_ms=lat(1.1, 3000),
                           ratio_to_bare=0.85, breakdown_us=breakdown(), overhead_us_mean=15.0,
                           limits={"batches": 0.95, "worker": 1.2, "full_batches": 0.9})  # fmt: skip
    return [bare, *served, traffic]


def serve_breakdown() -> tuple[str, ...]:
    from lowtail.benchmarks.serve_run import BREAKDOWN

    return BREAKDOWN


def test_bench_serve_figure_states_n_and_its_reference_lines_without_overprinting(kept: list[Any]) -> None:
    from lowtail.benchmarks import serve_report

    results = _serve_results()
    serve_report.plot(results)
    (fig,) = kept
    assert overprints(fig) == []
    text = _all_text(fig)
    assert "n=3,000-4,000 per bar group" in text and "ms per call / request" in text
    latency = fig.axes[1]
    lines = {line.get_label(): line for line in latency.get_lines()}
    floor = next(v for k, v in lines.items() if k.startswith("bare p50"))
    assert floor.get_ydata()[0] == pytest.approx(results[0].latency_ms.p50)  # the floor drawn where it is
    assert "no latency target" in latency.get_title()
    assert "target 20 us" in text and "95% of bare" in text


def test_bench_queue_figure_states_n_and_unit_without_overprinting(kept: list[Any]) -> None:
    import numpy as np

    from lowtail.benchmarks import queue_bench

    rng = np.random.default_rng(3)
    samples = {
        name: rng.pareto(3.0, 3000) * scale + scale
        for name, scale in (
            ("lowtail", 20.0),
            ("iceoryx2_busy", 18.0),
            ("mp_pipe", 600.0),
            ("ray_actor", 5000.0),
        )
    }
    fair = {
        "clients": 4,
        "per_client": [
            {"client": i, "answered": 900 + i, "wait_p50_us": 30.0 + i, "wait_p999_us": 400.0 + 50 * i}
            for i in range(4)
        ],
    }
    workload = {"request": "obs: float32[16, 512] (32 KiB)", "response": "logits: float32[16, 64] (4 KiB)",
                "client_cpu": 0, "worker_cpu": 1}  # fmt: skip
    queue_bench.plot(samples, {"workload": workload, "fairness": fair})
    (fig,) = kept
    assert overprints(fig) == []
    text = _all_text(fig)
    assert "lowtail (n=3000)" in text and "round trip (us)" in text and "µs" not in text
