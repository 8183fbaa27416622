"""Read a machine's CPU topology from sysfs and procfs, and detect topologies made up by a hypervisor.

Everything is read under configurable roots so a fixture tree can stand in for any machine
(``tests/fixtures/machines.py`` writes them). Only files the kernel has exposed for years are read:

    {sys}/devices/system/cpu/online                         online CPUs
    {sys}/devices/system/cpu/cpuN/topology/physical_package_id, core_id, thread_siblings_list
    {sys}/devices/system/cpu/cpuN/cache/indexK/{level,shared_cpu_list}   the L3 group (a CCD on Zen)
    {sys}/devices/system/node/nodeN/cpulist                 NUMA nodes (absent: one node 0)
    {sys}/devices/system/cpu/{isolated,nohz_full}           what the running kernel isolated
    {proc}/cpuinfo                                          vendor, model name, the hypervisor flag
    {sys}/class/dmi/id/{sys_vendor,product_name}            optional evidence of a hypervisor
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any

from . import cpulist
from .errors import LowtailError


class TopologyError(LowtailError, RuntimeError):
    """The sysfs/procfs tree is missing or incomplete, so no trustworthy topology can be read."""


@dataclass(frozen=True)
class Cpu:
    cpu: int
    socket: int
    core: int  # the kernel's core_id: unique only within a socket
    node: int
    l3: int  # index into Topology.l3_groups
    siblings: frozenset[int]  # SMT siblings including this CPU


@dataclass(frozen=True)
class Finding:
    """One piece of evidence about virtualization. ``deceptive`` marks a topology that cannot be real."""

    code: str
    detail: str
    deceptive: bool = False

    def to_dict(self) -> dict[str, Any]:
        return {"code": self.code, "detail": self.detail, "deceptive": self.deceptive}


# Vendors in DMI that only hypervisors report; used as evidence, never alone as deception.
_HYPERVISOR_DMI = re.compile(r"vmware|qemu|kvm|virtualbox|xen|microsoft corporation|amazon ec2|google", re.I)


@dataclass(frozen=True)
class Topology:
    cpus: tuple[Cpu, ...]
    l3_groups: tuple[frozenset[int], ...]
    isolated: frozenset[int]
    nohz_full: frozenset[int]
    vendor: str
    model_name: str
    hypervisor_flag: bool
    dmi_vendor: str = ""
    dmi_product: str = ""
    findings: tuple[Finding, ...] = field(default=())

    # ---- derived views -------------------------------------------------------------------------
    @property
    def online(self) -> frozenset[int]:
        return frozenset(c.cpu for c in self.cpus)

    @property
    def sockets(self) -> tuple[int, ...]:
        return tuple(sorted({c.socket for c in self.cpus}))

    @property
    def numa_nodes(self) -> tuple[int, ...]:
        return tuple(sorted({c.node for c in self.cpus}))

    @cached_property
    def cores(self) -> tuple[frozenset[int], ...]:
        """Whole cores (SMT sibling sets), ordered by their lowest CPU."""
        return tuple(sorted({c.siblings for c in self.cpus}, key=min))

    @property
    def threads_per_core(self) -> int:
        return max(len(c.siblings) for c in self.cpus)

    @property
    def cores_per_socket(self) -> int:
        return max(len(self.cores_of_socket(s)) for s in self.sockets)

    @property
    def deceptive(self) -> bool:
        return any(f.deceptive for f in self.findings)

    @property
    def virtual(self) -> bool:
        return bool(self.findings)

    @cached_property
    def _index(self) -> dict[int, Cpu]:
        return {c.cpu: c for c in self.cpus}

    def by_cpu(self) -> dict[int, Cpu]:
        return self._index

    def cores_of_socket(self, socket: int) -> tuple[frozenset[int], ...]:
        return tuple(core for core in self.cores if self._index[min(core)].socket == socket)

    def cpus_of_node(self, node: int) -> frozenset[int]:
        return frozenset(c.cpu for c in self.cpus if c.node == node)

    def to_dict(self) -> dict[str, Any]:
        return {
            "cpus": [
                {
                    "cpu": c.cpu,
                    "socket": c.socket,
                    "core": c.core,
                    "node": c.node,
                    "l3": c.l3,
                    "siblings": cpulist.format(c.siblings),
                }
                for c in self.cpus
            ],
            "online": cpulist.format(self.online),
            "sockets": len(self.sockets),
            "numa_nodes": len(self.numa_nodes),
            "cores_per_socket": self.cores_per_socket,
            "threads_per_core": self.threads_per_core,
            "l3_groups": [cpulist.format(g) for g in self.l3_groups],
            "isolated": cpulist.format(self.isolated),
            "nohz_full": cpulist.format(self.nohz_full),
            "model_name": self.model_name,
            "virtual": {
                "hypervisor_flag": self.hypervisor_flag,
                "vendor": self.vendor,
                "dmi_vendor": self.dmi_vendor,
                "dmi_product": self.dmi_product,
                "findings": [f.to_dict() for f in self.findings],
            },
            "deceptive": self.deceptive,
        }


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except FileNotFoundError:
        raise TopologyError(f"missing {path}: not a complete sysfs/procfs tree") from None


def _read_optional(path: Path) -> str:
    try:
        return path.read_text().strip()
    except (FileNotFoundError, PermissionError):
        return ""


def _read_cpulist_optional(path: Path) -> frozenset[int]:
    text = _read_optional(path)
    # Kernels print "(null)" in nohz_full when the feature is compiled in but unused.
    return frozenset() if text in ("", "(null)") else cpulist.parse(text)


def _l3_of(cpu_dir: Path, cpu: int, socket_cpus: frozenset[int]) -> frozenset[int]:
    cache = cpu_dir / "cache"
    if cache.is_dir():
        for index in sorted(cache.glob("index*")):
            if _read_optional(index / "level") == "3":
                return cpulist.parse(_read(index / "shared_cpu_list"))
    # No L3 exposed (some hypervisors hide caches): treat the whole socket as one group.
    return socket_cpus


def _nodes(sys_root: Path, online: frozenset[int]) -> dict[int, int]:
    node_dir = sys_root / "devices/system/node"
    mapping: dict[int, int] = {}
    for d in sorted(node_dir.glob("node[0-9]*")):
        node = int(d.name[4:])
        for cpu in _read_cpulist_optional(d / "cpulist"):
            mapping[cpu] = node
    # CONFIG_NUMA=n or CPUs not listed: everything is node 0, which is what the kernel means too.
    return {cpu: mapping.get(cpu, 0) for cpu in online}


def _cpuinfo(proc_root: Path) -> tuple[str, str, bool]:
    text = _read(proc_root / "cpuinfo")
    vendor = model = ""
    flags: set[str] = set()
    for line in text.splitlines():
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "vendor_id" and not vendor:
            vendor = value.strip()
        elif key == "model name" and not model:
            model = value.strip()
        elif key == "flags" and not flags:
            flags = set(value.split())
    return vendor, model, "hypervisor" in flags


def read_topology(sys_root: str | Path = "/sys", proc_root: str | Path = "/proc") -> Topology:
    """Read the topology of the machine described by ``sys_root`` and ``proc_root``."""
    sys_root, proc_root = Path(sys_root), Path(proc_root)
    cpu_root = sys_root / "devices/system/cpu"
    online = cpulist.parse(_read(cpu_root / "online"))
    if not online:
        raise TopologyError(f"{cpu_root / 'online'} lists no CPUs")

    raw: dict[int, tuple[int, int, frozenset[int]]] = {}
    for cpu in sorted(online):
        topo = cpu_root / f"cpu{cpu}" / "topology"
        try:
            socket = int(_read(topo / "physical_package_id"))
            core = int(_read(topo / "core_id"))
        except ValueError as e:
            raise TopologyError(f"unreadable topology of cpu{cpu} under {topo}: {e}") from None
        siblings = cpulist.parse(_read(topo / "thread_siblings_list")) & online
        raw[cpu] = (socket, core, siblings | {cpu})

    socket_cpus: dict[int, set[int]] = {}
    for cpu, (socket, _, _) in raw.items():
        socket_cpus.setdefault(socket, set()).add(cpu)

    groups: list[frozenset[int]] = []
    l3_index: dict[int, int] = {}
    for cpu in sorted(online):
        group = _l3_of(cpu_root / f"cpu{cpu}", cpu, frozenset(socket_cpus[raw[cpu][0]])) & online
        if group not in groups:
            groups.append(group)
        l3_index[cpu] = groups.index(group)

    nodes = _nodes(sys_root, online)
    cpus = tuple(
        Cpu(cpu=cpu, socket=s, core=core, node=nodes[cpu], l3=l3_index[cpu], siblings=sib)
        for cpu, (s, core, sib) in sorted(raw.items())
    )
    vendor, model, hv = _cpuinfo(proc_root)
    dmi = sys_root / "class/dmi/id"
    found = Topology(
        cpus=cpus,
        l3_groups=tuple(groups),
        isolated=_read_cpulist_optional(cpu_root / "isolated"),
        nohz_full=_read_cpulist_optional(cpu_root / "nohz_full"),
        vendor=vendor,
        model_name=model,
        hypervisor_flag=hv,
        dmi_vendor=_read_optional(dmi / "sys_vendor"),
        dmi_product=_read_optional(dmi / "product_name"),
    )
    return replace(found, findings=tuple(detect_virtualization(found)))


def detect_virtualization(topo: Topology) -> list[Finding]:
    """Evidence that the machine is a VM, and whether the topology it shows can be real.

    One NUMA node alone is not evidence: a one-socket EPYC in NPS1 has exactly one.
    """
    findings: list[Finding] = []
    n_cpus, n_sockets, n_nodes = len(topo.cpus), len(topo.sockets), len(topo.numa_nodes)
    if topo.hypervisor_flag:
        findings.append(
            Finding("hypervisor_flag", "/proc/cpuinfo flags contain 'hypervisor': this kernel runs in a VM")
        )
    dmi = f"{topo.dmi_vendor} {topo.dmi_product}".strip()
    if dmi and _HYPERVISOR_DMI.search(dmi):
        findings.append(Finding("dmi_hypervisor", f"DMI system is {dmi!r}"))
    if n_cpus > 1 and n_sockets == n_cpus:
        findings.append(
            Finding(
                "socket_per_cpu",
                f"{n_cpus} CPUs in {n_sockets} sockets: every CPU its own socket, as a hypervisor shows "
                "vCPUs; core, L3 and NUMA placement are invisible to the guest",
                deceptive=True,
            )
        )
    if n_sockets > 1 and n_nodes == 1:
        findings.append(
            Finding(
                "single_numa_multi_socket",
                f"{n_sockets} sockets but 1 NUMA node: real multi-socket hosts have a node per socket "
                "or more (NPS1/2/4)",
                deceptive=True,
            )
        )
    return findings
