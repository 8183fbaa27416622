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
  - With I(default_only), only C(irq/default_smp_affinity) is written.
  - With I(record), the affinity each IRQ had before this module first moved it, and the default
    before it first changed it, are kept in that JSON file (written before any IRQ moves, so an
    interrupted run still knows them; a value already recorded is kept, so the record is what the
    host had before lowtail).
  - With I(restore), the IRQs and the default in I(record) get their recorded affinity back (rollback);
    IRQs that no longer exist are reported as C(gone); without a recorded default, or without a
    record at all, the default becomes I(cpus) and unrecorded IRQs are left to irqbalance.
  - IRQs the kernel does not let user space move (per-CPU timer and IPI vectors, managed IRQs)
    answer EIO or EINVAL; they are reported as C(unmovable), not as failures.
options:
  cpus:
    description: >-
      The housekeeping cpulist, e.g. C(0-6,84-90); with I(restore), the default affinity when none is
      recorded (every online CPU, the kernel's default).
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
  record:
    description: JSON file keeping the affinities from before lowtail moved them (for rollback).
    type: path
  restore:
    description: Put the affinities in I(record) back; the default becomes I(cpus) when none is recorded.
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
gone:
  description: With I(restore), recorded IRQ numbers that no longer exist.
  type: list
  returned: always
"""

import errno
import json
import os
from pathlib import Path
from typing import Any

from ansible.module_utils.basic import AnsibleModule
from ansible.module_utils.lowtail import cpulist

# What DOCUMENTATION describes (tests/ansible/test_module_docs.py checks that they agree).
ARGUMENT_SPEC: dict[str, Any] = {
    "cpus": {"type": "str", "required": True},
    "procfs_root": {"type": "path", "default": "/proc"},
    "default_only": {"type": "bool", "default": False},
    "record": {"type": "path"},
    "restore": {"type": "bool", "default": False},
}


def _write(path: Path, text: str) -> bool:
    """Write one procfs file; False when the kernel refuses (per-CPU and managed IRQs answer EIO or
    EINVAL, EPERM without CAP_SYS_ADMIN)."""
    try:
        path.write_text(text + "\n")
    except OSError as e:
        if e.errno in (errno.EIO, errno.EINVAL, errno.EPERM):
            return False
        raise
    return True


def read_record(record: Path | None) -> dict[str, Any]:
    if record is None or not record.exists():
        return {"irqs": {}}
    data = json.loads(record.read_text())
    if not isinstance(data, dict) or not isinstance(data.get("irqs"), dict):
        raise ValueError(f"{record}: expected a JSON object with an 'irqs' map")
    return data


def write_record(record: Path, data: dict[str, Any]) -> None:
    """Replace the record atomically: a run interrupted mid-write leaves the old one whole."""
    tmp = record.with_name(record.name + ".tmp")
    tmp.write_text(json.dumps(data, indent=1, sort_keys=True) + "\n")
    os.chmod(tmp, 0o644)
    os.replace(tmp, record)


def _default_differs(default: Path, mask: str) -> bool:
    # The kernel pads the mask with leading zero words; compare numerically.
    return int(default.read_text().strip().replace(",", ""), 16) != int(mask.replace(",", ""), 16)


def set_affinity(
    procfs_root: Path,
    wanted: frozenset[int],
    check_mode: bool,
    default_only: bool = False,
    record: Path | None = None,
) -> dict[str, Any]:
    irq_root = procfs_root / "irq"
    if not irq_root.is_dir():
        raise FileNotFoundError(f"{irq_root} does not exist: not a procfs tree")
    irqs = [] if default_only else [p for p in irq_root.iterdir() if p.name.isdigit()]
    to_move: dict[int, str] = {}
    for d in sorted(irqs, key=lambda p: int(p.name)):
        try:
            text = (d / "smp_affinity_list").read_text().strip()
        except FileNotFoundError:
            continue
        current = cpulist.parse(text)
        if not (current and current <= wanted):
            to_move[int(d.name)] = text
    default = irq_root / "default_smp_affinity"
    want_mask = cpulist.format_mask(wanted)
    default_changed = default.exists() and _default_differs(default, want_mask)
    if record is not None and not check_mode:
        kept = read_record(record)
        for irq, text in to_move.items():
            kept["irqs"].setdefault(str(irq), text)
        if default_changed:
            kept.setdefault("default_smp_affinity", default.read_text().strip())
        write_record(record, kept)
    moved: list[int] = []
    unmovable: list[int] = []
    for irq in to_move:
        if check_mode or _write(irq_root / str(irq) / "smp_affinity_list", cpulist.format(wanted)):
            moved.append(irq)
        else:
            unmovable.append(irq)
    if default_changed and not check_mode:
        default.write_text(want_mask + "\n")
    return {"moved": moved, "unmovable": unmovable, "gone": [], "default_changed": default_changed}


def restore_affinity(
    procfs_root: Path, fallback_default: frozenset[int], record: Path, check_mode: bool
) -> dict[str, Any]:
    """Put back what `record` kept; the default falls back to `fallback_default` (every online CPU,
    the kernel's own default) when the record has none."""
    irq_root = procfs_root / "irq"
    if not irq_root.is_dir():
        raise FileNotFoundError(f"{irq_root} does not exist: not a procfs tree")
    kept = read_record(record)
    moved: list[int] = []
    unmovable: list[int] = []
    gone: list[int] = []
    for name, text in sorted(kept["irqs"].items(), key=lambda kv: int(kv[0])):
        path = irq_root / name / "smp_affinity_list"
        if not path.exists():
            gone.append(int(name))
            continue
        if cpulist.parse(path.read_text()) == cpulist.parse(text):
            continue
        if check_mode or _write(path, text):
            moved.append(int(name))
        else:
            unmovable.append(int(name))
    default = irq_root / "default_smp_affinity"
    mask = kept.get("default_smp_affinity") or cpulist.format_mask(fallback_default)
    default_changed = default.exists() and _default_differs(default, mask)
    if default_changed and not check_mode:
        default.write_text(mask + "\n")
    return {"moved": moved, "unmovable": unmovable, "gone": gone, "default_changed": default_changed}


def main() -> None:
    module = AnsibleModule(argument_spec=ARGUMENT_SPEC, supports_check_mode=True)
    try:
        wanted = cpulist.parse(module.params["cpus"])
    except cpulist.CpuListError as e:
        module.fail_json(msg=f"cpus: {e}")
    if not wanted:
        module.fail_json(msg="cpus is empty: IRQs need at least one housekeeping CPU")
    record = Path(module.params["record"]) if module.params["record"] else None
    procfs_root = Path(module.params["procfs_root"])
    try:
        if not module.params["restore"]:
            result = set_affinity(
                procfs_root, wanted, module.check_mode, module.params["default_only"], record
            )
        elif record is None:
            raise ValueError("restore needs record: the file with the affinities from before lowtail")
        else:
            result = restore_affinity(procfs_root, wanted, record, module.check_mode)
    except (OSError, ValueError) as e:
        module.fail_json(msg=f"cannot set IRQ affinity: {e}")
    module.exit_json(changed=bool(result["moved"] or result["default_changed"]), **result)


if __name__ == "__main__":
    main()
