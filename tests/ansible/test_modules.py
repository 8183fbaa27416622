"""library/lowtail_node_plan.py and library/lowtail_irq_affinity.py, as functions and through Ansible."""

from __future__ import annotations

import json
import shutil
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
        # Fixture trees describe topology only; test_init_* below covers PID 1.
        "require_systemd": False,
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


def test_l3_as_numa_host_has_24_nodes_and_its_kubelet_config_gets_the_numa_limit(
    node_plan_module: ModuleType, machine_roots: dict
) -> None:
    from lowtail.node import kubelet_options as ko

    node, _ = node_plan_module.build_node(params(*machine_roots["epyc9634_2s_l3numa"]))
    numa = node["topology"]["numa_nodes"]
    assert numa == 24
    assert [r["numaNode"] for r in node["kubelet_memory"]["reserved_memory"]] == list(range(24))
    chosen = ko.choose_options("v1.37.2", None, {}, "single-numa-node", numa)
    cfg = {
        "cpuManagerPolicy": "static",
        "cpuManagerPolicyOptions": chosen.options,
        "reservedSystemCPUs": node["plan"]["housekeeping"],
        "topologyManagerPolicy": "single-numa-node",
        "topologyManagerPolicyOptions": chosen.topology_options,
    }
    assert chosen.topology_options == {"max-allowable-numa-nodes": "24"}
    assert ko.check_config("v1.37.2", cfg, numa).problems == []
    without = ko.check_config("v1.37.2", {**cfg, "topologyManagerPolicyOptions": {}}, numa).problems
    assert len(without) == 1 and "this host has 24" in without[0], without


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
        (-2, 1000000, False, "expected -1 or 1..1000000"),
        (0, 1000000, True, "lowtail_rt_runtime_us 0 gives real-time tasks no CPU time"),
        (1000000, 1000000, False, "1000000 (the whole period: no RT throttling) without stalld"),
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
        "unthrottled": False,
    }
    assert node_plan_module.check_rt_budget(-1, 1000000, True)["unthrottled"]
    # The whole period throttles nothing: accepted with stalld, and marked unthrottled like -1.
    assert node_plan_module.check_rt_budget(1000000, 1000000, True)["unthrottled"]
    assert not node_plan_module.check_rt_budget(950000, 1000000, False)["unthrottled"]


@pytest.mark.parametrize("serial", [1, "3", "25%", "12.5%", "100%", [1, "10%", "50%"]])
def test_serial_accepts_counts_and_percentages(node_plan_module: ModuleType, serial: object) -> None:
    node_plan_module.check_serial(serial)


@pytest.mark.parametrize("serial", ["abc", 0, "0", "0%", "150%", -1, True, "25 %x", [1, "x"], None])
def test_serial_refuses_anything_else(node_plan_module: ModuleType, serial: object) -> None:
    with pytest.raises(node_plan_module.PreflightError, match="lowtail_serial"):
        node_plan_module.check_serial(serial)


@pytest.mark.parametrize(
    "arg",
    [
        "quiet$(reboot)",
        "a`id`",
        'dyndbg="+p"',
        "x'y",
        "a;b",
        "a b",
        "a|b",
        "a&b",
        "a>b",
        "a\\b",
        "a\nb",
        "${IFS}",
        "",
        3,
    ],
)
def test_kernel_argument_with_shell_syntax_is_refused(node_plan_module: ModuleType, arg: object) -> None:
    with pytest.raises(node_plan_module.PreflightError, match="may only use letters"):
        node_plan_module.check_kernel_args([arg], None, set())


def test_safe_kernel_arguments_pass(node_plan_module: ModuleType) -> None:
    node_plan_module.check_kernel_args(
        ["mitigations=auto", "audit=0", "console=ttyS0,115200n8", "intel_iommu=on", "a.b-c=x:y/z+1@2"],
        1,
        set(),
    )


def test_kernel_argument_checks_report_every_problem(node_plan_module: ModuleType) -> None:
    with pytest.raises(node_plan_module.PreflightError) as e:
        node_plan_module.check_kernel_args(["nohz_full=1", "a;b", "audit=0", "audit=1"], -1, {"nohz_full"})
    assert len(e.value.problems) == 4, e.value.problems
    text = str(e.value)
    assert text.startswith("4 problems: (1) lowtail_kernel_cstate_limit -1")
    assert "'nohz_full=1' sets nohz_full, which lowtail already sets" in text
    assert "'audit=1' sets audit, which is given twice" in text


def _node_meminfo(sys_root: Path, gib: int) -> None:
    for node in (sys_root / "devices/system/node").glob("node[0-9]*"):
        (node / "meminfo").write_text(f"Node {node.name[4:]} MemTotal:       {gib * 2**20} kB\n")


def test_hugepages_must_fit_each_numa_node(node_plan_module: ModuleType, tmp_path: Path) -> None:
    sys_root = tmp_path / "sys"
    for n in (0, 1):
        (sys_root / f"devices/system/node/node{n}").mkdir(parents=True)
    _node_meminfo(sys_root, 64)
    reserved = {0: 2**30, 1: 2**30}
    check = node_plan_module.check_hugepages
    # 126 x 1G is 63 per node: 63 GiB + 1 GiB reserved fits a 64 GiB node exactly.
    assert check(sys_root, {"size": "1G", "count": 126}, reserved)["per_node"] == {0: 63, 1: 63}
    with pytest.raises(node_plan_module.PreflightError) as e:
        check(sys_root, {"size": "1G", "count": 127}, reserved)  # 64 on node 0 (round-robin) + 1 GiB
    assert len(e.value.problems) == 2 and "NUMA node 0 would need 64 x 1G" in str(e.value)
    assert "expected at most 126 pages" in str(e.value)
    assert check(sys_root, {"size": "2M", "count": 0}, reserved)["count"] == 0
    with pytest.raises(node_plan_module.PreflightError, match="count -4"):
        check(sys_root, {"size": "1G", "count": -4}, reserved)
    (sys_root / "devices/system/node/node1/meminfo").unlink()
    with pytest.raises(node_plan_module.PreflightError, match="cannot read MemTotal of NUMA node 1"):
        check(sys_root, {"size": "2M", "count": 2}, reserved)


def test_init_other_than_systemd_is_refused(
    node_plan_module: ModuleType, tmp_path: Path, machine_roots: dict
) -> None:
    sys_root, proc_root = machine_roots["epyc9634_2s"]
    with pytest.raises(node_plan_module.PreflightError, match="PID 1 is 'unknown'"):
        node_plan_module.build_node(params(sys_root, proc_root, require_systemd=True))


def test_every_bad_input_is_reported_at_once(node_plan_module: ModuleType, machine_roots: dict) -> None:
    sys_root, proc_root = machine_roots["vmware_88"]
    with pytest.raises(node_plan_module.PreflightError) as e:
        node_plan_module.build_node(
            params(
                sys_root,
                proc_root,
                rt_runtime_us=0,
                serial="abc",
                cstate_limit=-1,
                kernel_extra_args=["$(reboot)"],
                housekeeping="0-500",
                require_systemd=True,
            )
        )
    problems = e.value.problems
    assert len(problems) == 7, problems
    for fragment in (
        "PID 1",
        "lowtail_rt_runtime_us 0",
        "lowtail_serial 'abc'",
        "lowtail_allow_virtual is false",
        "lowtail_housekeeping '0-500'",
        "lowtail_kernel_cstate_limit -1",
        "'$(reboot)'",
    ):
        assert any(fragment in p for p in problems), (fragment, problems)


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
    assert again == {"moved": [], "unmovable": [], "gone": [], "default_changed": False}


def test_irq_already_on_a_housekeeping_cpu_is_not_moved_again(irq_module: ModuleType, tmp_path: Path) -> None:
    """irqbalance puts each IRQ on one housekeeping CPU; the module must not widen it back every run."""
    _, proc_root = write_host(tmp_path / "host")
    wanted = frozenset(range(7)) | frozenset(range(84, 91))
    irq_module.set_affinity(proc_root, wanted, check_mode=False)
    (proc_root / "irq/3/smp_affinity_list").write_text("5\n")  # irqbalance's choice
    (proc_root / "irq/4/smp_affinity_list").write_text("5-8\n")  # reaches isolated CPUs 7-8
    again = irq_module.set_affinity(proc_root, wanted, check_mode=False)
    assert again["moved"] == [4], again
    assert (proc_root / "irq/3/smp_affinity_list").read_text().strip() == "5"
    assert (proc_root / "irq/4/smp_affinity_list").read_text().strip() == "0-6,84-90"


def test_default_only_restores_the_default_and_leaves_irqs(irq_module: ModuleType, tmp_path: Path) -> None:
    _, proc_root = write_host(tmp_path / "host")
    wanted = frozenset(range(7)) | frozenset(range(84, 91))
    irq_module.set_affinity(proc_root, wanted, check_mode=False)
    every = frozenset(range(168))
    back = irq_module.set_affinity(proc_root, every, check_mode=False, default_only=True)
    assert back == {"moved": [], "unmovable": [], "gone": [], "default_changed": True}
    assert (
        proc_root / "irq/default_smp_affinity"
    ).read_text().strip() == "ff,ffffffff,ffffffff,ffffffff,ffffffff,ffffffff"
    assert (proc_root / "irq/0/smp_affinity_list").read_text().strip() == "0-6,84-90"


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
            json.dumps(
                {
                    "sysfs_root": str(sys_root),
                    "procfs_root": str(proc_root),
                    "housekeeping": 1,
                    "require_systemd": False,
                    # One key alone: Ansible's argument spec fills the others from the module's defaults.
                    "kubelet_memory": {"system_reserved": "2Gi"},
                }
            ),
        ]
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert '"housekeeping": "0,84"' in result.stdout
    assert '"system_reserved": "2Gi"' in result.stdout and '"kube_reserved": "1Gi"' in result.stdout


def test_irq_record_keeps_the_affinity_from_before_lowtail_and_restore_puts_it_back(
    irq_module: ModuleType, tmp_path: Path
) -> None:
    _, proc_root = write_host(tmp_path / "host")
    (proc_root / "irq/1/smp_affinity_list").write_text("100-110\n")
    (proc_root / "irq/2/smp_affinity_list").write_text("0-3\n")
    record = tmp_path / "irq-before.json"
    hk = frozenset(range(7)) | frozenset(range(84, 91))
    irq_module.set_affinity(proc_root, hk, check_mode=False, record=record)
    # A second run (irqbalance moved IRQ 1 meanwhile) keeps the first value: the record is pre-lowtail.
    (proc_root / "irq/1/smp_affinity_list").write_text("120\n")
    irq_module.set_affinity(proc_root, hk, check_mode=False, record=record)
    kept = json.loads(record.read_text())
    assert kept["irqs"]["1"] == "100-110" and "2" not in kept["irqs"]  # IRQ 2 was never moved
    shutil.rmtree(proc_root / "irq/5")  # an IRQ that went away (a removed device)
    back = irq_module.restore_affinity(proc_root, frozenset(range(168)), record, check_mode=False)
    assert back["gone"] == [5] and 1 in back["moved"] and back["default_changed"]
    assert (proc_root / "irq/1/smp_affinity_list").read_text().strip() == "100-110"
    assert (proc_root / "irq/0/smp_affinity_list").read_text().strip() == "0-167"
    assert (proc_root / "irq/2/smp_affinity_list").read_text().strip() == "0-3"


def test_sysfs_values_record_the_choice_and_restore_reports_what_it_could_not(
    sysfs_module: ModuleType, tmp_path: Path
) -> None:
    root = tmp_path / "sys"
    thp = root / "kernel/mm/transparent_hugepage/enabled"
    thp.parent.mkdir(parents=True)
    thp.write_text("[always] madvise never\n")
    for cpu in (0, 1):
        gov = root / f"devices/system/cpu/cpu{cpu}/cpufreq/scaling_governor"
        gov.parent.mkdir(parents=True)
        gov.write_text("schedutil\n")
    tmpfiles = tmp_path / "lowtail.conf"
    tmpfiles.write_text(
        "# comment\n\nw /sys/kernel/mm/transparent_hugepage/enabled - - - - never\n"
        "w /sys/devices/system/cpu/cpu*/cpufreq/scaling_governor - - - - performance\n"
        "w /sys/kernel/mm/ksm/run - - - - 2\n"  # absent here: nothing to record
    )
    record = tmp_path / "sysfs-before.json"
    sysfs_module.record_values(tmpfiles, root, record, check_mode=False)
    assert json.loads(record.read_text()) == {
        "/sys/kernel/mm/transparent_hugepage/enabled": "always",
        "/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor": "schedutil",
        "/sys/devices/system/cpu/cpu1/cpufreq/scaling_governor": "schedutil",
    }
    thp.write_text("always madvise [never]\n")
    (root / "devices/system/cpu/cpu0/cpufreq/scaling_governor").write_text("performance\n")
    shutil.rmtree(root / "devices/system/cpu/cpu1")
    back = sysfs_module.restore_values(root, record, check_mode=False)
    assert back["gone"] == ["/sys/devices/system/cpu/cpu1/cpufreq/scaling_governor"]
    assert sorted(back["restored"]) == [
        "/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor",
        "/sys/kernel/mm/transparent_hugepage/enabled",
    ]
    assert thp.read_text() == "always\n"
    with pytest.raises(ValueError, match="expected only 'w' lines"):
        sysfs_module.written_paths("d /run/lowtail 0755 root root -\n")
    with pytest.raises(ValueError, match="expected a path under /sys/"):
        sysfs_module.written_paths("w /etc/passwd - - - - x\n")


def test_cgroup_v2_host_plans_as_on_v1_and_reports_v2(
    node_plan_module: ModuleType, machine_roots: dict
) -> None:
    v2, _ = node_plan_module.build_node(params(*machine_roots["epyc9634_2s_cgroup2"]))
    v1, _ = node_plan_module.build_node(params(*machine_roots["epyc9634_2s"]))
    # The plain fixture has no fs/cgroup at all (version unknown); the v2 one has the unified hierarchy.
    assert (v2["kernel"]["cgroup_version"], v1["kernel"]["cgroup_version"]) == (2, None)
    assert v2["plan"] == v1["plan"]
    assert v2["kubelet_memory"] == v1["kubelet_memory"]
