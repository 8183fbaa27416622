from __future__ import annotations

from pathlib import Path

import pytest

from lowtail.node import cpulist
from lowtail.node.topology import TopologyError, read_topology
from tests.fixtures.machines import MACHINES, MachineSpec


def test_epyc9634_two_sockets_smt_off(machine_roots: dict[str, tuple[Path, Path]]) -> None:
    topo = read_topology(*machine_roots["epyc9634_2s"])
    assert len(topo.cpus) == 168
    assert topo.sockets == (0, 1)
    assert topo.numa_nodes == (0, 1)
    assert topo.cores_per_socket == 84
    assert topo.threads_per_core == 1
    assert len(topo.l3_groups) == 24
    assert all(len(g) == 7 for g in topo.l3_groups)
    assert topo.cpus_of_node(1) == frozenset(range(84, 168))
    assert topo.vendor == "AuthenticAMD"
    assert not topo.findings and not topo.deceptive


def test_smt_siblings_are_paired_like_linux_numbers_them(machine_roots: dict[str, tuple[Path, Path]]) -> None:
    topo = read_topology(*machine_roots["epyc9634_2s_smt"])
    assert len(topo.cpus) == 336
    assert topo.threads_per_core == 2
    assert topo.by_cpu()[0].siblings == frozenset({0, 168})
    assert topo.by_cpu()[84].socket == 1 and topo.by_cpu()[84].siblings == frozenset({84, 252})
    # an L3 group holds 7 cores = 14 threads, and it never crosses a socket
    assert all(len(g) == 14 for g in topo.l3_groups)
    assert all(len({topo.by_cpu()[c].socket for c in g}) == 1 for g in topo.l3_groups)


def test_one_socket_nps1_has_one_node_and_is_not_deceptive(
    machine_roots: dict[str, tuple[Path, Path]],
) -> None:
    topo = read_topology(*machine_roots["epyc_1s_nps1"])
    assert topo.numa_nodes == (0,)
    assert topo.sockets == (0,)
    assert not topo.deceptive
    assert topo.findings == ()


def test_nps4_has_eight_nodes_each_inside_one_socket(machine_roots: dict[str, tuple[Path, Path]]) -> None:
    topo = read_topology(*machine_roots["epyc_2s_nps4"])
    assert topo.numa_nodes == tuple(range(8))
    for node in topo.numa_nodes:
        cpus = topo.cpus_of_node(node)
        assert len(cpus) == 48
        assert len({topo.by_cpu()[c].socket for c in cpus}) == 1


def test_vmware_guest_is_detected_as_deceptive_with_evidence(
    machine_roots: dict[str, tuple[Path, Path]],
) -> None:
    topo = read_topology(*machine_roots["vmware_88"])
    codes = {f.code for f in topo.findings}
    assert {"hypervisor_flag", "socket_per_cpu", "single_numa_multi_socket", "dmi_hypervisor"} <= codes
    assert topo.deceptive
    detail = next(f.detail for f in topo.findings if f.code == "socket_per_cpu")
    assert "88 CPUs in 88 sockets" in detail


def test_hypervisor_flag_alone_is_virtual_but_not_deceptive(make_machine) -> None:  # type: ignore[no-untyped-def]
    spec = MachineSpec(sockets=1, cores_per_socket=8, cores_per_l3=4, hypervisor=True, dmi_vendor="QEMU")
    topo = read_topology(*make_machine(spec))
    assert topo.virtual and not topo.deceptive


def test_offline_cpus_are_left_out(machine_roots: dict[str, tuple[Path, Path]]) -> None:
    topo = read_topology(*machine_roots["offline_cpus"])
    assert topo.online == frozenset(range(32)) - {6, 22}
    assert 6 not in topo.by_cpu()
    assert all(6 not in c.siblings for c in topo.cpus)


def test_missing_tree_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match=r"missing .*online"):
        read_topology(tmp_path / "nosys", tmp_path / "noproc")


def test_partial_tree_names_the_missing_file(make_machine) -> None:  # type: ignore[no-untyped-def]
    sys_root, proc_root = make_machine(MachineSpec(sockets=1, cores_per_socket=4, cores_per_l3=4))
    (sys_root / "devices/system/cpu/cpu2/topology/core_id").unlink()
    with pytest.raises(TopologyError, match="cpu2/topology/core_id"):
        read_topology(sys_root, proc_root)


def test_nohz_full_null_means_none(make_machine) -> None:  # type: ignore[no-untyped-def]
    spec = MachineSpec(
        sockets=1,
        cores_per_socket=4,
        cores_per_l3=4,
        sys_files={"devices/system/cpu/nohz_full": "(null)\n", "devices/system/cpu/isolated": "2-3\n"},
    )
    topo = read_topology(*make_machine(spec))
    assert topo.nohz_full == frozenset()
    assert topo.isolated == frozenset({2, 3})


def test_this_machine_reads_consistently() -> None:
    topo = read_topology()
    online = cpulist.parse(Path("/sys/devices/system/cpu/online").read_text())
    assert topo.online == online
    assert frozenset().union(*topo.l3_groups) == online
    assert frozenset().union(*topo.cores) == online
    assert sum(len(c) for c in topo.cores) == len(online)  # cores are disjoint


@pytest.mark.parametrize("name", sorted(MACHINES))
def test_every_cpu_is_in_exactly_one_l3_group_and_core(
    name: str, machine_roots: dict[str, tuple[Path, Path]]
) -> None:
    topo = read_topology(*machine_roots[name])
    assert sum(len(g) for g in topo.l3_groups) == len(topo.cpus)
    assert sum(len(c) for c in topo.cores) == len(topo.cpus)
