"""Kubelet memory reservations that balance: the memory manager's per-NUMA ``reservedMemory``.

With ``memoryManagerPolicy: Static`` kubelet refuses to start unless the sum of ``reservedMemory`` over
NUMA nodes equals ``kubeReserved.memory + systemReserved.memory + evictionHard["memory.available"]``
exactly (kubelet resource managers docs). This module parses Kubernetes quantities, splits the total
over the host's NUMA nodes (or checks a split given by the inventory) and formats the result so the
sum is exact in bytes, never rounded.

Stdlib only and relative imports only: the Ansible preflight module ships it as module_utils.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from fractions import Fraction
from typing import Any

from .errors import LowtailError

# resource.ParseQuantity's suffixes (k8s.io/apimachinery pkg/api/resource suffix.go newSuffixer): decimal
# powers of ten first, then binary powers of two.
_DECIMAL = {"n": -9, "u": -6, "m": -3, "": 0, "k": 3, "M": 6, "G": 9, "T": 12, "P": 15, "E": 18}
_BINARY = {"Ki": 10, "Mi": 20, "Gi": 30, "Ti": 40, "Pi": 50, "Ei": 60}
_SUFFIX_CHARS = frozenset("eEinumkKMGTP")
_DIGITS = frozenset("0123456789")
_NANO = Fraction(1, 10**9)
_MAX_INT64 = 2**63 - 1
QUANTITY_FORMS = (
    "a number with an optional sign and decimal point and a suffix Ki, Mi, Gi, Ti, Pi, Ei (powers of 2), "
    "n, u, m, k, M, G, T, P, E (powers of 10) or an exponent e<N>, as Kubernetes quantities are: "
    "'1Gi', '1.5Gi', '100Mi', '512M', '1e9'"
)


class MemoryReservationError(LowtailError, ValueError):
    """Memory reservations that kubelet would reject: unparsable, unknown NUMA node, or unbalanced."""


class QuantityError(LowtailError, ValueError):
    """A string resource.ParseQuantity refuses."""


def _parse(text: str) -> tuple[bool, str, str, int, bool]:
    """parseQuantityString and the suffix lookup: (negative, numerator digits without leading zeros,
    decimal digits, exponent, binary)."""
    if text == "":
        raise QuantityError("quantities must match the regular expression (empty string)")
    s, end, pos, negative = text, len(text), 0, False
    if s[0] in "+-":
        negative, pos = s[0] == "-", 1
    while pos < end and s[pos] == "0":
        pos += 1
    start = pos
    while pos < end and s[pos] in _DIGITS:
        pos += 1
    num, denom = s[start:pos] or "0", ""
    if pos < end and s[pos] == ".":
        pos += 1
        start = pos
        while pos < end and s[pos] in _DIGITS:
            pos += 1
        denom = s[start:pos]
    start = pos
    while pos < end and s[pos] in _SUFFIX_CHARS:
        pos += 1
    if pos < end:
        if s[pos] in "+-":
            pos += 1
        while pos < end and s[pos] in _DIGITS:
            pos += 1
        if pos < end:
            raise QuantityError(f"quantities must match the regular expression ({text!r})")
    suffix = s[start:]
    if suffix in _DECIMAL:
        return negative, num, denom, _DECIMAL[suffix], False
    if suffix in _BINARY:
        return negative, num, denom, _BINARY[suffix], True
    parsed = _go_int64(suffix[1:]) if len(suffix) > 1 and suffix[0] in "eE" else None
    if parsed is None:
        raise QuantityError(f"unable to parse quantity's suffix ({text!r})")
    return negative, num, denom, (parsed + 2**31) % 2**32 - 2**31, False  # int32(parsed): it wraps


def k8s_quantity(text: str) -> Fraction:
    """The exact value resource.ParseQuantity gives ``text`` (k8s.io/apimachinery v0.35-v0.37
    pkg/api/resource quantity.go parseQuantityString and ParseQuantity: an optional sign, digits with an
    optional decimal point - "1.", ".5" and a bare sign included -, then a suffix; non-zero values
    rounded away from zero to a multiple of 1n; binary values above 2^63-1 capped there)."""
    negative, num, denom, exponent, binary = _parse(text)
    value = Fraction(int(num + denom), 10 ** len(denom))
    value *= Fraction(2) ** exponent if binary else Fraction(10) ** exponent
    if value:
        value = -((-value) // _NANO) * _NANO  # up to the next multiple of 1n
    if binary and value > _MAX_INT64:
        value = Fraction(_MAX_INT64)
    return -value if negative else value


def k8s_quantity_is_int64(text: str) -> bool:
    """Whether Quantity.AsInt64 succeeds on what ParseQuantity makes of ``text``: only a value kept in
    its int64 form (ParseQuantity's fast path: at most 18 digits, no fraction on a binary suffix, 1n or
    coarser, no overflow) with a scale of 0 or more (int64Amount.AsInt64 refuses a negative one: '100m',
    '1.5', even '1000m')."""
    if text == "0":
        return True
    _, num, denom, exponent, binary = _parse(text)
    mantissa, scale = 1, exponent
    if binary:
        if exponent < 0 or denom:
            return False
        mantissa, scale = 2**exponent, 0
        # 15 - len(num) - int32(float32(exponent)*3/10) - 1
        precision = 15 - len(num) - int(exponent * 3 / 10) - 1
    else:
        precision = 18 - len(num) - len(denom)
    if precision < 0:
        return False
    scale -= len(denom)
    if scale < -9:
        return False
    result = int(num + denom) * mantissa
    if result > _MAX_INT64:
        return False
    return scale >= 0 and result * 10**scale <= _MAX_INT64


def _go_int64(text: str) -> int | None:
    """strconv.ParseInt(text, 10, 64): an optional sign and decimal digits that fit 64 bits."""
    body = text[1:] if text[:1] in ("+", "-") else text
    if not body or any(c not in _DIGITS for c in body):
        return None
    n = int(text)
    return n if -(2**63) <= n <= _MAX_INT64 else None


def parse_quantity(value: str | int, what: str = "quantity") -> int:
    """Bytes in a Kubernetes memory quantity (``1Gi``, ``1.5Gi``, ``100Mi``, ``512M``, ``1e9``), every
    form resource.ParseQuantity accepts, refused when it is negative or not a whole number of bytes."""
    if isinstance(value, bool):
        raise MemoryReservationError(f"{what} {value!r}: expected a memory quantity such as '1Gi'")
    if isinstance(value, int):
        if value < 0:
            raise MemoryReservationError(f"{what} {value!r}: expected a non-negative number of bytes")
        return value
    try:
        n = k8s_quantity(str(value))
    except QuantityError:
        raise MemoryReservationError(f"{what} {value!r}: expected {QUANTITY_FORMS}") from None
    if n < 0:
        raise MemoryReservationError(f"{what} {value!r}: expected a non-negative memory quantity")
    if n.denominator != 1:
        raise MemoryReservationError(
            f"{what} {value!r} is {float(n)} bytes; expected a whole number of bytes (such as '1.5Gi', "
            "not '100m')"
        )
    return int(n)


def format_quantity(n_bytes: int) -> str:
    """The largest binary suffix that represents ``n_bytes`` exactly (``1124Mi``, ``1536Ki``, ``7``)."""
    for suffix in ("Ei", "Pi", "Ti", "Gi", "Mi", "Ki"):
        unit = 2 ** _BINARY[suffix]
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
