"""``lowtail bench NAME``: side-by-side benchmarks, discovered from ``lowtail.benchmarks``."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Any

from lowtail import benchmarks


def register(sub: Any) -> None:
    p = sub.add_parser("bench", help="compare designs side by side (table, JSON, plot)")
    bench_sub = p.add_subparsers(dest="bench", required=True, metavar="BENCHMARK")
    for info in sorted(pkgutil.iter_modules(benchmarks.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"{benchmarks.__name__}.{info.name}")
        if hasattr(module, "register"):
            module.register(bench_sub)
