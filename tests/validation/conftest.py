"""Helpers for the validation tests: fixture machines with changes, a pinned CPU hog, one live report."""

from __future__ import annotations

import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from lowtail.validation.runner import Options, Report, run
from lowtail.validation.static import Sources
from tests.fixtures.machines import MACHINES, write_machine

# A CPU the probes may use on any machine: the highest one this process may run on. With 2 vCPUs it
# is CPU 1, which is also validate's default (all CPUs but 0 when none is isolated).
PROBE_CPU = max(os.sched_getaffinity(0))


# Base fixture trees, written once per session: a 168-CPU tree is thousands of files, and every
# variant below differs from its base in a handful of them.
_BASES: dict[str, Path] = {}


def base_machine(name: str) -> Path:
    if name not in _BASES:
        root = Path(tempfile.mkdtemp(prefix=f"lowtail-fixture-{name}-"))
        atexit.register(shutil.rmtree, root, True)
        write_machine(root, MACHINES[name])
        _BASES[name] = root
    return _BASES[name]


def _overlay(base: Path, out: Path, files: dict[str, str]) -> None:
    """Make ``out`` read like ``base`` with ``files`` (paths relative to the root) replaced or added:
    directories on the way to a changed file are real, everything else is a symlink into ``base``."""
    on_path = {Path(rel).parents[i].as_posix() for rel in files for i in range(len(Path(rel).parents) - 1)}

    def build(rel: str) -> None:
        (out / rel).mkdir(parents=True, exist_ok=True)
        src = base / rel
        for child in src.iterdir() if src.is_dir() else ():
            child_rel = f"{rel}/{child.name}" if rel else child.name
            if child_rel in on_path:
                build(child_rel)
            elif child_rel not in files:
                (out / child_rel).symlink_to(child)

    build("")
    for rel, text in files.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_text(text)


def validate_fixture(
    root: Path,
    name: str,
    only: tuple[str, ...],
    *,
    proc_files: dict[str, str] | None = None,
    sys_files: dict[str, str] | None = None,
    kernel_config: str | None = None,
    **opts: Any,
) -> Report:
    """Validate MACHINES[name] with some procfs/sysfs files (and the kernel config) changed."""
    files = {f"proc/{k}": v for k, v in (proc_files or {}).items()}
    files |= {f"sys/{k}": v for k, v in (sys_files or {}).items()}
    if kernel_config is not None:
        files["boot/config"] = kernel_config
    machine = root / name
    _overlay(base_machine(name), machine, files)
    config = machine / "boot/config"
    src = Sources(
        sys_root=machine / "sys",
        proc_root=machine / "proc",
        kernel_config=config if config.exists() and config.read_text() else None,
        kubelet_config=opts.pop("kubelet_config", root / "no-kubelet/config.yaml"),
        kubelet_state=opts.pop("kubelet_state", root / "no-kubelet/cpu_manager_state"),
    )
    return run(Options(src=src, only=only, progress=False, **opts))


def by_name(report: Report) -> dict[str, Any]:
    return {c.name: c for c in report.checks}


@pytest.fixture
def hog() -> Iterator[Callable[[int], subprocess.Popen[bytes]]]:
    """Start a busy loop pinned to a CPU; waits until it has burnt CPU time, kills it afterwards."""
    procs: list[subprocess.Popen[bytes]] = []

    def start(cpu: int) -> subprocess.Popen[bytes]:
        code = f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True:\n    pass\n"
        p = subprocess.Popen([sys.executable, "-c", code])
        procs.append(p)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            fields = Path(f"/proc/{p.pid}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[11]) > 5:  # utime in ticks: it is spinning, pinned
                return p
            time.sleep(0.05)
        raise RuntimeError("the CPU hog did not start spinning within 10 s")

    yield start
    for p in procs:
        p.kill()
        p.wait()


@pytest.fixture(scope="session")
def live_report(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, int]:
    """One real `lowtail validate` run on this machine: JSON, HTML and the exit status."""
    from lowtail.cli.main import main

    out = tmp_path_factory.mktemp("live")
    js, html = out / "report.json", out / "report.html"
    rc = main(
        [
            "validate",
            "--only",
            "rt_budget,thp,steal,deschedule,timer,cyclictest,shm_rtt",
            "--cpus",
            str(PROBE_CPU),
            "--samples",
            "1000",
            "--duration",
            "1",
            "--no-progress",
            "--json",
            str(js),
            "--html",
            str(html),
        ]
    )
    return js, html, rc
