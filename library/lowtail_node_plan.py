#!/usr/bin/python
"""Ansible module: read a host's CPU topology, compute lowtail's CPU plan, and check every input.

The topology reader, the planner and the kubelet memory arithmetic are the lowtail package's own
(python/lowtail, shipped through module_utils/lowtail), so the roles, the runtime and the validator
agree on one plan. The module only reads: it supports check mode and never reports a change.
"""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: lowtail_node_plan
short_description: Compute lowtail's CPU plan from the host's topology and check the inventory inputs
description:
  - Reads online CPUs, sockets, SMT siblings, NUMA nodes and L3 groups from sysfs/procfs, detects
    virtualization, and computes the housekeeping/isolated CPU plan and its kernel arguments with the
    lowtail package's own code.
  - Checks every inventory input before any host is changed and fails with a message that names the
    bad value and what was expected.
  - Reports the kernel release, whether the kernel has CONFIG_RT_GROUP_SCHED, and the cgroup version.
options:
  sysfs_root:
    description: Root of the sysfs tree to read (a fixture tree in tests).
    type: path
    default: /sys
  procfs_root:
    description: Root of the procfs tree to read (a fixture tree in tests).
    type: path
    default: /proc
  boot_root:
    description: Directory holding the kernel's C(config-RELEASE) file.
    type: path
    default: /boot
  kernel_release:
    description: Kernel release to look up; default is C(sys/kernel/osrelease) under I(procfs_root).
    type: str
  housekeeping:
    description:
      - C(auto), a number of whole cores per socket, or a cpulist (has a comma or a dash).
    type: raw
    default: auto
  amd_pstate:
    description: amd_pstate mode for AMD hosts; empty leaves the kernel's default.
    type: str
    default: guided
    choices: [guided, active, passive, ""]
  allow_virtual:
    description: Accept a host that shows signs of virtualization (test sandboxes only).
    type: bool
    default: false
  expected_hardware:
    description: What the inventory expects; a host whose BIOS settings differ fails.
    type: dict
    options:
      sockets: {type: int, description: Number of sockets.}
      numa_per_socket: {type: int, description: NUMA nodes per socket (the NPS mode).}
      smt: {type: bool, description: Whether SMT is on.}
      l3_per_socket: {type: int, description: L3 groups (CCDs) per socket.}
  rt_runtime_us:
    description: kernel.sched_rt_runtime_us; -1 (no limit) only together with I(stalld).
    type: raw
    default: 950000
  rt_period_us:
    description: kernel.sched_rt_period_us.
    type: raw
    default: 1000000
  stalld:
    description: Whether stalld runs on the host (required by an unlimited RT budget).
    type: bool
    default: false
  kubelet_memory:
    description: Memory reservations for kubelet's Static memory manager.
    type: dict
    options:
      kube_reserved: {type: raw, default: 1Gi, description: kubeReserved memory.}
      system_reserved: {type: raw, default: 1Gi, description: systemReserved memory.}
      eviction_hard: {type: raw, default: 100Mi, description: evictionHard memory.available.}
      per_numa:
        type: raw
        default: auto
        description: C(auto) or a map NUMA node -> quantity that must add up exactly.
  hugepages:
    description: Boot-time huge pages; their share on every NUMA node must fit in that node's MemTotal.
    type: dict
    options:
      size: {type: str, default: 1G, choices: [2M, 1G], description: Huge page size.}
      count: {type: raw, default: 0, description: Number of huge pages.}
  cstate_limit:
    description: Deepest C-state (0 = idle=poll); null leaves the kernel's choice; negative is refused.
    type: raw
  kernel_extra_args:
    description: Extra kernel arguments, each made of shell-inert characters (lowtail.node.kernel_args).
    type: list
    elements: raw
    default: []
  serial:
    description: The rollout batch (Ansible C(serial)); a count, a percentage, or a list of them.
    type: raw
    default: 25%
  require_systemd:
    description: Refuse a host whose PID 1 (C(procfs_root)/1/comm) is not systemd.
    type: bool
    default: true
author: lowtail
"""

EXAMPLES = r"""
- name: Compute the CPU plan of a fixture 2 x EPYC 9634
  lowtail_node_plan:
    sysfs_root: /srv/fixture/sys
    procfs_root: /srv/fixture/proc
    housekeeping: 1
  register: plan
"""

RETURN = r"""
node:
  description: Topology summary, CPU plan, RT budget, kubelet memory reservations and kernel facts.
  returned: success
  type: dict
"""

import os
import platform
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.lowtail import cpulist, kernel_args, kubelet_memory, plan, topology
from ansible.module_utils.lowtail.errors import LowtailError

_INT = re.compile(r"^-?[0-9]+\Z")
_INT_MAX = 2**31 - 1
T = TypeVar("T")


_PERCENT = re.compile(r"^([0-9]+(?:\.[0-9]+)?)%\Z")
_HUGEPAGE_BYTES = {"2M": 2 * 2**20, "1G": 2**30}
# Keys the kernel role sets besides the CPU plan's own (roles/lowtail_kernel/vars/main.yml).
KERNEL_ROLE_KEYS = frozenset(
    {
        "transparent_hugepage",
        "rcutree.nohz_full_patience_delay",
        "idle",
        "processor.max_cstate",
        "default_hugepagesz",
        "hugepagesz",
        "hugepages",
        "rcupdate.rcu_normal_after_boot",
    }
)


# What DOCUMENTATION describes (tests/ansible/test_module_docs.py checks that they agree).
# The one source of kubelet's memory reservations by default: the argument spec below is built from it,
# DOCUMENTATION and the preflight role's argument spec state it (tests/ansible/test_module_docs.py holds
# them equal), and a key the caller leaves out or sets to null takes its value from here.
KUBELET_MEMORY_DEFAULTS: dict[str, Any] = {
    "kube_reserved": "1Gi",
    "system_reserved": "1Gi",
    "eviction_hard": "100Mi",
    "per_numa": "auto",
}

ARGUMENT_SPEC: dict[str, Any] = {
    "sysfs_root": {"type": "path", "default": "/sys"},
    "procfs_root": {"type": "path", "default": "/proc"},
    "boot_root": {"type": "path", "default": "/boot"},
    "kernel_release": {"type": "str"},
    "housekeeping": {"type": "raw", "default": "auto"},
    "amd_pstate": {
        "type": "str",
        "default": "guided",
        "choices": ["guided", "active", "passive", ""],
    },
    "allow_virtual": {"type": "bool", "default": False},
    "expected_hardware": {
        "type": "dict",
        "options": {
            "sockets": {"type": "int"},
            "numa_per_socket": {"type": "int"},
            "smt": {"type": "bool"},
            "l3_per_socket": {"type": "int"},
        },
    },
    "rt_runtime_us": {"type": "raw", "default": 950000},
    "rt_period_us": {"type": "raw", "default": 1000000},
    "stalld": {"type": "bool", "default": False},
    "hugepages": {
        "type": "dict",
        "options": {
            "size": {"type": "str", "default": "1G", "choices": ["2M", "1G"]},
            "count": {"type": "raw", "default": 0},
        },
    },
    "cstate_limit": {"type": "raw"},
    "kernel_extra_args": {"type": "list", "elements": "raw", "default": []},
    "serial": {"type": "raw", "default": "25%"},
    "require_systemd": {"type": "bool", "default": True},
    "kubelet_memory": {
        "type": "dict",
        "options": {key: {"type": "raw", "default": value} for key, value in KUBELET_MEMORY_DEFAULTS.items()},
    },
}


class PreflightError(LowtailError, ValueError):
    """Inputs or a host that lowtail must not provision: every problem found, each naming its value."""

    def __init__(self, problems: str | list[str]) -> None:
        self.problems = [problems] if isinstance(problems, str) else list(problems)
        if len(self.problems) == 1:
            text = self.problems[0]
        else:
            text = f"{len(self.problems)} problems: " + " ".join(
                f"({i}) {p}" for i, p in enumerate(self.problems, 1)
            )
        super().__init__(text)


def _integer(value: Any, name: str) -> int:
    if isinstance(value, bool) or not (
        isinstance(value, int) or (isinstance(value, str) and _INT.match(value))
    ):
        raise PreflightError(f"{name} {value!r}: expected an integer number of microseconds")
    return int(value)


def check_rt_budget(runtime: Any, period: Any, stalld: bool) -> dict[str, Any]:
    """The RT budget, or PreflightError. A budget of the whole period throttles nothing, so it is the
    same as -1 and needs stalld; 0 gives SCHED_FIFO tasks no time at all (they never run)."""
    period_us = _integer(period, "lowtail_rt_period_us")
    runtime_us = _integer(runtime, "lowtail_rt_runtime_us")
    if not 1 <= period_us <= _INT_MAX:
        raise PreflightError(f"lowtail_rt_period_us {period_us}: expected 1..{_INT_MAX}")
    if runtime_us > period_us:
        raise PreflightError(
            f"lowtail_rt_runtime_us {runtime_us} is larger than lowtail_rt_period_us {period_us}"
        )
    if runtime_us == 0:
        raise PreflightError(
            "lowtail_rt_runtime_us 0 gives real-time tasks no CPU time at all (SCHED_FIFO workers would "
            f"never run); expected 950000 (the kernel default), 1..{period_us}, or -1 with stalld"
        )
    if runtime_us < -1:
        raise PreflightError(f"lowtail_rt_runtime_us {runtime_us}: expected -1 or 1..{period_us}")
    unthrottled = runtime_us in (-1, period_us)
    if unthrottled and not stalld:
        what = (
            "-1 (no RT throttling)"
            if runtime_us == -1
            else f"{runtime_us} (the whole period: no RT throttling)"
        )
        raise PreflightError(
            f"lowtail_rt_runtime_us {what} without stalld: a spinning SCHED_FIFO task "
            "would starve kernel threads on its CPU; set lowtail_stalld: true or use 950000"
        )
    return {"runtime_us": runtime_us, "period_us": period_us, "unthrottled": unthrottled}


def check_serial(serial: Any) -> None:
    """Ansible's play keyword serial: a positive count, a percentage in (0, 100], or a list of them."""
    items = serial if isinstance(serial, list) else [serial]
    for item in items:
        if isinstance(item, bool):
            ok = False
        elif isinstance(item, int):
            ok = item >= 1
        elif isinstance(item, str) and item.strip().isdigit():
            ok = int(item) >= 1
        elif isinstance(item, str) and (m := _PERCENT.match(item.strip())):
            ok = 0 < float(m.group(1)) <= 100
        else:
            ok = False
        if not ok or not items:
            raise PreflightError(
                f"lowtail_serial {serial!r}: expected a number of hosts (>= 1), a percentage such as "
                "'25%', or a list of them such as [1, '25%']"
            )


def check_kernel_args(extra: list[Any], cstate_limit: Any, lowtail_keys: set[str]) -> None:
    problems = []
    if cstate_limit not in (None, "") and (
        isinstance(cstate_limit, bool) or not _INT.match(str(cstate_limit)) or int(cstate_limit) < 0
    ):
        problems.append(
            f"lowtail_kernel_cstate_limit {cstate_limit!r}: expected null (kernel's choice), 0 "
            "(idle=poll) or a positive C-state number"
        )
    seen: set[str] = set()
    for arg in extra or []:
        if not kernel_args.is_safe(arg):
            problems.append(
                f"lowtail_kernel_extra_args {arg!r}: a kernel argument may only use letters, digits and "
                "_ . , : / + = @ - (a GRUB drop-in is sourced by a root shell; quotes, $, backquotes, "
                "spaces and ; never reach it)"
            )
            continue
        key = arg.split("=", 1)[0]
        if key in lowtail_keys or key in seen:
            problems.append(
                f"lowtail_kernel_extra_args {arg!r} sets {key}, which "
                + ("lowtail already sets" if key in lowtail_keys else "is given twice")
                + ": one value per key, or the running-argument check would never settle"
            )
        seen.add(key)
    if problems:
        raise PreflightError(problems)


def node_mem_total(sysfs_root: Path, node: int) -> int | None:
    """MemTotal of one NUMA node in bytes, from sysfs node/nodeN/meminfo (None when unreadable)."""
    try:
        text = (sysfs_root / f"devices/system/node/node{node}/meminfo").read_text()
    except OSError:
        return None
    m = re.search(r"MemTotal:\s+([0-9]+) kB", text)
    return int(m.group(1)) * 1024 if m else None


def check_hugepages(
    sysfs_root: Path, hugepages: dict[str, Any] | None, reserved: dict[int, int]
) -> dict[str, Any]:
    """hugepages=N at boot is spread round-robin over the NUMA nodes; each node's share plus kubelet's
    reservedMemory on it must fit in the node's MemTotal, or the kernel allocates fewer pages than asked
    (or none is left for the system)."""
    hp = hugepages or {}
    size = hp.get("size") or "1G"
    count_raw = hp.get("count", 0)
    if isinstance(count_raw, bool) or not _INT.match(str(count_raw)) or int(count_raw) < 0:
        raise PreflightError(f"lowtail_kernel_hugepages.count {count_raw!r}: expected a whole number >= 0")
    if size not in _HUGEPAGE_BYTES:
        raise PreflightError(f"lowtail_kernel_hugepages.size {size!r}: expected one of 2M, 1G")
    count = int(count_raw)
    result = {"size": size, "count": count, "per_node": {}}
    if count == 0:
        return result
    nodes = sorted(reserved)
    share = -(-count // len(nodes))
    problems = []
    for node in nodes:
        total = node_mem_total(sysfs_root, node)
        if total is None:
            problems.append(
                f"lowtail_kernel_hugepages {count} x {size}: cannot read MemTotal of NUMA node {node} "
                f"({sysfs_root}/devices/system/node/node{node}/meminfo)"
            )
            continue
        need = share * _HUGEPAGE_BYTES[size] + reserved[node]
        result["per_node"][node] = share
        if need > total:
            problems.append(
                f"lowtail_kernel_hugepages {count} x {size}: NUMA node {node} would need {share} x {size} "
                f"plus {reserved[node] // 2**20} MiB reserved for the system and kubelet, but has MemTotal "
                f"{total // 2**20} MiB; expected at most "
                f"{max(0, (total - reserved[node]) // _HUGEPAGE_BYTES[size]) * len(nodes)} pages"
            )
    if problems:
        raise PreflightError(problems)
    return result


def init_system(procfs_root: Path) -> str:
    try:
        return (procfs_root / "1/comm").read_text().strip()
    except OSError:
        return ""


def check_hardware(topo: topology.Topology, expected: dict[str, Any] | None) -> None:
    if not expected:
        return
    n_sockets = len(topo.sockets)
    actual = {
        "sockets": n_sockets,
        "numa_per_socket": len(topo.numa_nodes) // max(n_sockets, 1),
        "smt": topo.threads_per_core > 1,
        "l3_per_socket": len(topo.l3_groups) // max(n_sockets, 1),
    }
    hints = {
        "sockets": "a socket missing or disabled",
        "numa_per_socket": "check the BIOS NPS setting (NPS1/NPS2/NPS4)",
        "smt": "check the BIOS SMT setting",
        "l3_per_socket": "check the BIOS 'L3 as NUMA'/CCD settings and the CPU model",
    }
    wrong = [
        f"{key} expected {want!r}, host has {actual[key]!r} ({hints[key]})"
        for key, want in expected.items()
        if want is not None and actual[key] != want
    ]
    if wrong:
        raise PreflightError(
            "lowtail_expected_hardware does not match this host: "
            + "; ".join(wrong)
            + f" [{topo.model_name}]"
        )


def _kernel_release(procfs_root: Path, override: str | None) -> str:
    if override:
        return override
    try:
        return (procfs_root / "sys/kernel/osrelease").read_text().strip()
    except OSError:
        return platform.release()


def kernel_facts(sysfs_root: Path, procfs_root: Path, boot_root: Path, release: str | None) -> dict[str, Any]:
    """CONFIG_RT_GROUP_SCHED from /boot/config-RELEASE (None when missing) and the cgroup version."""
    rel = _kernel_release(procfs_root, release)
    config = boot_root / f"config-{rel}"
    rt_group: bool | None = None
    if config.is_file():
        rt_group = False
        for line in config.read_text(errors="replace").splitlines():
            if line.startswith("CONFIG_RT_GROUP_SCHED="):
                rt_group = line.split("=", 1)[1].strip() == "y"
    cgroup = sysfs_root / "fs/cgroup"
    cgroup_version = 2 if (cgroup / "cgroup.controllers").exists() else (1 if cgroup.is_dir() else None)
    return {
        "release": rel,
        "config_file": str(config) if config.is_file() else None,
        "rt_group_sched": rt_group,
        "cgroup_version": cgroup_version,
    }


def _collect(problems: list[str], check: Callable[[], T]) -> T | None:
    """Run one check; record its problems and go on, so one run reports every bad input at once."""
    try:
        return check()
    except PreflightError as e:
        problems.extend(e.problems)
        return None


def _init_problem(procfs_root: Path) -> str | None:
    init = init_system(procfs_root)
    if init == "systemd":
        return None
    return (
        f"PID 1 is {init or 'unknown'!r} ({procfs_root}/1/comm), not systemd: lowtail's tuning, "
        "kubelet and runtime steps need systemd (units, CPUAffinity=, daemon-reexec)"
    )


def _judge_virtual(
    topo: topology.Topology, allow_virtual: bool, problems: list[str], warnings: list[str]
) -> None:
    """A virtual host is a problem unless lowtail_allow_virtual, then a warning."""
    if not topo.virtual:
        return
    evidence = "; ".join(f.detail for f in topo.findings)
    if not allow_virtual:
        problems.append(
            f"this host looks virtual ({evidence}) and lowtail_allow_virtual is false: a VM cannot "
            "give exclusive physical cores or a true NUMA layout; set lowtail_allow_virtual: true "
            "only for test sandboxes"
        )
    else:
        warnings.append(f"provisioning a virtual host because lowtail_allow_virtual is true: {evidence}")


def _cpu_plan(topo: topology.Topology, params: dict[str, Any]) -> plan.Plan:
    housekeeping = params["housekeeping"]
    try:
        return plan.make_plan(topo, housekeeping, params["amd_pstate"] or None)
    except (plan.PlanError, cpulist.CpuListError) as e:
        raise PreflightError(f"lowtail_housekeeping {housekeeping!r}: {e}") from None


def _reservations(topo: topology.Topology, params: dict[str, Any]) -> kubelet_memory.MemoryReservations:
    given = params.get("kubelet_memory") or {}
    mem = {**KUBELET_MEMORY_DEFAULTS, **{k: v for k, v in given.items() if v is not None}}
    try:
        return kubelet_memory.plan_reservations(
            topo.numa_nodes,
            mem["kube_reserved"],
            mem["system_reserved"],
            mem["eviction_hard"],
            mem["per_numa"],
        )
    except kubelet_memory.MemoryReservationError as e:
        raise PreflightError(f"lowtail_kubelet_memory: {e}") from None


def _kernel_warning(kernel: dict[str, Any], boot_root: str) -> str | None:
    """What CONFIG_RT_GROUP_SCHED (or not knowing it) means for SCHED_FIFO in containers."""
    if kernel["rt_group_sched"]:
        return (
            f"kernel {kernel['release']} has CONFIG_RT_GROUP_SCHED=y: SCHED_FIFO is impossible inside "
            "containers (non-root cgroups get no RT budget); lowtail workers will fall back to SCHED_OTHER"
        )
    if kernel["rt_group_sched"] is None:
        return (
            f"no {boot_root}/config-{kernel['release']}: cannot tell whether the kernel has "
            "CONFIG_RT_GROUP_SCHED (validation will probe SCHED_FIFO instead)"
        )
    return None


def _topology_facts(topo: topology.Topology) -> dict[str, Any]:
    n_sockets = len(topo.sockets)
    return {
        "sockets": n_sockets,
        "numa_nodes": len(topo.numa_nodes),
        "numa_per_socket": len(topo.numa_nodes) // max(n_sockets, 1),
        "cores_per_socket": topo.cores_per_socket,
        "threads_per_core": topo.threads_per_core,
        "smt": topo.threads_per_core > 1,
        "l3_groups": len(topo.l3_groups),
        "l3_per_socket": len(topo.l3_groups) // max(n_sockets, 1),
        "online": cpulist.format(topo.online),
        "cpu_count": len(topo.online),
        "vendor": topo.vendor,
        "model_name": topo.model_name,
        "virtual": topo.virtual,
        "deceptive": topo.deceptive,
        "findings": [f.to_dict() for f in topo.findings],
        "isolated_now": cpulist.format(topo.isolated),
        "nohz_full_now": cpulist.format(topo.nohz_full),
    }


def build_node(params: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Everything the roles need about the host, or one PreflightError listing every problem found."""
    sysfs_root, procfs_root = Path(params["sysfs_root"]), Path(params["procfs_root"])
    warnings: list[str] = []
    problems: list[str] = []

    if params.get("require_systemd", True) and (why := _init_problem(procfs_root)):
        problems.append(why)
    rt = _collect(
        problems, lambda: check_rt_budget(params["rt_runtime_us"], params["rt_period_us"], params["stalld"])
    )
    _collect(problems, lambda: check_serial(params.get("serial", "25%")))

    try:
        topo = topology.read_topology(sysfs_root, procfs_root)
    except (topology.TopologyError, cpulist.CpuListError) as e:
        raise PreflightError([*problems, f"cannot read the CPU topology: {e}"]) from None

    _judge_virtual(topo, params["allow_virtual"], problems, warnings)
    _collect(problems, lambda: check_hardware(topo, params.get("expected_hardware")))
    cpu_plan = _collect(problems, lambda: _cpu_plan(topo, params))
    plan_keys = {a.split("=", 1)[0] for a in cpu_plan.kernel_args} if cpu_plan else set()
    _collect(
        problems,
        lambda: check_kernel_args(
            params.get("kernel_extra_args") or [], params.get("cstate_limit"), plan_keys | KERNEL_ROLE_KEYS
        ),
    )
    reservations = _collect(problems, lambda: _reservations(topo, params))
    per_numa = reservations.per_numa if reservations else dict.fromkeys(topo.numa_nodes, 0)
    hugepages = _collect(problems, lambda: check_hugepages(sysfs_root, params.get("hugepages"), per_numa))

    if problems or cpu_plan is None or rt is None or reservations is None:
        raise PreflightError(problems)

    kernel = kernel_facts(sysfs_root, procfs_root, Path(params["boot_root"]), params.get("kernel_release"))
    if warning := _kernel_warning(kernel, params["boot_root"]):
        warnings.append(warning)
    node = {
        "topology": _topology_facts(topo),
        "plan": cpu_plan.to_dict(),
        # sysfs files such as the workqueue cpumask take hex masks, not cpulists.
        "masks": {
            "housekeeping": cpulist.format_mask(cpu_plan.housekeeping),
            "isolated": cpulist.format_mask(cpu_plan.isolated),
        },
        "rt": rt,
        # An unthrottled budget (-1 or the whole period) runs stalld; check_rt_budget required the opt-in.
        "stalld": bool(params["stalld"]) or bool(rt["unthrottled"]),
        "kubelet_memory": reservations.to_dict(),
        "hugepages": hugepages,
        "kernel": kernel,
    }
    return node, warnings


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    try:
        node, warnings = build_node(module.params)
    except PreflightError as e:
        module.fail_json(msg=str(e), problems=e.problems)
    for w in warnings:
        module.warn(w)
    module.exit_json(changed=False, node=node, hostname=os.uname().nodename)


if __name__ == "__main__":
    main()
