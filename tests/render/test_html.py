"""HTML reports come from the Jinja2 templates in templates/ (the package's lowtail/render/templates),
autoescaped: a value is text, never markup."""

from __future__ import annotations

import base64
import re
from pathlib import Path

import jinja2
import pytest

from lowtail.render import html

ROOT = Path(__file__).resolve().parents[2]
PNG = b"\x89PNG\r\n\x1a\n" + b"\x00" * 16


def test_values_are_escaped_not_interpreted() -> None:
    page = html.report(
        "host <script>alert(1)</script>",
        [html.Section("s", text="a < b & c", table=html.Table(["k"], [["<b>x</b>"]]))],
        data={"err": "</pre><script>"},
    )
    assert "<script>" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page and "a &lt; b &amp; c" in page
    assert "&lt;b&gt;x&lt;/b&gt;" in page


def test_images_are_embedded_as_the_png_bytes() -> None:
    page = html.report("t", [html.Section("s", images=[html.Image("plot", PNG)])])
    (src,) = re.findall(r'src="data:image/png;base64,([^"]+)"', page)
    assert base64.b64decode(src) == PNG


def test_a_misspelt_template_field_is_an_error_not_an_empty_cell() -> None:
    env = html.environment()
    with pytest.raises(jinja2.UndefinedError):
        env.from_string("{{ hostnme }}").render(hostname="x")


def test_top_level_templates_is_what_the_package_ships() -> None:
    # One set of templates: the repository's templates/ is the package's lowtail/render/templates.
    shipped = Path(html.__file__).parent / "templates"
    assert (ROOT / "templates").resolve() == shipped.resolve()
    assert sorted(p.name for p in shipped.glob("*.j2")) == sorted(html.environment().list_templates())


def test_a_bench_page_opens_with_its_targets_verdict_and_says_what_check_does(tmp_path: Path) -> None:
    from lowtail.benchmarks.report import write_bench_html

    targets = [
        {"target": "p99.9 <= 0.1 ms", "met": False},
        {"target": "ratio >= 2", "met": True},
        {"target": "p99.9 at quick", "met": None, "why": "too few samples"},
    ]
    page = tmp_path / "b.html"
    write_bench_html(str(page), "lowtail bench queue", {"targets": targets}, [])
    text = page.read_text()
    first = text.index("<p>")
    assert text[first:].startswith(
        "<p>result: TARGETS NOT MET (1 NOT MET, 1 met, 1 not decided of 3); the exit status follows the "
        "targets only under --check</p>"
    )
    write_bench_html(str(page), "lowtail bench lanes", {}, [])
    assert "<p>no targets graded: this benchmark measures, it does not judge</p>" in page.read_text()


def test_targets_a_run_did_not_ask_for_are_left_out_of_the_tables_and_counted() -> None:
    from lowtail.benchmarks.queue_bench import tables, targets

    lt = {"n": 10000, "p50_us": 10.0, "p99_us": 20.0, "p999_us": 25.0, "max_us": 90.0}
    report = {"transports": {"lowtail": lt}, "targets": targets({"lowtail": lt}, priority="nice")}
    title, _, rows = tables(report)[-1]
    assert rows == [] and title.startswith("targets (") and "not asked for" in title
    assert all(t["why"] for t in report["targets"])  # the JSON keeps every target, with why


def test_the_fifo_target_is_left_out_at_another_priority_whatever_the_sample_count() -> None:
    """At the default priority a quick run's fifo-only target read 'too few samples' and was listed,
    as if more samples would decide it: it is not this run's to decide at all."""
    from lowtail.benchmarks.queue_bench import tables, targets

    lt = {"n": 300, "p50_us": 10.0, "p99_us": 20.0, "p999_us": 25.0, "max_us": 90.0}
    report = {"transports": {"lowtail": lt}, "targets": targets({"lowtail": lt}, priority="nice")}
    _, _, rows = tables(report)[-1]
    assert not [r for r in rows if "fifo" in r[0]], rows
    fifo = next(t for t in report["targets"] if "fifo" in t["target"])
    assert fifo["met"] is None and fifo["why"] == "decided under --priority fifo only"
    at_fifo = next(t for t in targets({"lowtail": lt}, priority="fifo") if "fifo" in t["target"])
    assert at_fifo["why"].startswith("too few samples"), at_fifo
