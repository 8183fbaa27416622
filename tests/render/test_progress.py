"""The one progress bar: what it writes on a terminal, in a log, and with --no-progress."""

from __future__ import annotations

import io

from lowtail.render.progress import Progress


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_terminal_bar_redraws_one_line_and_ends_it() -> None:
    out = Tty()
    bar = Progress("probe", 4, stream=out)
    bar.update(4, "n=4")
    bar.finish()
    text = out.getvalue()
    assert text.startswith("\rprobe") and text.endswith("\n") and text.count("\n") == 1
    assert "[" + "#" * 30 + "]" in text and "n=4" in text


def test_log_gets_a_start_and_an_end_line_not_a_redraw() -> None:
    out = io.StringIO()
    bar = Progress("probe", 10, stream=out, log_every_s=3600)
    for i in range(10):
        bar.update(i + 1)
    bar.finish("ok")
    lines = out.getvalue().splitlines()
    assert lines[0] == "probe: running"
    assert lines[1].startswith("probe: done in ") and lines[1].endswith("ok") and len(lines) == 2
    assert "\r" not in out.getvalue()


def test_finish_twice_writes_once() -> None:
    out = io.StringIO()
    bar = Progress("probe", 1, stream=out)
    bar.finish()
    bar.finish()
    assert out.getvalue().count("done in") == 1


def test_disabled_bar_writes_nothing() -> None:
    out = Tty()
    bar = Progress("probe", 1, stream=out, enabled=False)
    bar.update(1)
    bar.finish("x")
    assert out.getvalue() == ""


def test_the_bar_shows_the_remaining_time_once_some_is_done() -> None:
    import io

    from lowtail.render.progress import Progress

    bar = Progress("probe", 100, stream=io.StringIO())
    bar.t0 -= 10.0  # ten seconds in
    bar.done = 25
    assert " ETA   30s" in bar.line()  # 25% in 10 s: 30 s to go
    bar.done = 0
    assert "ETA" not in bar.line()  # nothing done yet: no estimate
