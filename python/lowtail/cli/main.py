"""The ``lowtail`` command: it parses the arguments, calls the library, and renders the result.

Subcommands live in ``lowtail.cli.commands``: every module there with a ``register(subparsers)`` function
adds its own, so a new command is a new file rather than an edit here. Registering must stay cheap
(standard library only): command modules import numpy, OpenVINO or Ray inside the function that runs the
command, so ``lowtail --help`` and ``--version`` start in a fraction of a second.
"""

from __future__ import annotations

import argparse
import importlib
import os
import pkgutil
import sys
from collections.abc import Sequence

from lowtail import __version__
from lowtail.cli import commands
from lowtail.errors import LowtailError, UsageError
from lowtail.node.process import end_resource_tracker
from lowtail.options import Parser, verbosity

__all__ = ["UsageError", "build_parser", "main"]  # UsageError: kept importable from here


def _label_subcommands(parser: argparse.ArgumentParser) -> None:
    """Give every (sub)parser's namespace its full name ("lowtail bench queue") for error messages."""
    parser.set_defaults(command_name=parser.prog, command_parser=parser)
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                _label_subcommands(sub)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="lowtail", description=__doc__.splitlines()[0])
    parser.add_argument("--version", action="version", version=f"lowtail {__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    for info in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{commands.__name__}.{info.name}")
        register = getattr(module, "register", None)
        if register is not None:
            register(sub)
    _label_subcommands(parser)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    if list(sys.argv[1:] if argv is None else argv) == ["--version"]:
        print(f"lowtail {__version__}")  # without importing a single command module
        return 0
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # reported by the subcommand that was given them, with its usage
        args.command_parser.error(f"unrecognized arguments: {' '.join(unknown)}")
    from lowtail.render import console

    console.configure(verbosity(args))
    if console.quiet() and hasattr(args, "no_progress"):
        args.no_progress = True  # commands that gate their notes on --no-progress are quiet too
    try:
        return int(args.func(args) or 0)
    except LowtailError as e:
        print(f"{args.command_name}: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `lowtail ... | head`: the reader left; no traceback (Python docs, SIGPIPE)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    finally:
        end_resource_tracker()  # the command's spawned children are stopped: none of its own is left


if __name__ == "__main__":
    sys.exit(main())
