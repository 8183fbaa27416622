#!/usr/bin/env python3
"""Instructions per queue round trip, counted by callgrind: a cost figure a noisy host cannot move.

    benchmarks/queue-instructions.py [--tree DIR ...] [--paths python,native] [--trips N] [--clients N]
                                     [--top K] [--json FILE]

For each source tree (default: this checkout), one process attaches a client and a worker to one
queue and does ``bench queue``'s round trip in turn (submit a 16 x 512 float32 request, claim it,
complete it with ``obs[:, :64]``, wait for the answer), under ``valgrind --tool=callgrind`` with
instrumentation off until a warm-up is done: only the N measured round trips are counted. Wall-clock
latency on a shared 2-vCPU guest moves by 5-10% from run to run; the instruction count of the same code
and inputs moved by 0.004% over three runs beside a ``make test``, so a change of the hot path's cost
(a renamed call, an extra check, a feature) shows as what it is. It does not count what a second
process adds (the wake-up, the cache lines crossing cores): that is ``lowtail bench queue``'s job.
Needs valgrind (the Debian package).

``--tree`` takes a checkout or worktree of any revision whose ``python/`` holds lowtail (e.g. one from
``git worktree add /tmp/old REV``), so revisions compare in one run; each runs in this interpreter.
``--paths`` counts each tree on the queue's Python path (``LOWTAIL_PURE_PYTHON=1``) and on its native
core (the tree's own ``build/native-dev`` build when it has one, else the ``lowtail_native`` module this
interpreter imports); each row names the path that really ran. ``--clients N`` splits the request among
N clients (16/N rows each) that submit before the worker claims, so each round trip is one coalesced
batch of N requests (N=1: ``bench queue``'s trip). ``--top K`` prints under each row the K functions
with most instructions (exclusive) per round trip, as the other callgrind scripts here do.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from callgrind_counts import common_options, path_env, paths_to_count, show, top_functions, warn_unequal_paths

REPO = Path(__file__).resolve().parents[1]
WARMUP = 200

# The measured process: imports lowtail from argv[1] (and its dev build of the core, when there is one),
# warms up, asks callgrind to count the trips.
CHILD = r"""
import os, subprocess, sys
dev = os.path.join(os.path.dirname(sys.argv[1]), "build", "native-dev")
sys.path[:0] = [sys.argv[1]] + ([dev] if os.path.isdir(dev) else [])
import numpy as np
from lowtail.benchmarks.queue_transports import echo, lowtail_config
from lowtail.shm.client import QueueClient
from lowtail.shm.queue import InferenceQueue
from lowtail.shm.server import QueueWorker

trips, warmup, n = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
try:
    from lowtail.shm import native
    print("QUEUE_CORE=" + native.implementation().name, native.implementation().reason, file=sys.stderr)
except ImportError:  # a tree from before the native core
    print("QUEUE_CORE=python", file=sys.stderr)
x = {"obs": np.ones((16 // n, 512), np.float32)}
queue = InferenceQueue.create(lowtail_config())
clients = [QueueClient.attach(queue.descriptor) for _ in range(n)]
worker = QueueWorker.attach(queue.descriptor)

def trip():
    tickets = [client.submit(x) for client in clients]
    batch = worker.claim(0.05)  # positional: older trees named it timeout, newer timeout_s
    assert len(batch) == n, f"a batch of {len(batch)} requests, expected {n}"
    if hasattr(batch, "__enter__"):
        with batch:
            batch.complete({"logits": echo(batch.inputs["obs"])})
    else:
        batch.complete({"logits": echo(batch.inputs["obs"])})
    for client, ticket in zip(clients, tickets):
        client.wait(ticket, 10.0)

for _ in range(warmup):
    trip()
control = ["callgrind_control", "--instr={}", str(os.getpid())]
subprocess.run([a.format("on") for a in control], check=True, capture_output=True)
for _ in range(trips):
    trip()
subprocess.run([a.format("off") for a in control], check=True, capture_output=True)
worker.close(); queue.close()
for client in clients:
    client.close()
"""


def count(tree: Path, args: argparse.Namespace, path: str) -> dict[str, Any]:
    """One callgrind run of ``args.trips`` round trips of ``tree``'s queue on ``path`` (each a batch of
    ``args.clients`` requests): its row, naming the path that ran."""
    with tempfile.TemporaryDirectory(prefix="lowtail-cg-") as tmp:
        out = Path(tmp) / "callgrind.out"
        proc = subprocess.run(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
             sys.executable, "-c", CHILD, str(tree / "python"), str(args.trips), str(WARMUP),
             str(args.clients)],
            capture_output=True, text=True, check=False, env=path_env(path),
        )  # fmt: skip
        found = re.search(r"Collected : (\d+)", proc.stderr)
        ran = re.search(r"^QUEUE_CORE=(\w+)", proc.stderr, re.MULTILINE)  # not valgrind's echo of -c
        if proc.returncode != 0 or found is None:
            raise SystemExit(
                f"callgrind run of {tree} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}"
            )
        top = top_functions(out, args.trips, args.top) if args.top else []
    total = int(found.group(1))
    return {"tree": str(tree), "revision": revision(tree), "path": ran.group(1) if ran else "unknown",
            "trips": args.trips, "clients": args.clients, "instructions": total,
            "per_round_trip": round(total / args.trips), "top": top}  # fmt: skip


def revision(tree: Path) -> str:
    proc = subprocess.run(
        ["git", "-C", str(tree), "describe", "--always", "--dirty"],
        capture_output=True,
        text=True,
        check=False,
    )
    return proc.stdout.strip() or "unknown"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_options(ap)
    ap.add_argument("--trips", type=int, default=2000, help="measured round trips per tree (default 2000)")
    ap.add_argument(
        "--clients", type=int, default=1, help="requests per round trip, one per client (1, 2, 4, 8 or 16)"
    )
    args = ap.parse_args()
    paths = paths_to_count(args.paths)
    if args.trips < 1:
        raise SystemExit(f"--trips {args.trips}: expected a positive number of round trips")
    if args.clients not in (1, 2, 4, 8, 16):
        raise SystemExit(f"--clients {args.clients}: expected 1, 2, 4, 8 or 16 (16 rows split evenly)")
    rows = []
    trees = args.tree or [REPO]
    warn_unequal_paths(trees)
    for i, tree in enumerate(trees, 1):
        if not (tree / "python/lowtail/shm/client.py").is_file():
            raise SystemExit(f"--tree {tree}: expected a lowtail checkout (python/lowtail/shm/client.py)")
        for path in paths:
            print(
                f"[{i}/{len(trees)}] {tree} ({revision(tree)}), {path} path: {args.trips} round trips "
                f"of {args.clients} request(s) under callgrind",
                file=sys.stderr,
            )
            rows.append(count(tree, args, path))
    first = rows[0]["per_round_trip"]
    print(f"{'revision':<24} {'path':<7} {'instructions per round trip':>28} {'vs first':>9}")

    def line(r: dict[str, Any]) -> str:
        per = r["per_round_trip"]
        return f"{r['revision']:<24} {r['path']:<7} {per:>28,} {per / first:>9.4f}"

    show(rows, line, "lowtail.queue-instructions/1", args.json, _versions() if args.json else {})
    return 0


def _versions() -> dict[str, str]:
    """What the JSON names beside the rows: the interpreter and valgrind that counted them."""
    version = subprocess.run(["valgrind", "--version"], capture_output=True, text=True, check=False)
    return {"python": sys.version.split()[0], "valgrind": version.stdout.strip()}


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")  # inherited by the child: same dict layouts every run
    sys.exit(main())
