from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import settings

# No per-example time limit: a shared, loaded 2-vCPU machine makes hypothesis' 200 ms deadline a
# latency assertion in disguise (the project never asserts timings in tests).
settings.register_profile("lowtail", deadline=None)
settings.load_profile("lowtail")

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.fixtures.machines import MACHINES, MachineSpec, write_machine  # noqa: E402


@pytest.fixture(scope="session")
def machine_roots(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    """Every fixture machine written once per session: name -> (sys_root, proc_root)."""
    base = tmp_path_factory.mktemp("machines")
    return {name: write_machine(base / name, spec) for name, spec in MACHINES.items()}


@pytest.fixture
def make_machine(tmp_path: Path):  # type: ignore[no-untyped-def]
    """Write a custom machine: make_machine(spec) -> (sys_root, proc_root)."""

    def _make(spec: MachineSpec, name: str = "m") -> tuple[Path, Path]:
        return write_machine(tmp_path / name, spec)

    return _make
