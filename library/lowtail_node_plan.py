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
from pathlib import Path
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.lowtail import cpulist, kubelet_memory, plan, topology

_INT = re.compile(r"^-?[0-9]+$")
_INT_MAX = 2**31 - 1


class PreflightError(ValueError):
    """An inventory input or a host that lowtail must not provision; the message names the value."""


def _integer(value: Any, name: str) -> int:
    if isinstance(value, bool) or not (
        isinstance(value, int) or (isinstance(value, str) and _INT.match(value))
    ):
        raise PreflightError(f"{name} {value!r}: expected an integer number of microseconds")
    return int(value)


def check_rt_budget(runtime: Any, period: Any, stalld: bool) -> dict[str, int]:
    period_us = _integer(period, "lowtail_rt_period_us")
    runtime_us = _integer(runtime, "lowtail_rt_runtime_us")
    if not 1 <= period_us <= _INT_MAX:
        raise PreflightError(f"lowtail_rt_period_us {period_us}: expected 1..{_INT_MAX}")
    if runtime_us == -1:
        if not stalld:
            raise PreflightError(
                "lowtail_rt_runtime_us -1 (no RT throttling) without stalld: a spinning SCHED_FIFO task "
                "would starve kernel threads on its CPU; set lowtail_stalld: true or use 950000"
            )
    elif not 0 <= runtime_us <= period_us:
        raise PreflightError(
            f"lowtail_rt_runtime_us {runtime_us} is larger than lowtail_rt_period_us {period_us}"
            if runtime_us > period_us
            else f"lowtail_rt_runtime_us {runtime_us}: expected -1 or 0..{period_us}"
        )
    return {"runtime_us": runtime_us, "period_us": period_us}


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


def build_node(params: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """Everything the roles need about the host, or PreflightError naming the first bad input."""
    sysfs_root, procfs_root = Path(params["sysfs_root"]), Path(params["procfs_root"])
    warnings: list[str] = []
    try:
        topo = topology.read_topology(sysfs_root, procfs_root)
    except (topology.TopologyError, cpulist.CpuListError) as e:
        raise PreflightError(f"cannot read the CPU topology: {e}") from None

    evidence = "; ".join(f.detail for f in topo.findings)
    if topo.virtual:
        if not params["allow_virtual"]:
            raise PreflightError(
                f"this host looks virtual ({evidence}) and lowtail_allow_virtual is false: a VM cannot "
                "give exclusive physical cores or a true NUMA layout; set lowtail_allow_virtual: true "
                "only for test sandboxes"
            )
        warnings.append(f"provisioning a virtual host because lowtail_allow_virtual is true: {evidence}")

    check_hardware(topo, params.get("expected_hardware"))

    housekeeping = params["housekeeping"]
    try:
        cpu_plan = plan.make_plan(topo, housekeeping, params["amd_pstate"] or None)
    except (plan.PlanError, cpulist.CpuListError) as e:
        raise PreflightError(f"lowtail_housekeeping {housekeeping!r}: {e}") from None

    rt = check_rt_budget(params["rt_runtime_us"], params["rt_period_us"], params["stalld"])

    mem = params.get("kubelet_memory") or {}
    try:
        reservations = kubelet_memory.plan_reservations(
            topo.numa_nodes,
            mem.get("kube_reserved", "1Gi"),
            mem.get("system_reserved", "1Gi"),
            mem.get("eviction_hard", "100Mi"),
            mem.get("per_numa", "auto"),
        )
    except kubelet_memory.MemoryReservationError as e:
        raise PreflightError(f"lowtail_kubelet_memory: {e}") from None

    kernel = kernel_facts(sysfs_root, procfs_root, Path(params["boot_root"]), params.get("kernel_release"))
    if kernel["rt_group_sched"]:
        warnings.append(
            f"kernel {kernel['release']} has CONFIG_RT_GROUP_SCHED=y: SCHED_FIFO is impossible inside "
            "containers (non-root cgroups get no RT budget); lowtail workers will fall back to SCHED_OTHER"
        )
    elif kernel["rt_group_sched"] is None:
        warnings.append(
            f"no {params['boot_root']}/config-{kernel['release']}: cannot tell whether the kernel has "
            "CONFIG_RT_GROUP_SCHED (validation will probe SCHED_FIFO instead)"
        )

    n_sockets = len(topo.sockets)
    node = {
        "topology": {
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
        },
        "plan": cpu_plan.to_dict(),
        # sysfs files such as the workqueue cpumask take hex masks, not cpulists.
        "masks": {
            "housekeeping": cpulist.format_mask(cpu_plan.housekeeping),
            "isolated": cpulist.format_mask(cpu_plan.isolated),
        },
        "rt": rt,
        "stalld": params["stalld"],
        "kubelet_memory": reservations.to_dict(),
        "kernel": kernel,
    }
    return node, warnings


def main() -> None:
    module = AnsibleModule(
        argument_spec={
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
            "kubelet_memory": {
                "type": "dict",
                "options": {
                    "kube_reserved": {"type": "raw", "default": "1Gi"},
                    "system_reserved": {"type": "raw", "default": "1Gi"},
                    "eviction_hard": {"type": "raw", "default": "100Mi"},
                    "per_numa": {"type": "raw", "default": "auto"},
                },
            },
        },
        supports_check_mode=True,
    )
    try:
        node, warnings = build_node(module.params)
    except PreflightError as e:
        module.fail_json(msg=str(e))
    for w in warnings:
        module.warn(w)
    module.exit_json(changed=False, node=node, hostname=os.uname().nodename)


if __name__ == "__main__":
    main()
