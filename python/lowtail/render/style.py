"""Colour for the terminal: on a terminal only, never when piped or when ``NO_COLOR`` is set
(https://no-color.org). Used on whole lines (verdicts), never inside tables, whose widths count
characters."""

from __future__ import annotations

import os
import sys
from typing import TextIO

CODES = {
    "pass": "32",
    "better": "32",
    "warn": "33",
    "not compared": "33",
    "fail": "31",
    "worse": "31",
    "skip": "90",
}


def enabled(stream: TextIO | None = None) -> bool:
    out = stream if stream is not None else sys.stdout
    return "NO_COLOR" not in os.environ and hasattr(out, "isatty") and out.isatty()


def paint(text: str, kind: str, stream: TextIO | None = None) -> str:
    """``text`` in the colour of ``kind`` (a status or a change) when the stream is a terminal."""
    code = CODES.get(kind.lower())
    if code is None or not enabled(stream):
        return text
    return f"\033[1;{code}m{text}\033[0m"
