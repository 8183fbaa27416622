"""scripts/kubelet-equipment.sh stops at once, naming what failed: no Go on PATH, or a module it cannot
download (it never reaches a build, so build/kubelet/bin is left as it was)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.kubelet.real.stack import ROOT

SCRIPT = ROOT / "scripts" / "kubelet-equipment.sh"


def test_without_go_it_stops_naming_go(tmp_path: Path) -> None:
    # A PATH with the shell tools the script needs and no go.
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for tool in ("bash", "dirname", "sha256sum", "find", "sort", "xargs", "sed", "cut", "cat", "grep"):
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    r = subprocess.run(
        [str(SCRIPT)],
        check=False,
        capture_output=True,
        text=True,
        env={"PATH": str(bin_dir), "HOME": str(tmp_path)},
    )
    assert r.returncode == 1
    assert "no 'go' on PATH" in r.stderr and "Go 1.26" in r.stderr, r.stderr


@pytest.mark.skipif(shutil.which("go") is None, reason="no Go toolchain on this machine")
def test_a_module_it_cannot_download_stops_it_with_the_command_and_its_output(tmp_path: Path) -> None:
    env = {
        **os.environ,
        "GOMODCACHE": str(tmp_path / "mod"),
        "GOPROXY": "off",
        "GOFLAGS": "-modcacherw",
        "LOWTAIL_KUBELET_EQUIPMENT_FORCE": "1",
    }
    before = {p.name: p.stat().st_mtime_ns for p in (ROOT / "build" / "kubelet" / "bin").glob("*")}
    r = subprocess.run([str(SCRIPT)], check=False, capture_output=True, text=True, env=env, timeout=300)
    assert r.returncode == 1, r.stderr
    assert "FAILED in" in r.stderr and "go list -deps" in r.stderr, r.stderr
    assert "GOPROXY=off" in r.stderr, r.stderr  # go's own message, printed whole
    assert "building" not in r.stderr
    after = {p.name: p.stat().st_mtime_ns for p in (ROOT / "build" / "kubelet" / "bin").glob("*")}
    assert after == before
