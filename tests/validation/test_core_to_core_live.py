"""The core-to-core probe on this machine: the C helper built with the system's compiler, a real
cache-line ping-pong between the online CPUs, the matrix in the JSON and the heat map in the HTML."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lowtail.node.plan import make_plan
from lowtail.node.topology import read_topology
from lowtail.validation.check import Status
from lowtail.validation.core_to_core import ProbeUnavailable, build, native_runner, probe_core_to_core

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def test_the_matrix_on_this_host_has_a_positive_round_trip_for_every_pair() -> None:
    online = sorted(os.sched_getaffinity(0))
    if len(online) < 2:
        pytest.skip("one CPU: no pair")
    topo = read_topology()
    c = probe_core_to_core(topo, make_plan(topo, "auto"), progress=False)
    assert c.status in (Status.PASS, Status.WARN), (c.reason, c.evidence)
    cpus = c.data["cpus"]
    for i, row in enumerate(c.data["matrix_ns"]):
        for j, v in enumerate(row):
            assert (v is None) == (i == j)
            if v is not None:
                # A cache line cannot cross cores in under a nanosecond, and no sane host takes 1 ms.
                assert 1.0 < v < 1e6, (cpus[i], cpus[j], v)
    assert json.loads(json.dumps(c.to_dict()))["data"]["matrix_ns"] == c.data["matrix_ns"]


def test_a_cpu_the_helper_cannot_pin_to_is_an_error_naming_it(tmp_path: Path) -> None:
    run = native_runner(build(tmp_path), iters=10, batches=3)
    with pytest.raises(ProbeUnavailable, match="cannot pin to CPU 4095"):
        run(0, 4095)


def test_validate_reports_the_matrix_and_draws_the_heat_map(tmp_path: Path) -> None:
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: no pair")
    out, page = tmp_path / "v.json", tmp_path / "v.html"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "lowtail.cli",
            "validate",
            "--only",
            "core_to_core",
            "--json",
            str(out),
            "--html",
            str(page),
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.exists(), r.stderr[-2000:]
    check = next(c for c in json.loads(out.read_text())["checks"] if c["name"] == "core_to_core")
    assert check["data"]["matrix_ns"], check
    assert "core_to_core: " in page.read_text() and "cache-line round trip" in page.read_text()
