"""The ``lowtail`` command. Thin: it parses, calls the library, and renders.

Subcommands live in ``lowtail.cli.commands``: every module there with a ``register(subparsers)`` function
adds its own, so a new command is a new file rather than an edit here.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

from lowtail import __version__
from lowtail.cli import commands
from lowtail.errors import LowtailError


class UsageError(LowtailError):
    """Bad input from the command line: exit status 2 with the message."""

    exit_code = 2


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lowtail", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"lowtail {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except LowtailError as e:
        print(f"lowtail {args.command}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
