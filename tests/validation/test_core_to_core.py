"""The core-to-core probe's logic on machines this host is not: which CPUs it measures, how close each
worker's pool is, and the verdicts (a fake ping-pong stands for the C helper, which runs in
``test_core_to_core_live``)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from lowtail.node.plan import L3Pool, Plan, make_plan
from lowtail.node.topology import Topology, read_topology
from lowtail.validation.check import Status
from lowtail.validation.core_to_core import (
    RELATIONS,
    check_placement,
    matrix_cpus,
    probe_core_to_core,
    relation,
)
from tests.validation.conftest import base_machine

_TOPOLOGIES: dict[str, Topology] = {}


def machine(tmp_path: Path, name: str) -> Topology:
    """The fixture machine's tree, written once per session for every validation test (thousands of
    files), read once here."""
    if name not in _TOPOLOGIES:
        root = base_machine(name)
        _TOPOLOGIES[name] = read_topology(root / "sys", root / "proc")
    return _TOPOLOGIES[name]


@pytest.mark.parametrize("name", ["epyc9634_2s", "epyc9634_2s_smt", "epyc_2s_nps4"])
def test_the_computed_plan_puts_every_pool_in_its_workers_l3_group(tmp_path: Path, name: str) -> None:
    topo = machine(tmp_path, name)
    plan = make_plan(topo, "auto")
    placements = check_placement(topo, plan)
    assert len(placements) == len(plan.isolated)
    assert all(p.ok for p in placements), [p for p in placements if not p.ok][:3]
    # On these machines every L3 group of the plan keeps several isolated CPUs: partners share the L3.
    assert {p.worst for p in placements} <= {"same-core", "same-l3"}


def merged_pools(topo: Topology) -> tuple[Plan, L3Pool, L3Pool]:
    """The computed plan with its L3 pools 1 and 2 made one (a plan written for another machine)."""
    plan = make_plan(topo, "auto")
    a, b = plan.l3_pools[1], plan.l3_pools[2]
    merged = L3Pool(a.index, a.node, a.socket, a.cpus | b.cpus, a.isolated | b.isolated)
    return replace(plan, l3_pools=(plan.l3_pools[0], merged, *plan.l3_pools[3:])), a, b


def test_a_pool_spanning_two_l3_groups_fails_naming_the_far_cpus(tmp_path: Path) -> None:
    topo = machine(tmp_path, "epyc9634_2s")
    bad, a, b = merged_pools(topo)
    placements = {p.worker: p for p in check_placement(topo, bad)}
    w = min(a.isolated)
    assert not placements[w].ok
    assert "same-node" in placements[w].detail and "the topology offers same-l3" in placements[w].detail
    assert str(min(b.isolated)) in placements[w].detail


def test_a_pool_holding_a_housekeeping_cpu_fails(tmp_path: Path) -> None:
    topo = machine(tmp_path, "epyc9634_2s")
    plan = make_plan(topo, "auto")
    p = plan.l3_pools[1]
    stray = min(plan.housekeeping)
    bad = replace(
        plan, l3_pools=(plan.l3_pools[0], replace(p, isolated=p.isolated | {stray}), *plan.l3_pools[2:])
    )
    worst = check_placement(topo, bad, workers=[min(p.isolated)])[0]
    assert not worst.ok and f"not isolated and online: [{stray}]" in worst.detail


def test_the_matrix_covers_each_relation_the_plan_depends_on_and_stays_bounded(tmp_path: Path) -> None:
    topo = machine(tmp_path, "epyc9634_2s")
    plan = make_plan(topo, "auto")
    cpus = matrix_cpus(topo, plan, limit=16)
    assert len(cpus) == 16
    rels = {relation(topo, a, b) for i, a in enumerate(cpus) for b in cpus[i + 1 :]}
    assert {"same-l3", "same-node", "cross-socket"} <= rels
    assert set(rels) <= set(RELATIONS)


def fake_runner(topo: Topology, ns: dict[str, float]) -> object:
    def run(a: int, b: int) -> list[float]:
        return [ns[relation(topo, a, b)]] * 11

    return run


def test_a_pool_partner_measured_slower_than_a_cpu_outside_the_pool_warns(tmp_path: Path) -> None:
    topo = machine(tmp_path, "epyc9634_2s")
    plan = make_plan(topo, "auto")
    honest = {
        "same-core": 20.0,
        "same-l3": 60.0,
        "same-node": 200.0,
        "same-socket": 200.0,
        "cross-socket": 400.0,
    }
    c = probe_core_to_core(topo, plan, runner=fake_runner(topo, honest), progress=False)  # type: ignore[arg-type]
    assert c.status is Status.PASS, c.evidence
    n = len(c.data["cpus"])
    assert len(c.data["matrix_ns"]) == n and all(len(row) == n for row in c.data["matrix_ns"])
    assert c.data["matrix_ns"][0][0] is None
    # The caches disagree with the reported topology (a VM's floating vCPUs): the L3 partner is slow.
    lying = dict(honest, **{"same-l3": 500.0})
    c = probe_core_to_core(topo, plan, runner=fake_runner(topo, lying), progress=False)  # type: ignore[arg-type]
    assert c.status is Status.WARN
    assert any("slower" in e or "slowest partner" in e for e in c.evidence)


def test_a_misplaced_pool_fails_the_probe(tmp_path: Path) -> None:
    topo = machine(tmp_path, "epyc9634_2s")
    bad, _, _ = merged_pools(topo)
    ns = {r: 100.0 for r in RELATIONS}
    c = probe_core_to_core(topo, bad, runner=fake_runner(topo, ns), progress=False)  # type: ignore[arg-type]
    assert c.status is Status.FAIL
    assert "farther than the topology allows" in c.reason
