"""The core-to-core probe: a cache line's round trip between the CPU pairs the plan cares about.

A worker and the samplers of its pool talk through one cache line per request (the queue's sequence
words): what that line costs to cross from one core to another is the floor under every round trip,
and it depends on where the two cores sit: the same L3 group (a CCD on Zen), another L3 group of the
same socket (through the I/O die), another socket. The plan puts each worker's samplers in the
worker's L3 group; this probe measures the line's round trip between the CPUs involved and checks
the placement two ways:

- by topology (``placement``): each worker CPU's pool (the plan's L3 pool that holds it) is as close as
  the topology allows: no member farther than the worker's nearest isolated CPU (same L3 group when
  that group has another isolated CPU), and nothing but isolated CPUs in it. A plan file written for
  another machine, or a topology that moved, fails here;
- by measurement: a pool partner's round trip is not slower than the worker's round trip to a CPU the
  plan keeps out of its pool (``warn``: the topology the kernel reports is not what the caches do, as
  on a VM whose vCPUs float).

The measurement is a small C program (the source is below, compiled with the system's ``cc`` into a
temporary directory at each run: no build step, nothing left behind): two threads pinned on the two
CPUs bounce one 64-byte-aligned word, ``ITERS`` round trips per batch, and the probe reports the median
and the 10th percentile of the per-batch means. Python could not measure this: its own loop costs more
than a cross-core round trip (~50-100 ns on bare metal). Without a C compiler the probe is skipped and
says so. On a VM the figure includes the hypervisor: a vCPU preempted mid-batch makes a slow batch,
which the median discounts and the maximum shows.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lowtail.node.plan import Plan
from lowtail.node.topology import Topology
from lowtail.validation.check import Check, Status, skip

NAME = "core_to_core"
ITERS = 2000  # round trips per batch
BATCHES = 101
MAX_CPUS = 16  # the matrix's CPUs at most: 120 pairs, a few seconds
PAIR_TIMEOUT_S = 30.0
# Closeness of two CPUs, nearest first.
RELATIONS = ("same-core", "same-l3", "same-node", "same-socket", "cross-socket")

SOURCE = r"""
#define _GNU_SOURCE
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

/* One cache line, bounced: the pinger writes an odd value, the ponger answers with the next even one. */
static _Alignas(64) _Atomic uint64_t line[8];
static int cpu_a, cpu_b;
static long iters, batches;

static double now_s(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void relax(void) {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#endif
}

static void pin(int cpu) {
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    if (pthread_setaffinity_np(pthread_self(), sizeof s, &s) != 0) {
        fprintf(stderr, "cannot pin to CPU %d\n", cpu);
        exit(3);
    }
}

/* Every wait is bounded: a partner that never answers (its CPU taken away) ends the run, not hangs it. */
static void wait_for(uint64_t want, double deadline) {
    unsigned long spins = 0;
    while (atomic_load_explicit(&line[0], memory_order_acquire) != want) {
        relax();
        if ((++spins & 0xfffff) == 0 && now_s() > deadline) {
            fprintf(stderr, "no answer from the other CPU within the deadline\n");
            exit(4);
        }
    }
}

static void *pong(void *arg) {
    double deadline = *(double *)arg;
    pin(cpu_b);
    for (uint64_t k = 0; k < (uint64_t)(iters * batches); k++) {
        wait_for(2 * k + 1, deadline);
        atomic_store_explicit(&line[0], 2 * k + 2, memory_order_release);
    }
    return NULL;
}

int main(int argc, char **argv) {
    if (argc != 6) {
        fprintf(stderr, "usage: c2c CPU_A CPU_B ITERS BATCHES TIMEOUT_S\n");
        return 2;
    }
    cpu_a = atoi(argv[1]);
    cpu_b = atoi(argv[2]);
    iters = atol(argv[3]);
    batches = atol(argv[4]);
    double deadline = now_s() + atof(argv[5]);
    pthread_t t;
    pin(cpu_a);
    if (pthread_create(&t, NULL, pong, &deadline) != 0) return 5;
    uint64_t k = 0;
    for (long b = 0; b < batches; b++) {
        double t0 = now_s();
        for (long i = 0; i < iters; i++, k++) {
            atomic_store_explicit(&line[0], 2 * k + 1, memory_order_release);
            wait_for(2 * k + 2, deadline);
        }
        printf("%.3f\n", (now_s() - t0) * 1e9 / iters);
    }
    pthread_join(t, NULL);
    return 0;
}
"""


class ProbeUnavailable(RuntimeError):
    """The probe cannot run here (no C compiler, the program failed to build)."""


@dataclass(frozen=True)
class PairResult:
    a: int
    b: int
    relation: str
    median_ns: float
    p10_ns: float
    max_ns: float
    batches: int

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# -- topology logic (fixture-tested) ----------------------------------------------------------------------


def relation(topo: Topology, a: int, b: int) -> str:
    """How close CPUs ``a`` and ``b`` are (one of ``RELATIONS``)."""
    by = topo.by_cpu()
    ca, cb = by[a], by[b]
    if b in ca.siblings:
        return "same-core"
    if ca.l3 == cb.l3:
        return "same-l3"
    if ca.node == cb.node:
        return "same-node"
    if ca.socket == cb.socket:
        return "same-socket"
    return "cross-socket"


def _rank(rel: str) -> int:
    return RELATIONS.index(rel)


def pool_of(plan: Plan, cpu: int) -> frozenset[int]:
    """The samplers' pool of a worker on ``cpu``: the other isolated CPUs of its plan L3 pool."""
    for p in plan.l3_pools:
        if cpu in p.cpus or cpu in p.isolated:
            return frozenset(p.isolated) - {cpu}
    return frozenset()


@dataclass(frozen=True)
class Placement:
    worker: int
    pool: frozenset[int]
    worst: str  # the pool's farthest member, as a relation ("-" for an empty pool)
    best_possible: str  # the nearest isolated CPU the topology offers ("-" when there is none)
    ok: bool
    detail: str

    def to_dict(self) -> dict[str, Any]:
        from lowtail.node import cpulist

        return dict(self.__dict__, pool=cpulist.format(self.pool))


def check_placement(topo: Topology, plan: Plan, workers: Iterable[int] | None = None) -> list[Placement]:
    """Each worker CPU's pool against the closest the topology allows (see the module's docstring)."""
    online = topo.online
    out = []
    for w in sorted(plan.isolated if workers is None else workers):
        if w not in online:
            out.append(Placement(w, frozenset(), "-", "-", False, f"worker CPU {w} is not online"))
            continue
        pool = pool_of(plan, w)
        others = (plan.isolated & online) - {w}
        best = min((relation(topo, w, c) for c in others), key=_rank, default="-")
        problems = []
        stray = pool - (plan.isolated & online)
        if stray:
            problems.append(f"pool holds CPUs that are not isolated and online: {sorted(stray)}")
        rels = [relation(topo, w, c) for c in pool & online]
        worst = max(rels, key=_rank, default="-")
        if best != "-" and not pool:
            problems.append(f"an empty pool while isolated CPUs {best} exist")
        elif rels and _rank(worst) > max(_rank(best), _rank("same-l3")):
            far = sorted(c for c in pool & online if _rank(relation(topo, w, c)) > max(_rank(best), 1))
            problems.append(f"pool CPUs {far[:8]} are {worst}, the topology offers {best}")
        out.append(
            Placement(w, pool, worst, best, not problems, "; ".join(problems) or "as close as allowed")
        )
    return out


def matrix_cpus(topo: Topology, plan: Plan, limit: int = MAX_CPUS) -> list[int]:
    """The CPUs to measure between: every online CPU on a small host; else per plan L3 pool its first
    isolated CPU (a worker) and its pool's next, plus for the first worker one CPU of another L3 group
    of its socket and one of another socket: each relation the plan depends on, once."""
    online = sorted(topo.online)
    if len(online) <= limit:
        return online
    chosen: list[int] = []

    def add(c: int | None) -> None:
        if c is not None and c not in chosen and len(chosen) < limit:
            chosen.append(c)

    pools = [sorted(p.isolated) for p in plan.l3_pools if p.isolated]
    if pools:
        # The first worker, its partner and one CPU per farther relation first: a limit that the
        # pools fill must not drop the comparison across L3 groups or sockets.
        w = pools[0][0]
        add(w)
        add(pools[0][1] if len(pools[0]) > 1 else None)
        for rel in ("same-node", "same-socket", "cross-socket"):
            add(next((c for c in online if relation(topo, w, c) == rel), None))
    for iso in pools[1:]:
        add(iso[0])
        add(iso[1] if len(iso) > 1 else None)
    return sorted(chosen)


# -- measurement --------------------------------------------------------------------------------------------

Runner = Callable[[int, int], list[float]]


def build(workdir: Path) -> Path:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        raise ProbeUnavailable("no C compiler (cc, gcc or clang) on PATH to build the ping-pong helper")
    src = workdir / "c2c.c"
    exe = workdir / "c2c"
    src.write_text(SOURCE)
    r = subprocess.run(
        [cc, "-O2", "-std=c11", "-pthread", "-o", str(exe), str(src)],
        capture_output=True,
        text=True,
        check=False,
    )
    if r.returncode != 0:
        raise ProbeUnavailable(f"{cc} could not build the ping-pong helper: {r.stderr.strip()[-500:]}")
    return exe


def native_runner(exe: Path, iters: int = ITERS, batches: int = BATCHES) -> Runner:
    def run(a: int, b: int) -> list[float]:
        r = subprocess.run(
            [str(exe), str(a), str(b), str(iters), str(batches), str(PAIR_TIMEOUT_S)],
            capture_output=True,
            text=True,
            timeout=PAIR_TIMEOUT_S + 10,
            check=False,
        )
        if r.returncode != 0:
            raise ProbeUnavailable(f"ping-pong CPU {a} <-> {b} failed ({r.returncode}): {r.stderr.strip()}")
        return [float(x) for x in r.stdout.split()]

    return run


def measure(
    cpus: list[int], runner: Runner, topo: Topology, on_pair: Callable[[int], None] | None = None
) -> list[PairResult]:
    import numpy as np

    out = []
    pairs = [(a, b) for i, a in enumerate(cpus) for b in cpus[i + 1 :]]
    for k, (a, b) in enumerate(pairs):
        xs = np.sort(np.asarray(runner(a, b), dtype=np.float64))
        out.append(
            PairResult(
                a,
                b,
                relation(topo, a, b),
                float(np.median(xs)),
                float(xs[len(xs) // 10]),
                float(xs[-1]),
                xs.size,
            )
        )
        if on_pair is not None:
            on_pair(k + 1)
    return out


def judge(
    results: list[PairResult], placements: list[Placement], plan: Plan
) -> tuple[Status, str, list[str]]:
    """Topology placement (fail) first, then the measured order (warn): a pool partner slower than a CPU
    outside the pool, beyond 20 % (a VM's noise between two equal paths is not a finding)."""
    rt = {(r.a, r.b): r.median_ns for r in results} | {(r.b, r.a): r.median_ns for r in results}
    evidence = []
    bad = [p for p in placements if not p.ok]
    for p in bad:
        evidence.append(f"worker CPU {p.worker}: {p.detail}")
    slower = []
    for p in placements:
        inside = [rt[(p.worker, c)] for c in p.pool if (p.worker, c) in rt]
        outside = [rt[(p.worker, c)] for c in plan.isolated - p.pool - {p.worker} if (p.worker, c) in rt]
        if inside and outside and max(inside) > 1.2 * min(outside):
            slower.append(
                f"worker CPU {p.worker}: its pool's slowest partner {max(inside):.0f} ns, a CPU outside the "
                f"pool {min(outside):.0f} ns (the reported topology is not what the caches do)"
            )
    evidence += slower
    if bad:
        return Status.FAIL, f"{len(bad)} worker pool(s) farther than the topology allows", evidence
    if slower:
        return Status.WARN, "a pool partner measured slower than a CPU outside the pool", evidence
    return Status.PASS, "", evidence


def probe_core_to_core(
    topo: Topology, plan: Plan, *, runner: Runner | None = None, progress: bool = True
) -> Check:
    from lowtail.render.progress import Progress

    placements = check_placement(topo, plan)
    cpus = matrix_cpus(topo, plan)
    if len(cpus) < 2:
        return skip(NAME, f"{len(cpus)} online CPU: no pair to measure", "probe")
    with tempfile.TemporaryDirectory(prefix="lowtail-c2c-") as tmp:
        try:
            run = runner or native_runner(build(Path(tmp)))
        except ProbeUnavailable as e:
            return skip(NAME, str(e), "probe")
        n = len(cpus) * (len(cpus) - 1) // 2
        bar = Progress(NAME, n, enabled=progress)
        try:
            results = measure(cpus, run, topo, on_pair=lambda k: bar.update(k, f"{k}/{n} pairs"))
        except ProbeUnavailable as e:
            bar.finish("failed")
            return Check(NAME, Status.FAIL, None, "", [str(e)], reason=str(e), kind="probe")
        bar.finish()
    status, reason, evidence = judge(results, placements, plan)
    by_rel: dict[str, list[float]] = {}
    for r in results:
        by_rel.setdefault(r.relation, []).append(r.median_ns)
    evidence = [
        f"{rel}: median round trip {min(v):.0f}-{max(v):.0f} ns over {len(v)} pair(s)"
        for rel, v in by_rel.items()
    ] + evidence
    matrix = [[None if a == b else _lookup(results, a, b) for b in cpus] for a in cpus]
    worst_pool = max(
        (
            _lookup(results, p.worker, c) or 0.0
            for p in placements
            for c in p.pool
            if c in cpus and p.worker in cpus
        ),
        default=None,
    )
    return Check(
        NAME,
        status,
        worst_pool,
        "pools as close as the topology allows; a pool partner not slower than a CPU outside it",
        evidence,
        reason=reason,
        kind="probe",
        unit="ns",
        data={
            "cpus": cpus,
            "matrix_ns": matrix,
            "pairs": [r.to_dict() for r in results],
            "placement": [p.to_dict() for p in placements],
            "iters_per_batch": ITERS,
            "batches": BATCHES,
            "statistic": "median of per-batch mean round trips",
        },
    )


def _lookup(results: list[PairResult], a: int, b: int) -> float | None:
    for r in results:
        if {r.a, r.b} == {a, b}:
            return r.median_ns
    return None


def figure(c: Check) -> tuple[str, bytes]:
    """The heat map of the matrix for the HTML report."""
    import numpy as np

    from lowtail.validation import plots  # sets matplotlib's Agg backend first

    plt = __import__("matplotlib.pyplot").pyplot
    cpus = c.data["cpus"]
    m = np.array([[np.nan if v is None else v for v in row] for row in c.data["matrix_ns"]], dtype=float)
    fig, ax = plt.subplots(figsize=(max(5.0, 1.2 + 0.45 * len(cpus)), max(3.0, 1.0 + 0.4 * len(cpus))))
    im = ax.imshow(m, cmap="viridis")
    ax.set_xticks(range(len(cpus)), [str(x) for x in cpus], fontsize=7)
    ax.set_yticks(range(len(cpus)), [str(x) for x in cpus], fontsize=7)
    for i in range(len(cpus)):
        for j in range(len(cpus)):
            if not np.isnan(m[i, j]):
                ax.text(j, i, f"{m[i, j]:.0f}", ha="center", va="center", fontsize=6, color="white")
    fig.colorbar(im, ax=ax, label="round trip (ns)")
    title = f"core_to_core: {c.status.upper()}, cache-line round trip between CPUs (median, ns)"
    ax.set_title(title, fontsize=8)
    return title, plots._png(fig)


def available() -> bool:
    return any(shutil.which(x) for x in ("cc", "gcc", "clang")) and os.name == "posix"
