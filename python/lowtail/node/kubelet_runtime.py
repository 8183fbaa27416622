"""Does the node's OCI runtime reset the CPU affinity a container inherits from systemd, and is its
containerd one containerd recommends for its kubelet?

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


# containerd's recommendation for each Kubernetes minor lowtail claims: RELEASES.md, "Kubernetes
# Support", of github.com/containerd/containerd/v2 v2.4.2 (the Go module, as the proxy serves it). Each
# entry is the first recommended release of a containerd branch; a release of a newer branch than the
# row's newest is taken as recommended too (the file lists only released branches). kubelet enforces
# none of it: it logs and falls back when the runtime lacks what it asks (KEP-4033).
CONTAINERD_SOURCE = "containerd's RELEASES.md (github.com/containerd/containerd/v2 v2.4.2)"
CONTAINERD_FOR_KUBELET: dict[int, tuple[tuple[int, int, int], ...]] = {
    35: ((2, 2, 0), (2, 1, 5), (1, 7, 28)),
    36: ((2, 3, 0), (2, 2, 0)),
    37: ((2, 4, 0), (2, 3, 0)),
}
# The same file's "Current State of containerd Releases": branches past their end of life, which get no
# fixes at all (1.6 and older; 2.1 since July 3, 2026).
CONTAINERD_END_OF_LIFE = frozenset({(2, 1)})
CONTAINERD_LAST_END_OF_LIFE_1X = (1, 6)


def containerd_support(output: str, kubelet_minor: int) -> tuple[list[str], list[str]]:
    """(problems, warnings) for the containerd whose ``--version`` printed ``output`` under kubelet
    1.``kubelet_minor``: a branch past its end of life that containerd does not recommend for this
    kubelet is a problem; any other release outside the recommendation is a warning."""
    wanted = CONTAINERD_FOR_KUBELET.get(kubelet_minor)
    if wanted is None:
        return [], []
    m = re.search(r"\bv?(\d+)\.(\d+)\.(\d+)", output or "")
    if m is None:
        return [f"containerd --version printed {output!r}; expected a version such as 'v2.3.7'"], []
    version = (int(m[1]), int(m[2]), int(m[3]))
    text = ".".join(map(str, version))
    listed = ", ".join(".".join(map(str, w)) + "+" for w in wanted)
    advice = f"containerd recommends {listed} for Kubernetes 1.{kubelet_minor} ({CONTAINERD_SOURCE})"
    # A release branch past its end of life that this row does not list: no fixes, not recommended.
    same_branch = [w for w in wanted if w[:2] == version[:2]]
    if version[:2] > max(wanted)[:2] or (same_branch and version >= same_branch[0]):
        return [], []
    end_of_life = version[:2] <= CONTAINERD_LAST_END_OF_LIFE_1X or version[:2] in CONTAINERD_END_OF_LIFE
    if end_of_life and not same_branch:
        return [f"containerd {text} is a release branch past its end of life; {advice}"], []
    return [], [f"containerd {text} is older than what {advice}"]
