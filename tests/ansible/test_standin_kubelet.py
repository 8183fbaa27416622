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
HEADER = {"apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration"}
GOOD: dict[str, Any] = {
    "apiVersion": "kubelet.config.k8s.io/v1beta1",
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
    # Two NUMA nodes, as GOOD's reservedMemory names.
    (tmp_path / "sys/devices/system/node").mkdir(parents=True)
    (tmp_path / "sys/devices/system/node/online").write_text("0-1\n")
    yield tmp_path


def run(tree: Path, version: str, cfg: dict[str, Any], *args: str, **env_extra: str) -> subprocess.Popen[str]:
    (tree / "etc/lowtail-standin/kubelet-version").write_text(version)
    (tree / "var/lib/kubelet/config.yaml").write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if k != "KUBELET_CONFIG_DROPIN_DIR_ALPHA"}
    env.update(LOWTAIL_STANDIN_PREFIX=str(tree), PYTHONPATH=str(tree / "lib"), **env_extra)
    return subprocess.Popen(
        [sys.executable, str(STANDIN / "kubelet.py"), f"--config={tree}/var/lib/kubelet/config.yaml", *args],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )


def refused(tree: Path, version: str, cfg: dict[str, Any], *args: str, **env: str) -> str:
    proc = run(tree, version, cfg, *args, **env)
    try:
        _, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        # It started instead of refusing: stop it, so a failing test leaves no process behind.
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the stand-in kubelet started instead of refusing: {err}") from None
    assert proc.returncode == 1, err
    return err


def started(tree: Path, version: str, cfg: dict[str, Any], *args: str, **env: str) -> str:
    """Start the stand-in, wait until it runs, stop it; its stderr (warnings)."""
    proc = run(tree, version, cfg, *args, **env)
    try:
        pid_file = tree / "run/lowtail-standin/kubelet.pid"
        deadline = time.monotonic() + 60
        while not pid_file.exists():
            assert proc.poll() is None, proc.communicate()[1]
            assert time.monotonic() < deadline, "stand-in kubelet did not start"
            time.sleep(0.05)
        configz = json.loads((tree / "run/lowtail-standin/configz.json").read_text())["kubeletconfig"]
        (tree / "configz-seen.json").write_text(json.dumps(configz))
    finally:
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    assert not (tree / "run/lowtail-standin/kubelet.pid").exists()
    return err


def configz(tree: Path) -> dict[str, Any]:
    """The running configuration the last started() stand-in published."""
    return json.loads((tree / "configz-seen.json").read_text())  # type: ignore[no-any-return]


def test_standin_reports_its_version(tree: Path) -> None:
    (tree / "etc/lowtail-standin/kubelet-version").write_text("1.35.4")
    env = dict(os.environ, LOWTAIL_STANDIN_PREFIX=str(tree), PYTHONPATH=str(tree / "lib"))
    out = subprocess.run(
        [sys.executable, str(STANDIN / "kubelet.py"), "--version"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout == "Kubernetes v1.35.4\n"


def test_good_config_starts_and_writes_checkpoints_of_its_policies(tree: Path) -> None:
    started(tree, "1.35.4", GOOD)
    cpu = json.loads((tree / "var/lib/kubelet/cpu_manager_state").read_text())
    mem = json.loads((tree / "var/lib/kubelet/memory_manager_state").read_text())
    assert (cpu["policyName"], mem["policyName"]) == ("static", "Static")


@pytest.mark.parametrize(("version", "typed"), [("1.35.4", False), ("1.36.3", True), ("1.37.2", True)])
def test_configz_carries_apiversion_and_kind_from_1_36(tree: Path, version: str, typed: bool) -> None:
    started(tree, version, GOOD)
    running = configz(tree)
    assert ("kind" in running, "apiVersion" in running) == (typed, typed)
    assert running["cpuManagerPolicy"] == "static"


def test_option_kubelet_does_not_know_is_refused(tree: Path) -> None:
    cfg = {**GOOD, "cpuManagerPolicyOptions": {"prefer-align-cpus-by-uncorecache": "true"}}
    assert "unknown CPU Manager Policy option" in refused(
        tree, "1.36.3", {**cfg, "cpuManagerPolicyOptions": {"prefer-align-cpus-by-uncore": "true"}}
    )
    started(tree, "1.36.3", cfg)


def test_alpha_option_without_gate_is_refused(tree: Path) -> None:
    cfg = {**GOOD, "cpuManagerPolicyOptions": {"distribute-cpus-across-cores": "true"}}
    assert "CPUManagerPolicyAlphaOptions" in refused(tree, "1.37.2", cfg)
    started(tree, "1.37.2", {**cfg, "featureGates": {"CPUManagerPolicyAlphaOptions": True}})


def test_forbidden_pair_is_refused(tree: Path) -> None:
    cfg = {
        **GOOD,
        "cpuManagerPolicyOptions": {"full-pcpus-only": "true", "distribute-cpus-across-cores": "true"},
        "featureGates": {"CPUManagerPolicyAlphaOptions": True},
    }
    assert "can not be used at the same time" in refused(tree, "1.36.3", cfg)


def test_reserved_memory_that_does_not_sum_is_refused(tree: Path) -> None:
    cfg = {**GOOD, "evictionHard": {"memory.available": "200Mi"}}
    assert "reservedMemory sums to" in refused(tree, "1.36.3", cfg)


def test_checkpoint_of_another_policy_is_refused(tree: Path) -> None:
    (tree / "var/lib/kubelet/cpu_manager_state").write_text('{"policyName":"none","checksum":1}')
    assert "could not restore state from checkpoint" in refused(tree, "1.36.3", GOOD)


def test_options_with_the_none_policy_are_refused(tree: Path) -> None:
    cfg = {**HEADER, "cpuManagerPolicy": "none", "cpuManagerPolicyOptions": {"full-pcpus-only": "true"}}
    assert "None policy" in refused(tree, "1.36.3", cfg)


def dropin(tree: Path, name: str, cfg: dict[str, Any]) -> str:
    """Write a --config-dir drop-in; the flag to pass."""
    d = tree / "etc/kubernetes/kubelet.conf.d"
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(yaml.safe_dump(cfg))
    return f"--config-dir={d}"


def test_config_dir_drop_ins_merge_over_the_file_in_lexical_order(tree: Path) -> None:
    # kubeadm's file keeps the none policy; lowtail's drop-in sets the rest, a later one overrides a map key.
    base = {**HEADER, "cpuManagerPolicy": "none", "clusterDNS": ["10.96.0.10"], "maxPods": 110}
    flag = dropin(tree, "50-lowtail.conf", {**GOOD, "clusterDNS": ["10.0.0.1"]})
    dropin(tree, "90-operator.conf", {**HEADER, "maxPods": 250, "evictionHard": {"nodefs.available": "5%"}})
    dropin(tree, "99-ignored.yaml", {**HEADER, "maxPods": 1})  # only *.conf files are read
    started(tree, "1.36.3", base, flag)
    running = configz(tree)
    assert running["cpuManagerPolicy"] == "static" and running["maxPods"] == 250
    assert running["clusterDNS"] == ["10.0.0.1"]  # lists are replaced
    assert running["evictionHard"] == {"memory.available": "100Mi", "nodefs.available": "5%"}  # maps merge


def test_a_later_drop_in_can_make_the_merged_result_refused(tree: Path) -> None:
    flag = dropin(tree, "50-lowtail.conf", GOOD)
    dropin(
        tree,
        "60-other.conf",
        {**HEADER, "cpuManagerPolicyOptions": {"distribute-cpus-across-numa": "true"}},
    )
    refused_err = refused(
        tree,
        "1.36.3",
        {**HEADER, "cpuManagerPolicyOptions": {"prefer-align-cpus-by-uncorecache": "true"}},
        flag,
    )
    assert "can not be used at the same time" in refused_err


def test_drop_in_without_its_kind_is_refused(tree: Path) -> None:
    flag = dropin(tree, "50-lowtail.conf", {"cpuManagerPolicy": "static"})
    assert "no kind None is registered" in refused(tree, "1.36.3", GOOD, flag)


def test_config_dir_drop_in_is_merged_over_the_file(tree: Path) -> None:
    flag = dropin(tree, "50-lowtail.conf", {**HEADER, "maxPods": 100})
    started(tree, "1.35.4", GOOD, flag)
    assert configz(tree)["maxPods"] == 100


def test_unknown_field_is_dropped_with_the_lenient_decoding_warning(tree: Path) -> None:
    # A typo is no refusal on v1beta1: kubelet drops it, so the setting silently does not apply.
    err = started(tree, "1.36.3", {**GOOD, "cpuManagerPolicyOption": {"full-pcpus-only": "true"}})
    assert (
        'Using lenient decoding as strict decoding failed err="strict decoding error: unknown field ' in err
    )
    assert '"cpuManagerPolicyOption"' in err
    assert "cpuManagerPolicyOption" not in configz(tree)


def test_file_of_another_kind_or_version_is_refused(tree: Path) -> None:
    assert "is registered for version" in refused(
        tree, "1.36.3", {**GOOD, "apiVersion": "kubelet.config.k8s.io/v1"}
    )
    assert "is registered for version" in refused(
        tree, "1.36.3", {k: v for k, v in GOOD.items() if k != "kind"}
    )


@pytest.mark.parametrize(
    ("version", "gates", "message"),
    [
        ("1.36.3", {"CPUManagerPolicyOptions": False}, "feature is locked to true"),
        ("1.37.2", {"CPUManager": True}, "unrecognized feature gate: CPUManager"),
        ("1.35.4", {"MemoryManager": "yes"}, "expected true or false"),
        ("1.36.3", {"MemoryManager": True}, "unrecognized feature gate: MemoryManager"),
        ("1.35.4", {"MemoryManager": False}, "feature is locked to true"),
    ],
    ids=["locked", "removed", "string_value", "removed_in_1_36", "memory_manager_locked"],
)
def test_feature_gates_kubelet_refuses(tree: Path, version: str, gates: dict[str, Any], message: str) -> None:
    assert message in refused(tree, version, {**GOOD, "featureGates": gates})


def numa(tree: Path, count: int) -> None:
    online = tree / "sys/devices/system/node/online"
    online.parent.mkdir(parents=True, exist_ok=True)
    online.write_text(f"0-{count - 1}\n")


def test_more_than_8_numa_nodes_need_max_allowable_numa_nodes(tree: Path) -> None:
    numa(tree, 24)
    cfg = dict(GOOD)
    assert "more than 8 NUMA nodes and this host has 24" in refused(tree, "1.36.3", cfg)
    with_option = {**cfg, "topologyManagerPolicyOptions": {"max-allowable-numa-nodes": "24"}}
    started(tree, "1.36.3", with_option)
    numa(tree, 8)
    started(tree, "1.35.4", cfg)
    # A fixture machine's sysfs elsewhere (as in the molecule containers) counts instead.
    fixture = tree / "fixture/sys/devices/system/node/online"
    fixture.parent.mkdir(parents=True)
    fixture.write_text("0-23\n")
    err = refused(tree, "1.36.3", cfg, LOWTAIL_STANDIN_SYSFS=str(tree / "fixture/sys"))
    assert "this host has 24" in err


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
