"""Static checks on fixture machines: each detection shown to fire, and shown not to fire on a tuned node."""

from __future__ import annotations

import json
from pathlib import Path

from lowtail.node.plan import make_plan
from lowtail.node.topology import read_topology
from lowtail.validation.check import Status
from lowtail.validation.runner import Options, run
from lowtail.validation.static import STATIC_CHECKS, Sources, parse_cmdline
from tests.fixtures.machines import MACHINES
from tests.validation.conftest import base_machine, by_name, validate_fixture

TUNED = "epyc9634_2s_tuned"
TUNED_CMDLINE = MACHINES[TUNED].proc_files["cmdline"]


# What a tuned node shows beyond the base fixture: amd_pstate in the plan's mode, the validator in a
# cgroup with no quota whose cpuset it may use whole.
TUNED_SELF = {
    "proc": {"self/cgroup": "0::/lowtail.slice", "self/status": "Cpus_allowed_list:\t0-167\n"},
    "sys": {
        "devices/system/cpu/amd_pstate/status": "guided",
        "fs/cgroup/cgroup.controllers": "cpuset cpu memory",
        "fs/cgroup/lowtail.slice/cpuset.cpus.effective": "0-167",
        "fs/cgroup/lowtail.slice/cpu.max": "max 100000",
        "fs/cgroup/lowtail.slice/cpu.stat": "nr_periods 0\nnr_throttled 0\nthrottled_usec 0",
    },
}


def test_tuned_node_passes_every_static_check_it_can_read(tmp_path: Path) -> None:
    report = validate_fixture(
        tmp_path,
        TUNED,
        # queue_core reads this process, not the fixture: tested on its own below
        (*(c for c in STATIC_CHECKS if c != "queue_core"), "cfs_throttle"),
        proc_files=TUNED_SELF["proc"],
        sys_files=TUNED_SELF["sys"],
    )
    statuses = {c.name: c.status for c in report.checks}
    # sched_fifo can only be tried on the running kernel, kubelet is absent on this fixture.
    assert statuses.pop("sched_fifo") is Status.SKIP
    assert statuses.pop("kubelet") is Status.SKIP
    assert all(s is Status.PASS for s in statuses.values()), statuses
    assert report.summary["status"] == "pass"


def test_vmware_guest_fails_the_topology_check(tmp_path: Path) -> None:
    check = by_name(validate_fixture(tmp_path, "vmware_88", ("topology",)))["topology"]
    assert check.status is Status.FAIL
    assert check.value == "deceptive VM topology"
    assert any("socket_per_cpu" in e for e in check.evidence)
    assert any("hypervisor_flag" in e for e in check.evidence)


def test_allow_virtual_turns_the_topology_failure_into_a_warning(tmp_path: Path) -> None:
    report = validate_fixture(tmp_path, "vmware_88", ("topology",), allow_virtual=True)
    assert by_name(report)["topology"].status is Status.WARN
    assert report.summary["status"] == "warn"
    assert not report.failed


def test_rt_runtime_500000_fails_the_rt_budget_check(tmp_path: Path) -> None:
    check = by_name(validate_fixture(tmp_path, "vmware_88_rt500", ("rt_budget",)))["rt_budget"]
    assert check.status is Status.FAIL
    assert check.value == "500000/1000000 (50%)"
    assert "400-470 ms" in check.reason


def test_rt_budget_passes_at_the_kernel_default_and_unlimited(tmp_path: Path) -> None:
    assert by_name(validate_fixture(tmp_path, TUNED, ("rt_budget",)))["rt_budget"].status is Status.PASS
    unlimited = validate_fixture(
        tmp_path / "u", TUNED, ("rt_budget",), proc_files={"sys/kernel/sched_rt_runtime_us": "-1\n"}
    )
    assert by_name(unlimited)["rt_budget"].value == "unlimited"


def test_rt_budget_with_garbage_fails_with_the_values(tmp_path: Path) -> None:
    report = validate_fixture(
        tmp_path, TUNED, ("rt_budget",), proc_files={"sys/kernel/sched_rt_runtime_us": "x"}
    )
    check = by_name(report)["rt_budget"]
    assert check.status is Status.FAIL
    assert "'x'" in check.reason


def test_cmdline_lacking_the_plans_arguments_fails_kernel_args(tmp_path: Path) -> None:
    cmdline = TUNED_CMDLINE.replace(" nohz_full=7-83,91-167", "").replace(
        "rcu_nocbs=7-83,91-167", "rcu_nocbs=7-83"
    )
    check = by_name(validate_fixture(tmp_path, TUNED, ("kernel_args",), proc_files={"cmdline": cmdline}))[
        "kernel_args"
    ]
    assert check.status is Status.FAIL
    assert set(check.data["missing"]) == {"nohz_full=7-83,91-167", "rcu_nocbs=7-83,91-167"}
    assert any("in effect: rcu_nocbs=7-83" in e for e in check.evidence)


def test_a_never_tuned_vm_lacks_every_argument(tmp_path: Path) -> None:
    check = by_name(validate_fixture(tmp_path, "vmware_88_rt500", ("kernel_args",)))["kernel_args"]
    assert check.status is Status.FAIL
    assert check.value == "0 of 11 in effect"


def test_kernel_args_compare_cpu_lists_not_strings(tmp_path: Path) -> None:
    # Same CPUs written differently, flags in another order: still in effect.
    cmdline = TUNED_CMDLINE.replace(
        "isolcpus=managed_irq,7-83,91-167", "isolcpus=7-40,41-83,91-167,managed_irq"
    )
    check = by_name(validate_fixture(tmp_path, TUNED, ("kernel_args",), proc_files={"cmdline": cmdline}))[
        "kernel_args"
    ]
    assert check.status is Status.PASS


def test_arguments_after_a_double_dash_belong_to_init() -> None:
    assert parse_cmdline("quiet isolcpus=1 -- nohz_full=1") == {"quiet": "", "isolcpus": "1"}


def test_a_plan_file_is_what_the_node_is_checked_against(tmp_path: Path) -> None:
    sys_root, proc_root = base_machine(TUNED) / "sys", base_machine(TUNED) / "proc"
    plan = make_plan(read_topology(sys_root, proc_root), "2")  # 2 cores per socket: not what was applied
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan.to_dict()))
    report = run(
        Options(
            src=Sources(sys_root=sys_root, proc_root=proc_root),
            plan_path=plan_path,
            only=("kernel_args", "isolation"),
            progress=False,
        )
    )
    assert {c.name: c.status for c in report.checks} == {"kernel_args": Status.FAIL, "isolation": Status.FAIL}
    assert report.host["plan_source"] == str(plan_path)


def test_isolated_list_different_from_the_plan_fails(tmp_path: Path) -> None:
    report = validate_fixture(
        tmp_path, TUNED, ("isolation",), sys_files={"devices/system/cpu/nohz_full": "8-83,91-167\n"}
    )
    check = by_name(report)["isolation"]
    assert check.status is Status.FAIL
    assert "nohz_full is 8-83,91-167" in check.reason


def test_an_irq_on_an_isolated_cpu_fails(tmp_path: Path) -> None:
    report = validate_fixture(
        tmp_path, TUNED, ("irq_affinity",), proc_files={"irq/77/effective_affinity_list": "9\n"}
    )
    check = by_name(report)["irq_affinity"]
    assert check.status is Status.FAIL
    assert check.value == "1 of 17 IRQs on isolated CPUs"
    assert check.evidence == ["irq 77: 9 (isolated 9)"]


def test_numa_balancing_fails_on_two_nodes_only(tmp_path: Path) -> None:
    on = {"sys/kernel/numa_balancing": "1\n"}
    assert (
        by_name(validate_fixture(tmp_path, TUNED, ("numa_balancing",), proc_files=on))[
            "numa_balancing"
        ].status
        is Status.FAIL
    )
    one_node = validate_fixture(tmp_path, "epyc_1s_nps1", ("numa_balancing",), proc_files=on)
    assert by_name(one_node)["numa_balancing"].status is Status.PASS


def test_thp_always_fails_and_madvise_warns(tmp_path: Path) -> None:
    for text, status in (("[always] madvise never", Status.FAIL), ("always [madvise] never", Status.WARN)):
        report = validate_fixture(
            tmp_path / status, TUNED, ("thp",), sys_files={"kernel/mm/transparent_hugepage/enabled": text}
        )
        assert by_name(report)["thp"].status is status


def test_powersave_governor_warns(tmp_path: Path) -> None:
    report = validate_fixture(
        tmp_path,
        TUNED,
        ("governor",),
        sys_files={"devices/system/cpu/cpu50/cpufreq/scaling_governor": "powersave"},
    )
    check = by_name(report)["governor"]
    assert check.status is Status.WARN
    assert "powersave: CPUs 50" in check.evidence


def test_rt_group_sched_in_the_kernel_config_fails_unless_disabled_at_boot(tmp_path: Path) -> None:
    config = "CONFIG_SMP=y\nCONFIG_RT_GROUP_SCHED=y\n"
    check = by_name(validate_fixture(tmp_path / "y", TUNED, ("rt_group_sched",), kernel_config=config))[
        "rt_group_sched"
    ]
    assert check.status is Status.FAIL
    disabled = validate_fixture(
        tmp_path / "off",
        TUNED,
        ("rt_group_sched",),
        kernel_config=config,
        proc_files={"cmdline": TUNED_CMDLINE.strip() + " rt_group_sched=0\n"},
    )
    assert by_name(disabled)["rt_group_sched"].status is Status.PASS


def test_fixture_without_kernel_config_skips_rather_than_reading_this_hosts(tmp_path: Path) -> None:
    check = by_name(validate_fixture(tmp_path, TUNED, ("rt_group_sched",), kernel_config=""))[
        "rt_group_sched"
    ]
    assert check.status is Status.SKIP
    assert "--kernel-config" in check.reason


def test_steal_time_above_one_percent_fails(tmp_path: Path) -> None:
    stat = "cpu  1000 0 0 8000 0 0 0 1000 0 0\n" + "".join(
        f"cpu{c} 100 0 0 800 0 0 0 {100 if c == 9 else 0} 0 0\n" for c in range(168)
    )
    check = by_name(validate_fixture(tmp_path, TUNED, ("steal",), proc_files={"stat": stat}))["steal"]
    assert check.status is Status.FAIL
    assert check.evidence[0] == "worst cpu9: 10.000%"


def test_kubelet_configuration_is_checked_against_the_plan(tmp_path: Path) -> None:
    good = {
        "kind": "KubeletConfiguration",
        "cpuManagerPolicy": "static",
        "reservedSystemCPUs": "0-6,84-90",
        "topologyManagerPolicy": "single-numa-node",
        "memoryManagerPolicy": "Static",
    }
    cfg, state = tmp_path / "config.yaml", tmp_path / "cpu_manager_state"
    cfg.write_text(json.dumps(good))  # JSON is YAML
    state.write_text(json.dumps({"policyName": "static", "defaultCpuSet": "0-6,84-90", "entries": {}}))
    report = validate_fixture(tmp_path, TUNED, ("kubelet",), kubelet_config=cfg, kubelet_state=state)
    assert by_name(report)["kubelet"].status is Status.PASS

    cfg.write_text(json.dumps({**good, "reservedSystemCPUs": "0-1", "cpuManagerPolicy": "none"}))
    check = by_name(
        validate_fixture(tmp_path / "b", TUNED, ("kubelet",), kubelet_config=cfg, kubelet_state=state)
    )["kubelet"]
    assert check.status is Status.FAIL
    assert "reservedSystemCPUs is '0-1', expected '0-6,84-90'" in check.reason
    assert "crash-loops" in check.reason  # state file says static, config says none


def test_a_plan_of_another_machine_is_refused(tmp_path: Path) -> None:
    import pytest

    from lowtail.validation.runner import ValidationError

    sys_root, proc_root = base_machine(TUNED) / "sys", base_machine(TUNED) / "proc"
    plan = make_plan(read_topology(sys_root, proc_root)).to_dict()
    plan["isolated"] += ",168-335"  # the CPUs of a bigger machine
    plan_path = tmp_path / "plan.json"
    plan_path.write_text(json.dumps(plan))
    with pytest.raises(ValidationError, match="CPUs 168-335 that are not online here"):
        run(Options(src=Sources(sys_root=sys_root, proc_root=proc_root), plan_path=plan_path, progress=False))


def test_queue_core_warns_when_the_python_path_runs(tmp_path: Path) -> None:
    from lowtail.shm import native

    with native.use(False):
        check = by_name(validate_fixture(tmp_path, TUNED, ("queue_core",)))["queue_core"]
    assert check.status is Status.WARN and check.value == "python"
    assert "Python path" in check.reason
    if native.available():
        check = by_name(validate_fixture(tmp_path / "again", TUNED, ("queue_core",)))["queue_core"]
        assert check.status is Status.PASS and check.value == "native"
