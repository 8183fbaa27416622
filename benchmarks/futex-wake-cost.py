#!/usr/bin/env python3
"""What waking parked samplers costs the waker's CPU: one futex word per waiter against one shared word.

    benchmarks/futex-wake-cost.py [--waiters 1,8,16] [--rounds N] [--target-busy] [--json FILE]

The worker answers a batch and wakes the parked samplers whose requests it held, one ``FUTEX_WAKE``
per lane (each lane parks on its own answer counter). On a KVM guest a wake-up of a task on another
vCPU is an inter-processor interrupt, and an IPI into a halted vCPU is a VM exit paid by the waker:
this measures it. N waiter processes park on CPU 0 (the samplers' CPU), the waker runs on CPU 1 (the
worker's) and times each round's wake-ups with its thread CPU clock, the way the worker pays them:

- ``per-word``: a word per waiter, one ``FUTEX_WAKE`` each (lowtail's lanes today);
- ``bitset``: one shared word, the waiters parked with ``FUTEX_WAIT_BITSET`` on a bit each, woken by
  one ``FUTEX_WAKE_BITSET`` (the kernel wakes them in one call);
- ``nobody``: one ``FUTEX_WAKE`` on a word nobody waits on (the system call alone).

Each round waits until every waiter has parked and then 2 ms more, so the waiters' CPU is idle (a
halted vCPU on a guest) unless ``--target-busy`` keeps a nice-19 loop on it. Arguments are converted
to ctypes once, as in ``lowtail.shm.futex``. Needs 2 CPUs (0 and 1).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import sys
import time

SYS_FUTEX, FUTEX_WAIT, FUTEX_WAKE, FUTEX_WAIT_BITSET, FUTEX_WAKE_BITSET = 202, 0, 1, 9, 10
WAITER_CPU, WAKER_CPU = 0, 1
SHARED, COUNTERS, PARKED, ACKS, STOP = 0, 64, 128, 192, 256  # u32 word indexes in the shared page

libc = ctypes.CDLL(None, use_errno=True)
syscall = libc.syscall
syscall.restype = ctypes.c_long
SYS_L, WAKE_ALL = ctypes.c_long(SYS_FUTEX), ctypes.c_int(0x7FFFFFFF)
NO_BITS, ALL_BITS = ctypes.c_uint(0), ctypes.c_uint(0xFFFFFFFF)


def waiter(words: ctypes.Array[ctypes.c_uint32], base: int, i: int, mode: str) -> None:
    os.sched_setaffinity(0, {WAITER_CPU})
    own = ctypes.c_void_p(base + 4 * (COUNTERS + i))
    shared = ctypes.c_void_p(base + 4 * SHARED)
    bit = ctypes.c_uint(1 << (i % 32))
    while not words[STOP]:
        if mode == "bitset":
            expected = words[SHARED]
            words[PARKED + i] = 1
            syscall(SYS_L, shared, ctypes.c_int(FUTEX_WAIT_BITSET), ctypes.c_uint(expected), None, None, bit)
        else:
            expected = words[COUNTERS + i]
            words[PARKED + i] = 1
            syscall(
                SYS_L, own, ctypes.c_int(FUTEX_WAIT), ctypes.c_uint(expected), None, None, ctypes.c_uint(0)
            )
        words[PARKED + i] = 0
        words[ACKS + i] += 1


def measure(n: int, mode: str, rounds: int) -> list[int]:
    page = mmap.mmap(-1, mmap.PAGESIZE)
    words = (ctypes.c_uint32 * (mmap.PAGESIZE // 4)).from_buffer(page)
    base = ctypes.addressof(words)
    addr = [ctypes.c_void_p(base + 4 * (COUNTERS + i)) for i in range(n)]
    shared, mask = ctypes.c_void_p(base + 4 * SHARED), ctypes.c_uint((1 << min(n, 32)) - 1)
    kids: list[int] = []
    for i in range(0 if mode == "nobody" else n):
        pid = os.fork()
        if pid == 0:  # the child parks until STOP and exits here, whatever happens: it never forks
            try:
                waiter(words, base, i, mode)
            finally:
                os._exit(0)
        kids.append(pid)
    costs = []
    try:
        for _ in range(rounds):
            deadline = time.monotonic() + 5
            while not all(words[PARKED + i] for i in range(len(kids))):
                if time.monotonic() > deadline:
                    raise RuntimeError("a waiter did not park within 5 s")
                time.sleep(0.0002)
            time.sleep(0.002)  # into the kernel, and its CPU idle
            acks = [words[ACKS + i] for i in range(len(kids))]
            t0 = time.thread_time_ns()
            if mode == "bitset":
                words[SHARED] += 1
                syscall(SYS_L, shared, ctypes.c_int(FUTEX_WAKE_BITSET), WAKE_ALL, None, None, mask)
            elif mode == "per-word":
                for i in range(n):
                    words[COUNTERS + i] += 1
                    syscall(SYS_L, addr[i], ctypes.c_int(FUTEX_WAKE), WAKE_ALL, None, None, NO_BITS)
            else:
                syscall(SYS_L, shared, ctypes.c_int(FUTEX_WAKE), WAKE_ALL, None, None, NO_BITS)
            costs.append(time.thread_time_ns() - t0)
            while any(words[ACKS + i] == acks[i] for i in range(len(kids))):
                pass
    finally:
        words[STOP] = 1
        words[SHARED] += 1
        syscall(
            SYS_L, shared, ctypes.c_int(FUTEX_WAKE_BITSET), WAKE_ALL, None, None, ctypes.c_uint(0xFFFFFFFF)
        )
        for i in range(len(kids)):
            words[COUNTERS + i] += 1
            syscall(SYS_L, addr[i], ctypes.c_int(FUTEX_WAKE), WAKE_ALL, None, None, NO_BITS)
        for pid in kids:
            os.waitpid(pid, 0)
        del words
        page.close()
    return costs


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--waiters", default="1,8,16", help="waiter counts, e.g. 1,8,16")
    p.add_argument("--rounds", type=int, default=300)
    p.add_argument("--target-busy", action="store_true", help="a nice-19 busy loop on the waiters' CPU")
    p.add_argument("--json", help="write the rows to FILE")
    args = p.parse_args()
    if not {WAITER_CPU, WAKER_CPU} <= os.sched_getaffinity(0):
        print(f"needs CPUs {WAITER_CPU} and {WAKER_CPU}", file=sys.stderr)
        return 2
    os.sched_setaffinity(0, {WAKER_CPU})
    busy = 0
    if args.target_busy:
        busy = os.fork()
        if busy == 0:
            os.sched_setaffinity(0, {WAITER_CPU})
            os.nice(19)
            while True:
                pass
    rows = []
    try:
        print(f"{'waiters':>7} {'mode':>8} {'n':>5} {'p50 us':>8} {'p90 us':>8} {'p50 per waiter':>15}")
        for k, n in enumerate(int(x) for x in args.waiters.split(",")):
            for mode in ("nobody", "per-word", "bitset")[0 if k == 0 else 1 :]:
                costs = measure(n, mode, args.rounds)
                p50 = statistics.median(costs) / 1e3
                p90 = sorted(costs)[int(len(costs) * 0.9)] / 1e3
                per = p50 / (1 if mode == "nobody" else n)
                rows.append({"waiters": n, "mode": mode, "n": len(costs), "p50_us": p50, "p90_us": p90})
                print(f"{n:>7} {mode:>8} {len(costs):>5} {p50:>8.1f} {p90:>8.1f} {per:>15.1f}", flush=True)
    finally:
        if busy:
            os.kill(busy, 9)
            os.waitpid(busy, 0)
    if args.json:
        setup = {"target_busy": args.target_busy, "loadavg": os.getloadavg(), "rounds": args.rounds}
        with open(args.json, "w") as f:
            json.dump({"setup": setup, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
