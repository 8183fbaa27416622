"""The molecule scenario's stand-in kubelet and kubectl, run as real processes on a temporary tree:
a stand-in that accepts everything proves nothing, so each refusal a real kubelet makes is checked."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from .conftest import ROOT

STANDIN = ROOT / "molecule/default/standin"
GOOD: dict[str, Any] = {
    "kind": "KubeletConfiguration",
    "cpuManagerPolicy": "static",
    "cpuManagerPolicyOptions": {"full-pcpus-only": "true"},
    "reservedSystemCPUs": "0-1",
    "topologyManagerPolicy": "single-numa-node",
    "memoryManagerPolicy": "Static",
    "reservedMemory": [
        {"numaNode": 0, "limits": {"memory": "1074Mi"}},
        {"numaNode": 1, "limits": {"memory": "1074Mi"}},
    ],
    "kubeReserved": {"memory": "1Gi"},
    "systemReserved": {"memory": "1Gi"},
    "evictionHard": {"memory.available": "100Mi"},
}


@pytest.fixture
def tree(tmp_path: Path) -> Iterator[Path]:
    for d in (
        "etc/lowtail-standin",
        "run/lowtail-standin",
        "var/lib/kubelet",
        "var/lib/lowtail-standin",
        "var/log",
    ):
        (tmp_path / d).mkdir(parents=True)
    # The stand-in imports the node package as lowtail_node, as it is copied into the container.
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib/lowtail_node").symlink_to(ROOT / "python/lowtail/node")
    yield tmp_path


def run(tree: Path, version: str, cfg: dict[str, Any], timeout: float = 10) -> subprocess.Popen[str]:
    (tree / "etc/lowtail-standin/kubelet-version").write_text(version)
    (tree / "var/lib/kubelet/config.yaml").write_text(yaml.safe_dump(cfg))
    env = dict(os.environ, LOWTAIL_STANDIN_PREFIX=str(tree), PYTHONPATH=str(tree / "lib"))
    return subprocess.Popen(
        [sys.executable, str(STANDIN / "kubelet.py"), f"--config={tree}/var/lib/kubelet/config.yaml"],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )


def refused(tree: Path, version: str, cfg: dict[str, Any]) -> str:
    proc = run(tree, version, cfg)
    _, err = proc.communicate(timeout=20)
    assert proc.returncode == 1, err
    return err


def started(tree: Path, version: str, cfg: dict[str, Any]) -> None:
    proc = run(tree, version, cfg)
    try:
        pid_file = tree / "run/lowtail-standin/kubelet.pid"
        deadline = time.monotonic() + 20
        while not pid_file.exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "stand-in kubelet did not start"
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=20)
    assert proc.returncode == 0
    assert not (tree / "run/lowtail-standin/kubelet.pid").exists()


def test_standin_reports_its_version(tree: Path) -> None:
    (tree / "etc/lowtail-standin/kubelet-version").write_text("1.31.4")
    env = dict(os.environ, LOWTAIL_STANDIN_PREFIX=str(tree), PYTHONPATH=str(tree / "lib"))
    out = subprocess.run(
        [sys.executable, str(STANDIN / "kubelet.py"), "--version"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout == "Kubernetes v1.31.4\n"


def test_good_config_starts_and_writes_checkpoints_of_its_policies(tree: Path) -> None:
    started(tree, "1.31.4", GOOD)
    cpu = json.loads((tree / "var/lib/kubelet/cpu_manager_state").read_text())
    mem = json.loads((tree / "var/lib/kubelet/memory_manager_state").read_text())
    assert (cpu["policyName"], mem["policyName"]) == ("static", "Static")


def test_option_the_version_lacks_is_refused(tree: Path) -> None:
    cfg = {**GOOD, "cpuManagerPolicyOptions": {"prefer-align-cpus-by-uncorecache": "true"}}
    assert "unknown CPU Manager Policy option" in refused(tree, "1.31.4", cfg)
    started(tree, "1.34.0", cfg)


def test_alpha_option_without_gate_is_refused(tree: Path) -> None:
    cfg = {**GOOD, "cpuManagerPolicyOptions": {"prefer-align-cpus-by-uncorecache": "true"}}
    assert "CPUManagerPolicyAlphaOptions" in refused(tree, "1.33.1", cfg)
    started(tree, "1.33.1", {**cfg, "featureGates": {"CPUManagerPolicyAlphaOptions": True}})


def test_forbidden_pair_is_refused(tree: Path) -> None:
    cfg = {
        **GOOD,
        "cpuManagerPolicyOptions": {"full-pcpus-only": "true", "distribute-cpus-across-cores": "true"},
        "featureGates": {"CPUManagerPolicyAlphaOptions": True},
    }
    assert "can not be used at the same time" in refused(tree, "1.34.0", cfg)


def test_reserved_memory_that_does_not_sum_is_refused(tree: Path) -> None:
    cfg = {**GOOD, "evictionHard": {"memory.available": "200Mi"}}
    assert "reserved memory" in refused(tree, "1.34.0", cfg)


def test_checkpoint_of_another_policy_is_refused(tree: Path) -> None:
    (tree / "var/lib/kubelet/cpu_manager_state").write_text('{"policyName":"none","checksum":1}')
    assert "could not restore state from checkpoint" in refused(tree, "1.34.0", GOOD)


def test_options_with_the_none_policy_are_refused(tree: Path) -> None:
    cfg = {"cpuManagerPolicy": "none", "cpuManagerPolicyOptions": {"full-pcpus-only": "true"}}
    assert "None policy" in refused(tree, "1.34.0", cfg)


def kubectl(tree: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, LOWTAIL_STANDIN_PREFIX=str(tree))
    return subprocess.run(
        [sys.executable, str(STANDIN / "kubectl.py"), *args],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def test_standin_kubectl_keeps_node_state_and_a_call_log(tree: Path) -> None:
    (tree / "var/lib/lowtail-standin/node.json").write_text(
        json.dumps({"name": "n1", "unschedulable": False, "taints": [], "labels": {}, "annotations": {}})
    )
    assert kubectl(tree, "drain", "n1", "--ignore-daemonsets").returncode == 0
    node = json.loads(kubectl(tree, "get", "node", "n1", "-o", "json").stdout)
    assert node["spec"]["unschedulable"] is True
    assert node["spec"]["taints"] == [{"key": "node.kubernetes.io/unschedulable", "effect": "NoSchedule"}]
    # No kubelet runs: not Ready, and /configz is unreachable.
    assert node["status"]["conditions"] == [{"type": "Ready", "status": "Unknown"}]
    assert kubectl(tree, "get", "--raw", "/api/v1/nodes/n1/proxy/configz").returncode == 1
    assert kubectl(tree, "annotate", "node", "n1", "a=1").returncode == 0
    refused_overwrite = kubectl(tree, "annotate", "node", "n1", "a=2")
    assert refused_overwrite.returncode == 1
    assert "--overwrite is false" in refused_overwrite.stderr
    assert kubectl(tree, "uncordon", "nope").returncode == 1
    assert kubectl(tree, "uncordon", "n1").returncode == 0
    node = json.loads(kubectl(tree, "get", "node", "n1", "-o", "json").stdout)
    assert (node["spec"]["unschedulable"], node["metadata"]["annotations"]) == (False, {"a": "1"})
    log = (tree / "var/log/lowtail-kubectl.log").read_text().splitlines()
    assert log[0] == "drain n1 --ignore-daemonsets"
    assert len(log) == 8
