"""The CPU plan: which CPUs do housekeeping and which are isolated for inference.

One plan, computed once from the real topology, feeds everything: the kernel arguments, irqbalance,
systemd affinity, kubelet's reservedSystemCPUs, the lease pool of the allocator and the validator.

Invariants (checked by ``check_invariants``, and by property tests on every fixture):
housekeeping and isolated are disjoint, their union is every online CPU, every socket has housekeeping,
at least one CPU is isolated, and both sets are made of whole cores (SMT siblings together).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import cpulist
from .errors import LowtailError
from .topology import Topology


class PlanError(LowtailError, ValueError):
    """A housekeeping request that cannot become a valid plan on this topology."""


# Arguments every lowtail node gets, whatever its CPUs (the set OpenShift's Node Tuning Operator renders
# for a PerformanceProfile). isolcpus without "domain": a domain-isolated CPU gets no load balancing at
# all (OpenShift's balanceIsolated documentation).
FIXED_KERNEL_ARGS: tuple[str, ...] = ("skew_tick=1", "nosoftlockup", "tsc=reliable", "nmi_watchdog=0")
# Only meaningful on AMD: iommu=pt keeps DMA off the IOMMU translation path; amd_pstate picks the driver
# mode (tuned's cpu-partitioning writes intel_pstate=disable, which does nothing on EPYC).
AMD_KERNEL_ARGS: tuple[str, ...] = ("iommu=pt",)
DEFAULT_AMD_PSTATE = "guided"


@dataclass(frozen=True)
class L3Pool:
    index: int
    node: int
    socket: int
    cpus: frozenset[int]
    isolated: frozenset[int]


@dataclass(frozen=True)
class Plan:
    housekeeping: frozenset[int]
    isolated: frozenset[int]
    per_node: dict[int, tuple[frozenset[int], frozenset[int]]]  # node -> (housekeeping, isolated)
    l3_pools: tuple[L3Pool, ...]
    kernel_args: tuple[str, ...]
    spec: str  # the housekeeping request this plan came from, for the record

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "housekeeping": cpulist.format(self.housekeeping),
            "isolated": cpulist.format(self.isolated),
            "per_node": {
                str(node): {"housekeeping": cpulist.format(hk), "isolated": cpulist.format(iso)}
                for node, (hk, iso) in sorted(self.per_node.items())
            },
            "l3_groups": [
                {
                    "index": p.index,
                    "node": p.node,
                    "socket": p.socket,
                    "cpus": cpulist.format(p.cpus),
                    "isolated": cpulist.format(p.isolated),
                }
                for p in self.l3_pools
            ],
            "kernel_args": list(self.kernel_args),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Plan:
        try:
            return cls(
                housekeeping=cpulist.parse(data["housekeeping"]),
                isolated=cpulist.parse(data["isolated"]),
                per_node={
                    int(node): (cpulist.parse(v["housekeeping"]), cpulist.parse(v["isolated"]))
                    for node, v in data["per_node"].items()
                },
                l3_pools=tuple(
                    L3Pool(
                        index=int(p["index"]),
                        node=int(p["node"]),
                        socket=int(p["socket"]),
                        cpus=cpulist.parse(p["cpus"]),
                        isolated=cpulist.parse(p["isolated"]),
                    )
                    for p in data["l3_groups"]
                ),
                kernel_args=tuple(data["kernel_args"]),
                spec=str(data.get("spec", "")),
            )
        except (KeyError, TypeError, AttributeError) as e:
            raise PlanError(f"not a lowtail plan: missing or malformed field {e}") from None


def load_plan(path: str | Path) -> Plan:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:  # ValueError: bad JSON or UTF-8, an integer past int's digit limit
        raise PlanError(f"cannot read plan {path}: {e}") from None
    except RecursionError:
        raise PlanError(f"cannot read plan {path}: JSON nested too deeply; expected a lowtail plan") from None
    if not isinstance(data, dict):
        raise PlanError(f"not a lowtail plan: {path} holds a JSON {type(data).__name__}, expected an object")
    return Plan.from_dict(data)


def _whole_cores(topo: Topology, cpus: frozenset[int]) -> frozenset[int]:
    out: set[int] = set()
    for core in topo.cores:
        if core & cpus:
            out |= core
    return frozenset(out)


def _socket_cores(topo: Topology) -> dict[int, tuple[frozenset[int], ...]]:
    """Whole cores per socket, as far as the plan is concerned.

    When a hypervisor shows every vCPU as its own socket, those sockets are fiction: requiring
    housekeeping on each would leave nothing to isolate. The plan then treats the guest as one socket
    (and the topology check reports the deception separately).
    """
    if any(f.code == "socket_per_cpu" for f in topo.findings):
        return {0: topo.cores}
    return {s: topo.cores_of_socket(s) for s in topo.sockets}


def _auto(topo: Topology) -> frozenset[int]:
    """The lowest-numbered L3 group of each socket; one core per socket where a socket has one group.

    A whole CCD keeps the housekeeping's cache traffic off the inference CCDs. A socket with a single
    L3 group (a small part, or a VM) cannot give one away, so it gets its first core instead.
    """
    chosen: set[int] = set()
    for cores in _socket_cores(topo).values():
        cpus = frozenset().union(*cores)
        groups = sorted((g for g in topo.l3_groups if g <= cpus), key=min)
        if len(groups) > 1 and len(_whole_cores(topo, groups[0])) < len(cpus):
            chosen |= _whole_cores(topo, groups[0])
        else:
            chosen |= cores[0]
    return frozenset(chosen)


def _per_socket_cores(topo: Topology, n: int) -> frozenset[int]:
    if n < 1:
        raise PlanError(f"housekeeping {n} cores per socket: expected at least 1")
    chosen: set[int] = set()
    for socket, cores in _socket_cores(topo).items():
        if n > len(cores):
            raise PlanError(f"housekeeping {n} cores per socket: socket {socket} has only {len(cores)} cores")
        for core in cores[:n]:
            chosen |= core
    return frozenset(chosen)


def _explicit(topo: Topology, text: str) -> frozenset[int]:
    try:
        wanted = cpulist.parse(text)
    except cpulist.CpuListError as e:
        raise PlanError(f"housekeeping {text!r}: {e}") from None
    missing = wanted - topo.online
    if missing:
        raise PlanError(
            f"housekeeping {text!r}: CPUs {cpulist.format(missing)} do not exist or are offline; "
            f"online CPUs are {cpulist.format(topo.online)}"
        )
    whole = _whole_cores(topo, wanted)
    if whole != wanted:
        raise PlanError(
            f"housekeeping {text!r} splits cores: add their SMT siblings "
            f"{cpulist.format(whole - wanted)} (whole cores would be {cpulist.format(whole)})"
        )
    return wanted


def resolve_housekeeping(topo: Topology, spec: str | int | None) -> frozenset[int]:
    """Turn ``auto``, a number of cores per socket, or a cpulist into housekeeping CPUs."""
    if spec is None or spec in ("auto", ""):
        return _auto(topo)
    if isinstance(spec, bool):
        raise PlanError(f"housekeeping {spec!r}: expected 'auto', cores per socket or a cpulist")
    if isinstance(spec, int):
        return _per_socket_cores(topo, spec)
    text = str(spec).strip()
    if cpulist.looks_like_cpulist(text):
        return _explicit(topo, text)
    if text.isdigit():
        return _per_socket_cores(topo, int(text))
    raise PlanError(
        f"housekeeping {spec!r}: expected 'auto', a number of cores per socket (e.g. 2) "
        "or a cpulist with a comma or a dash (e.g. '0-3,84-87')"
    )


def kernel_args(
    topo: Topology,
    housekeeping: frozenset[int],
    isolated: frozenset[int],
    amd_pstate: str | None = DEFAULT_AMD_PSTATE,
) -> tuple[str, ...]:
    iso, hk = cpulist.format(isolated), cpulist.format(housekeeping)
    args = [
        f"isolcpus=managed_irq,{iso}",
        f"nohz_full={iso}",
        f"rcu_nocbs={iso}",
        f"irqaffinity={hk}",
        f"systemd.cpu_affinity={hk}",
        *FIXED_KERNEL_ARGS,
    ]
    if topo.vendor == "AuthenticAMD":
        args += AMD_KERNEL_ARGS
        if amd_pstate:
            args.append(f"amd_pstate={amd_pstate}")
    return tuple(args)


def check_invariants(topo: Topology, plan: Plan) -> None:
    online = topo.online
    if plan.housekeeping & plan.isolated:
        raise PlanError(f"CPUs {cpulist.format(plan.housekeeping & plan.isolated)} are in both sets")
    if plan.housekeeping | plan.isolated != online:
        raise PlanError(
            f"plan covers {cpulist.format(plan.housekeeping | plan.isolated)}, online CPUs are "
            f"{cpulist.format(online)}"
        )
    if not plan.isolated:
        raise PlanError(
            f"housekeeping {cpulist.format(plan.housekeeping)} leaves no isolated CPU out of "
            f"{cpulist.format(online)}; expected at least one"
        )
    for socket, cores in _socket_cores(topo).items():
        if not plan.housekeeping & frozenset().union(*cores):
            raise PlanError(
                f"housekeeping {cpulist.format(plan.housekeeping)} has no CPU on socket {socket}; "
                "expected housekeeping on every socket (its IRQs and kernel threads need a home)"
            )
    for name, cpus in (("housekeeping", plan.housekeeping), ("isolated", plan.isolated)):
        if _whole_cores(topo, cpus) != cpus:
            raise PlanError(f"{name} {cpulist.format(cpus)} splits an SMT core")


def make_plan(
    topo: Topology, housekeeping: str | int | None = "auto", amd_pstate: str | None = DEFAULT_AMD_PSTATE
) -> Plan:
    hk = resolve_housekeeping(topo, housekeeping)
    iso = topo.online - hk
    if not iso:
        raise PlanError(
            f"housekeeping {housekeeping!r} takes every online CPU ({cpulist.format(topo.online)}); "
            "expected at least one isolated CPU"
        )
    per_node = {
        node: (topo.cpus_of_node(node) & hk, topo.cpus_of_node(node) & iso) for node in topo.numa_nodes
    }
    by_cpu = topo.by_cpu()
    pools = tuple(
        L3Pool(
            index=i,
            node=by_cpu[min(group)].node,
            socket=by_cpu[min(group)].socket,
            cpus=group,
            isolated=group & iso,
        )
        for i, group in enumerate(topo.l3_groups)
    )
    plan = Plan(
        housekeeping=hk,
        isolated=iso,
        per_node=per_node,
        l3_pools=pools,
        kernel_args=kernel_args(topo, hk, iso, amd_pstate),
        spec=str(housekeeping if housekeeping is not None else "auto"),
    )
    check_invariants(topo, plan)
    return plan
