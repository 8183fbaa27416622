"""Every OFD lock the product takes or tests names its byte (``lowtail.shm.layout``: ``WORKER_LOCK_BYTE``,
``client_lock_byte(lane)``), never a number or sum typed at the call: the bytes are the queue's protocol,
and a worker that locks 1 + lane where the client locks ``client_lock_byte(lane)`` would judge the wrong
lane alive the day the layout changes. Read from the syntax tree of every module of the package.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "python/lowtail"
LOCK_CALLS = {"held", "try_lock", "lock", "unlock"}  # lowtail.shm.ofd_lock's, the byte second


def typed_bytes(source: str) -> list[str]:
    """Where ``source`` passes an ``ofd_lock`` call a byte that is not a name or a call: ``line: code``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        owner = node.func.value
        if not (isinstance(owner, ast.Name) and owner.id == "ofd_lock" and node.func.attr in LOCK_CALLS):
            continue
        if len(node.args) >= 2 and not isinstance(node.args[1], ast.Name | ast.Call | ast.Attribute):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_check_sees_numbers_and_sums_and_passes_names() -> None:
    assert typed_bytes("ofd_lock.held(fd, 0)\nofd_lock.try_lock(fd, 1 + lane)") == [
        "1: ofd_lock.held(fd, 0)",
        "2: ofd_lock.try_lock(fd, 1 + lane)",
    ]
    assert typed_bytes("ofd_lock.held(fd, WORKER_LOCK_BYTE)\nofd_lock.unlock(fd, client_lock_byte(l))") == []


def test_every_lock_byte_is_named() -> None:
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 50, f"only {len(files)} modules under {PACKAGE}"
    typed = [f"{p.relative_to(ROOT)}:{hit}" for p in files for hit in typed_bytes(p.read_text())]
    assert not typed, "name the lock byte (lowtail.shm.layout):\n" + "\n".join(typed)
