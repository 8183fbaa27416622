#!/usr/bin/env python3
"""Instructions a sampler spends per request, counted by callgrind in the sampler's process alone.

    benchmarks/sampler-instructions.py [--tree DIR ...] [--paths python,native] [--requests N]
                                       [--busy-us US] [--samples 16] [--out | --infer | --actors]
                                       [--top K] [--json FILE]

``queue-instructions.py`` counts a client and a worker in one process; this counts the client's side
only, as ``bench serve``'s sampler runs it: ``client.start(x).finish()`` in a loop, the request
``samples`` x 512 float32 (16: a served x4 request, 32 KiB; 1: traffic 16x1's; ``--out``: its answer
copied into the sampler's arrays, ``finish(out=...)``; ``--infer``: ``client.infer(x)``, the one-call
round trip on the native core; ``--actors``: the actors' ``InferenceClient.infer(x)`` with the queue as
its one replica, its failover bookkeeping and timing series included), against a worker in
another process (not under valgrind) that holds each request ``busy_us`` before it answers
``obs[:, :64]``, so the client finds its answer not there and parks, as a sampler without a CPU of its
own does. Callgrind counts only after a warm-up. ``--top`` prints the functions that take the most
instructions (exclusive), the interpreter's and the core's, which says where a request's user time
goes. Needs valgrind.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from callgrind_counts import common_options, path_env, paths_to_count, show, top_functions, warn_unequal_paths

REPO = Path(__file__).resolve().parents[1]
WARMUP = 200

CHILD = r"""
import multiprocessing, os, subprocess, sys, time
sys.path.insert(0, sys.argv[1])
import numpy as np
from lowtail.shm.client import QueueClient
from lowtail.shm.queue import InferenceQueue, QueueConfig

def serve(desc, busy_us, stop):
    from lowtail.shm.server import QueueWorker
    with QueueWorker.attach(desc) as w:
        while not stop.is_set():
            b = w.claim(0.05)
            if b is None:
                continue
            with b:
                end = time.perf_counter_ns() + busy_us * 1000
                while time.perf_counter_ns() < end:
                    pass
                b.complete({"act": np.ascontiguousarray(b.inputs["obs"][:, :64])})

if __name__ == "__main__":
    requests, warmup, busy_us, samples = (int(v) for v in sys.argv[2:6])
    mode = sys.argv[6]  # "finish", "out" (finish into the sampler's arrays), "infer" or "actors"
    try:
        from lowtail.shm import native
        print("QUEUE_CORE=" + native.implementation().name, file=sys.stderr)
    except ImportError:
        print("QUEUE_CORE=python", file=sys.stderr)
    ctx = multiprocessing.get_context("spawn")  # an exec'd child: valgrind does not trace it
    stop = ctx.Event()
    with InferenceQueue.create(QueueConfig(request_bytes=65536, response_bytes=32768)) as q:
        proc = ctx.Process(target=serve, args=(q.descriptor, busy_us, stop))
        proc.start()
        try:
            with QueueClient.attach(q.descriptor, spin_us=0) as c:
                x = {"obs": np.ones((samples, 512), np.float32)}
                if mode == "actors":  # the InferenceClient's own QueueClient is ``c`` (counts, spin)
                    from lowtail.actors.endpoint import Endpoint
                    from lowtail.actors.inference_client import InferenceClient
                    ep = Endpoint("cg", "infer:cg:0", "node", 0, 0, q.descriptor, proc.pid)
                    ic = InferenceClient([ep], node_id="node", timeout_s=60.0)
                    c = ic._targets[0].client
                for _ in range(warmup):
                    if mode == "actors":
                        y = ic.infer(x)
                        ic.take_series()
                    else:
                        y = c.infer(x, timeout_s=60.0) if mode == "infer" else c.start(x).finish(60.0)
                kw = {"out": {k: np.empty_like(v) for k, v in y.items()}} if mode == "out" else {}
                parked0 = c.wait_counts["parked"]
                control = ["callgrind_control", "--instr={}", str(os.getpid())]
                subprocess.run([a.format("on") for a in control], check=True, capture_output=True)
                if mode == "infer":
                    for _ in range(requests):
                        c.infer(x, timeout_s=60.0)
                elif mode == "actors":
                    for _ in range(requests):
                        ic.infer(x)
                else:
                    for _ in range(requests):
                        c.start(x).finish(timeout_s=60.0, **kw)
                subprocess.run([a.format("off") for a in control], check=True, capture_output=True)
                print("PARKED=%d" % (c.wait_counts["parked"] - parked0), file=sys.stderr)
                if mode == "actors":
                    ic.close()
        finally:
            stop.set()
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join()
"""


def count(tree: Path, args: argparse.Namespace, path: str) -> dict[str, object]:
    """One callgrind run of ``tree``'s sampler on ``path``: its counts per request (and top functions)."""
    env = path_env(path)
    mode = "infer" if args.infer else "out" if args.out else "actors" if args.actors else "finish"
    with tempfile.TemporaryDirectory(prefix="lowtail-cg-") as tmp:
        out = Path(tmp) / "callgrind.out"
        script = Path(tmp) / "sampler.py"
        script.write_text(CHILD)
        proc = subprocess.run(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
             sys.executable, str(script), str(tree / "python"), str(args.requests), str(WARMUP),
             str(args.busy_us), str(args.samples), mode],
            capture_output=True, text=True, check=False, env=env,
        )  # fmt: skip
        found = re.search(r"Collected : (\d+)", proc.stderr)
        ran = re.search(r"^QUEUE_CORE=(\w+)", proc.stderr, re.MULTILINE)
        parked = re.search(r"^PARKED=(\d+)", proc.stderr, re.MULTILINE)
        if proc.returncode != 0 or found is None:
            raise SystemExit(
                f"callgrind run of {tree} failed (exit {proc.returncode}):\n{proc.stderr[-2000:]}"
            )
        top = top_functions(out, args.requests, args.top) if args.top else []
    total = int(found.group(1))
    return {
        "tree": str(tree),
        "path": ran.group(1) if ran else "unknown",
        "requests": args.requests,
        "samples": args.samples,
        "busy_us": args.busy_us,
        "out": args.out,
        "infer": args.infer,
        "actors": args.actors,
        "instructions": total,
        "per_request": round(total / args.requests),
        "parked": int(parked.group(1)) if parked else -1,
        "top": top,
    }


def _call(row: dict[str, object]) -> str:
    return "InferenceClient.infer" if row.get("actors") else "infer" if row["infer"] else "start/finish"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_options(ap)
    ap.add_argument("--requests", type=int, default=1000, help="measured requests (default 1000)")
    ap.add_argument("--busy-us", type=int, default=3000, help="the worker's hold per request (default 3000)")
    ap.add_argument("--samples", type=int, default=16, help="rows of 512 float32 per request (default 16)")
    ap.add_argument("--out", action="store_true", help="answers into the sampler's arrays (finish(out=))")
    ap.add_argument("--infer", action="store_true", help="client.infer(x) per request, not start().finish()")
    ap.add_argument("--actors", action="store_true", help="the actors' InferenceClient.infer(x) per request")
    args = ap.parse_args()
    paths = paths_to_count(args.paths)
    if (
        args.requests < 1
        or args.busy_us < 0
        or not 1 <= args.samples <= 16
        or args.out + args.infer + args.actors > 1
    ):
        raise SystemExit(
            "--requests >= 1, --busy-us >= 0, --samples 1..16 and at most one of --out, --infer, --actors"
        )
    warn_unequal_paths(args.tree or [REPO])
    rows = [count(tree, args, path) for tree in (args.tree or [REPO]) for path in paths]
    show(
        rows,
        lambda r: (
            f"{r['tree']} {r['path']}: {r['per_request']:,} instructions per request "
            f"({r['samples']} x 512 f32, {_call(r)}, "
            f"{r['parked']}/{r['requests']} parked)"
        ),
        "lowtail.sampler-instructions/1",
        args.json,
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
