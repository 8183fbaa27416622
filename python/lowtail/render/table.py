"""Plain-text tables for the terminal; every table a command prints is also available as JSON.

A table fits the terminal (``COLUMNS``, else the terminal's width, else 120 columns when piped): the
widest columns wrap onto more lines, the explanation is never cut.
"""

from __future__ import annotations

import shutil
import textwrap
from collections.abc import Sequence

GAP = 2
MIN_COLUMN = 8  # a column is not wrapped narrower than this (a number or a status word)
MAX_FLOOR = 24  # ... nor narrower than its longest word, up to this (a longer word is broken)


def terminal_width() -> int:
    return shutil.get_terminal_size((120, 24)).columns


def _fit(widths: list[int], floors: list[int], width: int) -> list[int]:
    """Narrow the widest column that may still narrow, one character at a time, until the row fits
    ``width`` or every column is at its floor (its longest word, at least MIN_COLUMN, at most
    MAX_FLOOR): words are not broken, and a table that still does not fit is wide, never cut."""
    out = list(widths)
    while sum(out) + GAP * (len(out) - 1) > width:
        narrowable = [i for i in range(len(out)) if out[i] > floors[i]]
        if not narrowable:
            break
        i = max(narrowable, key=out.__getitem__)
        out[i] -= 1
    return out


def _lines(text: str, width: int) -> list[str]:
    if len(text) <= width:
        return [text]
    return textwrap.wrap(text, width, break_long_words=True, break_on_hyphens=False) or [""]


def render(
    headers: Sequence[str], rows: Sequence[Sequence[object]], title: str = "", width: int | None = None
) -> str:
    """The table, its columns wrapped to fit ``width`` (default: the terminal's width)."""
    cells = [[str(h) for h in headers]] + [["" if v is None else str(v) for v in r] for r in rows]
    natural = [max(len(row[i]) for row in cells) for i in range(len(headers))]

    def longest(i: int) -> int:
        return max((len(word) for row in cells for word in row[i].split()), default=0)

    floors = [min(natural[i], max(MIN_COLUMN, min(longest(i), MAX_FLOOR))) for i in range(len(headers))]
    limit = terminal_width() if width is None else width
    # Headers wrap first ("desched p99.9 ms" over two lines), then the cells of the widest columns.
    data = [max([len(row[i]) for row in cells[1:]] + [floors[i]]) for i in range(len(headers))]
    widths = _fit(_fit(natural, data, limit), floors, limit)
    lines = textwrap.wrap(title, max(limit, 40)) if title else []

    def emit(row: list[str]) -> None:
        wrapped = [_lines(v, w) for v, w in zip(row, widths, strict=True)]
        for k in range(max(len(c) for c in wrapped)):
            parts = [(c[k] if k < len(c) else "").ljust(w) for c, w in zip(wrapped, widths, strict=True)]
            lines.append((" " * GAP).join(parts).rstrip())

    emit(cells[0])
    lines.append((" " * GAP).join("-" * w for w in widths))
    for row in cells[1:]:
        emit(row)
    return "\n".join(lines)
