"""The CPUs a process's cgroup lets it run on (cpuset(7), cgroup v1 and v2).

A daemon confined by systemd's ``CPUAffinity=`` to housekeeping CPUs may still pin a child to an
isolated CPU of its cpuset, and in a pod the cpuset is what the kubelet granted: the lease allocator cuts
its pool to this set, not to its own affinity mask. Standard library only (shipped to hosts by Ansible).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from lowtail.node import cpulist
from lowtail.node.errors import LowtailError


class CpusetError(LowtailError, RuntimeError):
    """The cgroup's cpuset cannot be read, or it shares no CPU with the plan's isolated set."""


@dataclass(frozen=True)
class Cpuset:
    """The CPUs a process's cgroup lets it (and its children) run on, and the file that said so."""

    cpus: frozenset[int]
    source: str  # the cpuset file read, e.g. /sys/fs/cgroup/cpuset/.../cpuset.effective_cpus


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo (proc_pid_mountinfo(5))
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _cgroup_dirs(proc: Path, fs_root: Path) -> list[tuple[str, Path, Path]]:
    """(version, mount point, cgroup directory) of each hierarchy carrying cpusets, v1 first."""
    memberships: dict[str, str] = {}
    for line in (proc / "cgroup").read_text().splitlines():
        hid, controllers, path = line.split(":", 2)
        if hid == "0" and controllers == "":
            memberships["v2"] = path
        elif "cpuset" in controllers.split(","):
            memberships["v1"] = path
    found: list[tuple[str, Path, Path]] = []
    for line in (proc / "mountinfo").read_text().splitlines():
        left, _, right = line.partition(" - ")
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or len(tail) < 3:
            continue
        root, mount = _unescape(fields[3]), _unescape(fields[4])
        fstype, superopts = tail[0], tail[2].split(",")
        if fstype == "cgroup" and "cpuset" in superopts and "v1" in memberships:
            version = "v1"
        elif fstype == "cgroup2" and "v2" in memberships:
            version = "v2"
        else:
            continue
        path = memberships[version]
        # A cgroup namespace shows paths relative to its root; a bind-mounted subtree has root != "/".
        rel = os.path.relpath(path, root) if path.startswith(root) else path.lstrip("/")
        mount_dir = fs_root / mount.lstrip("/")
        found.append((version, mount_dir, (mount_dir / rel).resolve() if rel != "." else mount_dir))
    return sorted(found, key=lambda x: x[0])


def cgroup_cpuset(proc_root: str | Path = "/proc/self", fs_root: str | Path = "/") -> Cpuset | None:
    """The effective cpuset of the process's cgroup (cgroup v1 or v2), or None when none is visible.

    This, not the process's affinity mask, is what the kernel allows ``sched_setaffinity`` to reach
    (cpuset(7)): a daemon confined by systemd's ``CPUAffinity=`` to housekeeping CPUs may still pin a
    child to an isolated CPU of its cpuset, and in a pod the cpuset is what the kubelet granted.
    v2: ``cpuset.cpus.effective``, from the nearest ancestor where the controller is enabled; v1:
    ``cpuset.effective_cpus`` (``effective_cpus`` with the ``noprefix`` mount option), else
    ``cpuset.cpus``. ``proc_root``/``fs_root`` point at fixture trees in tests.
    """
    proc, root = Path(proc_root), Path(fs_root)
    try:
        dirs = _cgroup_dirs(proc, root)
    except OSError:
        return None
    names = {
        "v1": ("cpuset.effective_cpus", "effective_cpus", "cpuset.cpus", "cpus"),
        "v2": ("cpuset.cpus.effective",),
    }
    for version, mount, cgdir in dirs:
        d = cgdir
        while True:
            for name in names[version]:
                f = d / name
                try:
                    text = f.read_text().strip()
                except OSError:
                    continue
                try:
                    return Cpuset(frozenset(cpulist.parse(text)), str(f))
                except ValueError as e:
                    raise CpusetError(f"{f}: {text!r} is not a CPU list: {e}") from None
            if d == mount or mount not in d.parents:
                break
            d = d.parent
    return None


def usable_cpus() -> frozenset[int]:
    """CPUs this process may move itself or a child onto: its cgroup's cpuset, else its affinity mask."""
    cpuset = cgroup_cpuset()
    return cpuset.cpus if cpuset is not None else frozenset(os.sched_getaffinity(0))
