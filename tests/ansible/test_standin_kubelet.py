"""The molecule scenario's stand-in kubelet and kubectl, run as real processes on a temporary tree:
a stand-in that accepts everything proves nothing, so each refusal a real kubelet makes is checked.

The stand-in asks the kubelet oracle of its minor (build/oracle, ``make oracle``) whether a
configuration starts; the tests that start it are therefore marked slow (they need the built oracle,
which ``make test`` and ``make pytest-ansible`` build first) and fail naming the missing binary.
"""

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

from tests.fixtures.machines import MACHINES, write_machine
from tests.kubelet.oracle_minors import MINORS, oracle_path

from .conftest import ROOT

STANDIN = ROOT / "molecule/default/standin"
HEADER = {"apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration"}
GOOD: dict[str, Any] = {
    "apiVersion": "kubelet.config.k8s.io/v1beta1",
    "kind": "KubeletConfiguration",
    # The fixture machine is a cgroup v1 host, where kubelet 1.35+ starts only with this.
    "failCgroupV1": False,
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
    # The 2 x EPYC 9634 fixture (two NUMA nodes, as GOOD's reservedMemory names, cgroup v1) as the host.
    write_machine(tmp_path, MACHINES["epyc9634_2s"])
    yield tmp_path


def standin_env(tree: Path, **extra: str) -> dict[str, str]:
    env = dict(os.environ, LOWTAIL_STANDIN_PREFIX=str(tree), PYTHONPATH=str(tree / "lib"))
    env["LOWTAIL_STANDIN_ORACLE_DIR"] = str(oracle_path(MINORS[0]).parent)
    env.update(extra)
    return env


@pytest.fixture(autouse=True)
def _oracles(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("slow") and not all(oracle_path(m).exists() for m in MINORS):
        pytest.fail(f"the kubelet oracles under {oracle_path(MINORS[0]).parent} are missing: make oracle")


# Starting the stand-in runs the oracle binary (make oracle).
needs_oracle = pytest.mark.slow


def run(tree: Path, version: str, cfg: dict[str, Any], *args: str, **env_extra: str) -> subprocess.Popen[str]:
    (tree / "etc/lowtail-standin/kubelet-version").write_text(version)
    (tree / "var/lib/kubelet/config.yaml").write_text(yaml.safe_dump(cfg))
    env = standin_env(tree, **env_extra)
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
    env = standin_env(tree, LOWTAIL_STANDIN_ORACLE_DIR=str(tree / "no-oracle"))
    out = subprocess.run(
        [sys.executable, str(STANDIN / "kubelet.py"), "--version"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    )
    assert out.stdout == "Kubernetes v1.35.4\n"


def test_without_the_oracle_of_its_minor_the_standin_does_not_start(tree: Path) -> None:
    # Strict: no silent fallback to lowtail's table, and not a kubelet refusal (exit 2, not 1).
    proc = run(tree, "1.37.2", GOOD, LOWTAIL_STANDIN_ORACLE_DIR=str(tree / "no-oracle"))
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert f"no kubelet 1.37 oracle at {tree}/no-oracle/kubelet-oracle-1.37 (make oracle builds it)" in err


def test_a_version_lowtail_does_not_claim_has_no_oracle_to_judge_with(tree: Path) -> None:
    proc = run(tree, "1.34.6", GOOD)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2, err
    assert "kubelet v1.34.6 is not supported; lowtail claims kubelet 1.35 to 1.37" in err


# Files the stand-in accepted while it judged with lowtail's table, and each kubelet refuses (the
# oracle's corpus, 19 cases per minor): the table was given neither the cgroup version, the sockets
# nor the online CPUs, and merged evictionHard: null itself.
TABLE_ACCEPTED = {
    "cgroup_v1_without_fail_cgroup_v1": (
        {k: v for k, v in GOOD.items() if k != "failCgroupV1"},
        "epyc9634_2s",
        "kubelet is configured to not run on a host using cgroup v1",
    ),
    "reserved_cpus_not_online": (
        {**GOOD, "reservedSystemCPUs": "0-400"},
        "epyc9634_2s",
        "is not a subset of online-cpus",
    ),
    "align_by_socket_more_sockets_than_nodes": (
        {
            **{k: v for k, v in GOOD.items() if k not in ("reservedMemory", "memoryManagerPolicy")},
            "topologyManagerPolicy": "none",
            "cpuManagerPolicyOptions": {"align-by-socket": "true"},
            "featureGates": {"CPUManagerPolicyAlphaOptions": True},
        },
        "vmware_88",
        "Align by socket is not compatible with hardware where number of sockets are more than number",
    ),
}


@needs_oracle
@pytest.mark.parametrize("version", ["1.35.4", "1.36.3", "1.37.2"])
@pytest.mark.parametrize("case", sorted(TABLE_ACCEPTED))
def test_files_lowtails_table_accepted_and_the_kubelet_refuses(tree: Path, version: str, case: str) -> None:
    cfg, machine, message = TABLE_ACCEPTED[case]
    sys_root, _ = write_machine(tree / "fixture", MACHINES[machine])
    assert message in refused(tree, version, cfg, LOWTAIL_STANDIN_SYSFS=str(sys_root))


@needs_oracle
def test_a_cgroup_v2_host_needs_no_fail_cgroup_v1(tree: Path) -> None:
    sys_root, _ = write_machine(tree / "fixture", MACHINES["epyc9634_2s_cgroup2"])
    assert (sys_root / "fs/cgroup/cgroup.controllers").exists()
    cfg = {k: v for k, v in GOOD.items() if k != "failCgroupV1"}
    started(tree, "1.37.2", cfg, LOWTAIL_STANDIN_SYSFS=str(sys_root))


@needs_oracle
def test_good_config_starts_and_writes_checkpoints_of_its_policies(tree: Path) -> None:
    started(tree, "1.35.4", GOOD)
    cpu = json.loads((tree / "var/lib/kubelet/cpu_manager_state").read_text())
    mem = json.loads((tree / "var/lib/kubelet/memory_manager_state").read_text())
    assert (cpu["policyName"], mem["policyName"]) == ("static", "Static")


@needs_oracle
@pytest.mark.parametrize(("version", "typed"), [("1.35.4", False), ("1.36.3", True), ("1.37.2", True)])
def test_configz_carries_apiversion_and_kind_from_1_36(tree: Path, version: str, typed: bool) -> None:
    started(tree, version, GOOD)
    running = configz(tree)
    assert ("kind" in running, "apiVersion" in running) == (typed, typed)
    assert running["cpuManagerPolicy"] == "static"


@needs_oracle
def test_option_kubelet_does_not_know_is_refused(tree: Path) -> None:
    cfg = {**GOOD, "cpuManagerPolicyOptions": {"prefer-align-cpus-by-uncorecache": "true"}}
    assert "unknown CPU Manager Policy option" in refused(
        tree, "1.36.3", {**cfg, "cpuManagerPolicyOptions": {"prefer-align-cpus-by-uncore": "true"}}
    )
    started(tree, "1.36.3", cfg)


@needs_oracle
def test_alpha_option_without_gate_is_refused(tree: Path) -> None:
    cfg = {**GOOD, "cpuManagerPolicyOptions": {"distribute-cpus-across-cores": "true"}}
    assert "Alpha-level Options not enabled" in refused(tree, "1.37.2", cfg)
    started(tree, "1.37.2", {**cfg, "featureGates": {"CPUManagerPolicyAlphaOptions": True}})


@needs_oracle
def test_forbidden_pair_is_refused(tree: Path) -> None:
    cfg = {
        **GOOD,
        "cpuManagerPolicyOptions": {"full-pcpus-only": "true", "distribute-cpus-across-cores": "true"},
        "featureGates": {"CPUManagerPolicyAlphaOptions": True},
    }
    assert "can not be used at the same time" in refused(tree, "1.36.3", cfg)


@needs_oracle
def test_reserved_memory_that_does_not_sum_is_refused(tree: Path) -> None:
    cfg = {**GOOD, "evictionHard": {"memory.available": "200Mi"}}
    assert 'not equal to the value "2248Mi" determined by Node Allocatable' in refused(tree, "1.36.3", cfg)


@needs_oracle
def test_checkpoint_of_another_policy_is_refused(tree: Path) -> None:
    (tree / "var/lib/kubelet/cpu_manager_state").write_text('{"policyName":"none","checksum":1}')
    assert "could not restore state from checkpoint" in refused(tree, "1.36.3", GOOD)


@needs_oracle
def test_options_with_the_none_policy_are_refused(tree: Path) -> None:
    cfg = {
        **HEADER,
        "failCgroupV1": False,
        "cpuManagerPolicy": "none",
        "cpuManagerPolicyOptions": {"full-pcpus-only": "true"},
    }
    assert "None policy" in refused(tree, "1.36.3", cfg)


def dropin(tree: Path, name: str, cfg: dict[str, Any]) -> str:
    """Write a --config-dir drop-in; the flag to pass."""
    d = tree / "etc/kubernetes/kubelet.conf.d"
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_text(yaml.safe_dump(cfg))
    return f"--config-dir={d}"


@needs_oracle
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


@needs_oracle
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


@needs_oracle
def test_drop_in_without_its_kind_is_refused(tree: Path) -> None:
    flag = dropin(tree, "50-lowtail.conf", {"cpuManagerPolicy": "static"})
    assert "Object 'Kind' is missing" in refused(tree, "1.36.3", GOOD, flag)


@needs_oracle
def test_config_dir_drop_in_is_merged_over_the_file(tree: Path) -> None:
    flag = dropin(tree, "50-lowtail.conf", {**HEADER, "maxPods": 100})
    started(tree, "1.35.4", GOOD, flag)
    assert configz(tree)["maxPods"] == 100


@needs_oracle
def test_unknown_field_is_dropped_with_the_lenient_decoding_warning(tree: Path) -> None:
    # A typo is no refusal on v1beta1: kubelet drops it, so the setting silently does not apply.
    err = started(tree, "1.36.3", {**GOOD, "cpuManagerPolicyOption": {"full-pcpus-only": "true"}})
    assert (
        'Using lenient decoding as strict decoding failed err="strict decoding error: unknown field ' in err
    )
    assert '"cpuManagerPolicyOption"' in err
    assert "cpuManagerPolicyOption" not in configz(tree)


@needs_oracle
def test_file_of_another_kind_or_version_is_refused(tree: Path) -> None:
    assert "is registered for version" in refused(
        tree, "1.36.3", {**GOOD, "apiVersion": "kubelet.config.k8s.io/v1"}
    )
    assert "Object 'Kind' is missing" in refused(
        tree, "1.36.3", {k: v for k, v in GOOD.items() if k != "kind"}
    )


@needs_oracle
@pytest.mark.parametrize(
    ("version", "gates", "message"),
    [
        ("1.36.3", {"CPUManagerPolicyOptions": False}, "feature is locked to true"),
        ("1.37.2", {"CPUManager": True}, "unrecognized feature gate: CPUManager"),
        ("1.35.4", {"MemoryManager": "yes"}, "featureGates of type bool"),
        ("1.36.3", {"MemoryManager": True}, "unrecognized feature gate: MemoryManager"),
        ("1.35.4", {"MemoryManager": False}, "feature is locked to true"),
    ],
    ids=["locked", "removed", "string_value", "removed_in_1_36", "memory_manager_locked"],
)
def test_feature_gates_kubelet_refuses(tree: Path, version: str, gates: dict[str, Any], message: str) -> None:
    assert message in refused(tree, version, {**GOOD, "featureGates": gates})


@needs_oracle
def test_more_than_8_numa_nodes_need_max_allowable_numa_nodes(tree: Path) -> None:
    # The machine is the fixture whose sysfs LOWTAIL_STANDIN_SYSFS names, as in the molecule containers.
    sys_root, _ = write_machine(tree / "fixture", MACHINES["epyc9634_2s_l3numa"])
    env = {"LOWTAIL_STANDIN_SYSFS": str(sys_root)}
    assert "more than 8 NUMA Nodes" in refused(tree, "1.36.3", GOOD, **env)
    with_option = {**GOOD, "topologyManagerPolicyOptions": {"max-allowable-numa-nodes": "24"}}
    started(tree, "1.36.3", with_option, **env)
    started(tree, "1.35.4", GOOD)


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
