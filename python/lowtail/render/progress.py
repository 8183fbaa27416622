"""The package's one progress bar, on stderr, for every long operation (probes, demo, benchmarks).

On a terminal it redraws one line (at most 10 times a second). Otherwise (Ansible, CI, a pipe) it writes
a line when the phase starts, one every ``log_every_s`` seconds, and one when it ends, so logs stay short
and readable. ``enabled=False`` (the commands' ``--no-progress``) or ``-q`` (``lowtail.render.console``)
writes nothing at all.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO

from lowtail.render import console

WIDTH = 30


class Progress:
    def __init__(
        self,
        label: str,
        total: float,
        stream: TextIO | None = None,
        enabled: bool = True,
        log_every_s: float = 10.0,
    ) -> None:
        self.label = label
        self.total = max(total, 1e-9)
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled and not console.quiet()
        self.tty = self.enabled and self.stream.isatty()
        self.log_every_s = log_every_s
        self.done = 0.0
        self.note = ""
        self.t0 = time.monotonic()
        self._last_draw = self.t0
        self._finished = False
        if self.enabled and not self.tty:
            self._write(f"{label}: running\n")

    def _write(self, text: str) -> None:
        self.stream.write(text)
        self.stream.flush()

    def line(self) -> str:
        """The bar as text: label, bar, fraction, elapsed seconds and the caller's note."""
        frac = self.done / self.total
        filled = int(frac * WIDTH)
        elapsed = time.monotonic() - self.t0
        note = f"  {self.note}" if self.note else ""
        # The remaining time where the total is known and some of it is done (a linear estimate).
        eta = f" ETA {elapsed * (1 - frac) / frac:4.0f}s" if 0.02 <= frac < 1 else ""
        bar = "#" * filled + "." * (WIDTH - filled)
        return f"{self.label:<28} [{bar}] {frac:4.0%} {elapsed:5.1f}s{eta}{note}"

    def update(self, done: float, note: str = "") -> None:
        """Progress so far, in the unit of ``total``; ``note`` is shown after the bar (counts, rates)."""
        self.done = min(max(done, 0.0), self.total)
        self.note = note
        if not self.enabled or self._finished:
            return
        now = time.monotonic()
        if self.tty:
            if now - self._last_draw >= 0.1 or self.done >= self.total:
                self._last_draw = now
                self._write("\r" + self.line())
        elif now - self._last_draw >= self.log_every_s:
            self._last_draw = now
            self._write(self.line() + "\n")

    def phase(self, done: float, note: str) -> None:
        """A new step begins (``note`` names it): redrawn on a terminal, one line in a log."""
        if self.enabled and not self.tty and not self._finished and note != self.note:
            self.done, self.note = min(max(done, 0.0), self.total), note
            self._last_draw = time.monotonic()
            self._write(self.line() + "\n")
            return
        self.update(done, note)

    def finish(self, note: str = "") -> None:
        """End the bar once (later calls do nothing); ``note`` replaces the running note."""
        if not self.enabled or self._finished:
            return
        self._finished = True
        if note:
            self.note = note
        if self.tty:
            self.done = self.total
            self._write("\r" + self.line() + "\n")
        else:
            elapsed = time.monotonic() - self.t0
            self._write(f"{self.label}: done in {elapsed:.1f}s{'  ' + self.note if self.note else ''}\n")
