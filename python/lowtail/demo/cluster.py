"""``python -m lowtail.demo.cluster``: the serving demo on a Ray cluster its nodes' units started.

Run on the head node of the two-node sandbox (``scripts/demo.sh``). Every node gets its own lease
allocator (its plan read from its own ``/etc/lowtail/plan.json``), inference actor and samplers placed on
it (``NodeAffinitySchedulingStrategy``, hard), so each sampler reaches its own node's inference actor
through that node's shared memory. Phases, each printed with its figures and kept in the JSON report:

``serve``       samplers on every node; per-node and total throughput and round trip.
``cross-node``  a client on one node given the other node's endpoint: refused with ``CrossNodeAttach``.
``worker-kill`` SIGKILL of one node's pinned worker mid-run; that node's failed requests, its answers
                after the kill, and the other node's figures.
``node-loss``   the driver writes ``--kill-file`` and waits: the caller then kills the worker node (the
                container); reported are when the head saw the node dead, how each lost sampler ended
                (an error, not a hang) and what the surviving node served meanwhile.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lowtail.errors import LowtailError
from lowtail.node import cpulist
from lowtail.render import table
from lowtail.telemetry.export import WindowStats

NAMESPACE = "lowtail-cluster-demo"


class ClusterDemoError(LowtailError, RuntimeError):
    """The cluster is not what the demo needs (too few live nodes, a node without a plan)."""


@dataclass(frozen=True)
class Options:
    address: str = "127.0.0.1:6379"
    node_ip: str = "127.0.0.1"
    nodes: int = 2
    samplers: int = 1  # per node
    seconds: float = 6.0
    rows: int = 8  # samples per environment step
    features: int = 512
    request_timeout_s: float = 2.0
    kill_file: str | None = None  # node-loss handshake; None skips the node-loss phase
    # How long to wait for the cluster: a unit whose raylet gave up on its slow-starting agents is
    # restarted by systemd (Restart=on-failure), which on a loaded machine takes a few tries.
    cluster_wait_s: float = 300.0
    faults: bool = True  # the worker-kill (and, with kill_file, node-loss) phases
    node_loss_timeout_s: float = 60.0


@dataclass
class Node:
    """One Ray node as the demo set it up: its facts and the actors it placed there."""

    node_id: str
    host: str
    ip: str
    head: bool
    plan: dict[str, Any]
    cpuset: str
    lease_note: str
    allocator: Any = None
    actor: Any = None
    samplers: list[Any] = field(default_factory=list)
    endpoint: Any = None
    model_dir: str | None = None  # the generated model in that node's /tmp, removed by tear_down


Say = Callable[[str], None]


def ray_nodes() -> list[dict[str, Any]]:
    import ray

    nodes: list[dict[str, Any]] = ray.nodes()  # type: ignore[no-untyped-call]
    return nodes


def _node_facts() -> dict[str, Any]:
    """Runs on a node: what it is, its plan (its own /etc/lowtail/plan.json) and its cgroup cpuset."""
    from lowtail.node.cpuset import usable_cpus
    from lowtail.node.lease import node_plan

    return {
        "host": socket.gethostname(),
        "plan": node_plan().to_dict(),
        "cpuset": cpulist.format(usable_cpus()),
    }


def _write_model(features: int) -> str:
    """Runs on a node: the generated policy model, written into that node's own filesystem."""
    import tempfile

    from lowtail.serve.model import ModelSpec, write_model

    out = Path(tempfile.mkdtemp(prefix="lt-cluster-model-"))
    write_model(out, ModelSpec(features=features))
    return str(out)


def _remove_model(path: str) -> None:
    """Runs on a node: remove the model _write_model made there, and nothing else."""
    import shutil
    import tempfile

    p = Path(path)
    if p.parent != Path(tempfile.gettempdir()) or not p.name.startswith("lt-cluster-model-"):
        raise ValueError(f"{path!r} is not a model directory the demo made (lt-cluster-model-* in /tmp)")
    shutil.rmtree(p, ignore_errors=True)


def _attach_elsewhere(endpoint: Any) -> str:
    """Runs on a node: try to reach another node's inference actor; returns the refusal."""
    import ray

    from lowtail.actors.endpoint import CrossNodeAttach
    from lowtail.actors.inference_client import InferenceClient

    try:
        InferenceClient([endpoint], node_id=ray.get_runtime_context().get_node_id()).close()
    except CrossNodeAttach as e:
        return f"CrossNodeAttach: {e}"
    return "ATTACHED (expected CrossNodeAttach)"


def _on(node_id: str, fn: Callable[..., Any], *args: Any, timeout_s: float = 120.0) -> Any:
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    task = ray.remote(num_cpus=0, max_retries=0)(fn)
    ref = task.options(scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False)).remote(*args)
    return ray.get(ref, timeout=timeout_s)


def connect(opts: Options, say: Say) -> None:
    """Join the cluster the units started, waiting (bounded) for its head to answer."""
    import ray

    deadline = time.monotonic() + opts.cluster_wait_s
    while True:
        try:
            ray.init(
                address=opts.address, _node_ip_address=opts.node_ip, namespace=NAMESPACE, log_to_driver=False
            )
            return
        except ConnectionError as e:
            if time.monotonic() > deadline:
                raise ClusterDemoError(
                    f"no Ray head at {opts.address} after {opts.cluster_wait_s:.0f} s ({e}): is "
                    "lowtail-ray.service active on the head (journalctl -u lowtail-ray)?"
                ) from None
            say(f"waiting for the Ray head at {opts.address} ({type(e).__name__})")
            time.sleep(5.0)


def live_nodes(want: int, timeout_s: float, say: Say) -> list[dict[str, Any]]:

    deadline = time.monotonic() + timeout_s
    while True:
        alive = [n for n in ray_nodes() if n["Alive"]]
        if len(alive) >= want:
            return sorted(alive, key=lambda n: n["NodeManagerAddress"])
        if time.monotonic() > deadline:
            raise ClusterDemoError(
                f"{len(alive)} live Ray node(s) after {timeout_s:.0f} s, expected {want}: "
                "is lowtail-ray.service running on every node (systemctl status lowtail-ray)?"
            )
        say(f"waiting for {want} live nodes ({len(alive)} so far)")
        time.sleep(2.0)


def set_up(opts: Options, say: Say) -> list[Node]:
    """Allocator, inference actor and samplers on every node, each node's from its own plan."""
    import ray

    from lowtail.actors.allocator import AllocatorConfig, get_node_allocator
    from lowtail.actors.inference import InferenceSpec, start_inference_actor
    from lowtail.actors.sampler import EnvSpec, SamplerSpec, start_sampler
    from lowtail.demo.local import lease_policy
    from lowtail.node.plan import Plan

    head_id = ray.get_runtime_context().get_node_id()
    nodes: list[Node] = []
    for info in live_nodes(opts.nodes, opts.cluster_wait_s, say):
        nid = info["NodeID"]
        facts = _on(nid, _node_facts)
        plan = Plan.from_dict(facts["plan"])
        policy = lease_policy(
            plan, 1 + opts.samplers, frozenset(cpulist.parse(facts["cpuset"])), strict=False
        )
        nodes.append(
            Node(
                nid,
                facts["host"],
                info["NodeManagerAddress"],
                nid == head_id,
                facts["plan"],
                facts["cpuset"],
                policy.note,
            )
        )
        # The allocator's own pool is the plan's isolated CPUs within its cgroup cpuset (not the unit's
        # CPUAffinity=); the demo override, when the plan isolates fewer CPUs than the node has owners,
        # is lease_policy's, stated in the output as `make demo` always did.
        cfg = AllocatorConfig(
            pool=None if policy.pool is None else cpulist.format(policy.pool), share=policy.share
        )
        node = nodes[-1]
        say(f"{node.host}: plan isolated {cpulist.format(plan.isolated) or '-'}, cpuset {node.cpuset}")
        node.allocator = get_node_allocator(nid, cfg)
        model = node.model_dir = _on(nid, _write_model, opts.features)
        tag = node.host.replace("_", "-")
        node.actor = start_inference_actor(
            InferenceSpec(hero=tag, index=0, model_dir=model, allocator=cfg), nid
        )
        node.endpoint = ray.get(node.actor.endpoint.remote())
        for j in range(opts.samplers):
            spec = SamplerSpec(
                name=f"{tag}-{j}",
                env=EnvSpec(features=opts.features, rows=opts.rows, seed=j),
                allocator=cfg,
                timeout_s=opts.request_timeout_s,
            )
            node.samplers.append(start_sampler(spec, [node.endpoint], nid))
        say(
            f"{node.host}: inference actor on CPU {node.endpoint.cpu} "
            f"(worker pid {node.endpoint.worker_pid}), {opts.samplers} sampler(s)"
        )
    return nodes


@dataclass
class NodeRun:
    """What one node's samplers did in one phase."""

    host: str
    samples: int = 0
    requests: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    rpc_ms: list[float] = field(default_factory=list)
    seconds: float = 0.0
    lost: list[str] = field(default_factory=list)  # samplers whose run ended in an error (node loss)

    def row(self) -> list[object]:
        s = WindowStats.of(self.rpc_ms)
        errs = ", ".join(f"{k} {v}" for k, v in sorted(self.errors.items())) or "0"
        rate = self.samples / self.seconds if self.seconds else 0.0
        return [
            self.host,
            self.samples,
            f"{rate:,.0f}",
            self.requests,
            f"{s.p50:.3f}",
            f"{s.p99:.3f}",
            f"{s.max:.3f}",
            errs,
            "; ".join(self.lost) or "-",
        ]

    def to_dict(self) -> dict[str, Any]:
        return {
            "rpc_ms_values": [round(x, 4) for x in self.rpc_ms],  # for the plot (a few thousand at most)
            "host": self.host,
            "samples": self.samples,
            "requests": self.requests,
            "errors": self.errors,
            "seconds": self.seconds,
            "rpc_ms": WindowStats.of(self.rpc_ms).to_dict(),
            "lost": self.lost,
        }


HEADERS = [
    "node",
    "samples",
    "samples/s",
    "requests",
    "rtt p50 ms",
    "rtt p99 ms",
    "rtt max ms",
    "errors",
    "lost samplers",
]


def run_phase(
    nodes: Sequence[Node], seconds: float, during: Callable[[float], None] | None, say: Say, wait_s: float
) -> list[NodeRun]:
    """All samplers run ``seconds``; ``during(elapsed)`` is called about every 0.2 s meanwhile."""
    import ray

    refs = {id(s): (n, s.run.remote(seconds, "async", 2)) for n in nodes for s in n.samplers}
    runs = {n.node_id: NodeRun(n.host) for n in nodes}
    t0 = time.monotonic()
    pending = [r for _, r in refs.values()]
    shown = -1
    while pending and time.monotonic() - t0 < seconds + wait_s:
        _, pending = ray.wait(pending, num_returns=len(pending), timeout=0.2)
        elapsed = time.monotonic() - t0
        if during is not None:
            during(elapsed)
        if int(elapsed) != shown:
            shown = int(elapsed)
            say(f"[{shown:3d}/{seconds:.0f} s] {len(refs) - len(pending)}/{len(refs)} samplers done")
    for node, ref in refs.values():
        run = runs[node.node_id]
        if ref in pending:
            run.lost.append(f"no answer within {seconds + wait_s:.0f} s (HANG)")
            continue
        try:
            r = ray.get(ref, timeout=1.0)
        except Exception as e:  # the sampler's actor or node died: the run ends in an error, not a hang
            run.lost.append(type(e).__name__)
            continue
        run.samples += r.samples
        run.requests += len(r.rpc_ms)
        run.rpc_ms.extend(r.rpc_ms)
        run.seconds = max(run.seconds, r.seconds)
        for k, v in r.errors.items():
            run.errors[k] = run.errors.get(k, 0) + v
    return list(runs.values())


def wait_restarted(node: Node, timeout_s: float) -> float:
    """Seconds until the node's inference actor reports a live worker after a restart (or the bound)."""
    import ray

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        st = ray.get(node.actor.status.remote(), timeout=timeout_s)
        if st.get("restarts", 0) >= 1 and st.get("worker_alive") and st.get("ready") is not None:
            break
        time.sleep(0.2)
    return time.monotonic() - t0


def total(runs: Sequence[NodeRun]) -> NodeRun:
    t = NodeRun("total")
    for r in runs:
        t.samples += r.samples
        t.requests += r.requests
        t.rpc_ms.extend(r.rpc_ms)
        t.seconds = max(t.seconds, r.seconds)
        for k, v in r.errors.items():
            t.errors[k] = t.errors.get(k, 0) + v
        t.lost.extend(f"{r.host}: {x}" for x in r.lost)
    return t


def lease_audit(nodes: Sequence[Node]) -> list[dict[str, Any]]:
    """Every node's leases as its own allocator records them."""
    import ray

    rows = []
    for n in nodes:
        for lease in ray.get(n.allocator.leases.remote(), timeout=30):
            rows.append({"node": n.host, "owner": lease.owner, "kind": lease.kind, "cpu": lease.cpu})
    return rows


def audit_ok(node: Node, audit: Sequence[dict[str, Any]]) -> bool:
    """A node's allocator holds exactly its own actor's and samplers' leases, on CPUs of its cpuset."""
    tag = node.host.replace("_", "-")
    want = {f"infer:{tag}:0"} | {f"sample:{tag}-{j}" for j in range(len(node.samplers))}
    mine = [r for r in audit if r["node"] == node.host]
    cpus = set(cpulist.parse(node.cpuset))
    return (
        {r["owner"] for r in mine} == want and len(mine) == len(want) and all(r["cpu"] in cpus for r in mine)
    )


def tear_down(nodes: Sequence[Node]) -> None:
    import contextlib

    import ray

    from lowtail.actors.allocator import stop_node_allocator
    from lowtail.actors.inference import stop_actor

    alive = {n["NodeID"] for n in ray_nodes() if n["Alive"]}
    for n in nodes:
        for handle in [*n.samplers, n.actor]:
            if handle is None:
                continue
            if n.node_id in alive:
                with contextlib.suppress(Exception):
                    stop_actor(handle, timeout_s=15)
            else:
                with contextlib.suppress(Exception):
                    ray.kill(handle, no_restart=True)
        if n.node_id in alive:
            with contextlib.suppress(Exception):
                stop_node_allocator(n.node_id, remove_state=True)
            if n.model_dir is not None:
                with contextlib.suppress(Exception):
                    _on(n.node_id, _remove_model, n.model_dir)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m lowtail.demo.cluster", description=__doc__.splitlines()[0])
    ap.add_argument("--address", default=Options.address)
    ap.add_argument("--node-ip", default=Options.node_ip)
    ap.add_argument("--nodes", type=int, default=Options.nodes)
    ap.add_argument("--samplers", type=int, default=Options.samplers, help="per node")
    ap.add_argument("--seconds", type=float, default=Options.seconds, help="per phase")
    ap.add_argument("--request-timeout", type=float, default=Options.request_timeout_s)
    ap.add_argument("--kill-file", help="node-loss handshake: written when the worker node may be killed")
    ap.add_argument("--no-faults", action="store_true", help="serve only: no worker kill, no node loss")
    ap.add_argument("--json", help="write the report here")
    ap.add_argument("--plot", help="write a PNG of every node's round-trip tail, per phase, here")
    a = ap.parse_args(argv)
    if a.nodes < 1 or a.samplers < 1 or a.seconds <= 0:
        ap.error(f"--nodes {a.nodes} --samplers {a.samplers} --seconds {a.seconds}: expected >= 1, >= 1, > 0")
    opts = Options(
        address=a.address,
        node_ip=a.node_ip,
        nodes=a.nodes,
        samplers=a.samplers,
        seconds=a.seconds,
        request_timeout_s=a.request_timeout,
        kill_file=a.kill_file,
        faults=not a.no_faults,
    )
    report = run(opts, lambda m: print(f"    {m}", flush=True))
    if a.plot:
        plot(report, a.plot)
    if a.json:
        Path(a.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0 if report["ok"] else 1


def _describe_nodes(nodes: Sequence[Node], say: Say, report: dict[str, Any]) -> None:
    """Each node's facts in the report, and a note when the nodes share one machine's CPUs."""
    report["nodes"] = [
        {
            "host": n.host,
            "node_id": n.node_id,
            "ip": n.ip,
            "head": n.head,
            "isolated": n.plan["isolated"],
            "housekeeping": n.plan["housekeeping"],
            "cpuset": n.cpuset,
            "lease_note": n.lease_note,
            "inference_cpu": n.endpoint.cpu,
        }
        for n in nodes
    ]
    shared = {c for n in nodes for c in cpulist.parse(n.cpuset)}
    if all(set(cpulist.parse(n.cpuset)) == shared for n in nodes):
        say(
            f"NOTE: every node's cpuset is {cpulist.format(shared)}: the nodes are containers on one "
            "machine and share its CPUs, so a lease on one node and a lease on another can be the same "
            "physical CPU; per-node figures here are not independent hosts' figures."
        )
        report["cpus_shared_between_nodes"] = cpulist.format(shared)
    for n in nodes:
        say(f"{n.host}: {n.lease_note}")


def _check_leases(nodes: Sequence[Node], report: dict[str, Any]) -> None:
    """Every node's allocator holds its own owners' leases only."""
    audit = lease_audit(nodes)
    report["leases"] = audit
    print(
        table.render(
            ["node", "owner", "kind", "cpu"],
            [[r["node"], r["owner"], r["kind"], r["cpu"]] for r in audit],
            title="leases, per node",
        )
    )
    report["checks"]["leases_per_node"] = all(audit_ok(n, audit) for n in nodes)


def _serve_phase(nodes: Sequence[Node], opts: Options, say: Say, report: dict[str, Any]) -> None:
    """Phase 1: serve on every node."""
    say(f"serve: {opts.samplers} sampler(s) per node, {opts.seconds:.0f} s")
    serve = run_phase(nodes, opts.seconds, None, say, wait_s=30)
    _show("serve: every node's samplers with their own node's inference actor", serve, report, "serve")
    report["checks"]["answers_from_every_node"] = all(r.samples > 0 and not r.lost for r in serve)
    # The pinned worker on an isolated CPU of its node's plan wherever the plan isolates any.
    report["checks"]["inference_on_isolated_cpu"] = all(
        n.endpoint.cpu in cpulist.parse(n.plan["isolated"]) for n in nodes if n.plan["isolated"]
    )


def _cross_node_phase(nodes: Sequence[Node], say: Say, report: dict[str, Any]) -> None:
    """Phase 2: a sampler's client on node A given node B's endpoint."""
    refusals = {}
    for a, b in zip(nodes, [*nodes[1:], nodes[0]], strict=True):
        if a.node_id != b.node_id:
            refusals[a.host] = _on(a.node_id, _attach_elsewhere, b.endpoint, timeout_s=60)
            say(f"cross-node: {a.host} -> {b.host}'s endpoint: {refusals[a.host]}")
    report["phases"]["cross_node"] = refusals
    report["checks"]["cross_node_refused"] = all(v.startswith("CrossNodeAttach") for v in refusals.values())


def _worker_kill_phase(
    nodes: Sequence[Node], victim: Node, opts: Options, say: Say, report: dict[str, Any]
) -> None:
    """Phase 3: SIGKILL the victim's pinned worker mid-run; it resumes, the other nodes do not notice."""
    import ray

    killed: dict[str, Any] = {}

    def kill_once(elapsed: float) -> None:
        if not killed and elapsed >= opts.seconds / 3:
            killed["pid"] = ray.get(victim.actor.kill_worker.remote(), timeout=30)
            killed["at_s"] = elapsed
            say(
                f"worker-kill: SIGKILL {victim.host}'s inference worker (pid {killed['pid']}) "
                f"at {elapsed:.1f} s"
            )

    wk = run_phase(nodes, opts.seconds, kill_once, say, wait_s=30)
    _show(
        f"worker-kill: {victim.host}'s pinned worker SIGKILLed at {killed.get('at_s', 0):.1f} s",
        wk,
        report,
        "worker_kill",
    )
    # Resumption is measured once the actor reports a live worker again (bounded wait).
    restarted = wait_restarted(victim, timeout_s=60.0)
    report["phases"]["worker_kill"]["restart_seen_after_s"] = restarted
    say(f"worker-kill: {victim.host}'s actor reports a live worker again after {restarted:.1f} s")
    after = run_phase(nodes, opts.seconds, None, say, wait_s=30)
    _show("after the worker kill: every node again", after, report, "after_worker_kill")
    report["phases"]["worker_kill"]["killed"] = killed
    report["checks"]["worker_kill_node_resumes"] = all(r.samples > 0 for r in after)
    others = [r for r in wk if r.host != victim.host]
    report["checks"]["worker_kill_other_nodes_unaffected"] = all(not r.errors and not r.lost for r in others)


def run(opts: Options, say: Say) -> dict[str, Any]:
    import ray

    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # matches the sandbox units (inventory/sandbox)
    connect(opts, say)
    nodes: list[Node] = []
    report: dict[str, Any] = {"options": opts.__dict__, "phases": {}, "checks": {}}
    try:
        t = time.monotonic()
        nodes = set_up(opts, say)
        report["setup_s"] = time.monotonic() - t
        _describe_nodes(nodes, say, report)
        _check_leases(nodes, report)
        _serve_phase(nodes, opts, say, report)
        _cross_node_phase(nodes, say, report)
        if opts.faults:
            victim = nodes[-1]  # the last node: the worker node
            _worker_kill_phase(nodes, victim, opts, say, report)
            # Phase 4: the caller kills the worker node when the kill file appears.
            if opts.kill_file and len(nodes) > 1:
                timeline = node_loss(nodes, victim, opts, say, report)
                report["phases"]["node_loss"].update(timeline)  # next to its per-node figures
    finally:
        tear_down(nodes)
        ray.shutdown()
    report["ok"] = all(report["checks"].values())
    print(
        table.render(
            ["check", "result"],
            [[k, "pass" if v else "FAIL"] for k, v in report["checks"].items()],
            title="two-node checks",
        )
    )
    return report


def node_loss(
    nodes: Sequence[Node], victim: Node, opts: Options, say: Say, report: dict[str, Any]
) -> dict[str, Any]:

    assert opts.kill_file is not None
    seen: dict[str, float] = {}

    def kill_and_watch(elapsed: float) -> None:
        if "asked_at_s" not in seen and elapsed >= opts.seconds / 3:
            Path(opts.kill_file).write_text(victim.host + "\n")  # type: ignore[arg-type]
            seen["asked_at_s"] = elapsed
            say(f"node-loss: asked for {victim.host} to be killed at {elapsed:.1f} s")
        if "asked_at_s" in seen and "dead_at_s" not in seen:
            state = {n["NodeID"]: n["Alive"] for n in ray_nodes()}
            if not state.get(victim.node_id, False):
                seen["dead_at_s"] = elapsed
                say(f"node-loss: the head marks {victim.host} dead at {elapsed:.1f} s")

    runs = run_phase(nodes, opts.seconds, kill_and_watch, say, wait_s=opts.node_loss_timeout_s)
    t_wait = time.monotonic() + opts.node_loss_timeout_s
    while "dead_at_s" not in seen and time.monotonic() < t_wait:
        kill_and_watch(opts.seconds + opts.node_loss_timeout_s - (t_wait - time.monotonic()))
        time.sleep(0.2)
    _show(f"node-loss: {victim.host} killed (the whole node)", runs, report, "node_loss")
    survivors = [r for r in runs if r.host != victim.host]
    lost = [r for r in runs if r.host == victim.host]
    report["checks"]["node_loss_noticed_by_head"] = "dead_at_s" in seen
    report["checks"]["node_loss_no_hang"] = all("HANG" not in x for r in runs for x in r.lost)
    report["checks"]["node_loss_survivors_keep_serving"] = all(
        r.samples > 0 and not r.lost for r in survivors
    )
    if "dead_at_s" in seen:
        say(
            f"node-loss: detected {seen['dead_at_s'] - seen['asked_at_s']:.1f} s after the kill was asked; "
            f"{victim.host}'s samplers ended with: {', '.join(x for r in lost for x in r.lost) or 'no error'}"
        )
    return {"victim": victim.host, **seen}


def _show(title: str, runs: Sequence[NodeRun], report: dict[str, Any], key: str) -> None:
    rows = [r.row() for r in runs] + [total(runs).row()]
    print(table.render(HEADERS, rows, title=title), flush=True)
    report["phases"][key] = {"nodes": [r.to_dict() for r in runs], "total": total(runs).to_dict()}


def plot(report: dict[str, Any], path: str) -> None:
    """Exceedance curves of the samplers' round trips, one per node and phase (lowtail demo ray's plot)."""
    import numpy as np

    from lowtail.demo.local import plot_tails

    series = {
        f"{phase}: {n['host']}": np.asarray(n["rpc_ms_values"], dtype=np.float64)
        for phase, data in report["phases"].items()
        if isinstance(data, dict) and "nodes" in data
        for n in data["nodes"]
    }
    shared = report.get("cpus_shared_between_nodes")
    note = f" (both nodes on CPUs {shared} of one machine)" if shared else ""
    plot_tails(series, path, title=f"lowtail two-node demo: sampler round trips{note}")


if __name__ == "__main__":
    sys.exit(main())
