"""Only ``lowtail.serve.openvino_core`` makes an ``ov.Core``: a second one in a process can leave its
threads' alternate signal stack unmapped, and the next Ctrl-C kills it with SIGSEGV (see that module)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAKER = ROOT / "python/lowtail/serve/openvino_core.py"
CORE_CALL = re.compile(r"\b(?:ov|openvino)\.Core\s*\(|\bfrom openvino import\b[^\n]*\bCore\b")


def test_no_other_file_makes_an_openvino_core() -> None:
    found = []
    for top in ("python", "tests", "benchmarks", "scripts", "roles", "molecule"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if path in (MAKER, Path(__file__).resolve()):
                continue
            found += [f"{path.relative_to(ROOT)}:{m.group(0)}" for m in CORE_CALL.finditer(path.read_text())]
    assert found == [], "make the core with lowtail.serve.openvino_core.shared_core():\n" + "\n".join(found)


def test_the_pattern_sees_the_spellings_it_forbids() -> None:
    for call in ("ov.Core()", "openvino.Core( )", "from openvino import Core, Type"):
        assert CORE_CALL.search(call), call
    assert not CORE_CALL.search("shared_core().compile_model(x)")
