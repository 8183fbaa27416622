#!/usr/bin/env python3
"""Instructions the worker's serving loop spends per call outside ``infer()``, counted by callgrind.

    benchmarks/worker-instructions.py [--tree DIR ...] [--paths python,native] [--calls N] [--top K]
                                      [--json FILE] [--keep DIR]

The real ``serve()`` (``lowtail.serve.worker_main``) runs in the measured process on a real queue shaped
as ``bench serve``'s served x4 (4 lanes, 16 x 512 float32 per request, 16 samples per call), its real
recorder (``new_recorder``: the native core's on that path) and stats segment, while 4 client processes
(not under valgrind) keep a request in every lane, so every claim finds one ready and the loop never
idles. The engine is a stand-in: ``check`` is the engine's cached-layout lookup and ``infer`` returns the
default policy model's six output arrays (16 rows each), prebuilt. What it counts is the loop's own
bookkeeping (claim, check, the clocks, SCHED_FIFO's calls, the answer's copy and publication, the
recorder), not a model. Counting starts inside the stand-in's ``infer`` of call ``WARMUP`` and stops
inside that of call ``WARMUP + N``: N whole turns of the loop. The stand-in's ``infer`` is then counted
alone (N calls in a loop, a second callgrind segment) and taken off, so ``per_call`` excludes the engine
call; the loop that calls it alone adds a few instructions per call to what is taken off.

Made deterministic on purpose, and what that leaves out: SCHED_FIFO is off (``fifo.enter``/``leave``
are still called: their no-op cost is counted, the real switch is a system call a count does not
see); the recorder's read of the scheduler counters on a descheduled call is switched off
(``DESCHEDULED_NS``: under valgrind almost every call looks descheduled), the ones on every
``stats_every``-th call stay; ``slow_infer`` thresholds are raised (a 16-fold slower loop). The toggles
go through a helper process, so the measured process only writes a byte and blocks in one read each
time (a ``subprocess.run`` from inside it counted 1-10 million instructions of its own, varying).
Each tree runs on its own build of the core (``build/native-dev``, as ``native/build-dev.sh`` makes it)
when it has one, else on the ``lowtail_native`` this interpreter imports: a tree whose package needs a
newer core than that refuses it and runs the Python path. Each row names the queue path that really
ran. Needs valgrind.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from callgrind_counts import common_options, path_env, paths_to_count, show, top_functions, warn_unequal_paths

REPO = Path(__file__).resolve().parents[1]
WARMUP = 1000  # past the loop's specialization (8 entries of 64 batches: see BATCHES_PER_ENTRY)

# Runs callgrind_control for the measured process on request: one line in, "ok" out.
HELPER = r"""
import subprocess, sys
pid = sys.argv[1]
for line in sys.stdin:
    subprocess.run(["callgrind_control", line.strip(), pid], check=True, capture_output=True)
    sys.stdout.write("ok\n")
    sys.stdout.flush()
"""

CHILD = r"""
import multiprocessing, os, subprocess, sys
dev = os.path.join(os.path.dirname(sys.argv[1]), "build", "native-dev")
sys.path[:0] = [sys.argv[1]] + ([dev] if os.path.isdir(dev) else [])
import numpy as np
from lowtail.shm.queue import InferenceQueue, QueueConfig

calls, warmup = int(sys.argv[2]), int(sys.argv[3])
HEADS = (("action", 12), ("move_x", 16), ("move_y", 16), ("skill", 8), ("target", 10), ("value", 1))

def sampler(desc, stop):
    from lowtail.shm.client import QueueClient
    with QueueClient.attach(desc) as c:
        x = {"obs": np.ones((16, 512), np.float32)}
        while not stop.is_set():
            try:
                c.start(x).finish(timeout_s=60.0)
            except Exception:
                if not stop.is_set():
                    import traceback
                    traceback.print_exc()
                    os._exit(1)
                return

class Toggle:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-c", sys.argv[4], str(os.getpid())],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        self.w, self.r = self.proc.stdin.fileno(), self.proc.stdout.fileno()

    def __call__(self, what):  # a write and a blocking read: all this process spends on a toggle
        os.write(self.w, what)
        os.read(self.r, 3)

class StandIn:
    precision = "f32"

    def __init__(self, toggle, stop):
        self.outputs = {k: np.full((16, n), 0.5, np.float32) for k, n in HEADS}
        self._by_layout = {}
        self.calls = 0
        self.toggle, self.stop = toggle, stop

    def check(self, inputs, layout=None):
        n = self._by_layout.get(layout)
        if n is None:
            n = self._by_layout[layout] = len(next(iter(inputs.values())))
        return n

    def infer(self, inputs, checked_batch=0):
        self.calls += 1
        if self.calls == warmup:
            self.toggle(b"--instr=on\n")
        elif self.calls == warmup + calls:
            self.toggle(b"--instr=off\n")
            self.stop()
        return self.outputs

def main():
    try:
        from lowtail.shm import native
        print("QUEUE_CORE=" + native.implementation().name, file=sys.stderr)
    except ImportError:
        print("QUEUE_CORE=python", file=sys.stderr)
    from lowtail.serve import call_recorder, worker_main
    from lowtail.serve.config import WorkerConfig
    from lowtail.serve.pinning import SchedFifo
    from lowtail.serve.stats_segment import StatsSegment
    from lowtail.shm.server import QueueWorker

    call_recorder.DESCHEDULED_NS = 1 << 62  # the module's word, set before the recorder is made
    toggle = Toggle()
    cfg = QueueConfig(lanes=4, slots_per_lane=4, request_bytes=16 * 512 * 4 + 4096,
                      response_bytes=16 * 512 * 4 + 4096, max_batch_samples=16, min_batch_samples=1,
                      max_batch_slots=4)
    ctx = multiprocessing.get_context("spawn")  # exec'd children: valgrind does not trace them
    stop = ctx.Event()
    fifo = SchedFifo(1)
    fifo.reason = "off for the count"
    config = WorkerConfig(name="count", slow_engine_cpu_ms=1e6, slow_total_ms=1e6)
    stats = StatsSegment.create(calls + warmup + 64)  # every counted row still in the ring after
    with InferenceQueue.create(cfg) as q:
        engine = StandIn(toggle, lambda: worker_main._stop.__setitem__("signalled", True))
        procs = [ctx.Process(target=sampler, args=(q.descriptor, stop)) for _ in range(4)]
        for p in procs:
            p.start()
        try:
            w = QueueWorker.attach(q.descriptor)
            ready = {"threads": 1, "nice": {"achieved": 0}}
            worker_main.serve(qworker=w, engine=engine, stats=stats, fifo=fifo, cpu=0, config=config,
                              ready=ready, ppid=os.getppid())
            raw = stats.read_raw(0).rows.copy()
        finally:
            stop.set()
            w.close()
            for p in procs:
                p.join(30)
                if p.is_alive():
                    p.kill()
                    p.join()
    stats.close()
    from lowtail.serve.call_stats import RAW_FIELDS
    col = {n: i for i, n in enumerate(RAW_FIELDS)}
    counted = raw[warmup:warmup + calls]
    print("SLOTS=%d" % int((counted[:, col["slots"]] != 1).sum()), file=sys.stderr)
    print("READS=%d" % int((counted[:, col["read_ns"]] != 0).sum()), file=sys.stderr)
    toggle(b"-d\n")  # the serving loop's segment is dumped; the stand-in's infer alone next
    infer, x = engine.infer, {"obs": np.ones((16, 512), np.float32)}
    engine.calls = calls + warmup + 1
    toggle(b"--instr=on\n")
    for _ in range(calls):
        infer(x, 16)
    toggle(b"--instr=off\n")
    toggle.proc.stdin.close()
    toggle.proc.wait()

if __name__ == "__main__":
    main()
"""


def _totals(out: Path) -> tuple[int, int]:
    """(the serving loop's segment, the stand-in's infer alone) from callgrind's two output files."""
    loop = re.search(r"^totals: (\d+)", Path(f"{out}.1").read_text(), re.MULTILINE)
    alone = re.search(r"^totals: (\d+)", out.read_text(), re.MULTILINE)
    if loop is None or alone is None:
        raise SystemExit(f"{out}: no totals line in callgrind's output")
    return int(loop.group(1)), int(alone.group(1))


def count(tree: Path, args: argparse.Namespace, path: str) -> dict[str, object]:
    """One callgrind run of ``tree``'s serving loop on ``path``: instructions per call beyond infer()."""
    env = path_env(path)
    with tempfile.TemporaryDirectory(prefix="lowtail-cg-") as tmp:
        out = Path(tmp) / "callgrind.out"
        script = Path(tmp) / "worker.py"
        script.write_text(CHILD)
        proc = subprocess.run(
            ["valgrind", "--tool=callgrind", "--instr-atstart=no", f"--callgrind-out-file={out}",
             sys.executable, str(script), str(tree / "python"), str(args.calls), str(WARMUP), HELPER],
            capture_output=True, text=True, check=False, env=env, timeout=args.calls + 600,
        )  # fmt: skip
        fields = dict(re.findall(r"^(QUEUE_CORE|SLOTS|READS)=(\w+)", proc.stderr, re.MULTILINE))
        if proc.returncode != 0 or not Path(f"{out}.1").exists():
            raise SystemExit(
                f"callgrind run of {tree} failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}"
            )
        loop, alone = _totals(out)
        top = top_functions(f"{out}.1", args.calls, args.top) if args.top else []
        if args.keep:
            args.keep.mkdir(parents=True, exist_ok=True)
            shutil.copy(f"{out}.1", args.keep / f"callgrind.{tree.name}.{path}.loop")
    return {
        "tree": str(tree),
        "path": fields.get("QUEUE_CORE", "unknown"),
        "calls": args.calls,
        "loop_instructions": loop,
        "infer_alone_instructions": alone,
        "per_call": round((loop - alone) / args.calls),
        "infer_alone_per_call": round(alone / args.calls),
        "calls_not_one_request": int(fields.get("SLOTS", -1)),
        "counter_reads": int(fields.get("READS", -1)),
        "top": top,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    common_options(ap)
    ap.add_argument("--calls", type=int, default=2000, help="measured calls (default 2000)")
    ap.add_argument("--keep", type=Path, help="keep the serving loop's callgrind file in this directory")
    args = ap.parse_args()
    paths = paths_to_count(args.paths)
    if args.calls < 1:
        raise SystemExit(f"--calls {args.calls}: expected >= 1")
    warn_unequal_paths(args.tree or [REPO])
    rows = [count(tree, args, path) for tree in (args.tree or [REPO]) for path in paths]
    show(rows, _line, "lowtail.worker-instructions/1", args.json)
    return 0


def _line(r: dict[str, Any]) -> str:
    return (
        f"{r['tree']} {r['path']}: {r['per_call']:,} instructions per call beyond infer() "
        f"({r['calls']} calls; the stand-in's infer {r['infer_alone_per_call']:,} taken off; "
        f"{r['calls_not_one_request']} calls not of one request, {r['counter_reads']} counter reads)"
    )


if __name__ == "__main__":
    os.environ.setdefault("PYTHONHASHSEED", "0")
    sys.exit(main())
