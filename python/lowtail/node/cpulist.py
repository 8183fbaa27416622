"""CPU lists in the kernel's format (``0-3,8,10-11``).

Every module in lowtail that reads or writes a CPU list goes through these two functions, so the
kernel command line, sysfs, kubelet's ``reservedSystemCPUs`` and the lease pool agree on one syntax.
"""

from __future__ import annotations

from collections.abc import Iterable

from .errors import LowtailError


class CpuListError(LowtailError, ValueError):
    """A CPU list string that is not in the kernel's ``0-3,8,10-11`` format."""


def parse(text: str) -> frozenset[int]:
    """Parse a kernel cpulist. Whitespace and a trailing newline are ignored; empty means no CPUs.

    Strides (``0-15:2``) are not accepted: lowtail never writes them and sysfs never prints them.
    """
    text = text.strip()
    if not text:
        return frozenset()
    cpus: set[int] = set()
    for raw in text.split(","):
        part = raw.strip()
        if not part:
            raise CpuListError(f"empty element in cpulist {text!r}; expected e.g. '0-3,8,10-11'")
        lo_s, sep, hi_s = part.partition("-")
        try:
            lo = int(lo_s)
            hi = int(hi_s) if sep else lo
        except ValueError:
            raise CpuListError(
                f"bad element {part!r} in cpulist {text!r}; expected N or N-M with N, M >= 0"
            ) from None
        if lo < 0 or hi < lo:
            raise CpuListError(f"bad range {part!r} in cpulist {text!r}; expected N-M with 0 <= N <= M")
        cpus.update(range(lo, hi + 1))
    return frozenset(cpus)


def format(cpus: Iterable[int]) -> str:  # noqa: A001 - mirrors the kernel's cpulist_print
    """Format CPUs as a normalised kernel cpulist: sorted, de-duplicated, runs collapsed."""
    ordered = sorted(set(cpus))
    if any(c < 0 for c in ordered):
        raise CpuListError(f"negative CPU number in {ordered!r}")
    parts: list[str] = []
    i = 0
    while i < len(ordered):
        j = i
        while j + 1 < len(ordered) and ordered[j + 1] == ordered[j] + 1:
            j += 1
        parts.append(str(ordered[i]) if i == j else f"{ordered[i]}-{ordered[j]}")
        i = j + 1
    return ",".join(parts)


def looks_like_cpulist(text: str) -> bool:
    """True for a cpulist spec rather than a bare count: the inventory rule is 'a comma or a dash'."""
    return "," in text or "-" in text


def format_mask(cpus: Iterable[int]) -> str:
    """Format CPUs as the kernel's hex cpumask (``7f,00000000``): 32-bit words, most significant first.

    Files such as ``/sys/devices/virtual/workqueue/cpumask`` and ``/proc/irq/default_smp_affinity``
    take this format rather than a cpulist.
    """
    numbers = set(cpus)
    if any(c < 0 for c in numbers):
        raise CpuListError(f"negative CPU number in {sorted(numbers)!r}")
    mask = sum(1 << c for c in numbers)
    words = [mask & 0xFFFFFFFF]
    while mask >> 32:
        mask >>= 32
        words.append(mask & 0xFFFFFFFF)
    head, *rest = reversed(words)
    return ",".join([f"{head:x}", *(f"{w:08x}" for w in rest)])
