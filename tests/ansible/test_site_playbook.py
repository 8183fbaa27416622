"""site.yml end to end over a local connection against fixture machines, always in check mode.

Each bad input must fail the preflight play (on its host, and stop the healthy host too: any_errors_fatal)
with a message that names the value, before the provisioning play starts. A good inventory shows what
check mode would change and changes nothing on this machine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.ansible.conftest import run_ansible

LOCAL = {"ansible_connection": "local", "ansible_python_interpreter": "/usr/bin/python3"}


def write_inventory(
    tmp_path: Path, roots: dict[str, tuple[Path, Path]], hosts: dict[str, dict[str, Any]]
) -> Path:
    entries = {}
    for name, host in hosts.items():
        spec = dict(host)
        sys_root, proc_root = roots[spec.pop("machine")]
        entries[name] = {
            **LOCAL,
            "lowtail_sysfs_root": str(sys_root),
            "lowtail_procfs_root": str(proc_root),
            "lowtail_boot_root": str(tmp_path / "boot"),
            # Nothing here may touch this machine even outside check mode.
            "lowtail_kernel_apply": False,
            "lowtail_tuning_apply": False,
            "lowtail_kubelet_apply": False,
            "lowtail_kernel_grub_dropin": str(tmp_path / "grub.d/60-lowtail.cfg"),
            "lowtail_kubelet_config_path": str(tmp_path / "kubelet/config.yaml"),
            **spec,
        }
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {"lowtail_nodes": {"hosts": entries}}}}))
    return inventory


def run_site(inventory: Path) -> tuple[int, str]:
    result = run_ansible(["ansible-playbook", "-i", str(inventory), "site.yml", "--check", "--diff"])
    return result.returncode, result.stdout + result.stderr


GOOD = {"machine": "epyc9634_2s"}

BAD_INPUTS = {
    "housekeeping_cpu_missing": (
        {"machine": "epyc9634_2s", "lowtail_housekeeping": "0-6,84-90,200"},
        "CPUs 200 do not exist or are offline",
    ),
    "housekeeping_cpu_offline": (
        {"machine": "offline_cpus", "lowtail_housekeeping": "0,6,16,22"},
        "CPUs 6,22 do not exist or are offline",
    ),
    "housekeeping_splits_core": (
        {"machine": "epyc9634_2s_smt", "lowtail_housekeeping": "0-6,84-90"},
        "'0-6,84-90' splits cores",
    ),
    "housekeeping_leaves_nothing": (
        {"machine": "epyc9634_2s", "lowtail_housekeeping": "0-167"},
        "takes every online CPU",
    ),
    "housekeeping_too_many_cores": (
        {"machine": "epyc9634_2s", "lowtail_housekeeping": 85},
        "housekeeping 85 cores per socket",
    ),
    "rt_runtime_above_period": (
        {"machine": "epyc9634_2s", "lowtail_rt_runtime_us": 1500000},
        "lowtail_rt_runtime_us 1500000 is larger than lowtail_rt_period_us 1000000",
    ),
    "rt_runtime_not_integer": (
        {"machine": "epyc9634_2s", "lowtail_rt_runtime_us": "95%"},
        "lowtail_rt_runtime_us '95%': expected an integer",
    ),
    "rt_unlimited_without_stalld": (
        {"machine": "epyc9634_2s", "lowtail_rt_runtime_us": -1},
        "lowtail_rt_runtime_us -1 (no RT throttling) without stalld",
    ),
    "memory_unbalanced": (
        {
            "machine": "epyc9634_2s",
            "lowtail_kubelet_memory": {
                "kube_reserved": "1Gi",
                "system_reserved": "1Gi",
                "eviction_hard": "100Mi",
                "per_numa": {0: "1Gi", 1: "1Gi"},
            },
        },
        "memory reservations do not balance",
    ),
    "unknown_key_in_memory_dict": (
        {"machine": "epyc9634_2s", "lowtail_kubelet_memory": {"kube_reservd": "1Gi"}},
        "kube_reservd",
    ),
    "unknown_key_in_hardware_dict": (
        {"machine": "epyc9634_2s", "lowtail_expected_hardware": {"sokets": 2}},
        "sokets",
    ),
    "virtual_not_allowed": ({"machine": "vmware_88"}, "lowtail_allow_virtual is false"),
    "bios_differs": (
        {"machine": "epyc_2s_nps4", "lowtail_expected_hardware": {"numa_per_socket": 1}},
        "numa_per_socket expected 1, host has 4",
    ),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_fails_in_preflight_before_any_change(
    case: str, tmp_path: Path, machine_roots: dict[str, tuple[Path, Path]]
) -> None:
    bad, message = BAD_INPUTS[case]
    inventory = write_inventory(tmp_path, machine_roots, {"good-host": GOOD, "bad-host": bad})
    rc, out = run_site(inventory)
    assert rc != 0, out
    assert message in out, out
    assert "PLAY [Preflight" in out and "PLAY [Provision" not in out, out
    # The healthy host stopped too (any_errors_fatal), and nothing changed anywhere.
    recap = out[out.rindex("PLAY RECAP") :]
    assert "changed=0" in recap.split("good-host")[1].splitlines()[0], recap
    assert "changed=0" in recap.split("bad-host")[1].splitlines()[0], recap


@pytest.mark.slow
def test_check_mode_reports_changes_and_changes_nothing(
    tmp_path: Path, machine_roots: dict[str, tuple[Path, Path]]
) -> None:
    inventory = write_inventory(tmp_path, machine_roots, {"good-host": GOOD})
    owned = [
        Path("/etc/sysctl.d/60-lowtail.conf"),
        Path("/etc/tmpfiles.d/lowtail-tuning.conf"),
        Path("/etc/systemd/system.conf.d/60-lowtail-cpu-affinity.conf"),
    ]
    before = {p: p.exists() for p in owned}
    rc, out = run_site(inventory)
    assert rc == 0, out
    assert "PLAY [Provision" in out
    # --diff shows the GRUB drop-in that would be written, with the plan's arguments.
    assert "isolcpus=managed_irq,7-83,91-167 nohz_full=7-83,91-167" in out, out
    assert "IRQBALANCE_BANNED_CPULIST=7-83,91-167" in out, out
    recap = out[out.rindex("PLAY RECAP") :]
    assert "changed=0" not in recap.split("good-host")[1].splitlines()[0], recap
    assert not (tmp_path / "grub.d").exists()
    assert {p: p.exists() for p in owned} == before


@pytest.mark.slow
def test_example_inventory_passes_preflight_on_its_hardware(
    tmp_path: Path, machine_roots: dict[str, tuple[Path, Path]]
) -> None:
    """inventory/example describes 2 x EPYC 9634 hosts: its group_vars (expected hardware included) and
    its per-host housekeeping must pass preflight on that machine's fixture tree."""
    root = Path(__file__).resolve().parents[2] / "inventory/example"
    group_vars = yaml.safe_load((root / "group_vars/lowtail_nodes.yml").read_text())
    group_vars.pop("ansible_user")
    hosts = yaml.safe_load((root / "hosts.yml").read_text())["all"]["children"]["lowtail_nodes"]["hosts"]
    inventory = write_inventory(
        tmp_path,
        machine_roots,
        {
            name: {
                "machine": "epyc9634_2s",
                **group_vars,
                **{k: v for k, v in (spec or {}).items() if k != "ansible_host"},
            }
            for name, spec in hosts.items()
        },
    )
    result = run_ansible(["ansible-playbook", "-i", str(inventory), "playbooks/preflight.yml", "--check"])
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    words = " ".join(out.split())  # the YAML callback may wrap the plan message
    assert "housekeeping 0-6,84-90," in words and "housekeeping 0-13,84-97," in words, out
