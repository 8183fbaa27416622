#!/usr/bin/env python3
"""The native spin floor with no Python at all: ``bench queue``'s ``native_floor`` pair, timed in C.

    benchmarks/native-floor-c-only.py [--trips N] [--runs N]

``bench queue`` measures every transport through the same Python harness (one call per round trip,
its clock reads and the answer's dict), the ``native_floor`` transport included: its figure is the C
pair plus that harness. This compiles the same ``floor.c`` with a C driver that forks the server onto
CPU 1, keeps the client on CPU 0 and times each round trip in C, so the two figures side by side show
what the harness itself costs on this host, which every transport's figure includes. Run it at the same
priority as the bench (``nice -n -20``) and beside it, not instead of it: the host's state moves both.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

FLOOR_C = Path(__file__).resolve().parent.parent / "python/lowtail/benchmarks/native/floor.c"

DRIVER_C = r"""
#define _GNU_SOURCE
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <stdint.h>
#include <sys/mman.h>
#include <sys/wait.h>
#include <unistd.h>
#include <time.h>
uint64_t floor_serve(uint8_t *seg);
int floor_round_trip(uint8_t *seg, const float *in, float *out, uint64_t seq, uint64_t timeout_ns);
static uint64_t now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000ull + t.tv_nsec;
}
static int cmp(const void *a, const void *b) {
    uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return x < y ? -1 : x > y;
}
static void pin(int cpu) {
    cpu_set_t s;
    CPU_ZERO(&s);
    CPU_SET(cpu, &s);
    if (sched_setaffinity(0, sizeof s, &s)) { perror("sched_setaffinity"); _exit(2); }
}
int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 30000;
    uint8_t *seg = mmap(0, 1 << 20, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    if (seg == MAP_FAILED || n < 1000) return 2;
    pid_t p = fork();
    if (p == 0) { pin(1); floor_serve(seg); _exit(0); }
    pin(0);
    while (!__atomic_load_n((uint64_t *)seg + 2, __ATOMIC_ACQUIRE)) {}
    static float in[16 * 512], out[16 * 64];
    uint64_t *lat = malloc(n * sizeof *lat);
    int failed = 0;
    for (int i = 0; i < n; i++) {
        uint64_t t0 = now();
        failed |= floor_round_trip(seg, in, out, i + 1, 10000000000ull);
        lat[i] = now() - t0;
    }
    __atomic_store_n((uint64_t *)seg + 3, 1, __ATOMIC_RELEASE);
    waitpid(p, 0, 0);
    qsort(lat, n, sizeof *lat, cmp);
    printf("%d %.3f %.3f %.3f\n", n, lat[n / 2] / 1e3, lat[n * 99 / 100] / 1e3, lat[n * 999 / 1000] / 1e3);
    return failed;
}
"""


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--trips", type=int, default=30000, help="round trips per run (default 30000)")
    ap.add_argument("--runs", type=int, default=3, help="runs, one after the other (default 3)")
    args = ap.parse_args()
    if len(os.sched_getaffinity(0) & {0, 1}) < 2:
        sys.exit("needs CPUs 0 and 1")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        sys.exit("needs a C compiler (cc or gcc, or CC=...)")
    with tempfile.TemporaryDirectory(prefix="lowtail-floor-c-") as tmp:
        driver, exe = Path(tmp, "driver.c"), Path(tmp, "floor-c-only")
        driver.write_text(DRIVER_C)
        subprocess.run([cc, "-O2", "-march=native", "-o", str(exe), str(driver), str(FLOOR_C)], check=True)
        print(f"native floor in C alone (client CPU 0, server CPU 1, load {os.getloadavg()[0]:.1f})")
        print("run  n       p50 us  p99 us  p99.9 us")
        for run in range(1, args.runs + 1):
            run_ = subprocess.run([str(exe), str(args.trips)], check=True, capture_output=True, text=True)
            out = run_.stdout
            n, p50, p99, p999 = out.split()
            print(f"{run:<4} {n:<7} {float(p50):<7.2f} {float(p99):<7.2f} {float(p999):.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
