"""Kubelet memory reservations that balance: the memory manager's per-NUMA ``reservedMemory``.

With ``memoryManagerPolicy: Static`` kubelet refuses to start unless the sum of ``reservedMemory`` over
NUMA nodes equals ``kubeReserved.memory + systemReserved.memory + evictionHard["memory.available"]``
exactly (kubelet resource managers docs). This module parses Kubernetes quantities, splits the total
over the host's NUMA nodes (or checks a split given by the inventory) and formats the result so the
sum is exact in bytes, never rounded.

Stdlib only and relative imports only: the Ansible preflight module ships it as module_utils.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from .errors import LowtailError

# Binary and decimal suffixes of resource.Quantity that make sense for memory (no milli-bytes).
_SUFFIX: dict[str, int] = {
    "": 1,
    "k": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "E": 10**18,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
    "Ei": 2**60,
}
_QUANTITY = re.compile(r"^\s*([0-9]+)\s*(Ki|Mi|Gi|Ti|Pi|Ei|k|M|G|T|P|E|)\s*\Z")


class MemoryReservationError(LowtailError, ValueError):
    """Memory reservations that kubelet would reject: unparsable, unknown NUMA node, or unbalanced."""


def parse_quantity(value: str | int, what: str = "quantity") -> int:
    """Bytes in a Kubernetes memory quantity such as ``1Gi``, ``100Mi``, ``512M`` or ``1073741824``."""
    if isinstance(value, bool):
        raise MemoryReservationError(f"{what} {value!r}: expected a memory quantity such as '1Gi'")
    if isinstance(value, int):
        if value < 0:
            raise MemoryReservationError(f"{what} {value!r}: expected a non-negative number of bytes")
        return value
    m = _QUANTITY.match(str(value))
    if not m:
        raise MemoryReservationError(
            f"{what} {value!r}: expected an integer with an optional suffix "
            "Ki, Mi, Gi, Ti (or k, M, G, T), e.g. '1Gi' or '100Mi'"
        )
    return int(m.group(1)) * _SUFFIX[m.group(2)]


def format_quantity(n_bytes: int) -> str:
    """The largest binary suffix that represents ``n_bytes`` exactly (``1124Mi``, ``1536Ki``, ``7``)."""
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        unit = _SUFFIX[suffix]
        if n_bytes and n_bytes % unit == 0:
            return f"{n_bytes // unit}{suffix}"
    return str(n_bytes)


@dataclass(frozen=True)
class MemoryReservations:
    kube_reserved: int
    system_reserved: int
    eviction_hard: int
    per_numa: dict[int, int]  # NUMA node -> bytes

    @property
    def total(self) -> int:
        return self.kube_reserved + self.system_reserved + self.eviction_hard

    def reserved_memory(self) -> list[dict[str, Any]]:
        """KubeletConfiguration ``reservedMemory``: ``[{numaNode: N, limits: {memory: Q}}]``."""
        return [
            {"numaNode": node, "limits": {"memory": format_quantity(n)}}
            for node, n in sorted(self.per_numa.items())
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "kube_reserved": format_quantity(self.kube_reserved),
            "system_reserved": format_quantity(self.system_reserved),
            "eviction_hard": format_quantity(self.eviction_hard),
            "total": format_quantity(self.total),
            "total_bytes": self.total,
            "reserved_memory": self.reserved_memory(),
        }


def _split_evenly(total: int, nodes: list[int]) -> dict[int, int]:
    """Equal shares in whole MiB where possible; the remainder goes to the lowest node (housekeeping's)."""
    unit = 2**20 if total % 2**20 == 0 else 1
    units = total // unit
    share, rest = divmod(units, len(nodes))
    return {node: (share + (rest if i == 0 else 0)) * unit for i, node in enumerate(sorted(nodes))}


def plan_reservations(
    numa_nodes: Iterable[int],
    kube_reserved: str | int,
    system_reserved: str | int,
    eviction_hard: str | int,
    per_numa: Mapping[Any, str | int] | str | None = "auto",
) -> MemoryReservations:
    """Per-NUMA reservations whose sum equals kubeReserved + systemReserved + evictionHard memory.

    ``per_numa`` is ``auto`` (split evenly over the host's nodes) or a map node -> quantity given by the
    inventory, which must name existing nodes and add up exactly.
    """
    nodes = sorted(set(numa_nodes))
    if not nodes:
        raise MemoryReservationError("the host has no NUMA node to reserve memory on")
    kube = parse_quantity(kube_reserved, "kube_reserved")
    system = parse_quantity(system_reserved, "system_reserved")
    eviction = parse_quantity(eviction_hard, "eviction_hard")
    total = kube + system + eviction
    if total == 0:
        raise MemoryReservationError(
            "kube_reserved + system_reserved + eviction_hard is 0: the Static memory manager needs a "
            "non-zero reservation on at least one NUMA node"
        )
    if per_numa is None or per_numa == "auto":
        split = _split_evenly(total, nodes)
    elif isinstance(per_numa, Mapping):
        split = {}
        for raw_node, quantity in per_numa.items():
            try:
                node = int(raw_node)
            except (TypeError, ValueError):
                raise MemoryReservationError(
                    f"per_numa key {raw_node!r}: expected a NUMA node number, one of {nodes}"
                ) from None
            if node not in nodes:
                raise MemoryReservationError(
                    f"per_numa names NUMA node {node}, which this host does not have (nodes: {nodes})"
                )
            n = parse_quantity(quantity, f"per_numa[{node}]")
            if n == 0:
                raise MemoryReservationError(f"per_numa[{node}] is 0: kubelet rejects zero limits")
            split[node] = n
        given = sum(split.values())
        if given != total:
            detail = " + ".join(f"{format_quantity(split[n])} (node {n})" for n in sorted(split))
            raise MemoryReservationError(
                f"memory reservations do not balance: per_numa {detail} = {format_quantity(given)} "
                f"({given} bytes), but kube_reserved {format_quantity(kube)} + system_reserved "
                f"{format_quantity(system)} + eviction_hard {format_quantity(eviction)} = "
                f"{format_quantity(total)} ({total} bytes); kubelet would not start"
            )
    else:
        raise MemoryReservationError(f"per_numa {per_numa!r}: expected 'auto' or a map NUMA node -> quantity")
    return MemoryReservations(kube, system, eviction, split)
