"""The generated corpus of kubelet start-up cases that lowtail and each claimed kubelet must agree on.

A case is the main KubeletConfiguration file's text, its --config-dir drop-ins ([name, text]), a
fixture machine (tests/fixtures/machines.py, written as a sysfs tree) and the host's cgroup version.
The corpus varies what lowtail reads and writes: every CPU manager option at every value kind under
every setting of the two option gates, every refused pair, the topology policies and scopes on
machines of 1 to 24 NUMA nodes, every gate lowtail reads set true, false, to a string and misspelt,
the topology manager's options, failCgroupV1 on cgroup v1 and v2, reservedSystemCPUs, the memory
manager's reservations, drop-ins, malformed files and lowtail's own rendered file for every fixture.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from lowtail.node import cpulist, kubelet_memory, plan, topology
from lowtail.node import kubelet_options as ko
from tests.fixtures.machines import MACHINES, write_machine

# Fixtures of 1, 2, 2 (SMT), 8 and 24 NUMA nodes, 88 one-core sockets over 1 node, offline CPUs.
FIXTURES = (
    "epyc9634_2s",
    "epyc9634_2s_smt",
    "epyc_2s_nps4",
    "epyc9634_2s_l3numa",
    "vmware_88",
    "offline_cpus",
)
HEADER = {"apiVersion": ko.API_VERSION, "kind": ko.KIND}
# What kubeadm writes besides lowtail's fields (a trimmed kubeadm 1.3x config.yaml).
KUBEADM = {
    **HEADER,
    "authentication": {"anonymous": {"enabled": False}, "webhook": {"enabled": True}},
    "authorization": {"mode": "Webhook"},
    "cgroupDriver": "systemd",
    "clusterDNS": ["10.96.0.10"],
    "clusterDomain": "cluster.local",
    "rotateCertificates": True,
    "staticPodPath": "/etc/kubernetes/manifests",
}
# Every gate lowtail reads or writes, and gates it must know a release has or lacks.
GATES_READ = (
    ko.ALPHA_GATE,
    ko.BETA_GATE,
    "CPUManagerPolicyOptions",
    "CPUManager",
    "MemoryManager",
    "TopologyManager",
    "TopologyManagerPolicyOptions",
    ko.TOPOLOGY_ALPHA_GATE,
    ko.TOPOLOGY_BETA_GATE,
    "PodLevelResources",
    "PodLevelResourceManagers",
    "KubeletConfigDropInDir",
    "MemoryQoS",
    # Registered by NewKubeletCommand (component-base logs), not by pkg/features.
    "ContextualLogging",
    "LoggingBetaOptions",
)
ALL_OPTIONS = (
    ko.FULL_PCPUS,
    ko.ACROSS_NUMA,
    ko.BY_SOCKET,
    ko.ACROSS_CORES,
    ko.STRICT_RESERVATION,
    ko.UNCORECACHE,
)


@dataclass(frozen=True)
class Machine:
    name: str
    sysfs: str
    numa_nodes: int
    sockets: int
    cpus: frozenset[int]
    topo: topology.Topology


@dataclass
class Case:
    id: str
    main: Any  # the main file's content (dumped as YAML) or a str written as is
    machine: Machine
    cgroup: int
    dropins: list[tuple[str, Any]] = field(default_factory=list)

    def text(self, content: Any) -> str:
        return content if isinstance(content, str) else yaml.safe_dump(content, sort_keys=False)

    def to_oracle(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "config": self.text(self.main),
            "dropins": [[n, self.text(c)] for n, c in self.dropins],
            "sysfs": self.machine.sysfs,
            "cgroup": self.cgroup,
        }


def write_machines(root: Path) -> dict[str, Machine]:
    out = {}
    for name in FIXTURES:
        sys_root, proc_root = write_machine(root / name, MACHINES[name])
        topo = topology.read_topology(sys_root, proc_root)
        out[name] = Machine(name, str(sys_root), len(topo.numa_nodes), len(topo.sockets), topo.online, topo)
    return out


def lowtail_settings(
    version: str, m: Machine, cgroup: int, base: dict[str, Any] | None = None
) -> dict[str, Any]:
    """What roles/lowtail_kubelet/vars/main.yml writes for this machine (__lowtail_kubelet_ours)."""
    cpu_plan = plan.make_plan(m.topo)
    mem = kubelet_memory.plan_reservations(m.topo.numa_nodes, "1Gi", "1Gi", "100Mi")
    policy = ko.choose_options(version, None, {}, "single-numa-node", m.numa_nodes)
    ours: dict[str, Any] = {
        "cpuManagerPolicy": "static",
        "cpuManagerPolicyOptions": policy.options,
        "reservedSystemCPUs": cpulist.format(cpu_plan.housekeeping),
        "topologyManagerPolicy": "single-numa-node",
        "topologyManagerScope": "pod",
        "memoryManagerPolicy": "Static",
        "reservedMemory": mem.reserved_memory(),
        "kubeReserved": {"memory": kubelet_memory.format_quantity(mem.kube_reserved)},
        "systemReserved": {"memory": kubelet_memory.format_quantity(mem.system_reserved)},
    }
    if policy.gates:
        ours["featureGates"] = policy.gates
    if policy.topology_options:
        ours["topologyManagerPolicyOptions"] = policy.topology_options
    if cgroup == 1:
        ours["failCgroupV1"] = False
    existing = (base or {}).get("evictionHard")
    ours["evictionHard"] = ko.eviction_hard(existing, kubelet_memory.format_quantity(mem.eviction_hard))
    return ours


def rendered(version: str, m: Machine, cgroup: int) -> dict[str, Any]:
    """lowtail's file in target file: its settings merged over kubeadm's file."""
    return ko.merge_dropin(KUBEADM, lowtail_settings(version, m, cgroup, KUBEADM))


def _with(base: dict[str, Any], **changes: Any) -> dict[str, Any]:
    out = dict(base)
    for key, value in changes.items():
        if value is _DROP:
            out.pop(key, None)
        else:
            out[key] = value
    return out


_DROP = object()


def misspellings(name: str) -> list[str]:
    return [name.lower(), name[:-1], name + "s"]


def cases(version: str, machines: dict[str, Machine]) -> Iterator[Case]:
    epyc, smt = machines["epyc9634_2s"], machines["epyc9634_2s_smt"]
    base = {m: rendered(version, machines[m], 2) for m in machines}

    # lowtail's own file for every fixture, as the main file and as lowtail's drop-in, on v1 and v2.
    for (name, m), cgroup in itertools.product(machines.items(), (1, 2)):
        yield Case(f"rendered/{name}/v{cgroup}", rendered(version, m, cgroup), m, cgroup)
        dropin = {**HEADER, **lowtail_settings(version, m, cgroup, KUBEADM)}
        yield Case(f"rendered-dropin/{name}/v{cgroup}", KUBEADM, m, cgroup, [("90-lowtail.conf", dropin)])

    # Every option at every value kind under every setting of the option gates, on two machines.
    values = ("true", "false", "maybe", True, "1", "")
    gate_values: tuple[Any, ...] = (_DROP, True, False, "yes")
    for m, option, value, alpha, beta in itertools.product(
        (epyc, smt), ALL_OPTIONS, values, gate_values, gate_values[:3]
    ):
        gates = {g: v for g, v in ((ko.ALPHA_GATE, alpha), (ko.BETA_GATE, beta)) if v is not _DROP}
        cfg = _with(base[m.name], cpuManagerPolicyOptions={option: value}, featureGates=gates or _DROP)
        yield Case(f"option/{m.name}/{option}={value!r}/alpha={alpha!r}/beta={beta!r}", cfg, m, 2)

    # Every pair of options both true, alpha gate on, with two topology policies.
    for (a, b), policy in itertools.product(
        itertools.combinations(ALL_OPTIONS, 2), ("single-numa-node", "restricted")
    ):
        cfg = _with(
            base["epyc9634_2s"],
            cpuManagerPolicyOptions={a: "true", b: "true"},
            featureGates={ko.ALPHA_GATE: True},
            topologyManagerPolicy=policy,
        )
        yield Case(f"pair/{a}+{b}/{policy}", cfg, epyc, 2)

    # Topology policies and scopes on machines of 1, 2, 8 and 24 NUMA nodes, with and without
    # align-by-socket.
    for name, policy, scope, by_socket in itertools.product(
        ("vmware_88", "epyc9634_2s", "epyc_2s_nps4", "epyc9634_2s_l3numa"),
        (*ko.TOPOLOGY_POLICIES, "bogus", _DROP),
        ("container", "pod", "Pod", _DROP),
        (False, True),
    ):
        changes: dict[str, Any] = {"topologyManagerPolicy": policy, "topologyManagerScope": scope}
        if by_socket:
            changes["cpuManagerPolicyOptions"] = {ko.BY_SOCKET: "true"}
            changes["featureGates"] = {ko.ALPHA_GATE: True}
        if name == "epyc9634_2s_l3numa":
            changes["topologyManagerPolicyOptions"] = _DROP
        cfg = _with(base[name], **changes)
        label = "drop" if policy is _DROP else policy
        yield Case(
            f"topology/{name}/{label}/{'drop' if scope is _DROP else scope}/socket={by_socket}",
            cfg,
            machines[name],
            2,
        )

    # Every gate lowtail reads: true, false, a string, and misspelt.
    for gate in GATES_READ:
        for value in (True, False, "true"):
            cfg = _with(base["epyc9634_2s"], featureGates={gate: value})
            yield Case(f"gate/{gate}={value!r}", cfg, epyc, 2)
        for wrong in misspellings(gate):
            cfg = _with(base["epyc9634_2s"], featureGates={wrong: True})
            yield Case(f"gate-misspelt/{wrong}", cfg, epyc, 2)

    # The topology manager's options, their gate, and the NUMA limit.
    for name, option, value, gate in itertools.product(
        ("epyc9634_2s", "epyc9634_2s_l3numa"),
        (ko.PREFER_CLOSEST, ko.MAX_NUMA),
        ("true", "false", "x", True, "8", "16", "24", "7", "+24", "24 ", 24),
        (_DROP, False, True),
    ):
        gates = {} if gate is _DROP else {"TopologyManagerPolicyOptions": gate}
        cfg = _with(base[name], topologyManagerPolicyOptions={option: value}, featureGates=gates or _DROP)
        yield Case(f"topology-option/{name}/{option}={value!r}/gate={gate!r}", cfg, machines[name], 2)

    # failCgroupV1 on both cgroup versions.
    for value, cgroup in itertools.product((_DROP, True, False, "false"), (1, 2)):
        cfg = _with(base["epyc9634_2s"], failCgroupV1=value)
        yield Case(f"failcgroupv1/{value!r}/v{cgroup}", cfg, epyc, cgroup)

    # reservedSystemCPUs and the CPU manager policy.
    for cpus, policy in itertools.product(
        ("", "0-6,84-90", "0-6, 84-90", "6-0", "0-400", "abc", "0-6,84-90,", "0", _DROP),
        ("static", "none", "Static", "bogus"),
    ):
        cfg = _with(base["epyc9634_2s"], reservedSystemCPUs=cpus, cpuManagerPolicy=policy)
        if policy == "none":
            cfg["cpuManagerPolicyOptions"] = {}
        yield Case(f"cpus/{cpus!r}/{policy}", cfg, epyc, 2)
    for reserved in (
        {"cpu": "2"},
        {"cpu": "500m"},
        {"cpu": "0"},
        {"gpu": "1"},
        {"memory": "1Gb"},
        {"memory": 1024},
    ):
        cfg = _with(base["epyc9634_2s"], reservedSystemCPUs=_DROP, kubeReserved={"memory": "1Gi", **reserved})
        yield Case(f"kube-reserved/{reserved!r}", cfg, epyc, 2)

    # The memory manager's reservations.
    balanced = base["epyc9634_2s"]["reservedMemory"]
    memories: dict[str, Any] = {
        "balanced": balanced,
        "short": [{"numaNode": 0, "limits": {"memory": "1Mi"}}, *balanced[1:]],
        "none": [],
        "node5": [*balanced, {"numaNode": 5, "limits": {"memory": "1Mi"}}],
        "zero": [*balanced, {"numaNode": 1, "limits": {"hugepages-2Mi": "0"}}],
        "duplicate": [*balanced, balanced[0]],
        "cpu-limit": [*balanced, {"numaNode": 0, "limits": {"cpu": "1"}}],
    }
    for policy, (label, reserved_memory), eviction in itertools.product(
        ("Static", "None", "static", "bogus"), memories.items(), ("keep", "no-memory", "drop")
    ):
        cfg = _with(base["epyc9634_2s"], memoryManagerPolicy=policy, reservedMemory=reserved_memory)
        if eviction == "no-memory":
            cfg["evictionHard"] = {k: v for k, v in cfg["evictionHard"].items() if k != "memory.available"}
        elif eviction == "drop":
            cfg.pop("evictionHard")
            # kubelet's default memory.available is 100Mi, which lowtail's reservation already counts.
        yield Case(f"memory/{policy}/{label}/{eviction}", cfg, epyc, 2)

    # Drop-ins over lowtail's file.
    lowtail_dropin = {**HEADER, **lowtail_settings(version, epyc, 2, KUBEADM)}
    others: dict[str, list[tuple[str, Any]]] = {
        "numa-after": [("95-numa.conf", {**HEADER, "cpuManagerPolicyOptions": {ko.ACROSS_NUMA: "true"}})],
        "numa-replaces": [
            (
                "95-numa.conf",
                {**HEADER, "cpuManagerPolicyOptions": {ko.FULL_PCPUS: None, ko.UNCORECACHE: None}},
            )
        ],
        "no-header": [("95-x.conf", {"topologyManagerScope": "container"})],
        "wrong-kind": [("95-x.conf", {**HEADER, "kind": "KubeProxyConfiguration"})],
        "misspelt-gate": [("95-x.conf", {**HEADER, "featureGates": {"CPUManagerPolicyBetaOption": True}})],
        "not-conf": [("95-x.yaml", "this is: [not, a kubelet file")],
        "empty": [("95-x.conf", "")],
        "gate-off": [("95-x.conf", {**HEADER, "featureGates": {ko.BETA_GATE: False}})],
        "scope": [("95-x.conf", {**HEADER, "topologyManagerScope": "node"})],
        "memory-unbalanced": [("95-x.conf", {**HEADER, "systemReserved": {"memory": "2Gi"}})],
        "before": [("10-x.conf", {**HEADER, "topologyManagerPolicy": "bogus"})],
        "fail-cgroup": [("95-x.conf", {**HEADER, "failCgroupV1": True})],
        "eviction-null": [("95-x.conf", {**HEADER, "evictionHard": None})],
    }
    for (label, extra), cgroup in itertools.product(others.items(), (1, 2)):
        ours = {**lowtail_dropin, "failCgroupV1": False} if cgroup == 1 else lowtail_dropin
        yield Case(f"dropin/{label}/v{cgroup}", KUBEADM, epyc, cgroup, [("90-lowtail.conf", ours), *extra])

    yield from quantity_cases(base["epyc9634_2s"], epyc)

    # Malformed main files.
    malformed: dict[str, Any] = {
        "no-kind": {k: v for k, v in base["epyc9634_2s"].items() if k != "kind"},
        "wrong-version": {**base["epyc9634_2s"], "apiVersion": "kubelet.config.k8s.io/v1"},
        "list": "- a\n- b\n",
        "empty": "",
        "unknown-field": {**base["epyc9634_2s"], "cpuManagerPolicyOption": {"x": "y"}},
        "policy-int": {**base["epyc9634_2s"], "cpuManagerPolicy": 5},
        "options-list": {**base["epyc9634_2s"], "cpuManagerPolicyOptions": ["full-pcpus-only"]},
        "gates-string": {**base["epyc9634_2s"], "featureGates": "CPUManagerPolicyAlphaOptions=true"},
    }
    for label, content in malformed.items():
        yield Case(f"malformed/{label}", content, epyc, 2)


# Quantity spellings: every form resource.ParseQuantity takes or refuses at its edges.
SPELLINGS = (
    "1Gi", "1.5Gi", "1536Mi", "1610612736", "1.610612736G", "1610612736e0", "+1.5Gi", "1.50Gi", ".5Gi",
    "1.Gi", "0.5Gi", "100m", "1e9", "1E9", "1e+9", "1e-3", "1E", "1k", "1K", "1Ki", "1ki", "1n", "0.1n",
    "1 Gi", " 1Gi", "1Gi ", "1GiB", "1.5", "0", "0Gi", "-1Gi", "-0", "", "+", ".", "1e", "1ee3", "10%",
    "abc", "1_000", "0x10", "1..5Gi", "1Gi5", "9223372036854775807", "9223372036854775808", "8Ei",
    "16Ei", "1e4294967296", "00001Mi", "1.0000000001",
)  # fmt: skip
PERCENTAGES = (
    "10%", "0%", "100%", "100.0%", "0.5%", "5.5%", "-1%", "101%", "1e1%", "%", "abc%", "10%%", "nan%",
    "inf%", "0x1p-2%", "1_0%", "100.000001%", " 5%",
)  # fmt: skip
NODE_MEMORY = 64 * 2**30  # what the oracle gives each NUMA node of a fixture without node meminfo


def quantity_cases(rendered_file: dict[str, Any], m: Machine) -> Iterator[Case]:
    """kubeReserved, evictionHard and reservedMemory quantities, as parseResourceList, the eviction
    thresholds and Quantity decoding read them, and sums the memory manager compares exactly."""
    for case in _quantity_cases(rendered_file, m):
        # Every string quoted: Go's YAML reads an unquoted 1e9, 0x10 or 1_000 as a number, PyYAML as a
        # string, and these cases are about the quantities, not YAML.
        yield Case(case.id, yaml.safe_dump(case.main, default_style='"'), case.machine, case.cgroup)


def _quantity_cases(rendered_file: dict[str, Any], m: Machine) -> Iterator[Case]:
    no_memory_manager = _with(rendered_file, memoryManagerPolicy="None", reservedMemory=_DROP)
    for q in SPELLINGS:
        yield Case(f"quantity/kube-memory/{q!r}", _with(no_memory_manager, kubeReserved={"memory": q}), m, 2)
        yield Case(f"quantity/system-cpu/{q!r}", _with(no_memory_manager, systemReserved={"cpu": q}), m, 2)
        eviction = {**rendered_file["evictionHard"], "memory.available": q}
        yield Case(f"quantity/eviction/{q!r}", _with(no_memory_manager, evictionHard=eviction), m, 2)
        # Static: kube 1Gi + system 1Gi + eviction 100Mi, all reserved on node 0 as spelt here.
        static = _with(
            rendered_file,
            reservedMemory=[{"numaNode": 0, "limits": {"memory": q}}],
            kubeReserved={"memory": q},
            systemReserved=_DROP,
            evictionHard={"memory.available": "0%"},
        )
        yield Case(f"quantity/reserved-equal/{q!r}", static, m, 2)
        # The same value spelt as whole bytes on the other side: equal only where kubelet's value is.
        try:
            as_bytes = str(int(kubelet_memory.k8s_quantity(q)))
        except (kubelet_memory.QuantityError, ValueError):
            continue
        yield Case(
            f"quantity/reserved-bytes/{q!r}",
            _with(static, reservedMemory=[{"numaNode": 0, "limits": {"memory": as_bytes}}]),
            m,
            2,
        )
    for pct in PERCENTAGES:
        for signal in ("memory.available", "nodefs.available", "pid.available"):
            eviction = {**rendered_file["evictionHard"], signal: pct}
            yield Case(f"percentage/{signal}/{pct!r}", _with(no_memory_manager, evictionHard=eviction), m, 2)
    yield Case(
        "eviction/unknown-signal",
        _with(no_memory_manager, evictionHard={"memory.availble": "100Mi"}),
        m,
        2,
    )
    # A percentage of memory.available with the Static policy: reservedMemory must include it.
    capacity = NODE_MEMORY * m.numa_nodes
    for pct in ("1%", "0.5%", "5.5%", "0%", "100%"):
        f32 = struct.unpack("f", struct.pack("f", float(pct[:-1])))[0]
        f32 = struct.unpack("f", struct.pack("f", f32 / 100))[0]
        evicted = 0 if pct in ("0%", "100%") else int(float(capacity) * f32)
        total = 2 * 2**30 + evicted
        cfg = _with(
            rendered_file,
            evictionHard={"memory.available": pct},
            reservedMemory=[{"numaNode": 0, "limits": {"memory": str(total)}}],
        )
        yield Case(f"percentage/static/{pct}", cfg, m, 2)
        yield Case(
            f"percentage/static-off-by-one/{pct}",
            _with(cfg, reservedMemory=[{"numaNode": 0, "limits": {"memory": str(total + 1)}}]),
            m,
            2,
        )
    # reservedMemory limits as YAML numbers (Quantity decodes a JSON number too) and padded strings.
    for limit in (2 * 2**30 + 100 * 2**20, float(2 * 2**30 + 100 * 2**20), " 2148Mi ", "2148Mi", True):
        cfg = _with(rendered_file, reservedMemory=[{"numaNode": 0, "limits": {"memory": limit}}])
        yield Case(f"quantity/reserved-number/{limit!r}", cfg, m, 2)


def lowtail_verdict(version: str, case: Case) -> tuple[bool, str]:
    """lowtail's answer for a case: accept, or refuse with its problems joined."""

    def load(content: Any) -> Any:
        return yaml.safe_load(case.text(content)) if isinstance(content, str) else content

    try:
        main = load(case.main)
        # Only *.conf files are read (the role's dropins.yml lists those alone).
        dropins = [(name, load(content)) for name, content in case.dropins if name.endswith(".conf")]
    except yaml.YAMLError as e:
        return False, f"not YAML: {e}"
    m = case.machine
    result = ko.check_files(
        version,
        main,
        dropins,
        m.numa_nodes,
        sockets=m.sockets,
        cpus=m.cpus,
        cgroup_version=case.cgroup,
        memory_bytes=NODE_MEMORY * m.numa_nodes,
    )
    return not result.problems, "; ".join(result.problems)
