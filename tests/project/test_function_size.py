"""No function of the product grows past MAX_LINES: a long one is split into named stages, each with one job.

The few that stay longer are listed in ALLOWED, each with its length today as a ceiling and the reason it
may stay: an entry may shrink or be deleted, never grow, and a new long function fails here, so the
number of long functions can only go down. Lengths count from the ``def`` line to the function's last line
(decorators not included); a nested function is measured on its own and also counts in its parent.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# What ships or runs on a node (the package, the Ansible modules and filters) and the experiments kept
# beside it; tests are not counted.
SOURCES = ("python/lowtail", "library", "module_utils", "filter_plugins", "benchmarks")
MAX_LINES = 60

HOT_PATH = "hot path: reads top to bottom in one place, one call fewer per request"
# "path::qualname": (ceiling in lines, why it may be this long).
ALLOWED: dict[str, tuple[int, str]] = {
    "python/lowtail/shm/client.py::QueueClient._park": (81, HOT_PATH),
    "python/lowtail/shm/server.py::QueueWorker._poll": (82, HOT_PATH),
    "python/lowtail/serve/call_recorder.py::CallRecorder.record": (71, HOT_PATH),
    "python/lowtail/serve/worker_main.py::_serve_batches": (106, HOT_PATH),
    "python/lowtail/shm/payload.py::decode_header": (62, "one bounded parse of a header from shared memory"),
    "python/lowtail/benchmarks/queue_bench.py::register": (62, "an argparse option table, read in order"),
}


def _functions(tree: ast.AST, prefix: str = "") -> list[tuple[str, int, int]]:
    """(qualname, first line, length) of every function in ``tree``, nested ones included."""
    out = []
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.ClassDef):
            out += _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert node.end_lineno is not None
            out.append((prefix + node.name, node.lineno, node.end_lineno - node.lineno + 1))
            out += _functions(node, f"{prefix}{node.name}.")
    return out


def function_lengths() -> dict[str, tuple[int, int]]:
    """``path::qualname`` -> (first line, length) for every function under SOURCES."""
    found = {}
    for top in SOURCES:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            for name, line, length in _functions(ast.parse(path.read_text(), filename=rel)):
                found[f"{rel}::{name}"] = (line, length)
    return found


def test_no_function_grows_past_the_limit_or_its_ceiling() -> None:
    found = function_lengths()
    assert len(found) > 1000, f"only {len(found)} functions under {SOURCES}: is ROOT {ROOT} the repository?"
    too_long = []
    for key, (line, length) in sorted(found.items()):
        ceiling, _ = ALLOWED.get(key, (MAX_LINES, ""))
        if length > ceiling:
            path, name = key.split("::")
            listed = f"its ceiling in ALLOWED is {ceiling}" if key in ALLOWED else f"the limit is {MAX_LINES}"
            too_long.append(f"{path}:{line} {name} is {length} lines; {listed}")
    assert not too_long, "split these into named stages, each with one job:\n" + "\n".join(too_long)


def test_every_allowed_entry_says_why_and_stays_short_of_a_free_pass() -> None:
    for key, (ceiling, reason) in ALLOWED.items():
        assert "::" in key and (ROOT / key.split("::")[0]).is_file(), f"{key}: no such file"
        assert ceiling > MAX_LINES, f"{key}: a ceiling of {ceiling} is within the limit; delete the entry"
        assert reason.strip(), f"{key}: an entry says why the function may stay long"
    assert len(ALLOWED) <= 20, f"{len(ALLOWED)} entries: the allow-list is for exceptions"


def test_the_measure_counts_from_def_to_last_line_and_sees_nested_and_methods() -> None:
    src = "class A:\n    def m(self):\n        def inner():\n            return 1\n\n        return inner()\n"
    assert _functions(ast.parse(src)) == [("A.m", 2, 5), ("A.m.inner", 3, 2)]
