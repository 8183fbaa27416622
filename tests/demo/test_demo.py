"""``lowtail demo ray``: the library run on the session cluster, the command line in its own process."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
import ray

from lowtail.actors.allocator import NAMESPACE, allocator_name
from lowtail.actors.metrics_hub import hub_name
from lowtail.cli.main import main
from lowtail.demo.local import DemoError, DemoOptions, lease_policy, run_demo
from lowtail.node.lease import node_plan
from lowtail.node.plan import Plan
from lowtail.telemetry import tbreport
from lowtail.telemetry.export import P999_DESCHEDULE_TAG
from tests.fixtures.plans import tiny_plan
from tests.fixtures.ray_cluster import RayNodes
from tests.serve.conftest import SMALL_SPEC


def test_lease_policy_uses_isolated_cpus_when_there_are_enough() -> None:
    plan = tiny_plan("1-8")
    strict = lease_policy(plan, 4, frozenset(range(9)), strict=False)
    assert (strict.pool, strict.share) == (None, 1) and "one owner each" in strict.note
    small = lease_policy(tiny_plan("1", "0", ("0-1",)), 4, frozenset({0, 1}), strict=False)
    assert (small.pool, small.share) == (frozenset({0, 1}), 2)
    assert small.note.startswith("DEMO OVERRIDE: this node isolates 1 CPU(s) (1) but the demo has 4 owners")
    two = lease_policy(tiny_plan("1", "0", ("0-1",)), 2, frozenset({0, 1}), strict=False)
    assert two.share == 1 and "CPUs 0-1 (housekeeping included), one owner each." in two.note
    with pytest.raises(DemoError, match="4 owners need 4 isolated CPUs; this node's plan isolates 1 \\(1\\)"):
        lease_policy(tiny_plan("1", "0", ("0-1",)), 4, frozenset({0, 1}), strict=True)


def test_demo_runs_measures_and_leaves_nothing_behind(
    ray_nodes: RayNodes,
    tmp_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from lowtail.demo import local
    from lowtail.serve.model import write_model

    # The plan and lease policy are decided once, before Ray starts, and used as decided (they were
    # computed a second time inside the run, overwriting what the caller had been told).
    calls: list[Plan] = []

    def counted_plan() -> Plan:
        calls.append(node_plan())
        return calls[-1]

    monkeypatch.setattr(local, "node_plan", counted_plan)

    model = tmp_path_factory.mktemp("demo-model")
    write_model(model, SMALL_SPEC)
    opts = DemoOptions(
        seconds=2.0,
        actors=2,
        samplers=2,
        rows=4,
        tb_logdir=str(tmp_path / "tb"),
        features=64,
        # behaviour, not latency: a CI machine may stall a request past the demo's 2 s
        request_timeout_s=30.0,
    )
    seen: list[tuple[float, int]] = []
    result = run_demo(opts, progress=lambda e, t, n: seen.append((e, n)), model_dir=str(model))

    assert ray.is_initialized()  # it used the session's Ray and left it running
    assert len(calls) == 1
    assert result.samples > 0 and result.samples_per_s > 0 and result.errors == {}
    assert result.rpc_ms.n == result.requests > 0
    assert result.worker["deschedule_ms"].n > 0 and result.worker["worker_batch_size"].max <= 16
    assert {k: len(v) for k, v in result.leases_by_kind.items()} == {"infer": 2, "sample": 2, "other": 0}
    assert seen and seen[-1][1] > 0  # the progress callback saw samples arriving
    plan: Plan = node_plan()
    if len(plan.isolated) < 4:
        assert result.lease_note.startswith("DEMO OVERRIDE")
    assert any(line.startswith('lowtail_p999_deschedule_ms{node="') for line in result.prometheus_sample)
    # the validator's tb-report reads the run under the predecessor system's names
    report = tbreport.load(str(tmp_path / "tb"))
    assert (
        report["p999_deschedule_ms"]["tag"].endswith(P999_DESCHEDULE_TAG)
        and report["p999_deschedule_ms"]["n"] > 0
    )
    assert {"rpc_elapsed_ms", "infer_exec_ms", "infer_exec_max_ms"} <= set(report["sl_remote"])
    assert report["samples_per_s"]["max"] > 0
    json.dumps(result.to_dict())  # the JSON report is serializable
    # nothing left: no allocator, no metrics hub, no inference actors, no lease table
    for name in (allocator_name(ray_nodes.head), hub_name(ray_nodes.head), "lowtail-infer-demo-0"):
        with pytest.raises(ValueError):
            ray.get_actor(name, namespace=NAMESPACE)


def test_demo_command_rejects_bad_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["demo", "ray", "--seconds", "0"])
    assert e.value.code == 2
    assert "'0': expected a positive float" in capsys.readouterr().err
    # one owner more than this node isolates: strict leases refuse before anything starts
    samplers = len(node_plan().isolated & os.sched_getaffinity(0))
    assert main(["demo", "ray", "--strict-leases", "--actors", "1", "--samplers", str(samplers)]) == 2
    err = capsys.readouterr().err
    assert f"{samplers + 1} owners need {samplers + 1} isolated CPUs" in err and "--strict-leases" in err


@pytest.mark.slow
def test_demo_command_end_to_end_in_its_own_process() -> None:
    """A fresh process starts its own Ray, runs, prints the tables and JSON, and cleans up after itself."""
    # Its own short TMPDIR (Ray's unix sockets live under it: 107 bytes at most): anything the demo
    # leaves in a temp dir would show up here.
    tmp_path = Path(tempfile.mkdtemp(prefix="lt-t-"))
    report = tmp_path / "demo.json"
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    env.pop("RAY_TMPDIR", None)
    env.pop("RAY_ADDRESS", None)
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "lowtail.cli.main",
                "demo",
                "ray",
                "--seconds",
                "2",
                "--actors",
                "1",
                "--samplers",
                "1",
                "--json",
                str(report),
            ],
            capture_output=True,
            text=True,
            timeout=300,
            env=env,
            check=False,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        out = proc.stdout
        for heading in ("Throughput", "Latency and deschedule tails", "Leases by kind", "Inference actors"):
            assert heading in out
        data = json.loads(report.read_text())
        assert data["samples"] > 0 and data["leases_by_kind"]["infer"][0]["owner"] == "infer:demo:0"
        assert sorted(p.name for p in tmp_path.iterdir()) == ["demo.json"]
    finally:
        shutil.rmtree(tmp_path, ignore_errors=True)
