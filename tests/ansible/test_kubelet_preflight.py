"""The kubelet role's preflight through ansible-playbook, against the stand-in kubelet (for its version)
and a kubelet configuration file already on the host: preflight checks the file kubelet will read after
the role ran (the existing file merged with lowtail's settings), not lowtail's inputs alone."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.ansible.conftest import ROOT, local_node_inventory, run_ansible

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
            # Split exactly, the remainder on node 0, as kubelet_memory.plan_reservations does.
            "reserved_memory": [
                {
                    "numaNode": n,
                    "limits": {
                        "memory": f"{per_numa // numa_nodes + (per_numa % numa_nodes if n == 0 else 0)}Mi"
                    },
                }
                for n in range(numa_nodes)
            ],
        },
    }


# kubeadm's kubelet drop-in as the deb/rpm packages install it (kubernetes/release, 10-kubeadm.conf), as
# `systemctl cat kubelet.service` prints it after the packaged unit.
KUBEADM_UNIT = """# /usr/lib/systemd/system/kubelet.service
[Unit]
Description=kubelet: The Kubernetes Node Agent

[Service]
ExecStart=/usr/bin/kubelet
Restart=always
StartLimitInterval=0
RestartSec=10

[Install]
WantedBy=multi-user.target

# /usr/lib/systemd/system/kubelet.service.d/10-kubeadm.conf
# Note: This dropin only works with kubeadm and kubelet v1.11+
[Service]
Environment="KUBELET_KUBECONFIG_ARGS=--bootstrap-kubeconfig=/etc/kubernetes/bootstrap-kubelet.conf \\
 --kubeconfig=/etc/kubernetes/kubelet.conf"
Environment="KUBELET_CONFIG_ARGS=--config=@CONFIG@"
EnvironmentFile=-@FLAGS_ENV@
EnvironmentFile=-/etc/default/kubelet-does-not-exist
ExecStart=
ExecStart=/usr/bin/kubelet $KUBELET_KUBECONFIG_ARGS $KUBELET_CONFIG_ARGS $KUBELET_KUBEADM_ARGS \\
 $KUBELET_EXTRA_ARGS
"""
KUBEADM_FLAGS = 'KUBELET_KUBEADM_ARGS="--container-runtime-endpoint=unix:///run/containerd/containerd.sock"\n'


def run_preflight(
    tmp_path: Path,
    version: str,
    existing: dict[str, Any],
    numa_nodes: int = 2,
    *,
    unit: str | None = KUBEADM_UNIT,
    flags_env: str = KUBEADM_FLAGS,
    **extra: Any,
) -> tuple[int, str]:
    """Run tasks/preflight.yml with the stand-in kubelet of ``version``, ``existing`` as the file and
    ``unit`` as what systemctl cat prints (@CONFIG@ and @FLAGS_ENV@ replaced by this run's paths;
    None: systemctl cat fails as it does for a unit that does not exist)."""
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
    (tmp_path / "kubeadm-flags.env").write_text(flags_env)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    # A stand-in for `systemctl cat`: prints the unit or fails like systemctl does for an unknown unit.
    (tmp_path / "unit.txt").write_text(
        (unit or "")
        .replace("@CONFIG@", str(config))
        .replace("@FLAGS_ENV@", str(tmp_path / "kubeadm-flags.env"))
    )
    failing = 'echo "No files found for kubelet.service." >&2; exit 1'
    (bin_dir / "systemctl").write_text(
        '#!/bin/sh\n[ "$1 $2 $3" = "cat -- kubelet.service" ] || exit 2\n'
        + (f"cat {tmp_path / 'unit.txt'}\n" if unit is not None else failing + "\n")
    )
    (bin_dir / "systemctl").chmod(0o755)
    playbook = tmp_path / "preflight.yml"
    playbook.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "Kubelet preflight",
                    "hosts": "all",
                    "gather_facts": False,
                    "environment": {"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin"},
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
    inventory = local_node_inventory(tmp_path)
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
    rc, out = run_preflight(tmp_path, "1.36.3", KUBEADM)
    assert rc == 0, out


@pytest.mark.parametrize(
    ("version", "existing", "message"),
    [
        # The file's option is refused together with the one lowtail adds.
        (
            "1.36.3",
            {**KUBEADM, "cpuManagerPolicyOptions": {"distribute-cpus-across-numa": "true"}},
            "options 'prefer-align-cpus-by-uncorecache' and 'distribute-cpus-across-numa' can not be used at "
            "the same time (kubelet 1.36)",
        ),
        (
            "1.35.4",
            {**KUBEADM, "featureGates": {"CPUManagerPolicyBetaOptions": False}},
            "option 'prefer-align-cpus-by-uncorecache' is beta in kubelet 1.35 and needs "
            "featureGates.CPUManagerPolicyBetaOptions",
        ),
        (
            "1.37.2",
            {**KUBEADM, "featureGates": {"CPUManagerPolicyOptions": False}},
            "cannot set feature gate CPUManagerPolicyOptions to false, feature is locked to true "
            "(kubelet 1.37)",
        ),
        (
            "1.36.3",
            {**KUBEADM, "featureGates": {"MemoryManager": False}},
            "unrecognized feature gate: MemoryManager (kubelet 1.36",
        ),
        (
            "1.35.4",
            {**KUBEADM, "featureGates": {"MemoryManager": "yes"}},
            "featureGates.MemoryManager is 'yes'; expected true or false",
        ),
    ],
    ids=["pair_with_added_option", "beta_gate_off", "locked_gate", "removed_gate", "string_gate"],
)
def test_merged_file_kubelet_would_refuse_fails_preflight(
    tmp_path: Path, version: str, existing: dict[str, Any], message: str
) -> None:
    rc, out = run_preflight(tmp_path, version, existing)
    assert rc != 0, out
    assert "the configuration kubelet would read: " + message in out, out


def test_24_numa_nodes_pass_with_max_allowable_numa_nodes(tmp_path: Path) -> None:
    rc, out = run_preflight(tmp_path, "1.37.2", KUBEADM, numa_nodes=24)
    assert rc == 0, out
    assert 'topology options {"max-allowable-numa-nodes": "24"}' in out, out


@pytest.mark.parametrize("version", ["1.34.6", "1.38.0"])
def test_a_minor_lowtail_does_not_claim_is_refused_naming_it_and_the_range(
    tmp_path: Path, version: str
) -> None:
    rc, out = run_preflight(tmp_path, version, KUBEADM)
    assert rc != 0, out
    assert f"v{version} is not supported; lowtail claims kubelet 1.35 to 1.37" in out, out
    assert "Traceback" not in out, out


def test_flag_in_kubeadm_flags_env_that_overrides_a_lowtail_field_fails(tmp_path: Path) -> None:
    flags = 'KUBELET_KUBEADM_ARGS="--container-runtime-endpoint=unix:///x --cpu-manager-policy none"\n'
    rc, out = run_preflight(tmp_path, "1.36.3", KUBEADM, flags_env=flags)
    assert rc != 0, out
    assert (
        "kubelet.service: kubelet is started with --cpu-manager-policy, which overrides cpuManagerPolicy"
        in out
    ), out


def test_flag_in_an_execstart_drop_in_fails_and_kubeadm_ownership_is_reported(tmp_path: Path) -> None:
    unit = KUBEADM_UNIT + (
        "\n# /etc/systemd/system/kubelet.service.d/20-extra.conf\n[Service]\nExecStart=\n"
        "ExecStart=/usr/bin/kubelet --config=@CONFIG@ --reserved-cpus=0-3\n"
    )
    rc, out = run_preflight(tmp_path, "1.36.3", KUBEADM, unit=unit)
    assert rc != 0, out
    assert "kubelet is started with --reserved-cpus, which overrides reservedSystemCPUs" in out, out
    rc, out = run_preflight(tmp_path, "1.36.3", KUBEADM)
    assert rc == 0, out
    assert (
        "`kubeadm upgrade node` (phase kubelet-config) rewrites it from the kube-system/kubelet-config" in out
    )


def test_config_flag_naming_another_file_fails(tmp_path: Path) -> None:
    unit = KUBEADM_UNIT.replace("--config=@CONFIG@", "--config /etc/kubernetes/kubelet-config.yaml")
    rc, out = run_preflight(tmp_path, "1.36.3", KUBEADM, unit=unit)
    assert rc != 0, out
    assert (
        "starts kubelet with --config=/etc/kubernetes/kubelet-config.yaml but lowtail_kubelet_config_path"
        in out
    )


def test_config_dir_drop_ins_are_part_of_the_file_kubelet_reads(tmp_path: Path) -> None:
    dropins = tmp_path / "kubelet.conf.d"
    dropins.mkdir()
    unit = KUBEADM_UNIT.replace("--config=@CONFIG@", f"--config=@CONFIG@ --config-dir={dropins}")
    header = {"apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration"}
    (dropins / "10-gates.conf").write_text(
        yaml.safe_dump({**header, "featureGates": {"CPUManagerPolicyBetaOptions": True}})
    )
    (dropins / "README").write_text("not a drop-in: kubelet reads *.conf only\n")
    rc, out = run_preflight(tmp_path, "1.36.3", KUBEADM, unit=unit)
    assert rc == 0, out
    assert f"kubelet reads drop-ins from {dropins}: they merge over" in out, out
    # A drop-in that sets a field lowtail writes would win over lowtail's file.
    (dropins / "20-policy.conf").write_text(yaml.safe_dump({**header, "cpuManagerPolicy": "none"}))
    rc, out = run_preflight(tmp_path, "1.36.3", KUBEADM, unit=unit)
    assert rc != 0, out
    assert f"{dropins}/20-policy.conf sets cpuManagerPolicy, which overrides cpuManagerPolicy" in out, out
    # A drop-in's gate is part of the merged result kubelet would refuse.
    (dropins / "20-policy.conf").unlink()
    (dropins / "30-locked.conf").write_text(
        yaml.safe_dump({**header, "featureGates": {"CPUManagerPolicyOptions": False}})
    )
    rc, out = run_preflight(tmp_path, "1.36.3", KUBEADM, unit=unit)
    assert rc != 0, out
    assert "the configuration kubelet would read: cannot set feature gate CPUManagerPolicyOptions" in out, out


def test_unreadable_unit_is_a_problem_not_a_silent_skip(tmp_path: Path) -> None:
    rc, out = run_preflight(tmp_path, "1.36.3", KUBEADM, unit=None)
    assert rc != 0, out
    assert "systemctl cat kubelet.service failed (rc 1): No files found for kubelet.service." in out, out


@pytest.mark.parametrize("cgroup", [1, 2])
def test_cgroup_v1_host_gets_fail_cgroup_v1_false_and_a_warning(tmp_path: Path, cgroup: int) -> None:
    # Every claimed kubelet refuses cgroup v1 unless failCgroupV1 is false: preflight's check of the
    # rendered file passes on v1 only because the role writes that field there.
    versions = {"kernel_release": "6.1.0-28-amd64", "oci_runtimes": {}, "cgroup_version": cgroup}
    rc, out = run_preflight(tmp_path, "1.35.4", KUBEADM, lowtail_versions=versions)
    assert rc == 0, out
    warned = "this host runs cgroup v1; lowtail writes failCgroupV1: false" in out
    assert warned is (cgroup == 1), out


def test_a_drop_in_that_sets_fail_cgroup_v1_on_a_cgroup_v1_host_is_refused(tmp_path: Path) -> None:
    versions = {"kernel_release": "6.1.0-28-amd64", "oci_runtimes": {}, "cgroup_version": 1}
    rc, out = run_preflight(tmp_path, "1.36.3", {**KUBEADM, "failCgroupV1": True}, lowtail_versions=versions)
    # target file: lowtail's false replaces the file's true.
    assert rc == 0, out


@pytest.mark.parametrize(
    ("old_gates", "new_gates", "reset"),
    [
        ({}, {"PodLevelResourceManagers": True}, True),
        ({"PodLevelResourceManagers": True}, {}, True),
        ({"PodLevelResourceManagers": False}, {}, False),
        ({"PodLevelResourceManagers": True}, {"PodLevelResourceManagers": True}, False),
    ],
)
def test_a_flip_of_the_pod_level_resource_managers_gate_resets_the_checkpoints(
    tmp_path: Path, old_gates: dict[str, bool], new_gates: dict[str, bool], reset: bool
) -> None:
    # The gate switches the CPU manager's checkpoint between its v2 and v3 formats, which each side
    # refuses: the role treats a flip like a policy change (drain, remove the checkpoints).
    base = {"cpuManagerPolicy": "static", "reservedSystemCPUs": "0-3"}
    playbook = tmp_path / "changes.yml"
    playbook.write_text(
        yaml.safe_dump(
            [
                {
                    "hosts": "all",
                    "gather_facts": False,
                    "vars_files": [str(ROOT / "roles/lowtail_kubelet/vars/main.yml")],
                    "vars": {
                        "__lowtail_kubelet_old": {**base, "featureGates": old_gates},
                        "__lowtail_kubelet_new": {**base, "featureGates": new_gates},
                    },
                    "tasks": [
                        {
                            "ansible.builtin.debug": {
                                "msg": "changes {{ __lowtail_kubelet_checkpoint_changes | to_json }}"
                            }
                        }
                    ],
                }
            ]
        )
    )
    result = run_ansible(["ansible-playbook", "-i", str(local_node_inventory(tmp_path)), str(playbook)])
    out = " ".join((result.stdout + result.stderr).split())
    assert result.returncode == 0, out
    wanted = '["featureGates.PodLevelResourceManagers"]' if reset else "[]"
    assert f"changes {wanted}" in out, out


@pytest.mark.parametrize(
    ("version", "containerd", "rc", "message"),
    [
        # Debian 12's containerd: a branch past its end of life, not recommended for 1.36.
        (
            "1.36.3",
            "containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+b1",
            2,
            "containerd 1.6.20 is a release branch past its end of life; containerd recommends 2.3.0+, "
            "2.2.0+ for Kubernetes 1.36",
        ),
        # Supported, but older than containerd recommends for 1.37: a warning, preflight passes.
        (
            "1.37.2",
            "containerd containerd.io v2.2.1 abc",
            0,
            "WARNING containerd 2.2.1 is older than what containerd recommends 2.4.0+, 2.3.0+ for "
            "Kubernetes 1.37",
        ),
        ("1.37.2", "containerd github.com/containerd/containerd/v2 v2.3.7 abc", 0, None),
    ],
    ids=["end_of_life", "older_than_recommended", "recommended"],
)
def test_containerd_is_checked_against_containerds_matrix(
    tmp_path: Path, version: str, containerd: str, rc: int, message: str | None
) -> None:
    versions = {"kernel_release": "6.1.0-28-amd64", "oci_runtimes": {}, "engines": {"containerd": containerd}}
    code, out = run_preflight(tmp_path, version, KUBEADM, lowtail_versions=versions)
    assert code == rc, out
    if message:
        assert message in out, out
    else:
        assert "WARNING containerd" not in out, out
