"""benchmarks/callgrind_counts.py, the callgrind scripts' shared part: the note on trees at paths of
different lengths, whose counts differ by malloc's start-up state alone."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]


def _module() -> Any:
    spec = importlib.util.spec_from_file_location(
        "callgrind_counts", REPO / "benchmarks" / "callgrind_counts.py"
    )
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_trees_at_paths_of_different_lengths_are_noted_and_of_one_length_are_not(
    tmp_path: Path, capsys: Any
) -> None:
    cc = _module()
    a, b, longer = tmp_path / "wt-a", tmp_path / "wt-b", tmp_path / "wt-base"
    for d in (a, b, longer):
        d.mkdir()
    cc.warn_unequal_paths([a, b])
    assert capsys.readouterr().err == ""
    cc.warn_unequal_paths([a, longer])
    err = capsys.readouterr().err
    assert f"{a}: {len(str(a))}" in err and f"{longer}: {len(str(longer))}" in err
    assert "one length" in err
