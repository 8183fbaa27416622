"""Does the node's OCI runtime reset the CPU affinity a container inherits from systemd?

lowtail pins systemd (``systemd.cpu_affinity=`` and ``CPUAffinity=``) to the housekeeping CPUs. Since
Linux 6.2 (kernel commit da019032819a, "sched: Enforce user requested affinity") moving a task into a
cpuset cgroup no longer widens the affinity it inherited, so a container started under such a systemd
runs on the housekeeping CPUs only unless its OCI runtime resets the mask:

* runc: opencontainers/runc#4858 ("libct: reset CPU affinity by default"), backported to 1.3 in #4865
  (runc#5023 names v1.3.1 as the first release with it) and to 1.2 in #4869; 1.4.0 has it.
* crun: containers/crun#1315 (NEWS of 1.9.2) relied on a kernel patch that was never merged, which
  crun#1891 (merged 2025-10-16) fixed; lowtail asks for the first release after it.

Stdlib only: shipped to hosts as module_utils.
"""

from __future__ import annotations

import re

# Kernel from which the inherited affinity survives the cgroup move.
AFFINITY_KERNEL = (6, 2)
# Per runtime: the first fixed release of each maintained series (None: a series without a fix
# below the next listed minimum), in ascending order.
FIXED: dict[str, tuple[tuple[int, int, int], ...]] = {
    # runc#4869 (1.2 backport) was merged 2025-08-28; 1.2.7 is the first 1.2 tag after it.
    "runc": ((1, 2, 7), (1, 3, 1), (1, 4, 0)),
    # crun#1891; 1.25 is the first crun release after 2025-10-16.
    "crun": ((1, 25, 0),),
}
_NUM = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")


def parse(text: str) -> tuple[int, int, int] | None:
    """The first x.y[.z] in a ``--version`` output, or None."""
    m = _NUM.search(text or "")
    return (int(m[1]), int(m[2]), int(m[3] or 0)) if m else None


def resets_affinity(runtime: str, version: tuple[int, int, int]) -> bool:
    """Whether this runtime release resets the inherited affinity (a series is fixed from its listed
    release on; a series older than every listed one is not)."""
    fixed = FIXED[runtime]
    for first in reversed(fixed):
        if version[:2] == first[:2]:
            return version >= first
        if version > first:
            return True
    return False


def affinity_problems(runtimes: dict[str, str], kernel_release: str) -> list[str]:
    """One message per installed runtime (name -> its ``--version`` output) that would leave containers
    on the housekeeping CPUs of this kernel."""
    kernel = parse(kernel_release)
    if kernel is None or kernel[:2] < AFFINITY_KERNEL:
        return []
    problems = []
    for name, output in sorted(runtimes.items()):
        version = parse(output)
        if name not in FIXED:
            continue
        if version is None:
            problems.append(f"{name} --version printed {output!r}; expected a version such as '1.3.1'")
        elif not resets_affinity(name, version):
            wanted = " or ".join(".".join(map(str, f)) for f in FIXED[name])
            problems.append(
                f"{name} {'.'.join(map(str, version))} on kernel {kernel_release} does not reset the CPU "
                f"affinity containers inherit from systemd.cpu_affinity (Guaranteed pods would run on the "
                f"housekeeping CPUs only); expected {name} >= {wanted}"
            )
    return problems
