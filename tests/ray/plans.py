"""Hand-made plans for lease tests (the fixture machines give the big ones)."""

from __future__ import annotations

from lowtail.node import cpulist
from lowtail.node.plan import Plan


def tiny_plan(isolated: str = "1-8", housekeeping: str = "0", l3: tuple[str, ...] = ("0-4", "5-8")) -> Plan:
    """One socket and one NUMA node with the given L3 groups (cpulists)."""
    iso = cpulist.parse(isolated)
    return Plan.from_dict(
        {
            "spec": housekeeping,
            "housekeeping": housekeeping,
            "isolated": isolated,
            "per_node": {"0": {"housekeeping": housekeeping, "isolated": isolated}},
            "l3_groups": [
                {
                    "index": i,
                    "node": 0,
                    "socket": 0,
                    "cpus": g,
                    "isolated": cpulist.format(cpulist.parse(g) & iso),
                }
                for i, g in enumerate(l3)
            ],
            "kernel_args": [],
        }
    )
