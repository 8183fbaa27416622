#!/usr/bin/python
"""Ansible module: move existing IRQs to the housekeeping CPUs.

The irqaffinity= kernel argument only covers IRQs set up after boot parameters are read, and
irqbalance's banned list only governs what irqbalance itself moves; IRQs already pinned elsewhere
stay on isolated CPUs until someone writes their smp_affinity_list. This module does that, reports
exactly which IRQs it changed, and supports check mode.
"""

from __future__ import annotations

DOCUMENTATION = r"""
---
module: lowtail_irq_affinity
short_description: Set the affinity of existing IRQs (and the default for new ones) to a cpulist
description:
  - Writes I(cpus) to C(irq/N/smp_affinity_list) for every IRQ that may run on a CPU outside I(cpus),
    and I(cpus) to C(irq/default_smp_affinity) as a hex mask.
  - An IRQ already confined to some of I(cpus) is left alone, because irqbalance spreads IRQs over
    single housekeeping CPUs and widening them back to the whole list on every run would fight it.
  - With I(default_only), only C(irq/default_smp_affinity) is written (rollback restores it to every
    online CPU and leaves the existing IRQs to irqbalance).
  - IRQs the kernel does not let user space move (per-CPU timer and IPI vectors, managed IRQs)
    answer EIO or EINVAL; they are reported as C(unmovable), not as failures.
options:
  cpus:
    description: The housekeeping cpulist, e.g. C(0-6,84-90).
    type: str
    required: true
  procfs_root:
    description: Root of procfs (a fixture tree in tests).
    type: path
    default: /proc
  default_only:
    description: Set only the default affinity for new IRQs; leave existing IRQs as they are.
    type: bool
    default: false
author: lowtail
"""

EXAMPLES = r"""
- name: Move every movable IRQ to the housekeeping CPUs
  lowtail_irq_affinity:
    cpus: 0-6,84-90
"""

RETURN = r"""
moved:
  description: IRQ numbers whose affinity was (or in check mode would be) changed.
  type: list
  returned: always
unmovable:
  description: IRQ numbers the kernel refused to move.
  type: list
  returned: always
"""

import errno
from pathlib import Path
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.lowtail import cpulist

# What DOCUMENTATION describes (tests/ansible/test_module_docs.py checks that they agree).
ARGUMENT_SPEC: dict[str, Any] = {
    "cpus": {"type": "str", "required": True},
    "procfs_root": {"type": "path", "default": "/proc"},
    "default_only": {"type": "bool", "default": False},
}


def set_affinity(
    procfs_root: Path, wanted: frozenset[int], check_mode: bool, default_only: bool = False
) -> dict[str, Any]:
    irq_root = procfs_root / "irq"
    if not irq_root.is_dir():
        raise FileNotFoundError(f"{irq_root} does not exist: not a procfs tree")
    moved: list[int] = []
    unmovable: list[int] = []
    irqs = [] if default_only else [p for p in irq_root.iterdir() if p.name.isdigit()]
    for d in sorted(irqs, key=lambda p: int(p.name)):
        f = d / "smp_affinity_list"
        try:
            current = cpulist.parse(f.read_text())
        except FileNotFoundError:
            continue
        if current and current <= wanted:
            continue
        if not check_mode:
            try:
                f.write_text(cpulist.format(wanted) + "\n")
            except OSError as e:
                if e.errno in (errno.EIO, errno.EINVAL, errno.EPERM):
                    unmovable.append(int(d.name))
                    continue
                raise
        moved.append(int(d.name))
    default = irq_root / "default_smp_affinity"
    default_changed = False
    if default.exists():
        want_mask = cpulist.format_mask(wanted)
        # The kernel pads the mask with leading zero words; compare numerically.
        if int(default.read_text().strip().replace(",", ""), 16) != int(want_mask.replace(",", ""), 16):
            default_changed = True
            if not check_mode:
                default.write_text(want_mask + "\n")
    return {"moved": moved, "unmovable": unmovable, "default_changed": default_changed}


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    try:
        wanted = cpulist.parse(module.params["cpus"])
    except cpulist.CpuListError as e:
        module.fail_json(msg=f"cpus: {e}")
    if not wanted:
        module.fail_json(msg="cpus is empty: IRQs need at least one housekeeping CPU")
    try:
        result = set_affinity(
            Path(module.params["procfs_root"]), wanted, module.check_mode, module.params["default_only"]
        )
    except OSError as e:
        module.fail_json(msg=f"cannot set IRQ affinity: {e}")
    module.exit_json(changed=bool(result["moved"] or result["default_changed"]), **result)


if __name__ == "__main__":
    main()
