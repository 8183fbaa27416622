"""The kubelet role's preflight through ansible-playbook, against the stand-in kubelet (for its version)
and a kubelet configuration file already on the host: preflight checks the file kubelet will read after
the role ran (the existing file merged with lowtail's settings), not lowtail's inputs alone."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.ansible.conftest import ROOT, run_ansible

pytestmark = pytest.mark.slow

STANDIN = ROOT / "molecule/default/standin/kubelet.py"


def node(numa_nodes: int) -> dict[str, Any]:
    """The part of preflight's lowtail_node fact the kubelet role reads."""
    per_numa = 2 * 1024 + 100
    return {
        "topology": {"numa_nodes": numa_nodes},
        "plan": {"housekeeping": "0-6,84-90"},
        "kubelet_memory": {
            "kube_reserved": "1Gi",
            "system_reserved": "1Gi",
            "eviction_hard": "100Mi",
            "reserved_memory": [
                {"numaNode": n, "limits": {"memory": f"{per_numa // numa_nodes}Mi"}}
                for n in range(numa_nodes)
            ],
        },
    }


def run_preflight(
    tmp_path: Path, version: str, existing: dict[str, Any], numa_nodes: int = 2, **extra: Any
) -> tuple[int, str]:
    """Run tasks/preflight.yml with the stand-in kubelet of ``version`` and ``existing`` as the file."""
    state = tmp_path / "etc/lowtail-standin"
    state.mkdir(parents=True, exist_ok=True)
    (state / "kubelet-version").write_text(version + "\n")
    lib = tmp_path / "lib"
    lib.mkdir(exist_ok=True)
    if not (lib / "lowtail_node").exists():
        (lib / "lowtail_node").symlink_to(ROOT / "python/lowtail/node")
    kubelet = tmp_path / "kubelet"
    env = f"LOWTAIL_STANDIN_PREFIX={tmp_path} PYTHONPATH={lib}"
    kubelet.write_text(f'#!/bin/sh\n{env} exec {sys.executable} {STANDIN} "$@"\n')
    kubelet.chmod(0o755)
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(existing))
    playbook = tmp_path / "preflight.yml"
    playbook.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "Kubelet preflight",
                    "hosts": "all",
                    "gather_facts": False,
                    "vars": {
                        "lowtail_node": node(numa_nodes),
                        "lowtail_versions": {"kernel_release": "6.1.0-28-amd64", "oci_runtimes": {}},
                        "lowtail_drain_delegate": "localhost",
                        "lowtail_kubelet_binary": str(kubelet),
                        "lowtail_kubelet_config_path": str(config),
                        "lowtail_kubelet_flag_files": [],
                        **extra,
                    },
                    "tasks": [
                        {
                            "name": "Check the kubelet",
                            "ansible.builtin.include_role": {
                                "name": "lowtail_kubelet",
                                "tasks_from": "preflight",
                            },
                        },
                        {
                            "name": "Show the topology manager options lowtail will write",
                            "ansible.builtin.debug": {
                                "msg": "topology options {{ lowtail_versions.kubelet_policy.topology_options"
                                " | to_json }}"
                            },
                        },
                    ],
                }
            ]
        )
    )
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(
        yaml.safe_dump(
            {
                "all": {
                    "hosts": {
                        "node-a": {
                            "ansible_connection": "local",
                            "ansible_python_interpreter": sys.executable,
                        }
                    }
                }
            }
        )
    )
    result = run_ansible(["ansible-playbook", "-i", str(inventory), str(playbook)])
    return result.returncode, " ".join((result.stdout + result.stderr).split())


KUBEADM = {
    "apiVersion": "kubelet.config.k8s.io/v1beta1",
    "kind": "KubeletConfiguration",
    "cgroupDriver": "systemd",
    "clusterDNS": ["10.96.0.10"],
    "cpuManagerPolicy": "none",
}


def test_clean_file_passes(tmp_path: Path) -> None:
    rc, out = run_preflight(tmp_path, "1.34.1", KUBEADM)
    assert rc == 0, out


@pytest.mark.parametrize(
    ("version", "existing", "message"),
    [
        # The file's option is refused together with the one lowtail adds on 1.34.
        (
            "1.34.1",
            {**KUBEADM, "cpuManagerPolicyOptions": {"distribute-cpus-across-numa": "true"}},
            "options 'prefer-align-cpus-by-uncorecache' and 'distribute-cpus-across-numa' can not be used at "
            "the same time (kubelet 1.34)",
        ),
        (
            "1.31.4",
            {**KUBEADM, "featureGates": {"CPUManagerPolicyBetaOptions": False}},
            "option 'full-pcpus-only' is beta in kubelet 1.31 and needs "
            "featureGates.CPUManagerPolicyBetaOptions",
        ),
        (
            "1.34.1",
            {**KUBEADM, "featureGates": {"CPUManagerPolicyOptions": False}},
            "cannot set feature gate CPUManagerPolicyOptions to false, feature is locked to true "
            "(kubelet 1.34)",
        ),
        (
            "1.31.4",
            {**KUBEADM, "featureGates": {"MemoryManager": False}},
            "featureGates.MemoryManager: false turns the memory manager off",
        ),
        (
            "1.31.4",
            {**KUBEADM, "featureGates": {"MemoryManager": "yes"}},
            "featureGates.MemoryManager is 'yes'; expected true or false",
        ),
    ],
    ids=["pair_with_added_option", "beta_gate_off", "locked_gate", "memory_manager_off", "string_gate"],
)
def test_merged_file_kubelet_would_refuse_fails_preflight(
    tmp_path: Path, version: str, existing: dict[str, Any], message: str
) -> None:
    rc, out = run_preflight(tmp_path, version, existing)
    assert rc != 0, out
    assert "the configuration kubelet would read: " + message in out, out


def test_24_numa_nodes_pass_on_1_34_and_are_refused_on_1_30_naming_the_count(tmp_path: Path) -> None:
    rc, out = run_preflight(tmp_path, "1.34.1", KUBEADM, numa_nodes=24)
    assert rc == 0, out
    assert 'topology options {"max-allowable-numa-nodes": "24"}' in out, out
    rc, out = run_preflight(tmp_path, "1.30.2", KUBEADM, numa_nodes=24)
    assert rc != 0, out
    assert "more than 8 NUMA nodes and this host has 24" in out, out
