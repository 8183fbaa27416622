"""The command line's one convention, shared by every command (``lowtail <command> --help`` shows it).

It sits at the package root, not in ``lowtail.cli``: the benchmark commands register their own subcommands
and use it too, and library code never imports the CLI.

- ``--json FILE`` writes the command's result as JSON; ``-`` writes it to standard output instead of the
  tables (nothing else goes to stdout then). Every table a command prints is also in its JSON.
- ``--plot FILE`` (PNG) and ``--html FILE`` write a plot and a self-contained report.
- ``--seconds`` is a duration, ``--samples`` a sample count, ``--no-progress`` turns off the progress bar.
- Output paths are checked while the arguments are parsed, before any work: a directory that does not
  exist or cannot be written is a usage error (exit 2) at once, not a traceback after a long probe.
- Defaults are shown in ``--help``.
- ``-q``/``--quiet`` and ``-v``/``--verbose`` on every parser (``lowtail -q validate`` and
  ``lowtail validate -q`` alike): only the result and errors, or also debug logging of what runs
  (``lowtail.render.console``).

Standard library only: the parser is built for ``lowtail --help``, which must not import numpy.
"""

from __future__ import annotations

import argparse
import difflib
import json
import math
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from lowtail.errors import LowtailError

STDOUT = "-"


class HelpFormatter(argparse.HelpFormatter):
    """Shows ``(default: X)`` after an option's help unless the default is empty, off or already said."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        default = action.default
        if (
            "%(default)" in text
            or "default" in text.lower()
            or default is None
            or default is False  # a store_true flag: "(default: False)" says nothing
            or default == argparse.SUPPRESS
            or not action.option_strings
        ):
            return text
        return text + " (default: %(default)s)"


class Parser(argparse.ArgumentParser):
    """Every lowtail parser and subparser: defaults in --help and -q/-v (subparsers inherit this class)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)
        add_verbosity(self)

    def error(self, message: str) -> NoReturn:
        # A mistyped command or choice gets the nearest real one, as git's "did you mean" does
        # (argparse learns it only in Python 3.14).
        hit = _INVALID_CHOICE.search(message)
        if hit is not None:
            near = difflib.get_close_matches(hit["given"], _CHOICE.findall(hit["choices"]), n=1, cutoff=0.6)
            if near:
                message += f"; did you mean {near[0]!r}?"
        super().error(message)


_INVALID_CHOICE = re.compile(r"invalid choice: '(?P<given>[^']*)' \(choose from (?P<choices>.*)\)")
_CHOICE = re.compile(r"'([^']*)'")


QUIET, VERBOSE = -1, 1  # the values of lowtail.render.console (not imported: it is not needed for --help)


def add_verbosity(p: argparse.ArgumentParser) -> None:
    """``-q``/``-v``. No default: a subcommand's parser must not reset what ``lowtail -q CMD`` set (argparse
    copies every attribute of a subparser's namespace over the parent's); ``verbosity(args)`` reads it."""
    group = p.add_mutually_exclusive_group()
    group.add_argument(
        "-q",
        "--quiet",
        dest="verbosity",
        action="store_const",
        const=QUIET,
        default=argparse.SUPPRESS,
        help="print only the result and errors: no progress bar, no notes",
    )
    group.add_argument(
        "-v",
        "--verbose",
        dest="verbosity",
        action="store_const",
        const=VERBOSE,
        default=argparse.SUPPRESS,
        help="also log what runs (probe commands, processes started, their options) to stderr",
    )


def verbosity(args: argparse.Namespace) -> int:
    """-1 quiet, 0 the default, 1 verbose."""
    return int(getattr(args, "verbosity", 0))


class OutputError(LowtailError):
    """An output file that could not be written after the work was done (the result was printed)."""

    exit_code = 2


def _writable(path: Path) -> str:
    """ "" when ``path`` can be written, else why not. Opens it for writing (without truncating) or, for a
    new file, creates and removes it: permission bits, read-only mounts and pseudo filesystems (/proc,
    /sys) all answer the one way that counts, even for root."""
    if path.is_dir():
        return "is a directory; expected a file name"
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        return f"{str(parent)!r} {'is not a directory' if parent.exists() else 'does not exist'}"
    exists = path.exists()
    try:
        if exists:
            os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC))
        else:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644))
            path.unlink()
    except OSError as e:
        return f"cannot be written ({'opening' if exists else 'creating'} it failed: {e.strerror})"
    return ""


def output_path(allow_stdout: bool = False) -> Callable[[str], str]:
    """An argparse type: a file that can be written (checked while parsing, before any work)."""

    def check(text: str) -> str:
        if text == STDOUT:
            if allow_stdout:
                return text
            raise argparse.ArgumentTypeError("'-' (standard output) is only accepted by --json")
        why = _writable(Path(text))
        if why:
            raise argparse.ArgumentTypeError(f"{text!r}: {why}")
        return text

    check.lowtail_output = True  # type: ignore[attr-defined]  # tests find every output option by it
    return check


def output_dir() -> Callable[[str], str]:
    """An argparse type: a directory that exists and can be written, or can be created in its parent."""

    def check(text: str) -> str:
        path = Path(text)
        probe = path if path.is_dir() else path.parent if str(path.parent) else Path(".")
        if path.exists() and not path.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r} is a file; expected a directory")
        if not probe.is_dir():
            raise argparse.ArgumentTypeError(f"{text!r}: {str(probe)!r} does not exist")
        why = _writable(probe / f".lowtail-write-test-{os.getpid()}")
        if why:
            raise argparse.ArgumentTypeError(f"{text!r}: {str(probe)!r} {why}")
        return text

    check.lowtail_output = True  # type: ignore[attr-defined]
    return check


def positive(kind: type[int] | type[float]) -> Callable[[str], Any]:
    """An argparse type: a positive, finite int or float."""

    def parse(text: str) -> Any:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r}: expected a positive {kind.__name__}") from None
        if value <= 0 or not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text!r}: expected a positive {kind.__name__}")
        return value

    parse.__name__ = kind.__name__  # argparse names the type in its "invalid ... value" message
    return parse


def add_json(p: argparse.ArgumentParser, what: str = "the result") -> None:
    p.add_argument(
        "--json",
        metavar="FILE",
        type=output_path(allow_stdout=True),
        help=f"write {what} as JSON to FILE; '-' prints it to stdout instead of the tables",
    )


def add_plot(
    p: argparse.ArgumentParser, what: str = "the latency distributions", old: str = "", dest: str = "plot"
) -> None:
    """``--plot FILE``; ``old`` keeps a former name (``--png``) working as an alias."""
    names = ["--plot", old] if old else ["--plot"]
    p.add_argument(*names, dest=dest, metavar="FILE", type=output_path(), help=f"write a PNG plot of {what}")


def add_html(p: argparse.ArgumentParser, what: str = "a report with the tables and plots") -> None:
    p.add_argument("--html", metavar="FILE", type=output_path(), help=f"write {what} as one HTML file")


def add_no_progress(p: argparse.ArgumentParser) -> None:
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")


def json_to_stdout(args: argparse.Namespace) -> bool:
    """True when ``--json -`` asked for JSON on stdout (then tables are not printed)."""
    return getattr(args, "json", None) == STDOUT


def write_json(target: str | None, doc: Any) -> None:
    """Write ``doc`` to the ``--json`` target: a file, or stdout for ``-``; nothing for None."""
    if target is None:
        return
    text = json.dumps(doc, indent=2) + "\n"
    if target == STDOUT:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        write_text(target, text)


def write_text(path: str, text: str | bytes) -> None:
    """Write an output file; a failure now (disk full, a path removed meanwhile) names the file."""
    try:
        if isinstance(text, bytes):
            Path(path).write_bytes(text)
        else:
            Path(path).write_text(text)
    except OSError as e:
        raise OutputError(f"cannot write {path}: {e.strerror or e}") from None
