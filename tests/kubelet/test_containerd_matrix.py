"""lowtail's containerd table is containerd's own: RELEASES.md of the github.com/containerd/containerd/v2
module it cites, fetched through the Go module proxy as `make oracle` fetches kubernetes."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from lowtail.node import kubelet_runtime as kr

pytestmark = pytest.mark.slow  # a module download

MODULE = "github.com/containerd/containerd/v2@v2.4.2"


@pytest.fixture(scope="module")
def releases() -> str:
    if shutil.which("go") is None:
        pytest.fail(
            "no go on PATH; this test reads containerd's RELEASES.md from its Go module", pytrace=False
        )
    done = subprocess.run(
        ["go", "mod", "download", "-json", MODULE], capture_output=True, text=True, timeout=600, check=False
    )
    assert done.returncode == 0, f"go mod download {MODULE} failed: {done.stdout}{done.stderr}"
    return (Path(json.loads(done.stdout)["Dir"]) / "RELEASES.md").read_text()


def test_the_table_cites_the_module_read_here() -> None:
    path, version = MODULE.split("@")
    assert f"{path} {version}" in kr.CONTAINERD_SOURCE


def test_each_claimed_minor_has_containerds_recommendation(releases: str) -> None:
    section = releases[releases.index("### Kubernetes Support") :]
    rows = dict(re.findall(r"^\| (1\.\d+) +\| ([0-9.+, ]+?) +\| v1 +\|$", section, re.MULTILINE))
    theirs = {
        int(k.split(".")[1]): tuple(
            tuple(int(x) for x in v.strip().rstrip("+").split(".")) for v in vs.split(",")
        )
        for k, vs in rows.items()
    }
    assert {m: theirs.get(m) for m in kr.CONTAINERD_FOR_KUBELET} == kr.CONTAINERD_FOR_KUBELET


def test_the_end_of_life_branches_are_containerds(releases: str) -> None:
    states = dict(re.findall(r"^\| \[(\d+\.\d+)\]\([^)]*\) *\| ([A-Za-z ]+?) +\|", releases, re.MULTILINE))
    end_of_life = {
        tuple(int(x) for x in v.split(".")) for v, state in states.items() if state == "End of Life"
    }
    ours = {b for b in end_of_life if b <= kr.CONTAINERD_LAST_END_OF_LIFE_1X} | set(kr.CONTAINERD_END_OF_LIFE)
    assert end_of_life == ours
    assert kr.CONTAINERD_LAST_END_OF_LIFE_1X in end_of_life
