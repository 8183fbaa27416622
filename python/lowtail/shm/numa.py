"""NUMA placement of shared memory through raw syscalls (no libnuma): bind, pre-fault, report.

Pinning CPUs is not enough: left to first touch, a segment zeroed by whichever thread created it
lands on that thread's node for good. Here a segment's range is bound with
``mbind(MPOL_BIND)`` before its pages are allocated, then touched by a thread pinned to the node's CPUs
(so the page tables are populated and any page allocated by touch also obeys the node), and placement
is verified with ``move_pages(pid, n, pages, NULL, status, 0)``, which only reports (``nodes=NULL``)
and, unlike ``get_mempolicy(MPOL_F_NODE|MPOL_F_ADDR)``, never faults a page in.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import threading
from collections import Counter
from pathlib import Path

from lowtail.node import cpulist
from lowtail.shm import libc
from lowtail.shm.errors import NumaError

SYS_MBIND = 237  # x86-64
SYS_MOVE_PAGES = 279
MPOL_BIND = 2
MPOL_MF_STRICT = 1 << 0
MPOL_MF_MOVE = 1 << 1
PAGE = mmap.PAGESIZE

_syscall = libc.function("syscall", ctypes.c_long)


def online_nodes(sys_root: str = "/sys") -> frozenset[int]:
    path = Path(sys_root) / "devices/system/node/online"
    try:
        return cpulist.parse(path.read_text())
    except FileNotFoundError:
        return frozenset({0})  # a kernel without NUMA support has one node, 0


def node_cpus(node: int, sys_root: str = "/sys") -> frozenset[int]:
    nodes = online_nodes(sys_root)
    if node not in nodes:
        raise NumaError(f"NUMA node {node} is not online; online nodes: {cpulist.format(nodes)}")
    path = Path(sys_root) / f"devices/system/node/node{node}/cpulist"
    try:
        cpus = cpulist.parse(path.read_text())
    except FileNotFoundError:
        cpus = frozenset(os.sched_getaffinity(0))
    if not cpus:
        raise NumaError(f"NUMA node {node} has no CPUs (a memory-only node): pre-fault from a CPU node")
    return cpus


def _address(mm: mmap.mmap) -> tuple[int, ctypes.c_char]:
    anchor = ctypes.c_char.from_buffer(mm)  # holds a buffer export until dropped
    return ctypes.addressof(anchor), anchor


def bind(mm: mmap.mmap, node: int) -> None:
    """``mbind(MPOL_BIND, {node}, MPOL_MF_MOVE|MPOL_MF_STRICT)`` on the whole mapping."""
    nodes = online_nodes()
    if node not in nodes:
        raise NumaError(f"NUMA node {node} is not online; online nodes: {cpulist.format(nodes)}")
    words = node // 64 + 1
    mask = (ctypes.c_ulong * words)()
    mask[node // 64] = 1 << (node % 64)
    addr, anchor = _address(mm)
    try:
        # maxnode is a bit count; the kernel reads maxnode-1 bits (a long-standing off-by-one).
        rc = _syscall(
            ctypes.c_long(SYS_MBIND),
            ctypes.c_void_p(addr),
            ctypes.c_ulong(len(mm)),
            ctypes.c_int(MPOL_BIND),
            ctypes.cast(mask, ctypes.c_void_p),
            ctypes.c_ulong(words * 64 + 1),
            ctypes.c_uint(MPOL_MF_MOVE | MPOL_MF_STRICT),
        )
    finally:
        del anchor
    if rc != 0:
        err = ctypes.get_errno()
        raise NumaError(f"mbind of {len(mm)} bytes to node {node} failed: {os.strerror(err)}")


def prefault(mm: mmap.mmap, node: int | None) -> None:
    """Touch every page from a thread pinned to ``node``'s CPUs (or the caller's CPUs when None).

    ``os.sched_setaffinity(0, ...)`` pins only the calling thread, which is exactly what we want: the
    caller's own mask is untouched.
    """
    cpus = node_cpus(node) if node is not None else frozenset(os.sched_getaffinity(0))
    errors: list[BaseException] = []

    def touch() -> None:
        try:
            os.sched_setaffinity(0, cpus)
            view = memoryview(mm)
            try:
                for off in range(0, len(mm), PAGE):
                    view[off] = view[off]  # a write fault: populates the page table entry
            finally:
                view.release()
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=touch, name="lowtail-prefault", daemon=True)
    t.start()
    t.join()
    if errors:
        raise NumaError(f"pre-faulting on node {node} failed: {errors[0]}") from errors[0]


def page_nodes(mm: mmap.mmap, pid: int = 0) -> list[int]:
    """Node of every page of the mapping (negative errno for a page not present), via move_pages(NULL)."""
    n = (len(mm) + PAGE - 1) // PAGE
    addr, anchor = _address(mm)
    try:
        pages = (ctypes.c_void_p * n)(*[addr + i * PAGE for i in range(n)])
        status = (ctypes.c_int * n)()
        rc = _syscall(
            ctypes.c_long(SYS_MOVE_PAGES),
            ctypes.c_int(pid),
            ctypes.c_ulong(n),
            pages,
            ctypes.c_void_p(None),
            status,
            ctypes.c_int(0),
        )
    finally:
        del anchor
    if rc < 0:
        err = ctypes.get_errno()
        raise NumaError(f"move_pages status query on {n} pages failed: {os.strerror(err)}")
    return list(status)


def placement(mm: mmap.mmap) -> dict[str, int]:
    """Pages per node as ``{"node0": 12, ...}``; pages not present are counted under ``"absent"``."""
    counts = Counter("absent" if s < 0 else f"node{s}" for s in page_nodes(mm))
    return dict(sorted(counts.items()))
