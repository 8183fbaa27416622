"""Other threads on leased CPUs: who else ran on the CPUs the lease allocator handed out.

A sampler reads every thread's ``/proc/PID/task/TID/stat`` (field 39 ``processor``: the CPU it last ran
on; field 9 ``flags``: PF_KTHREAD) and ``schedstat`` (field 1: nanoseconds on a CPU) a few times a
second while the probes run, and charges each thread's run-time growth between two samples to the CPU
it was on at the second one. That attributes time to a CPU only as exactly as the sampling interval
allows (a thread that hopped CPUs between samples is charged to the last one), which is why the verdict
is on a rate with a margin, and the evidence names each offender so a person can confirm it with
``ps -L -o tid,psr,comm``.

Not charged: the lease owner's process tree (its worker spins there on purpose), the validator's own
tree (its probes run on those CPUs), and, on a nohz_full CPU, per-CPU kernel threads bound to exactly that
CPU (ksoftirqd/N, migration/N, kworker/N:*: they cannot move, and nohz_full is what keeps them quiet);
those are listed apart. On a CPU without nohz_full they are charged: the fix is the kernel argument.
Unbound kernel threads (rcuo*, kworker/u*) can be moved to housekeeping CPUs and are always charged.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowtail.node import cpulist
from lowtail.node.lease import DEFAULT_STATE_DIR, STATE_FILE, Lease
from lowtail.validation.check import Check, Limits, graded, skip

LEASE_STATE = DEFAULT_STATE_DIR / STATE_FILE
PF_KTHREAD = 0x00200000  # include/linux/sched.h
CLK_TCK = os.sysconf("SC_CLK_TCK")
# Foreign run time per leased CPU, in ms per second of the window: 1 ms/s (0.1%) passes, 10 ms/s warns.
DEFAULT_LIMITS = Limits(1.0, 10.0)
TOP = 5


@dataclass(frozen=True)
class ThreadSample:
    pid: int
    tid: int
    comm: str
    ppid: int
    kthread: bool
    processor: int
    runtime_ns: int


def _stat(task: Path, pid: int, tid: int) -> ThreadSample | None:
    try:
        text = (task / "stat").read_text()
    except OSError:
        return None  # exited between listdir and read
    lpar, rpar = text.find("("), text.rfind(")")
    rest = text[rpar + 2 :].split()
    if lpar < 0 or len(rest) < 37:
        return None
    try:
        runtime = int((task / "schedstat").read_text().split()[0])
    except (OSError, IndexError, ValueError):
        runtime = (int(rest[11]) + int(rest[12])) * 1_000_000_000 // CLK_TCK
    return ThreadSample(
        pid=pid,
        tid=tid,
        comm=text[lpar + 1 : rpar],
        ppid=int(rest[1]),
        kthread=bool(int(rest[6]) & PF_KTHREAD),
        processor=int(rest[36]),
        runtime_ns=runtime,
    )


def snapshot(proc_root: Path) -> dict[int, ThreadSample]:
    """Every thread on the node by tid."""
    out: dict[int, ThreadSample] = {}
    for entry in os.scandir(proc_root):
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        try:
            tids = [int(t) for t in os.listdir(Path(entry.path) / "task") if t.isdigit()]
        except OSError:
            continue
        for tid in tids:
            s = _stat(Path(entry.path) / "task" / str(tid), pid, tid)
            if s is not None:
                out[tid] = s
    return out


def thread_allowed(proc_root: Path, pid: int, tid: int) -> frozenset[int] | None:
    try:
        text = (proc_root / str(pid) / "task" / str(tid) / "status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("Cpus_allowed_list:"):
            return cpulist.parse(line.split(":", 1)[1].strip())
    return None


class Sampler:
    """Charges run time to (thread, CPU) for the CPUs watched, from successive snapshots."""

    def __init__(
        self,
        proc_root: Path,
        cpus: frozenset[int],
        interval_s: float = 0.2,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.proc_root = proc_root
        self._clock = clock
        self.cpus = cpus
        self.interval_s = interval_s
        self.charged: dict[tuple[int, int], int] = defaultdict(int)  # (tid, cpu) -> ns
        self.seen: dict[int, ThreadSample] = {}
        self.samples = 0
        self._last: dict[int, ThreadSample] | None = None
        self._t0 = self._t1 = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def tick(self) -> None:
        now = snapshot(self.proc_root)
        self.samples += 1
        self._t1 = self._clock()
        if self._last is None:
            self._t0 = self._t1
        else:
            for tid, cur in now.items():
                prev = self._last.get(tid)
                grew = cur.runtime_ns - (prev.runtime_ns if prev and prev.pid == cur.pid else 0)
                # A thread born between samples is charged its whole run time so far.
                if grew > 0 and cur.processor in self.cpus:
                    self.charged[(tid, cur.processor)] += grew
                    self.seen[tid] = cur
        self._last = now

    @property
    def threads(self) -> dict[int, ThreadSample]:
        """The last snapshot and every thread that was charged (some may have exited since)."""
        return {**(self._last or {}), **self.seen}

    @property
    def window_s(self) -> float:
        return self._t1 - self._t0

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.tick()

    def start(self) -> None:
        self.tick()
        self._thread = threading.Thread(target=self._loop, name="lowtail-thread-sampler", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        self.tick()


def read_leases(state_file: Path, current_boot: str | None = None) -> tuple[list[Lease], str]:
    """The leases from the allocator's state file (read-only); with ``current_boot``, none from another
    boot (/run is a tmpfs, but a state dir elsewhere survives a reboot). The string says why none."""
    try:
        data = json.loads(state_file.read_text())
        leases = [Lease.from_dict(d) for d in data["leases"]]
    except FileNotFoundError:
        return [], f"no lease state at {state_file}: the allocator has handed out no CPU on this node"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        return [], f"lease state {state_file} is unreadable: {e}"
    except RecursionError:
        return [], f"lease state {state_file} is unreadable: JSON nested too deeply"
    if current_boot and data.get("boot_id") and data["boot_id"] != current_boot:
        return [], f"lease state {state_file} is from another boot ({data['boot_id']})"
    return leases, ""


def _descendants(roots: Iterable[int], threads: dict[int, ThreadSample]) -> set[int]:
    """``roots`` and every process below them, from the ppid of each thread-group leader."""
    children: dict[int, set[int]] = defaultdict(set)
    for s in threads.values():
        if s.tid == s.pid:
            children[s.ppid].add(s.pid)
    out, todo = set(), [r for r in roots if r]
    while todo:
        p = todo.pop()
        if p not in out:
            out.add(p)
            todo.extend(children.get(p, ()))
    return out


def _foreign_time(
    sampler: Sampler, by_cpu: Mapping[int, Lease], own_pids: Iterable[int], nohz_full: frozenset[int]
) -> tuple[dict[int, list[tuple[int, ThreadSample]]], dict[int, list[tuple[int, ThreadSample]]]]:
    """Run time (ns) on each leased CPU of threads that are neither the owner's nor the validator's: the
    foreign ones, and apart from them the per-CPU kthreads bound to a nohz_full CPU (they cannot move)."""
    threads = sampler.threads
    excused_pids = _descendants(own_pids, threads)
    owners = {cpu: _descendants([lease.pid or 0], threads) for cpu, lease in by_cpu.items()}
    foreign: dict[int, list[tuple[int, ThreadSample]]] = defaultdict(list)
    pinned_kthreads: dict[int, list[tuple[int, ThreadSample]]] = defaultdict(list)
    for (tid, cpu), ns in sampler.charged.items():
        s = sampler.seen[tid]
        if cpu not in by_cpu or s.pid in excused_pids or s.pid in owners[cpu]:
            continue
        allowed = thread_allowed(sampler.proc_root, s.pid, tid)
        if s.kthread and allowed == frozenset({cpu}) and cpu in nohz_full:
            pinned_kthreads[cpu].append((ns, s))
        else:
            foreign[cpu].append((ns, s))
    return foreign, pinned_kthreads


def _leased_cpu(
    cpu: int,
    lease: Lease,
    foreign: list[tuple[int, ThreadSample]],
    pinned_kthreads: list[tuple[int, ThreadSample]],
    window: float,
) -> tuple[float, dict[str, Any], str]:
    """One leased CPU: foreign ms per second, its report entry and its evidence line."""
    top = sorted(foreign, key=lambda x: -x[0])
    ms_per_s = sum(ns for ns, _ in top) / 1e6 / window
    kt = sorted(pinned_kthreads, key=lambda x: -x[0])
    entry = {
        "owner": lease.owner,
        "owner_pid": lease.pid,
        "foreign_ms_per_s": round(ms_per_s, 3),
        "top": [
            {"pid": s.pid, "tid": s.tid, "comm": s.comm, "kthread": s.kthread, "ms": round(ns / 1e6, 3)}
            for ns, s in top[:TOP]
        ],
        "bound_kthreads_ms": round(sum(ns for ns, _ in kt) / 1e6, 3),
    }
    line = f"CPU {cpu} ({lease.owner}, pid {lease.pid}): foreign {ms_per_s:.3f} ms/s"
    if top:
        line += "; top: " + ", ".join(
            f"{s.comm}[{s.pid}/{s.tid}]{' (kthread)' if s.kthread else ''} {ns / 1e6:.2f} ms"
            for ns, s in top[:TOP]
        )
    if kt:
        line += "; per-CPU kthreads (cannot move): " + ", ".join(
            f"{s.comm} {ns / 1e6:.2f} ms" for ns, s in kt[:TOP]
        )
    return ms_per_s, entry, line


def check_leased_threads(
    sampler: Sampler,
    leases: list[Lease],
    own_pids: Iterable[int] = (),
    limits: Limits = DEFAULT_LIMITS,
    nohz_full: frozenset[int] = frozenset(),
) -> Check:
    name = "leased_threads"
    window = sampler.window_s
    if sampler.samples < 2 or window <= 0:
        return skip(name, "the thread sampler took fewer than two samples", "probe")
    by_cpu: dict[int, Lease] = {lease.cpu: lease for lease in leases if lease.cpu in sampler.cpus}
    foreign, pinned_kthreads = _foreign_time(sampler, by_cpu, own_pids, nohz_full)
    per_cpu: dict[str, Any] = {}
    evidence = [
        f"{sampler.samples} samples of every thread over {window:.2f} s; leased CPUs "
        f"{cpulist.format(frozenset(by_cpu))}"
    ]
    worst = 0.0
    for cpu in sorted(by_cpu):
        ms_per_s, per_cpu[str(cpu)], line = _leased_cpu(
            cpu, by_cpu[cpu], foreign[cpu], pinned_kthreads[cpu], window
        )
        worst = max(worst, ms_per_s)
        evidence.append(line)
    return graded(
        name,
        round(worst, 3),
        limits,
        unit="ms/s",
        what="of foreign run time on the worst leased CPU",
        evidence=evidence,
        why=f"other threads ran {worst:.3f} ms per second on a leased CPU: move them to housekeeping CPUs "
        "(systemd CPUAffinity= for Ray's daemons, the kubelet's reserved CPUs for other pods, "
        "rcu_nocbs/kthread affinity for kernel threads)",
        kind="probe",
        data={"window_s": round(window, 3), "samples": sampler.samples, "leased_cpus": per_cpu},
    )
