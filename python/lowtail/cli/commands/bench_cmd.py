"""``lowtail bench NAME``: side-by-side benchmarks, discovered from ``lowtail.benchmarks``.

A benchmark module ``<name>_bench`` with a ``register(subparsers)`` function adds ``lowtail bench <name>``.
The modules import numpy, the queue and OpenVINO at the top, so they are imported only when their
benchmark is chosen: until then each one is a placeholder whose help is its docstring's first line
(read from the source, not imported), and ``lowtail --help`` stays fast.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import pkgutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from lowtail import benchmarks

SUFFIX = "_bench"


def _summary(path: Path) -> str:
    """The docstring's first line without its ``lowtail bench NAME``: prefix."""
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    first = doc.strip().splitlines()[0] if doc.strip() else ""
    return first.split(": ", 1)[1] if first.startswith("``lowtail bench") and ": " in first else first


class _LazyBenchmarks(argparse._SubParsersAction):  # type: ignore[type-arg]
    """Imports a benchmark's module and lets it register its real parser when the name is parsed."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        assert isinstance(values, list) and values
        name = values[0]
        if name in self.choices and getattr(self.choices[name], "lowtail_placeholder", False):
            del self.choices[name]
            self._choices_actions = [a for a in self._choices_actions if a.dest != name]
            importlib.import_module(f"{benchmarks.__name__}.{name}{SUFFIX}").register(self)
            if name not in self.choices:
                raise RuntimeError(f"{name}{SUFFIX}.register() did not add a benchmark named {name!r}")
            self.choices[name].set_defaults(command_name=self.choices[name].prog)
        super().__call__(parser, namespace, values, option_string)


def register(sub: Any) -> None:
    p = sub.add_parser("bench", help="compare designs side by side (table, JSON, plot)")
    p.register("action", "lazy_parsers", _LazyBenchmarks)
    bench_sub = p.add_subparsers(dest="bench", required=True, metavar="BENCHMARK", action="lazy_parsers")
    root = Path(benchmarks.__path__[0])
    for info in sorted(pkgutil.iter_modules(benchmarks.__path__), key=lambda m: m.name):
        path = root / f"{info.name}.py"
        if not info.name.endswith(SUFFIX) or "\ndef register(" not in path.read_text():
            continue
        name = info.name.removesuffix(SUFFIX)
        placeholder = bench_sub.add_parser(name, help=_summary(path), add_help=False)
        placeholder.lowtail_placeholder = True
