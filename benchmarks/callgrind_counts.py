"""What the callgrind scripts here share: the checks of their common options, the functions a count
spends most in, and the rows printed and saved (``worker-instructions.py``, ``queue-instructions.py``,
``sampler-instructions.py``)."""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any


def common_options(ap: argparse.ArgumentParser) -> None:
    """--tree, --paths, --top and --json, as every script here reads them."""
    ap.add_argument(
        "--tree", type=Path, action="append", help="a source tree (repeatable; default: this one)"
    )
    ap.add_argument("--paths", default="python,native", help="the queue's paths (default: python,native)")
    ap.add_argument("--top", type=int, default=0, help="print the K functions with most instructions")
    ap.add_argument("--json", type=Path, help="also write the rows as JSON here")


def warn_unequal_paths(trees: list[Path]) -> None:
    """Say so when the trees compared sit at paths of different lengths: the interpreter's start-up
    allocates those paths, glibc's malloc state differs with their lengths, and the same tree counted
    from /work/main (10 characters) read 0.2-0.5% fewer instructions per round trip than from
    /work/wt-old or /work/wt-new (12) or /work/wt-base (13)
    (``_int_malloc``; docs/benchmarks.md, "The twelfth step"). Length is a heuristic, not the whole
    cause (a path of 8 characters read level with one of 12): worktrees with names of one length
    compare like for like."""
    lengths = {len(str(t)) for t in trees}  # as the measured process is given them (tree / "python")
    if len(lengths) > 1:
        print(
            "note: the trees' paths differ in length ("
            + ", ".join(f"{t}: {len(str(t))}" for t in trees)
            + "); malloc's state after start-up differs with them, up to about 0.5% of a round trip's count: "
            "put the trees in worktrees whose paths have one length to compare them",
            file=sys.stderr,
        )


def paths_to_count(text: str) -> list[str]:
    """The queue paths of ``--paths`` (python, native), valgrind being there; SystemExit naming what is
    wrong otherwise."""
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed: apt-get install valgrind")
    paths = [p.strip() for p in text.split(",") if p.strip()]
    if not paths or set(paths) - {"python", "native"}:
        raise SystemExit(f"--paths {text!r}: expected a subset of python,native")
    return paths


def path_env(path: str) -> dict[str, str]:
    """This process's environment with the queue's path chosen: ``LOWTAIL_PURE_PYTHON=1`` for python."""
    env = {k: v for k, v in os.environ.items() if k != "LOWTAIL_PURE_PYTHON"}
    return env | ({"LOWTAIL_PURE_PYTHON": "1"} if path == "python" else {})


def top_functions(callgrind_file: str | Path, per: int, k: int) -> list[tuple[int, str]]:
    """The ``k`` functions with most instructions (exclusive) in a callgrind file, divided by ``per``."""
    ann = subprocess.run(
        ["callgrind_annotate", "--threshold=100", str(callgrind_file)],
        capture_output=True,
        text=True,
        check=False,
    )
    top = []
    for line in ann.stdout.splitlines():
        m = re.match(r"\s*([\d,]+) \([^)]*\)\s+(\S.*)$", line)
        if m and "PROGRAM TOTALS" not in line:
            top.append((int(m.group(1).replace(",", "")) // per, m.group(2)[:110]))
    return top[:k]


def show(
    rows: list[dict[str, Any]],
    line: Callable[[dict[str, Any]], str],
    schema: str,
    out: Path | None,
    fields: dict[str, Any] | None = None,
) -> None:
    """Each row's line and its top functions; the rows as JSON into ``out`` under ``schema``, after
    ``fields`` (what counted them, say)."""
    for r in rows:
        print(line(r))
        for n, fn in r["top"]:
            print(f"  {n:>9,}  {fn}")
    if out:
        out.write_text(json.dumps({"schema": schema, **(fields or {}), "rows": rows}, indent=2) + "\n")
