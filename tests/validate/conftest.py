"""Helpers for the validation tests: fixture machines with changes, a pinned CPU hog, one live report."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from lowtail.validation.runner import Options, Report, run
from lowtail.validation.static import Sources
from tests.fixtures.machines import MACHINES, write_machine

# A CPU the probes may use on any machine: the highest one this process may run on. With 2 vCPUs it
# is CPU 1, which is also validate's default (all CPUs but 0 when none is isolated).
PROBE_CPU = max(os.sched_getaffinity(0))


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
    """Write MACHINES[name] with extra/changed files under root and validate it (static checks)."""
    spec = MACHINES[name]
    spec = replace(
        spec,
        proc_files={**spec.proc_files, **(proc_files or {})},
        sys_files={**spec.sys_files, **(sys_files or {})},
        kernel_config=spec.kernel_config if kernel_config is None else kernel_config,
    )
    sys_root, proc_root = write_machine(root / name, spec)
    config = root / name / "boot/config"
    src = Sources(
        sys_root=sys_root,
        proc_root=proc_root,
        kernel_config=config if config.exists() else None,
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
    from lowtail.cli import main

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
