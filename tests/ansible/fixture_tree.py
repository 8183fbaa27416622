"""Write a fixture host tree for the Ansible tests: a machine's sysfs/procfs plus IRQs to move.

``python tests/ansible/fixture_tree.py OUTDIR [MACHINE]`` writes OUTDIR/sys and OUTDIR/proc (default
machine: epyc9634_2s) with ``proc/irq/N/smp_affinity_list`` spread over every CPU and ``proc/1/comm``
naming systemd, as a host looks before lowtail moves its IRQs to the housekeeping CPUs.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "python"))

from lowtail.node import cpulist  # noqa: E402
from tests.fixtures.machines import MACHINES, write_machine  # noqa: E402

N_IRQS = 24


def write_host(out: Path, machine: str = "epyc9634_2s") -> tuple[Path, Path]:
    """Write the machine under ``out`` and give it IRQs whose affinity is every online CPU."""
    sys_root, proc_root = write_machine(out, MACHINES[machine])
    online = cpulist.parse((sys_root / "devices/system/cpu/online").read_text())
    for irq in range(N_IRQS):
        d = proc_root / "irq" / str(irq)
        d.mkdir(parents=True, exist_ok=True)
        (d / "smp_affinity_list").write_text(cpulist.format(online) + "\n")
    (proc_root / "irq/default_smp_affinity").write_text(cpulist.format_mask(online) + "\n")
    # PID 1 of the host the tree describes (preflight refuses a host whose init is not systemd).
    (proc_root / "1").mkdir(exist_ok=True)
    (proc_root / "1/comm").write_text("systemd\n")
    return sys_root, proc_root


if __name__ == "__main__":
    write_host(Path(sys.argv[1]), sys.argv[2] if len(sys.argv) > 2 else "epyc9634_2s")
