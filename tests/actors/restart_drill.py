"""A measurement, not a test: how long samplers are without answers after a worker or actor crash.

    .venv/bin/python -m tests.actors.restart_drill --trials 3 --out /tmp/lt-drill

Runs a one-node Ray (2 CPUs, the demo lease override on a small machine), one inference actor and 4
async samplers; per trial it freezes the worker mid-batch, counts the queue, crashes the worker (SIGKILL)
or the actor (``ray.kill`` + SIGKILL of its frozen worker), and records each sampler's failed requests and
its recovery time (first failure to the next answer). Writes ``drill.json`` and ``drill.png``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--out", default="/tmp/lt-drill")
    args = ap.parse_args(argv)

    import ray

    from lowtail.actors.allocator import AllocatorConfig, stop_node_allocator
    from lowtail.actors.inference import InferenceSpec, start_inference_actor, stop_actor
    from lowtail.actors.sampler import EnvSpec, SamplerSpec, start_sampler
    from lowtail.node.lease import node_plan
    from lowtail.serve.model import ModelSpec, write_model
    from tests.actors.test_restart import freeze_and_count

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="lt-drill-"))
    os.environ["RAY_TMPDIR"] = str(work)
    ray.init(num_cpus=4, resources={"lowtail_isolated_cpu": 4}, include_dashboard=False, log_to_driver=False)
    plan = node_plan()
    small = len(plan.isolated) < 5
    alloc = AllocatorConfig(
        state_dir=str(work / "leases"), pool="0-1" if small else None, share=8 if small else 1
    )
    model = work / "model"
    write_model(model, ModelSpec(features=512))
    rows: list[dict[str, Any]] = []
    try:
        for kind in ("worker", "actor"):
            for trial in range(args.trials):
                spec = InferenceSpec(hero="d", index=0, model_dir=str(model), allocator=alloc)
                actor = start_inference_actor(spec)
                ep = ray.get(actor.endpoint.remote())
                env = EnvSpec(features=512, rows=8, step_us=200)
                samplers = [
                    start_sampler(SamplerSpec(f"d{i}", env, allocator=alloc, timeout_s=60.0), [ep])
                    for i in range(4)
                ]
                runs = [s.run.remote(args.seconds, "async", 2) for s in samplers]
                time.sleep(3.0)
                load = os.getloadavg()[0]
                states = ("PROCESSING",) if kind == "worker" else ("WRITING", "READY", "PROCESSING")
                pid, in_flight = freeze_and_count(actor, states)
                if kind == "actor":
                    ray.kill(actor, no_restart=False)
                os.kill(pid, signal.SIGKILL)
                results = ray.get(runs)
                failed = sum(sum(r.errors.values()) for r in results)
                rows.append(
                    {
                        "crash": kind,
                        "trial": trial,
                        "in_flight": in_flight,
                        "failed": failed,
                        "recovery_s": [x for r in results for x in r.recovery_s],
                        "steps": [r.steps for r in results],
                        "waits": [r.waits for r in results],
                        "load1": load,
                    }
                )
                print(json.dumps(rows[-1]), flush=True)
                for s in samplers:
                    stop_actor(s)
                stop_actor(actor)
    finally:
        stop_node_allocator()
        ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)
    (out / "drill.json").write_text(json.dumps(rows, indent=1))
    plot(rows, out / "drill.png")
    return 0


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    for i, kind in enumerate(("worker", "actor")):
        ys = [x for r in rows if r["crash"] == kind for x in r["recovery_s"]]
        ax.scatter([i + 0.05 * (k % 7 - 3) for k in range(len(ys))], ys, s=14, label=f"{kind} (n={len(ys)})")
    ax.set_xticks([0, 1], ["worker SIGKILL", "actor kill"])
    ax.set_ylabel("sampler recovery: first failure to next answer (s)")
    ax.set_title("Samplers after a crash (4 async samplers, 1 inference actor)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


if __name__ == "__main__":
    sys.exit(main())
