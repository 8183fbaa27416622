"""``lowtail bench failover`` grades only what its samplers' runs covered (no Ray: the report's logic).

A kill can land late in a sampler run (Ray runs the kill call seconds after its plan): counting the time
after the run's last step as a gap would show all samplers "stalled" 1-3 s on a quiet host while every
one of them was answered within 40 ms until its run ended.
"""

from __future__ import annotations

import numpy as np

from lowtail.benchmarks.failover_bench import (
    TARGET_GAP_MS,
    WINDOW_AFTER_S,
    WINDOW_BEFORE_S,
    Report,
    Row,
    gap_ms,
    judge,
    render,
    window,
)

STANDBY_TARGET = "standby: no sampler's gap > 50 ms for any hero (worker kill)"


def test_the_window_is_cut_to_the_run() -> None:
    at = 100.0
    assert window(at, 90.0, 110.0) == (at - WINDOW_BEFORE_S, at + WINDOW_AFTER_S)
    assert window(at, 99.9, 101.0) == (99.9, 101.0)  # started late, ended early: its own span
    assert window(at, 90.0, 99.0) == (at - WINDOW_BEFORE_S, at)  # ended before the kill: nothing after


def test_a_run_that_ends_after_the_kill_shows_no_gap_after_its_end() -> None:
    at, ended = 100.0, 101.0
    answers = np.arange(at - 1.0, ended, 0.02)  # answered every 20 ms until the run's end
    lo, hi = window(at, 90.0, ended)
    assert gap_ms(answers, lo, hi) < 25.0
    # A fixed window closing 3 s after the kill would count the 2 s after the run's end as a stall.
    assert gap_ms(answers, at - WINDOW_BEFORE_S, at + WINDOW_AFTER_S) > 1900.0


def rows(covered_after_s: float, gap: float = 30.0) -> list[Row]:
    return [
        Row("standby", "worker", f"s{i}", f"hero {h}", gap, 100, 0, covered_after_s)
        for i in range(3)
        for h in "ab"
    ]


def test_a_gap_target_is_graded_on_covered_windows_and_not_decided_otherwise() -> None:
    met = Report(rows=rows(WINDOW_AFTER_S))
    judge(met)
    assert met.targets[STANDBY_TARGET] is True
    missed = Report(rows=rows(WINDOW_AFTER_S, gap=TARGET_GAP_MS + 1))
    judge(missed)
    assert missed.targets[STANDBY_TARGET] is False
    cut = Report(rows=rows(WINDOW_AFTER_S)[:-1] + rows(0.8)[-1:])
    judge(cut)
    assert cut.targets[STANDBY_TARGET] is None
    assert "ended 0.80 s after the kill" in cut.undecided[STANDBY_TARGET]
    text = render(cut)
    assert "not decided: a sampler's run ended 0.80 s after the kill" in text
    assert "s after kill" in text  # the coverage of every row is shown


def test_rows_around_a_kill_give_each_hero_each_replica_of_a_and_the_first_answer_after_it() -> None:
    from types import SimpleNamespace

    from lowtail.benchmarks.failover_bench import Kill, _rows_around

    at = 100.0
    t = np.arange(99.0, 104.0, 0.01)  # an answer every 10 ms ...
    replica = np.where(t < at, 0, 1)  # ... from a.0 until the kill, from a.1 after it
    replica[t > at + 0.25] = np.where(np.arange((t > at + 0.25).sum()) % 2 == 0, 0, 1)  # a.0 back at +250 ms
    sent = t - 0.001
    a = SimpleNamespace(answer_s=t, replica=replica, sent_s=sent, failed=0, errors={})
    b = SimpleNamespace(
        answer_s=t[::2], replica=np.zeros(t[::2].size, int), sent_s=sent[::2], failed=0, errors={}
    )
    run = SimpleNamespace(name="s0", started_s=98.0, ended_s=at + 2.0, heroes={"a": a, "b": b})
    out: list[Row] = []
    first_ms = _rows_around(Kill("standby", "worker", at, claimed=1), [run], out)
    assert [r.series for r in out] == ["hero a", "replica a.0", "replica a.1", "hero b"]
    assert {r.sampler for r in out} == {"s0"} and {r.config for r in out} == {"standby"}
    assert all(r.covered_after_s == 2.0 for r in out)  # the run ended 2 s after the kill
    by = {r.series: r for r in out}
    assert by["hero a"].longest_gap_ms < 15 and by["hero b"].longest_gap_ms < 25
    assert 250 <= by["replica a.0"].longest_gap_ms < 270  # a.0 silent from the kill until it serves again
    assert 250 < first_ms < 270  # the killed replica's first answer published after the kill
