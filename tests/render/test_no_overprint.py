"""Figures say n, unit, limit and the deciding value, and no text overprints another: each figure is
rendered and the boxes of its drawn texts (titles, labels, ticks, legends, annotations) must not meet."""

from __future__ import annotations

import itertools
import random
from typing import Any

import pytest

from lowtail.validation import plots


def _texts(fig: Any) -> list[tuple[str, Any]]:
    from matplotlib.text import Text

    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    out = []
    for t in fig.findobj(Text):
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
