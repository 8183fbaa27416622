"""``lowtail bench NAME``: side-by-side benchmarks, discovered from ``lowtail.benchmarks``.

A module in ``lowtail.benchmarks`` whose ``register(subparsers)`` calls ``add_parser("NAME", help=...)``
adds ``lowtail bench NAME``. The modules import numpy, the queue and OpenVINO at the top, so they are
imported only when one of their benchmarks is chosen: until then each benchmark is a placeholder whose
name and help are read from the module's source (not imported), and ``lowtail --help`` stays fast.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import pkgutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from lowtail import benchmarks
from lowtail.render import console

SUFFIX = "_bench"


def _declared(path: Path) -> list[tuple[str, str]]:
    """(name, help) of each ``add_parser("NAME", help=...)`` in the module's ``register`` (its source)."""
    tree = ast.parse(path.read_text())
    register = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "register"), None)
    found = []
    for node in ast.walk(register) if register is not None else ():
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_parser"
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
        ):
            text = next(
                (
                    k.value.value
                    for k in node.keywords
                    if k.arg == "help" and isinstance(k.value, ast.Constant)
                ),
                "",
            )
            found.append((node.args[0].value, str(text)))
    return found


def _noting(run: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    """The benchmark's run, then a note naming each file it wrote ("JSON report: FILE"), once here for
    every benchmark."""

    def run_and_note(args: argparse.Namespace) -> int:
        code = run(args)
        console.wrote(args)
        return code

    return run_and_note


class _LazyBenchmarks(argparse._SubParsersAction):  # type: ignore[type-arg]
    """Imports a benchmark's module and lets it register its real parsers when one of them is chosen."""

    modules: dict[str, str]  # benchmark name -> module name

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        assert isinstance(values, list) and values
        module = self.modules.get(values[0])
        if module is not None and getattr(self.choices[values[0]], "lowtail_placeholder", False):
            names = {n for n, m in self.modules.items() if m == module}
            for name in names:
                del self.choices[name]
            self._choices_actions = [a for a in self._choices_actions if a.dest not in names]
            importlib.import_module(f"{benchmarks.__name__}.{module}").register(self)
            missing = names - set(self.choices)
            if missing:
                raise RuntimeError(f"{module}.register() did not add the benchmarks {sorted(missing)}")
            for name in names:
                chosen = self.choices[name]
                chosen.set_defaults(
                    command_name=chosen.prog, command_parser=chosen, func=_noting(chosen.get_default("func"))
                )
        super().__call__(parser, namespace, values, option_string)


def register(sub: Any) -> None:
    p = sub.add_parser("bench", help="compare designs side by side (table, JSON, plot)")
    p.register("action", "lazy_parsers", _LazyBenchmarks)
    bench_sub = p.add_subparsers(dest="bench", required=True, metavar="BENCHMARK", action="lazy_parsers")
    bench_sub.modules = {}
    root = Path(benchmarks.__path__[0])
    for info in sorted(pkgutil.iter_modules(benchmarks.__path__), key=lambda m: m.name):
        for name, text in _declared(root / f"{info.name}.py"):
            bench_sub.modules[name] = info.name
            placeholder = bench_sub.add_parser(name, help=text, add_help=False)
            placeholder.lowtail_placeholder = True
