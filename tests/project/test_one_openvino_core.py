"""Only ``lowtail.serve.openvino_core`` makes an ``ov.Core``: a second one in a process can leave its
threads' alternate signal stack unmapped, and the next Ctrl-C kills it with SIGSEGV (see that module).

Read from each file's syntax tree, so an alias, a multi-line import or a bound name is seen too:
``openvino.compile_model`` makes a core of its own on every call and counts as a maker. A name got
by ``getattr`` with a string is not seen.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
MAKER = ROOT / "python/lowtail/serve/openvino_core.py"
MAKERS = {"Core", "compile_model"}  # openvino's names that make a core
TOPS = (
    "python",
    "tests",
    "benchmarks",
    "scripts",
    "roles",
    "molecule",
    "library",
    "module_utils",
    "filter_plugins",
)


def core_makers(source: str) -> list[str]:
    """Where ``source`` names an OpenVINO core maker: ``line: what``."""
    tree = ast.parse(source)
    aliases = set()  # names bound to openvino or one of its modules
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            aliases |= {
                (a.asname or a.name).split(".")[0] for a in node.names if a.name.startswith("openvino")
            }
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("openvino"):
            found += [
                f"{node.lineno}: from {node.module} import {a.name}" for a in node.names if a.name in MAKERS
            ]
            aliases |= {a.asname or a.name for a in node.names if a.name not in MAKERS}
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr in MAKERS:
            base = node.value
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in aliases:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(found)


def test_no_other_file_makes_an_openvino_core() -> None:
    found = []
    for top in TOPS:
        for path in sorted((ROOT / top).rglob("*.py")):
            if path != MAKER:
                found += [f"{path.relative_to(ROOT)}:{hit}" for hit in core_makers(path.read_text())]
    assert found == [], "make the core with lowtail.serve.openvino_core.shared_core():\n" + "\n".join(found)


def test_the_check_sees_the_spellings_it_forbids() -> None:
    for source in (
        "import openvino as ov\nov.Core()",
        "import openvino\nopenvino.Core()",
        "import openvino as OV\nmake = OV.Core",
        "import openvino.runtime as ovr\novr.Core()",
        "import openvino\nopenvino.runtime.Core()",
        "import openvino as ov\nov.compile_model('m.xml')",
        "from openvino import Type, Core",
        "from openvino import (\n    Type,\n    compile_model,\n)",
        "from openvino.runtime import Core as C",
        "from openvino import runtime\nruntime.Core()",
    ):
        assert core_makers(source), source
    for source in (
        "from lowtail.serve.openvino_core import shared_core\nshared_core().compile_model('m.xml')",
        "import openvino as ov\nov.Type.f32  # a Core comment",
        "class Core: ...\nCore()",
    ):
        assert not core_makers(source), source
