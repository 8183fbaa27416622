"""The validate and compare HTML pages render through the shared Jinja2 templates, autoescaped."""

from __future__ import annotations

import re
from typing import Any

import jinja2
import pytest

from lowtail.render import html
from lowtail.validation import compare, report
from lowtail.validation.check import Check, Status
from lowtail.validation.runner import Report, summarize

SCRIPT = "<script>alert(1)</script>"
ESCAPED = "&lt;script&gt;alert(1)&lt;/script&gt;"


def _report(hostname: str, evidence: list[str]) -> Report:
    checks = [
        Check("rt_budget", Status.FAIL, 500000, "950000", evidence, reason="sched_rt_runtime_us=500000"),
        Check("thp", Status.PASS, "never", "never", ["/sys/kernel/mm/transparent_hugepage/enabled: never"]),
        Check("steal", Status.SKIP, reason="no steal counter", kind="probe"),
    ]
    host = {"hostname": hostname, "kernel": "6.1.0", "versions": {"lowtail": "0"}, "plan": {"omitted": True}}
    return Report(host=host, checks=checks, summary=summarize(checks, frozenset({1}), 0.5))


def test_evidence_with_markup_is_escaped_in_the_validate_page() -> None:
    page = report.render_html(_report(f"node{SCRIPT}", [f"grub says {SCRIPT}", "second line"]))
    assert SCRIPT not in page
    assert f"<li>grub says {ESCAPED}</li>" in page
    assert f"<title>lowtail validate: node{ESCAPED}</title>" in page


def test_validate_page_keeps_status_colours_checks_and_host() -> None:
    page = report.render_html(_report("node-a", ["e1", "e2"]))
    assert page.startswith("<!doctype html>")
    fail, passed = report.STATUS_COLOR["fail"], report.STATUS_COLOR["pass"]
    assert f".status {{ font-size: 1.6em; color: {fail};" in page  # the verdict in the failing colour
    assert '<p class="status">FAIL</p>' in page and "1 pass, 0 warn, 1 fail, 1 skip; probe CPUs 1" in page
    assert f'<td>rt_budget</td><td style="color:{fail};font-weight:bold">FAIL</td>' in page
    assert f'<td>thp</td><td style="color:{passed};font-weight:bold">PASS</td>' in page
    assert "<td>sched_rt_runtime_us=500000<details>" in page  # the why: a failure's reason
    assert "<li>e1</li><li>e2</li>" in page
    assert "<p>no probe ran</p>" in page  # no probe ran, so no plots
    assert "<tr><th>kernel</th><td>6.1.0</td></tr>" in page
    assert "<tr><th>versions.lowtail</th><td>0</td></tr>" in page  # a table, not a Python or JSON repr
    assert "omitted" not in page  # the plan is in the JSON, not the page
    assert "p99.9 deschedule" not in page  # no headline without a deschedule probe


def test_validate_page_puts_the_headline_against_the_predecessors_figure() -> None:
    r = _report("node-a", [])
    head = {"p999_deschedule_ms": 0.02, "cpu": 3, "n": 1000, "max_ms": 0.05, "status": "pass"}
    r.summary["headline"] = head
    page = report.render_html(r)
    assert (
        '<p class="head">headline: p99.9 deschedule 0.02 ms on CPU 3 (n=1000, max 0.05 ms); the predecessor '
        "system: 400-470 ms on VMware with sched_rt_runtime_us=500000, 0.02 ms at 950000</p>"
    ) in page


def _doc(hostname: str, status: str, value: float, extra: list[dict[str, Any]]) -> dict[str, Any]:
    checks = [{"name": "timer", "kind": "probe", "status": status, "value": value, "unit": "ms"}, *extra]
    return {"host": {"hostname": hostname}, "checks": checks, "summary": {"status": status}}


def test_compare_page_escapes_hosts_colours_each_side_and_words_each_change() -> None:
    before = _doc(f"vm{SCRIPT}", "fail", 2.0, [{"name": "thp", "status": "warn", "value": "madvise"}])
    after = _doc("metal", "pass", 0.5, [])
    cmp = compare.compare(before, after)
    page = compare.render_html(before, after, cmp)
    assert SCRIPT not in page and f"before: vm{ESCAPED} (fail)" in page
    assert '<p class="head">headline p99.9 deschedule: not measured in both reports</p>' in page
    verdict = (
        "result: INCOMPLETE, nothing compared got worse but 2 checks were not compared (timer max, thp); "
        "1 better (exit 3)"
    )
    assert f'<p class="verdict">{verdict}</p>' in page
    assert '<p class="warning">warning: host differ: before' in page  # vm... vs metal
    fail, passed, absent = (compare.STATUS_COLOR[s] for s in ("fail", "pass", "absent"))
    better = compare.CHANGE_COLOR["better"]
    assert re.search(
        rf'<tr class="changed"><td>timer</td><td style="color:{fail};font-weight:bold">FAIL</td><td>2 ms</td>'
        rf'<td style="color:{passed};font-weight:bold">PASS</td><td>0.5 ms</td>'
        rf'<td style="color:{better}"><b>better</b>: fail -&gt; pass; the before report has no interval',
        page,
    )
    assert f'<td style="color:{absent};font-weight:bold">ABSENT</td>' in page  # thp is only in before
    assert "<b>not compared</b>: only in the before report" in page
    assert page.count("<img ") == 1  # the probe bars; no deschedule ladders to compare
    assert "timer (value)" in page or "lower is better" in page  # each bar says what it shows


def test_a_missing_template_field_is_an_error_not_an_empty_cell() -> None:
    with pytest.raises(jinja2.UndefinedError, match="change_colors"):
        html.render("compare.html.j2", title="t")


def _failing_cyclictest() -> Check:
    """cyclictest's own JSON from a 2-vCPU KVM guest (a 400 us histogram and overflows beyond it), graded
    under a limit its maximum exceeds."""
    import json
    from pathlib import Path

    from lowtail.validation import rttests
    from lowtail.validation.check import Limits

    doc = json.loads((Path(__file__).parent / "data/cyclictest-kvm-2vcpu.json").read_text())
    check = rttests._grade("cyclictest", doc, rttests.parse_cyclictest(doc), Limits(0.05, 0.2))
    check.histograms = rttests.histograms(doc)
    return check


def test_the_failing_cyclictest_plot_runs_to_the_maximum_and_marks_it() -> None:
    from lowtail.validation import plots

    check = _failing_cyclictest()
    assert check.status is Status.FAIL
    peak = check.value  # cyclictest is graded on the maximum: 20 ms, far beyond its 0.4 ms histogram
    assert peak > 0.4
    series = check.histograms[1]
    assert sum(c for _, c in series) == check.data["per_cpu"]["1"]["n"]  # overflows counted, at the max
    fig = plots.histogram_figure("t", check.histograms, (0.05, 0.2), ("max", peak))
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert ax.get_xlim()[1] > peak  # the axis reaches past the value the check fails on
    texts = [t.get_text() for t in ax.texts]
    assert f"max {peak:.4g} ms (CPU 1)" in texts
    assert {"pass <= 0.05 ms", "warn <= 0.2 ms"} <= {t.get_text() for t in ax.get_legend().get_texts()}
    import matplotlib.pyplot as plt

    plt.close(fig)


def test_the_validate_page_shows_failures_first_and_each_plot_with_n_and_its_graded_figure() -> None:
    check = _failing_cyclictest()
    checks = [Check("thp", Status.PASS, "never", "never", ["never"]), check]
    r = Report(host={"hostname": "kvm"}, checks=checks, summary=summarize(checks, frozenset({1}), 1.0))
    page = report.render_html(r)
    attention = page.index("<h2>Needs attention</h2>")
    assert attention < page.index("<h2>Plots</h2>") < page.index("<h2>All checks</h2>")
    n = check.data["per_cpu"]["1"]["n"]
    caption = f"cyclictest: FAIL, graded on the worst CPU&#39;s max = {check.value:.4g} ms; n={n}"
    assert f"<figcaption>{caption}</figcaption>" in page
    assert f"max {check.value:.4g} ms on CPU 1 (n={n})" in page[attention:]
    assert "Fix: find what shares the CPU" in page
