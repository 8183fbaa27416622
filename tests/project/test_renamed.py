"""A renamed module's old name is the same module object, with a DeprecationWarning naming the new one."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

from lowtail.renamed import RENAMED


@pytest.mark.parametrize(("old", "new"), sorted(RENAMED.items()))
def test_an_old_module_name_is_the_new_module_and_warns(old: str, new: str) -> None:
    code = (
        "import importlib, warnings\n"
        "warnings.simplefilter('error', DeprecationWarning)\n"
        f"try:\n    importlib.import_module({old!r})\nexcept DeprecationWarning as e:\n    print(e)\n"
        "warnings.simplefilter('ignore', DeprecationWarning)\n"
        f"print(importlib.import_module({old!r}) is importlib.import_module({new!r}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True
    )
    lines = out.stdout.splitlines()
    assert lines[0] == f"{old} is renamed {new}; the old name will be removed in the next release"
    assert lines[-1] == "True"


def test_no_file_is_left_at_an_old_name() -> None:
    for old in RENAMED:
        parent, _, leaf = old.rpartition(".")
        assert importlib.util.find_spec(f"{parent}.{leaf}").loader.__class__.__name__ == "_RenamedFinder"
