"""``lowtail shm ls`` and ``lowtail shm gc``: lowtail's shared-memory segments and their owners."""

from __future__ import annotations

import argparse
import os
import pwd
from typing import Any

from lowtail.errors import UsageError
from lowtail.options import add_json, json_to_stdout, write_json
from lowtail.render import console, table
from lowtail.render.schema import stamp
from lowtail.shm import segments


def register(sub: Any) -> None:
    p = sub.add_parser("shm", help="list lowtail shared-memory segments, remove those of dead owners")
    shm_sub = p.add_subparsers(dest="shm_command", required=True, metavar="ACTION")
    ls = shm_sub.add_parser("ls", help="segments with owner pid, liveness, size and mode")
    gc = shm_sub.add_parser("gc", help="unlink segments whose owner process is dead")
    gc.add_argument("--dry-run", action="store_true", help="only list what would be removed")
    for q in (ls, gc):
        q.add_argument("--dir", default=segments.SHM_DIR, help="shared-memory directory")
        add_json(q, "the segments")
    ls.set_defaults(func=run_ls)
    gc.set_defaults(func=run_gc)


def _check_dir(path: str) -> None:
    if not os.path.isdir(path):
        raise UsageError(f"--dir {path!r} is not a directory; expected a tmpfs such as /dev/shm")


def human_bytes(n: int) -> str:
    """4096 -> '4 KiB', 25165824 -> '24 MiB' (binary units, as tmpfs sizes are given); exact in the JSON."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" or value >= 100 else f"{value:.3g} {unit}"
        value /= 1024
    return f"{n} B"


def _mode(text: str) -> str:
    """'0o600' -> '0600', as ls and chmod write it."""
    try:
        return f"{int(text, 8):04o}"
    except ValueError:
        return text


def _user(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _flags(s: segments.SegmentInfo) -> str:
    return f"FOREIGN: {s.foreign}" if s.foreign else ""


def _rows(infos: list[segments.SegmentInfo]) -> list[list[object]]:
    return [
        [s.name, s.kind, s.pid, s.liveness, human_bytes(s.size), _mode(s.mode), _user(s.uid), _flags(s)]
        for s in infos
    ]


HEADERS = ["segment", "kind", "owner pid", "owner", "size", "mode", "user", "flags"]


def run_ls(args: argparse.Namespace) -> int:
    _check_dir(args.dir)
    found = segments.scan(args.dir)
    infos = found.segments
    if not json_to_stdout(args):  # the table first: a file that cannot be written never hides it
        title = f"lowtail segments in {found.dir}: {len(infos)}"
        if found.ignored:
            title += f" ({found.ignored} other entries ignored)"
        print(table.render(HEADERS, _rows(infos), title=title))
    write_json(
        args.json,
        {
            **stamp("shm.ls"),
            "dir": found.dir,
            "segments": [s.to_dict() for s in infos],
            "ignored_entries": found.ignored,
        },
    )
    console.wrote(args)
    return 0


def run_gc(args: argparse.Namespace) -> int:
    _check_dir(args.dir)
    removed = segments.sweep_dead(args.dir, dry_run=args.dry_run)
    if not json_to_stdout(args):
        verb = "would remove" if args.dry_run else "removed"
        print(table.render(HEADERS, _rows(removed), title=f"{verb} {len(removed)} segment(s) of dead owners"))
    write_json(
        args.json,
        {
            **stamp("shm.gc"),
            "dir": args.dir,
            "dry_run": args.dry_run,
            "removed": [s.to_dict() for s in removed],
        },
    )
    console.wrote(args)
    return 0
