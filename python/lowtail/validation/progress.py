"""A progress bar on stderr for long probes. On a terminal it redraws one line; otherwise it prints a
line when a phase starts and ends, so logs (Ansible, CI) stay readable."""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    def __init__(self, label: str, total: float, stream: TextIO | None = None, enabled: bool = True) -> None:
        self.label = label
        self.total = max(total, 1e-9)
        self.stream = stream if stream is not None else sys.stderr
        self.enabled = enabled
        self.tty = enabled and self.stream.isatty()
        self.done = 0.0
        self.t0 = time.monotonic()
        self._last_draw = 0.0
        if enabled and not self.tty:
            self.stream.write(f"{label}: running\n")
            self.stream.flush()

    def update(self, done: float) -> None:
        self.done = min(done, self.total)
        if not self.tty:
            return
        now = time.monotonic()
        if now - self._last_draw < 0.1 and self.done < self.total:
            return
        self._last_draw = now
        frac = self.done / self.total
        width = 30
        bar = "#" * int(frac * width) + "." * (width - int(frac * width))
        self.stream.write(f"\r{self.label:<28} [{bar}] {frac:4.0%} {now - self.t0:5.1f}s")
        self.stream.flush()

    def finish(self, note: str = "") -> None:
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.t0
        if self.tty:
            self.update(self.total)
            self.stream.write(f"  {note}\n" if note else "\n")
        else:
            self.stream.write(f"{self.label}: done in {elapsed:.1f}s{'  ' + note if note else ''}\n")
        self.stream.flush()
