"""The two-node demo's own checks (lowtail.demo.cluster) can fail: each on the case it exists to catch."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from lowtail.demo.cluster import Node, NodeRun, audit_ok, plot, total


def node(host: str, samplers: int = 1) -> Node:
    n = Node("id-" + host, host, "127.0.0.1", False, {"isolated": "1"}, "0-1", "note")
    n.samplers = [object()] * samplers
    return n


def lease(node: str, owner: str, cpu: int) -> dict[str, object]:
    return {"node": node, "owner": owner, "kind": owner.split(":", maxsplit=1)[0], "cpu": cpu}


def test_audit_accepts_exactly_the_nodes_own_owners() -> None:
    audit = [lease("a", "infer:a:0", 1), lease("a", "sample:a-0", 0), lease("b", "infer:b:0", 1)]
    assert audit_ok(node("a"), audit)


def test_audit_refuses_another_nodes_owner_a_missing_lease_and_a_cpu_outside_the_cpuset() -> None:
    assert not audit_ok(node("a"), [lease("a", "infer:a:0", 1), lease("a", "sample:b-0", 0)])
    assert not audit_ok(node("a"), [lease("a", "infer:a:0", 1)])
    assert not audit_ok(node("a"), [lease("a", "infer:a:0", 1), lease("a", "sample:a-0", 7)])


def test_total_adds_nodes_and_keeps_every_lost_sampler() -> None:
    a = NodeRun("a", samples=80, requests=10, errors={"QueueTimeout": 1}, rpc_ms=[1.0] * 10, seconds=2.0)
    b = NodeRun("b", samples=16, requests=2, errors={"QueueTimeout": 2}, rpc_ms=[3.0] * 2, seconds=2.5)
    b.lost.append("ActorDiedError")
    t = total([a, b])
    assert (t.samples, t.requests, t.errors, t.seconds) == (96, 12, {"QueueTimeout": 3}, 2.5)
    assert t.lost == ["b: ActorDiedError"]
    assert t.row()[0] == "total" and t.row()[1] == 96


def test_plot_draws_every_node_and_phase(tmp_path: Path) -> None:
    a = NodeRun("a", samples=8, requests=3, rpc_ms=[0.5, 0.7, 2.0], seconds=1.0)
    b = NodeRun("b", samples=8, requests=2, rpc_ms=[0.6, 9.0], seconds=1.0)
    report = {"phases": {"serve": {"nodes": [a.to_dict(), b.to_dict()]}, "cross_node": {}}}
    out = tmp_path / "tails.png"
    plot(report, str(out))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_tear_down_removes_the_model_each_live_node_wrote(monkeypatch: pytest.MonkeyPatch) -> None:
    """The generated model goes into each node's own /tmp; on real nodes (not the demo's containers) it
    stayed there after the demo. A node that is gone is not asked."""
    from lowtail.demo import cluster

    live, gone = node("a"), node("b")
    live.samplers, gone.samplers = [], []
    live.model_dir, gone.model_dir = cluster._write_model(8), cluster._write_model(8)
    asked: list[str] = []

    def on_node(node_id: str, fn: Any, *args: Any, timeout_s: float = 120.0) -> Any:
        asked.append(node_id)
        return fn(*args)

    monkeypatch.setattr(cluster, "_on", on_node)
    monkeypatch.setattr(cluster, "ray_nodes", lambda: [{"NodeID": live.node_id, "Alive": True}])
    monkeypatch.setattr("lowtail.actors.allocator.stop_node_allocator", lambda *a, **k: None)
    try:
        cluster.tear_down([live, gone])
        assert not Path(live.model_dir).exists()
        assert asked == [live.node_id]
    finally:
        shutil.rmtree(gone.model_dir, ignore_errors=True)
        shutil.rmtree(live.model_dir, ignore_errors=True)


def test_removing_a_model_touches_only_a_directory_the_demo_made(tmp_path: Path) -> None:
    from lowtail.demo import cluster

    other = tmp_path / "lt-cluster-model-elsewhere"
    other.mkdir()
    with pytest.raises(ValueError, match="not a model directory the demo made"):
        cluster._remove_model(str(other))
    assert other.exists()
