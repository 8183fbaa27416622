"""The kubelet minors the oracle is built for (one go.<minor>.mod each) and where make puts them."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ORACLE_DIR = ROOT / "tests/kubelet/oracle"
# The Makefile's oracle target builds build/oracle/kubelet-oracle-<minor> for each go.<minor>.mod.
MINORS: tuple[str, ...] = tuple(
    sorted((p.name[3:-4] for p in ORACLE_DIR.glob("go.1.*.mod")), key=lambda m: int(m.split(".")[1]))
)


def oracle_path(minor: str) -> Path:
    return ROOT / "build/oracle" / f"kubelet-oracle-{minor}"
