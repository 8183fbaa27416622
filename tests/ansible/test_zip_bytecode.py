"""The tests' bytecode cache for zip imports (``zip_bytecode/sitecustomize.py``): a module imported from
a zip is compiled once per source and interpreter, a new zip of the same source reuses it under its own
file name, a changed source is compiled again, and the interpreter's own sitecustomize still runs."""

from __future__ import annotations

import marshal
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.ansible.conftest import ZIP_BYTECODE_HOOK

IMPORT = """
import sys, traceback
sys.path.insert(0, sys.argv[1])
import ziplib
try:
    ziplib.fail()
except RuntimeError:
    print(traceback.extract_tb(sys.exc_info()[2])[-1].filename)
print(ziplib.VALUE)
"""


def _zip(path: Path, value: int) -> Path:
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("ziplib.py", f"VALUE = {value}\n\n\ndef fail():\n    raise RuntimeError('from the zip')\n")
    return path


def _import(zip_path: Path, cache: Path) -> list[str]:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ZIP_BYTECODE_HOOK)}
    env["LOWTAIL_TEST_ZIP_BYTECODE"] = str(cache)
    out = subprocess.run(
        [sys.executable, "-c", IMPORT, str(zip_path)], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.split()


def test_a_module_from_a_zip_is_compiled_once_per_source(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    first = _zip(tmp_path / "one.zip", 1)
    assert _import(first, cache) == [f"{first}/ziplib.py", "1"]
    entries = sorted(cache.iterdir())
    assert len(entries) == 1 and not entries[0].name.endswith(".tmp")
    # Another zip of the same source (the next module run): the cached code, under this zip's name.
    second = _zip(tmp_path / "two.zip", 1)
    assert _import(second, cache) == [f"{second}/ziplib.py", "1"]
    assert sorted(cache.iterdir()) == entries
    # ... and it is the cached code that runs: an entry replaced by other code gives the other value.
    entries[0].write_bytes(marshal.dumps(compile("VALUE = 99\ndef fail(): raise RuntimeError", "x", "exec")))
    assert _import(second, cache)[-1] == "99"
    # A changed source is its own entry, never the old code.
    third = _zip(tmp_path / "three.zip", 3)
    assert _import(third, cache) == [f"{third}/ziplib.py", "3"]
    assert len(list(cache.iterdir())) == 2


def test_a_corrupt_entry_is_compiled_again(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    cache.mkdir()
    zip_path = _zip(tmp_path / "one.zip", 7)
    _import(zip_path, cache)
    (entry,) = cache.iterdir()
    for junk in (b"not marshal data", marshal.dumps(42)):  # unreadable, and readable but no code
        entry.write_bytes(junk)
        assert _import(zip_path, cache)[-1] == "7"
        assert entry.read_bytes() != junk  # rewritten whole


def test_without_a_cache_directory_nothing_is_cached(tmp_path: Path) -> None:
    zip_path = _zip(tmp_path / "one.zip", 5)
    assert _import(zip_path, tmp_path / "absent")[-1] == "5"
    assert not (tmp_path / "absent").exists()


def test_the_interpreters_own_sitecustomize_still_runs(tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    (other / "sitecustomize.py").write_text("import builtins\nbuiltins.OTHER_SITECUSTOMIZE = True\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{ZIP_BYTECODE_HOOK}:{other}"}
    code = "import builtins; print(getattr(builtins, 'OTHER_SITECUSTOMIZE', False))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"
