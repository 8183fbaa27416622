"""How much a command says besides its result: ``-q`` (quiet), the default, or ``-v`` (verbose).

- quiet: the result (tables, verdict) and errors only: no progress bar, no info lines ("JSON report:
  FILE"), log records of level ERROR and above;
- default: the progress bar and info lines; log records of level WARNING and above;
- verbose: also DEBUG records of the ``lowtail`` loggers: the commands a probe runs, the processes and
  options it starts.

``configure`` is called once per command by ``lowtail.cli.main``; library code asks ``quiet()`` or logs
through ``logging.getLogger(__name__)``, and never prints its own notes. Log records go to stderr; on a
terminal each first clears the progress bar's line, so a record and the bar never share a line (the bar
is drawn again at its next update).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import Any, TextIO

QUIET, NORMAL, VERBOSE = -1, 0, 1
_LEVELS = {QUIET: logging.ERROR, NORMAL: logging.WARNING, VERBOSE: logging.DEBUG}


class _State:
    verbosity = NORMAL


class _StderrHandler(logging.StreamHandler):  # type: ignore[type-arg]
    """Writes to whatever ``sys.stderr`` is now (a test's capture, a redirected stream)."""

    def __init__(self) -> None:
        super().__init__(sys.stderr)
        self.setFormatter(logging.Formatter("%(levelname)s %(name)s: %(message)s"))

    def emit(self, record: logging.LogRecord) -> None:
        # Assigned, not setStream(): that flushes the stream it replaces, which may be closed by now
        # (a finished test's capture, a host program's old stderr) and would fail this record.
        self.stream = sys.stderr
        if sys.stderr.isatty():
            sys.stderr.write("\r\x1b[K")  # erase the progress bar's line first
        super().emit(record)


_handler = _StderrHandler()


def configure(verbosity: int) -> None:
    """Set the verbosity for this process (QUIET, NORMAL or VERBOSE) and the ``lowtail`` loggers' level."""
    if verbosity not in _LEVELS:
        raise ValueError(f"verbosity {verbosity!r}: expected one of {sorted(_LEVELS)}")
    _State.verbosity = verbosity
    # The level sits on the handler: the loggers keep inheriting (a host program's or a test's own
    # handlers see what they saw), except that -v lets lowtail's DEBUG records be made at all.
    _handler.setLevel(_LEVELS[verbosity])
    root = logging.getLogger("lowtail")
    root.setLevel(logging.DEBUG if verbosity == VERBOSE else logging.NOTSET)
    if _handler not in root.handlers:
        root.addHandler(_handler)


def verbosity() -> int:
    return _State.verbosity


def quiet() -> bool:
    return _State.verbosity == QUIET


def info(text: str, stream: TextIO | None = None) -> None:
    """A note beside the result ("JSON report: FILE"): printed unless quiet (stdout by default)."""
    if not quiet():
        print(text, file=stream if stream is not None else sys.stdout, flush=True)


# The output options every command shares (lowtail.options: --json, --plot, --html, --junit), with the
# name its note gives the file.
OUTPUTS = (("json", "JSON report"), ("plot", "PNG plot"), ("png", "PNG plot"), ("html", "HTML report"),
           ("junit", "JUnit report"))  # fmt: skip


def wrote(args: Any) -> None:
    """One note per output file the command wrote ("JSON report: FILE"), to stdout, or to stderr when
    ``--json -`` keeps stdout for the JSON; a file not written (an interrupted run) gets no note."""
    stream = sys.stderr if getattr(args, "json", None) == "-" else sys.stdout
    seen = set()
    for dest, what in OUTPUTS:
        path = getattr(args, dest, None)
        if isinstance(path, str) and path != "-" and path not in seen and os.path.isfile(path):
            seen.add(path)
            info(f"{what}: {path}", stream)
