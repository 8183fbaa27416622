"""library/lowtail_node_plan.py and library/lowtail_irq_affinity.py, as functions and through Ansible."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.ansible.conftest import run_ansible
from tests.ansible.fixture_tree import N_IRQS, write_host


def params(sys_root: Path, proc_root: Path, boot: Path | None = None, **kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "sysfs_root": str(sys_root),
        "procfs_root": str(proc_root),
        "boot_root": str(boot or sys_root.parent / "boot"),
        "kernel_release": "6.1.0-lowtail",
        "housekeeping": "auto",
        "amd_pstate": "guided",
        "allow_virtual": False,
        "expected_hardware": None,
        "rt_runtime_us": 950000,
        "rt_period_us": 1000000,
        "stalld": False,
        "kubelet_memory": {
            "kube_reserved": "1Gi",
            "system_reserved": "1Gi",
            "eviction_hard": "100Mi",
            "per_numa": "auto",
        },
    }
    base.update(kw)
    return base


def test_epyc_9634_plan_masks_and_memory(node_plan_module: ModuleType, machine_roots: dict) -> None:
    node, warnings = node_plan_module.build_node(params(*machine_roots["epyc9634_2s"]))
    assert node["plan"]["housekeeping"] == "0-6,84-90"
    assert node["plan"]["isolated"] == "7-83,91-167"
    assert node["masks"]["housekeeping"] == "7f00000,00000000,0000007f"
    assert node["topology"]["sockets"] == 2 and node["topology"]["l3_per_socket"] == 12
    assert node["kubelet_memory"]["reserved_memory"] == [
        {"numaNode": 0, "limits": {"memory": "1074Mi"}},
        {"numaNode": 1, "limits": {"memory": "1074Mi"}},
    ]
    assert "amd_pstate=guided" in node["plan"]["kernel_args"]
    assert any("CONFIG_RT_GROUP_SCHED" in w for w in warnings)  # no /boot/config in the fixture


def test_virtual_host_fails_unless_allowed(node_plan_module: ModuleType, machine_roots: dict) -> None:
    with pytest.raises(node_plan_module.PreflightError, match="lowtail_allow_virtual is false"):
        node_plan_module.build_node(params(*machine_roots["vmware_88"]))
    node, warnings = node_plan_module.build_node(params(*machine_roots["vmware_88"], allow_virtual=True))
    assert node["topology"]["deceptive"] and any("virtual host" in w for w in warnings)


def test_bios_that_differs_from_the_inventory_fails(
    node_plan_module: ModuleType, machine_roots: dict
) -> None:
    expected = {"sockets": 2, "numa_per_socket": 1, "smt": False, "l3_per_socket": None}
    with pytest.raises(node_plan_module.PreflightError) as e:
        node_plan_module.build_node(params(*machine_roots["epyc_2s_nps4"], expected_hardware=expected))
    assert "numa_per_socket expected 1, host has 4" in str(e.value)
    assert "smt expected False, host has True" in str(e.value)


@pytest.mark.parametrize(
    ("runtime", "period", "stalld", "message"),
    [
        (
            2000000,
            1000000,
            False,
            "lowtail_rt_runtime_us 2000000 is larger than lowtail_rt_period_us 1000000",
        ),
        ("95%", 1000000, False, "lowtail_rt_runtime_us '95%': expected an integer"),
        (950000.5, 1000000, False, "lowtail_rt_runtime_us 950000.5: expected an integer"),
        (True, 1000000, False, "lowtail_rt_runtime_us True"),
        (-1, 1000000, False, "without stalld"),
        (-2, 1000000, False, "expected -1 or 0..1000000"),
        (500000, 0, False, "lowtail_rt_period_us 0"),
    ],
)
def test_bad_rt_budget_names_the_value(
    node_plan_module: ModuleType, runtime: object, period: object, stalld: bool, message: str
) -> None:
    with pytest.raises(node_plan_module.PreflightError, match=None) as e:
        node_plan_module.check_rt_budget(runtime, period, stalld)
    assert message in str(e.value)


def test_good_rt_budgets(node_plan_module: ModuleType) -> None:
    assert node_plan_module.check_rt_budget("950000", 1000000, False) == {
        "runtime_us": 950000,
        "period_us": 1000000,
    }
    assert node_plan_module.check_rt_budget(-1, 1000000, True)["runtime_us"] == -1


def test_kernel_config_and_cgroup_detection(node_plan_module: ModuleType, tmp_path: Path) -> None:
    sys_root, proc_root, boot = tmp_path / "sys", tmp_path / "proc", tmp_path / "boot"
    (sys_root / "fs/cgroup").mkdir(parents=True)
    (sys_root / "fs/cgroup/cgroup.controllers").write_text("cpu memory\n")
    boot.mkdir()
    (boot / "config-6.1.0-a").write_text("CONFIG_SMP=y\nCONFIG_RT_GROUP_SCHED=y\n")
    (boot / "config-6.1.0-b").write_text("# CONFIG_RT_GROUP_SCHED is not set\n")
    facts = node_plan_module.kernel_facts
    assert facts(sys_root, proc_root, boot, "6.1.0-a")["rt_group_sched"] is True
    assert facts(sys_root, proc_root, boot, "6.1.0-b")["rt_group_sched"] is False
    missing = facts(sys_root, proc_root, boot, "6.1.0-c")
    assert missing["rt_group_sched"] is None and missing["cgroup_version"] == 2
    (sys_root / "fs/cgroup/cgroup.controllers").unlink()
    assert facts(sys_root, proc_root, boot, "6.1.0-a")["cgroup_version"] == 1


def test_irq_affinity_moves_every_irq_once(irq_module: ModuleType, tmp_path: Path) -> None:
    _, proc_root = write_host(tmp_path / "host")
    wanted = frozenset(range(7)) | frozenset(range(84, 91))
    dry = irq_module.set_affinity(proc_root, wanted, check_mode=True)
    assert dry["moved"] == list(range(N_IRQS)) and dry["default_changed"]
    assert (proc_root / "irq/0/smp_affinity_list").read_text().strip() == "0-167"  # check mode wrote nothing
    done = irq_module.set_affinity(proc_root, wanted, check_mode=False)
    assert done["moved"] == list(range(N_IRQS))
    assert {(proc_root / f"irq/{i}/smp_affinity_list").read_text().strip() for i in range(N_IRQS)} == {
        "0-6,84-90"
    }
    assert (proc_root / "irq/default_smp_affinity").read_text().strip() == "7f00000,00000000,0000007f"
    again = irq_module.set_affinity(proc_root, wanted, check_mode=False)
    assert again == {"moved": [], "unmovable": [], "default_changed": False}


def test_module_runs_on_a_python_without_lowtail(machine_roots: dict) -> None:
    """AnsiballZ carries module_utils/lowtail (relative imports too): /usr/bin/python3 has no lowtail."""
    probe = subprocess.run(["/usr/bin/python3", "-c", "import lowtail"], capture_output=True, check=False)
    assert probe.returncode != 0, "this test needs a system python without lowtail installed"
    sys_root, proc_root = machine_roots["epyc9634_2s"]
    result = run_ansible(
        [
            "ansible",
            "localhost",
            "-i",
            "localhost,",
            "-c",
            "local",
            "-o",
            "-e",
            "ansible_python_interpreter=/usr/bin/python3",
            "-m",
            "lowtail_node_plan",
            "-a",
            json.dumps({"sysfs_root": str(sys_root), "procfs_root": str(proc_root), "housekeeping": 1}),
        ]
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert '"housekeeping": "0,84"' in result.stdout
