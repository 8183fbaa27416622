from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lowtail.node import cpulist
from lowtail.node.plan import Plan, PlanError, check_invariants, load_plan, make_plan
from lowtail.node.topology import read_topology
from tests.fixtures.machines import MACHINES


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_auto_plan_keeps_invariants_on_every_fixture(
    name: str, machine_roots: dict[str, tuple[Path, Path]]
) -> None:
    topo = read_topology(*machine_roots[name])
    plan = make_plan(topo)
    check_invariants(topo, plan)
    assert plan.housekeeping | plan.isolated == topo.online
    assert not plan.housekeeping & plan.isolated
    # round trip through JSON, as the runtime and the roles read it
    assert Plan.from_dict(json.loads(json.dumps(plan.to_dict()))) == plan


def test_auto_takes_the_first_l3_group_of_each_socket(machine_roots: dict[str, tuple[Path, Path]]) -> None:
    topo = read_topology(*machine_roots["epyc9634_2s"])
    plan = make_plan(topo)
    assert cpulist.format(plan.housekeeping) == "0-6,84-90"
    assert plan.per_node[0][0] == frozenset(range(7))
    assert plan.per_node[1][1] == frozenset(range(91, 168))
    assert len(plan.l3_pools) == 24
    assert plan.l3_pools[0].isolated == frozenset()
    assert plan.l3_pools[1].isolated == frozenset(range(7, 14))


def test_auto_with_smt_keeps_siblings_together(machine_roots: dict[str, tuple[Path, Path]]) -> None:
    plan = make_plan(read_topology(*machine_roots["epyc9634_2s_smt"]))
    assert cpulist.format(plan.housekeeping) == "0-6,84-90,168-174,252-258"


def test_cores_per_socket_count(machine_roots: dict[str, tuple[Path, Path]]) -> None:
    plan = make_plan(read_topology(*machine_roots["epyc9634_2s_smt"]), 2)
    assert cpulist.format(plan.housekeeping) == "0-1,84-85,168-169,252-253"
    assert make_plan(read_topology(*machine_roots["epyc9634_2s_smt"]), "2") == plan


def test_kernel_arguments_follow_the_plan(machine_roots: dict[str, tuple[Path, Path]]) -> None:
    plan = make_plan(read_topology(*machine_roots["epyc9634_2s"]))
    args = plan.kernel_args
    assert "isolcpus=managed_irq,7-83,91-167" in args
    assert "nohz_full=7-83,91-167" in args
    assert "rcu_nocbs=7-83,91-167" in args
    assert "irqaffinity=0-6,84-90" in args
    assert "systemd.cpu_affinity=0-6,84-90" in args
    assert {"skew_tick=1", "nosoftlockup", "tsc=reliable", "nmi_watchdog=0", "iommu=pt"} <= set(args)
    assert "amd_pstate=guided" in args
    assert not any(a.startswith("isolcpus=domain") for a in args)


def test_nps4_pools_per_node(machine_roots: dict[str, tuple[Path, Path]]) -> None:
    topo = read_topology(*machine_roots["epyc_2s_nps4"])
    plan = make_plan(topo)
    assert sorted(plan.per_node) == list(range(8))
    # housekeeping sits in the first node of each socket; the other nodes are fully isolated
    assert plan.per_node[0][0] and plan.per_node[4][0]
    assert not plan.per_node[1][0]
    assert all(p.node in range(8) for p in plan.l3_pools)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("0-6,84-90,500", "500 do not exist or are offline"),
        ("0-5", "splits cores"),
        ("0-335", "leaves no isolated|takes every online CPU"),
        ("0-6,168-174", "no CPU on socket 1"),
        ("85", "socket 0 has only 84 cores|expected"),
        ("many", "expected 'auto', a number of cores per socket"),
        ("0", "at least 1"),
    ],
)
def test_bad_housekeeping_is_rejected_naming_the_value(
    spec: str, message: str, machine_roots: dict[str, tuple[Path, Path]]
) -> None:
    topo = read_topology(*machine_roots["epyc9634_2s_smt"])
    with pytest.raises(PlanError, match=message):
        make_plan(topo, spec)


def test_offline_cpu_cannot_be_housekeeping(machine_roots: dict[str, tuple[Path, Path]]) -> None:
    topo = read_topology(*machine_roots["offline_cpus"])
    with pytest.raises(PlanError, match="CPUs 6 do not exist or are offline"):
        make_plan(topo, "0,6,16")
    plan = make_plan(topo, 1)
    assert 6 not in plan.isolated and 22 not in plan.isolated


def test_vmware_sockets_are_treated_as_one(machine_roots: dict[str, tuple[Path, Path]]) -> None:
    # every vCPU is its own "socket": requiring housekeeping on each would isolate nothing
    topo = read_topology(*machine_roots["vmware_88"])
    plan = make_plan(topo)
    assert plan.housekeeping == frozenset({0})
    assert make_plan(topo, 4).housekeeping == frozenset(range(4))


@settings(max_examples=40, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_any_whole_core_choice_with_every_socket_is_a_valid_plan(
    data: st.DataObject, machine_roots: dict[str, tuple[Path, Path]]
) -> None:
    topo = read_topology(*machine_roots["epyc_2s_nps4"])
    hk: set[int] = set()
    for socket in topo.sockets:
        cores = topo.cores_of_socket(socket)
        picks = data.draw(st.sets(st.integers(0, len(cores) - 2), min_size=1, max_size=6))
        for i in picks:
            hk |= cores[i]
    plan = make_plan(topo, cpulist.format(hk))
    check_invariants(topo, plan)
    assert plan.housekeeping == hk


@pytest.mark.parametrize(
    ("content", "why"),
    [
        ("[" * 100_000 + "]" * 100_000, "nested too deeply"),
        ('{"housekeeping": ' + "9" * 5000 + "}", "digits"),
        ("[1]", "holds a JSON list, expected an object"),
        ('{"x": 1}', "missing or malformed field"),
    ],
)
def test_a_hostile_plan_file_is_a_plan_error_naming_it(tmp_path: Path, content: str, why: str) -> None:
    path = tmp_path / "plan.json"
    path.write_text(content)
    with pytest.raises(PlanError, match=why):
        load_plan(path)
