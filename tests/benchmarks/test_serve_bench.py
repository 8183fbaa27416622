"""``lowtail bench serve`` end to end on a tiny model: the report's shape and consistency, never its speed."""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
from pathlib import Path

import numpy as np
import pytest

from lowtail.benchmarks.serve_run import SAMPLER_COSTS, WAKES
from lowtail.cli.main import main
from lowtail.serve.call_stats import CALL_FIELDS

BREAKDOWN_PARTS = ("claim_us", "check_us", "fifo_us", "answer_us", "measure_us", "record_us")
LIMITS = ("batches", "worker", "sampler_cpu")  # and the full-batch two where the samplers fill a batch


def test_bench_serve_writes_table_json_plots_and_breakdown(
    small_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("COLUMNS", "100")
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--model", str(small_model), "--duration", "0.5", "--samplers", "2"]
    argv += ["--traffic", "3x2", "--breakdown"]
    code = main(
        [*argv, "--json", str(out), "--png", str(tmp_path / "s.png"), "--html", str(tmp_path / "s.html")]
    )
    report = json.loads(out.read_text())
    assert code == 0, report["verdicts"]
    designs = [(r["label"], r["samplers"], r["batch"]) for r in report["results"]]
    assert designs == [("bare (limit)", 0, 16), ("served x2", 2, 16), ("traffic 3x2", 3, 2)]
    for r in report["results"]:
        assert not r["error"]
        assert r["samples"] > 0 and r["latency_ms"]["n"] > 0 and r["deschedule_ms"]["n"] > 0
        assert r["samples_per_s"] == pytest.approx(r["samples"] / r["duration_s"])
        assert r["engine_ms_mean"] > 0 and 0 < r["worker_busy"] <= 1.05
    for r in report["results"][1:]:
        parts = r["breakdown_us"]
        assert set(parts) == {*BREAKDOWN_PARTS, "overhead_us", *WAKES}
        # the wakes are part of answer; the overhead without them is the overhead less them, call by call
        assert 0 <= parts["wake_us"]["mean"] <= parts["answer_us"]["mean"] and parts["woken"]["mean"] >= 0
        less = parts["overhead_us"]["mean"] - parts["wake_us"]["mean"]
        assert parts["overhead_less_wakes_us"]["mean"] == pytest.approx(less, rel=1e-6)
        # overhead is the sum of the stages, call by call, so the means add up too
        total = sum(parts[k]["mean"] for k in BREAKDOWN_PARTS)
        assert parts["overhead_us"]["mean"] == pytest.approx(total, rel=1e-6)
        assert r["overhead_us_mean"] == parts["overhead_us"]["mean"] > 0
        assert r["worker_rss_mib"] > 10 and r["queue_mib"] > 0
        # the samplers' own CPU per request: at least the submit and read of one round trip
        assert r["sampler_cpu_us_per_request"] > 1 and 0 < r["sampler_cpus_busy"] <= 1.05
        # where it went: user + system is the same thread CPU (getrusage scales its split to that total)
        costs = r["sampler_costs"]
        assert list(costs) == list(SAMPLER_COSTS)
        cpu = r["sampler_cpu_us_per_request"]
        assert costs["user_us"] + costs["sys_us"] == pytest.approx(cpu, rel=0.25, abs=2.0)
        assert 0 <= costs["parked"] <= 1 and costs["vol_cs"] >= 0 and costs["invol_cs"] >= 0
        assert costs["park_us"] > 0 if costs["parked"] else costs["park_us"] >= 0
        assert 0 < costs["loop_us"] < cpu and costs["spin_us"] >= 0 and costs["run_delay_us"] >= 0
        # the wall time outside the parks and the parks' make up a request's round trip (the loop's)
        assert costs["loop_us"] < costs["code_us"]
        round_trip_us = r["latency_ms"]["mean"] * 1e3
        assert costs["code_us"] + costs["park_us"] == pytest.approx(round_trip_us, rel=0.1), costs
    # a sampler sends 2 observations, so an engine call can never be smaller than one request
    assert report["results"][2]["engine_batch_mean"] >= 2
    # the traffic design's ceilings come from its own figures; the batch-per-request designs have none,
    # and 3 samplers x 2 observations never fill a batch of 16: no full-batch ceiling
    assert [sorted(r["limits"]) for r in report["results"]] == [[], [], sorted(LIMITS)]
    assert all(v > 0 for v in report["results"][2]["limits"].values())
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<img" in (tmp_path / "s.html").read_text()
    text = capsys.readouterr().out
    assert "served x2" in text and "traffic 3x2" in text and "worker cost per engine call" in text
    assert "a sampler's CPU per request" in text and "<th>run_delay</th>" in (tmp_path / "s.html").read_text()
    assert max(len(line) for line in text.splitlines()) <= 100, text  # the tables fit the terminal
    page = (tmp_path / "s.html").read_text()
    assert page.index("<h2>Targets</h2>") < page.index("<h2>Plots</h2>") < page.index("<h2>JSON</h2>")
    assert "<details><summary>Show the JSON</summary>" in page and "<th>p99.9 ms</th>" in page
    assert (report["schema"], report["complete"], report["interrupted"]) == (
        "lowtail.bench.serve",
        True,
        False,
    )


def write_static_batch_model(out: Path, features: int = 8) -> Path:
    """A model whose batch axis is fixed at 1: any batch of 16 makes OpenVINO itself refuse the call."""
    import openvino as ov
    import openvino.opset13 as ops

    obs = ops.parameter([1, features], ov.Type.f32, name="obs")
    obs.output(0).get_tensor().set_names({"obs"})
    w = ops.constant(np.ones((features, 2), dtype=np.float32))
    y = ops.matmul(obs, w, False, False)
    y.output(0).get_tensor().set_names({"value"})
    out.mkdir(parents=True, exist_ok=True)
    ov.save_model(ov.Model([y], [obs], "static1"), str(out / "static1.xml"), compress_to_fp16=False)
    return out


def test_failing_designs_become_rows_and_the_json_is_still_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = write_static_batch_model(tmp_path / "m")
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--model", str(model), "--duration", "0.3", "--samplers", "1", "--traffic", ""]
    code = main([*argv, "--json", str(out)])
    assert code == 1  # a failed design is a failed run, but not a traceback
    report = json.loads(out.read_text())
    labels = [r["label"] for r in report["results"]]
    assert labels == ["bare (limit)", "served x1"]
    bare, served = report["results"]
    assert "bare loop died" in bare["error"]
    # The worker runs every batch size once before it reports ready, so a model that cannot take the
    # batch the queue will give it fails the design at the worker's start, naming the shapes.
    assert "failed to start" in served["error"] and "incompatible" in served["error"]
    assert served["samples"] == 0 and served["samples_per_s"] is None  # NaN is written as null
    assert any("designs with errors" in v for v in report["verdicts"])
    assert "ERROR" in capsys.readouterr().out


def test_bench_serve_rejects_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serve", "--samplers", "1,x"]) == 2
    assert "--samplers '1,x'" in capsys.readouterr().err
    assert main(["bench", "serve", "--cpu", "4095"]) == 2
    assert "--cpu 4095" in capsys.readouterr().err
    assert main(["bench", "serve", "--traffic", "16by1"]) == 2
    assert "--traffic '16by1'" in capsys.readouterr().err
    assert main(["bench", "serve", "--samplers", "", "--traffic", ""]) == 2
    assert "nothing to serve" in capsys.readouterr().err
    for bad, why in (("16", "MIN:US"), ("17:100", "MIN in 1..16"), ("8:200000", "US in 0..100000")):
        assert main(["bench", "serve", "--coalesce", bad]) == 2
        assert f"--coalesce {bad!r}: expected {why}" in capsys.readouterr().err


def test_coalesce_sets_the_traffic_designs_batching_and_leaves_the_others_alone(tmp_path: Path) -> None:
    from lowtail.benchmarks.serve_run import Setup, Traffic, _queue_config
    from lowtail.shm.queue import QueueConfig

    setup = Setup(tmp_path, 1, 16, "obs", 512, 1.0, frozenset({0}))
    default = _queue_config(setup, Traffic(16, 1, coalesce=True))
    assert (default.min_batch_samples, default.coalesce_us) == (QueueConfig.min_batch_samples, 200)
    full = dataclasses.replace(setup, coalesce=(16, 2000))
    got = _queue_config(full, Traffic(16, 1, coalesce=True))
    assert (got.min_batch_samples, got.coalesce_us, got.max_batch_samples) == (16, 2000, 16)
    served = _queue_config(full, Traffic(4, 16, coalesce=False))  # one request is one batch: no waiting
    assert served.min_batch_samples == 1


def test_call_rows_carry_the_breakdown_columns() -> None:
    # the columns before overhead_us keep their places; the wake columns were added after it
    assert CALL_FIELDS[-4:] == ("overhead_us", *WAKES) and all(k in CALL_FIELDS for k in BREAKDOWN_PARTS)


def test_rounds_interleave_designs_and_each_ratio_uses_its_own_rounds_bare(
    small_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--model", str(small_model), "--seconds", "0.3", "--samplers", "2"]
    code = main([*argv, "--traffic", "", "--rounds", "2", "--json", str(out), "--no-progress"])
    report = json.loads(out.read_text())
    assert code == 0, report["verdicts"]
    seq = [(r["label"], r["round"]) for r in report["results"]]
    assert seq == [("bare (limit)", 1), ("served x2", 1), ("bare (limit)", 2), ("served x2", 2)]
    for bare, served in (report["results"][0:2], report["results"][2:4]):
        assert served["ratio_to_bare"] == pytest.approx(served["samples_per_s"] / bare["samples_per_s"])
        assert served["fifo_switches_per_call"] is not None and served["fifo_switches_per_call"] >= 0
    text = capsys.readouterr().out
    assert "served/bare per round" in text and "served x2 #2" in text


def test_verdicts_decide_ratio_targets_on_the_median_of_rounds() -> None:
    from lowtail.benchmarks.serve_report import verdicts
    from lowtail.benchmarks.serve_run import DesignResult

    rows = []
    for rnd, ratio in enumerate((0.99, 0.96, 0.90), start=1):
        rows.append(DesignResult("bare", 0, 16, round=rnd))
        rows.append(DesignResult("served", 2, 16, ratio_to_bare=ratio, round=rnd))
    (line,) = verdicts(rows, 16)
    assert line.startswith(
        "served x2 >= 95% of bare at batch 16: met"
    )  # the median 0.96, not the last round's 0.90
    assert "median of 3 rounds, 0.900-0.990" in line
    rows[3].ratio_to_bare = 0.80  # round 2: 0.99, 0.80, 0.90 has the median 0.90
    assert "NOT met (0.900" in verdicts(rows, 16)[0]


def test_the_worker_overhead_target_is_graded_without_the_wakes_of_parked_samplers() -> None:
    from lowtail.benchmarks.serve_report import targets
    from lowtail.benchmarks.serve_run import DesignResult
    from lowtail.telemetry.percentiles import Percentiles

    def served(**us: list[float]) -> DesignResult:
        r = DesignResult("served", 4, 16, ratio_to_bare=0.9)
        r.breakdown_us = {k: Percentiles.of(np.array(v)) for k, v in us.items()}
        return r

    # 35 us p50 with the wakes, 15 without: met, and the figure gives both and the wakes
    three = {"overhead_us": 35.0, "wake_us": 20.0, "woken": 1.0, "overhead_less_wakes_us": 15.0}
    rows = [DesignResult("bare", 0, 16), served(**{k: [v] * 3 for k, v in three.items()})]
    (got,) = [t for t in targets(rows, 16) if t["target"].startswith("worker overhead")]
    assert got["met"] is True and "without the wakes" in got["target"]
    assert (
        got["figure"].startswith("15.0 us p50 without the wakes")
        and "with the wakes 35.0 us p50" in got["figure"]
    )
    assert "the wakes 20.0 us p50" in got["figure"]
    # rows without the wake columns (an older worker) are graded with the wakes in, and say so
    rows[1] = served(overhead_us=[35.0] * 3)
    (got,) = [t for t in targets(rows, 16) if t["target"].startswith("worker overhead")]
    assert got["met"] is False and "wakes not reported: included" in got["figure"]


def test_a_truncated_model_is_a_clean_error_and_the_json_says_so(
    small_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(small_model, broken)
    (weights,) = broken.glob("*.bin")
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 3])
    out = tmp_path / "serve.json"
    assert main(["bench", "serve", "--model", str(broken), "--seconds", "0.3", "--json", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"lowtail bench serve: --model {broken}: OpenVINO cannot read" in err
    assert "Incorrect weights in bin file" in err and "Traceback" not in err
    report = json.loads(out.read_text())
    assert (
        report["complete"] is False and report["results"] == [] and "OpenVINO cannot read" in report["error"]
    )
    assert (report["schema"], report["schema_version"]) == ("lowtail.bench.serve", 1)


def test_ctrl_c_leaves_a_partial_report_marked_as_such(small_model: Path, tmp_path: Path) -> None:
    import sys
    import time

    out = tmp_path / "serve.json"
    argv = [sys.executable, "-m", "lowtail.cli.main", "bench", "serve", "--model", str(small_model)]
    argv += ["--seconds", "3", "--samplers", "1,2", "--traffic", "", "--json", str(out)]
    proc = subprocess.Popen(
        argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stderr is not None
    seen = []
    try:
        while True:  # the bar logs each design as it starts (not a terminal: one line each)
            line = proc.stderr.readline()
            seen.append(line)
            if not line or "served x1" in line:
                break
        time.sleep(2.0)  # the worker compiles, the samplers measure
        # Once: one that lands while the parent spawns a child (node.signals.deaf_to_ctrl_c) is held
        # until the child is started, not lost.
        os.killpg(proc.pid, signal.SIGINT)
        stdout, err = proc.communicate(timeout=120)
    finally:
        _end(proc)
    err = "".join(seen) + err
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    report = json.loads(out.read_text())
    assert report["interrupted"] is True and report["complete"] is False
    assert report["verdicts"][0].startswith("INTERRUPTED: a partial run")
    assert [r["label"] for r in report["results"]][:1] == ["bare (limit)"]  # what finished is kept
    assert "served x2" not in [r["label"] for r in report["results"]]
    assert "INTERRUPTED" in stdout


def _end(proc: subprocess.Popen[str]) -> None:
    """A step of the test failed with the run still going: Ctrl-C it, then kill what is left, and
    remove the segments it named after itself, so a failing test leaves nothing behind."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    for name in os.listdir("/dev/shm"):
        if f".{proc.pid}." in name:
            os.unlink(f"/dev/shm/{name}")


# -- the samplers' own CPU, the model-size ladder, one round trip by stage ---------------------------


def test_sampler_cpu_target_is_decided_only_for_samplers_that_shared_their_cpu() -> None:
    from lowtail.benchmarks.serve_report import targets
    from lowtail.benchmarks.serve_run import DesignResult

    def traffic(cpu_us: float, spin_us: int) -> list[DesignResult]:
        served = DesignResult("traffic 16x1", 16, 1, ratio_to_bare=0.9, sampler_cpu_us_per_request=cpu_us)
        served.sampler_spin_us, served.sampler_spin_reason = spin_us, "why"
        return [DesignResult("bare", 0, 16), served]

    def cpu_target(rows: list[DesignResult]) -> dict[str, object]:
        return next(t for t in targets(rows, 16) if t["target"].startswith("sampler CPU"))

    assert cpu_target(traffic(12.0, 0))["met"] is True
    assert cpu_target(traffic(35.0, 0))["met"] is False
    spun = cpu_target(traffic(12.0, 200))  # a client that spun had a CPU of its own: not this case
    assert spun["met"] is None and "spun" in str(spun["why"])


def test_traffic_limits_give_the_ceilings_the_host_allows_and_the_target_cites_them() -> None:
    from lowtail.benchmarks.serve_report import targets, traffic_limits
    from lowtail.benchmarks.serve_run import DesignResult
    from lowtail.telemetry.percentiles import Percentiles

    # a bare call of 16 every 800 us; batches of 8 in 0.5 ms; 50 us of sampler CPU per request on 1 CPU
    bare = DesignResult("bare", 0, 16, samples_per_s=20_000.0)
    run = DesignResult("traffic 16x1", 16, 1, samples_per_s=9_000.0, ratio_to_bare=0.45)
    run.engine_ms_mean, run.engine_batch_mean = 0.5, 8.0
    run.sampler_cpu_us_per_request, run.sampler_cpu_count, run.sampler_spin_us = 50.0, 1, 0
    assert "worker" not in traffic_limits(run, bare)  # without the per-stage figures
    run.overhead_us_mean = 150.0  # of which the claim (its wait included) is 50 us on average
    run.breakdown_us = {"claim_us": Percentiles.of([40.0, 60.0])}
    lim = traffic_limits(run, bare)
    assert lim["batches"] == pytest.approx(0.8)  # 16,000 samples/s of infer() at batch 8
    assert lim["worker"] == pytest.approx(8 / 600e-6 / 20_000)  # 500 us of infer() + 100 us of work
    assert lim["sampler_cpu"] == pytest.approx(1.0)  # 20,000 requests/s of sampler CPU
    assert lim["full_batches"] == pytest.approx(0.5)  # 800 / (800 + 16 * 50)
    assert lim["sampler_us_for_target"] == pytest.approx(800 * (1 / 0.85 - 1) / 16)
    run.sampler_cpu_count = 2  # two CPUs resubmit the 16 in half the time
    assert traffic_limits(run, bare)["full_batches"] == pytest.approx(800 / 1200)
    run.sampler_cpu_count = 1
    lone = traffic_limits(dataclasses.replace(run, samplers=1), bare)  # 1 request never fills 16
    assert "full_batches" not in lone and "sampler_us_for_target" not in lone
    assert lone["batches"] == pytest.approx(0.8)
    run.limits = lim
    (got,) = (t for t in targets([bare, run], 16) if t["target"].startswith("traffic 16x1"))
    assert got["met"] is False and "0.50 with full batches" in got["figure"]
    assert "0.80 from the engine at its batches of 8.0 (0.67 adding the worker's" in got["figure"]
    assert got["limits"] == [lim]
    for missing in ("engine_ms_mean", "engine_batch_mean", "sampler_cpu_us_per_request"):
        assert traffic_limits(dataclasses.replace(run, **{missing: float("nan")}), bare) == {}
    assert traffic_limits(dataclasses.replace(run, sampler_cpu_count=0), bare) == {}
    assert traffic_limits(run, dataclasses.replace(bare, samples_per_s=float("nan"))) == {}


def _ladder_row(calibrated_ms: float, ratio: float, error: str = "") -> dict[str, object]:
    return {
        "calibrated_ms": calibrated_ms,
        "model_ms": calibrated_ms,
        "served_vs_bare": ratio,
        "overhead_us": 30.0,
        "overhead_share": 0.01,
        "bare_infer_ms": calibrated_ms,
        "served_infer_ms": calibrated_ms * 1.1,
        "error": error,
    }


def test_ladder_targets_are_met_not_met_or_not_decided() -> None:
    from lowtail.benchmarks.serve_ladder import ladder_targets

    got = ladder_targets([_ladder_row(0.1, 0.5), _ladder_row(1.1, 0.96), _ladder_row(16.0, 0.98)])
    assert [t["met"] for t in got] == [False, True]  # 0.98 < 0.99 at 16 ms; 0.96 >= 0.95 at 1.1 ms
    got = ladder_targets([_ladder_row(0.1, 0.5), _ladder_row(3.0, 0.99)])  # neither size was measured
    assert [t["met"] for t in got] == [None, None] and "within 1.5x" in got[0]["why"]
    got = ladder_targets([_ladder_row(16.6, float("nan"), "worker failed"), _ladder_row(1.0, 0.97)])
    assert got[0]["met"] is None and got[0]["why"] == "its run failed" and got[1]["met"] is True
    # a bare loop that ran at half speed (the host changed between the runs) decides nothing
    slow_bare = _ladder_row(16.6, 1.8) | {"bare_infer_ms": 14.2, "served_infer_ms": 7.6}
    got = ladder_targets([slow_bare, _ladder_row(1.0, 0.97)])
    assert got[0]["met"] is None and "the host changed between the runs" in got[0]["why"]


def test_ladder_row_is_the_median_round_and_a_failed_round_is_not_outvoted() -> None:
    from lowtail.benchmarks.serve_ladder import ladder_rows, ladder_table, ladder_targets
    from lowtail.benchmarks.serve_run import DesignResult

    def round_of(rnd: int, ratio: float, infer_ms: float, error: str = "") -> list[DesignResult]:
        bare = DesignResult("bare", 0, 16, engine_ms_mean=16.0, size="16.6 ms", round=rnd)
        served = DesignResult("served", 4, 16, ratio_to_bare=ratio, engine_ms_mean=infer_ms, size="16.6 ms")
        served.round, served.error, served.overhead_us_mean = rnd, error, 100.0
        return [bare, served]

    size = {"tag": "16.6 ms", "target_ms": 16.6, "hidden": [3864] * 3, "measured_ms": 16.9}
    results = round_of(1, 0.991, 16.1) + round_of(2, 0.962, 16.2) + round_of(3, 0.995, 16.3)
    (row,) = ladder_rows(results, [size])
    # the median round's own figures (round 1), not the best round's nor a mix of rounds
    assert row["served_vs_bare"] == 0.991 and row["served_infer_ms"] == 16.1
    assert row["rounds"] == [0.991, 0.962, 0.995]
    (at_predecessor, _) = ladder_targets([row])
    assert at_predecessor["met"] is True and "median of 3 rounds, 0.962-0.995" in at_predecessor["figure"]
    assert "3: 0.962-0.995" in ladder_table([row])[2][0]
    # an even count takes the lower middle: two rounds never round a target up
    (row,) = ladder_rows(round_of(1, 0.995, 16.1) + round_of(2, 0.985, 16.2), [size])
    assert row["served_vs_bare"] == 0.985
    # a failed round reaches the row with its error, whatever the others measured
    failed = (
        round_of(1, 0.999, 16.1) + round_of(2, float("nan"), 16.2, "worker died") + round_of(3, 0.999, 16.0)
    )
    (row,) = ladder_rows(failed, [size])
    assert row["error"] == "worker died" and ladder_targets([row])[0]["met"] is None


def test_bench_serve_model_ladder_measures_each_size_and_its_stages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "ladder.json"
    argv = ["bench", "serve", "--model-ms", "0.3", "--seconds", "0.5", "--breakdown", "--no-progress"]
    argv += ["--rounds", "2"]
    code = main(
        [*argv, "--json", str(out), "--png", str(tmp_path / "l.png"), "--html", str(tmp_path / "l.html")]
    )
    report = json.loads(out.read_text())
    assert code == 0, report["verdicts"]
    # two rounds, each the bare loop then served x4, each round's ratio against its own bare loop
    labels = [(r["label"], r["round"]) for r in report["results"]]
    one_round = ["bare (limit) @0.3 ms", "served x4 @0.3 ms"]
    assert labels == [(label, rnd) for rnd in (1, 2) for label in one_round]
    assert report["ladder"]["rounds"] == 2
    (size,) = report["ladder"]["sizes"]
    assert size["hidden"] == [size["width"]] * 3 and size["measured_ms"] > 0 and size["steps"]
    (row,) = report["ladder"]["rows"]
    ratios = [
        r["samples_per_s"] / report["results"][i - 1]["samples_per_s"]
        for i, r in enumerate(report["results"])
        if i % 2
    ]
    assert row["rounds"] == pytest.approx(ratios)
    served = report["results"][1 if ratios[0] <= ratios[1] else 3]  # the lower middle of two rounds
    assert row["served_vs_bare"] == pytest.approx(served["ratio_to_bare"])
    assert 0 < row["overhead_share"] < 1 and row["n"] == served["latency_ms"]["n"] > 0
    # the two ladder targets come first; neither 1 ms nor 16.6 ms was measured: not decided
    ladder_t = [t for t in report["targets_met"] if "a model of" in t["target"]]
    assert [t["met"] for t in ladder_t] == [None, None]
    assert (
        report["verdicts"][0].startswith("served x4 >= 99% of bare")
        and "not decided" in report["verdicts"][0]
    )
    # one round trip by stage: every stage measured for every request, each non-negative
    stages = served["stages_us"]
    assert list(stages) == [
        "copy_in_us",
        "to_claim_us",
        "worker_us",
        "compute_us",
        "to_client_us",
        "copy_out_us",
    ]
    assert all(p["n"] == served["latency_ms"]["n"] and p["p50"] >= 0 for p in stages.values())
    assert stages["compute_us"]["mean"] > 0
    # the stages lie inside the sampler's round trip
    assert sum(p["mean"] for p in stages.values()) <= served["latency_ms"]["mean"] * 1000 * 1.01
    assert (tmp_path / "l.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    page = (tmp_path / "l.html").read_text()
    assert "model-size ladder" in page and "one round trip by stage" in page and "<img" in page
    text = capsys.readouterr().out
    assert "model-size ladder" in text and "one round trip by stage" in text


def test_bench_serve_rejects_bad_ladders(small_model: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serve", "--model-ms", "1,fast"]) == 2
    assert "--model-ms '1,fast': 'fast' is not a number" in capsys.readouterr().err
    assert main(["bench", "serve", "--model-ms", "0"]) == 2
    assert "0 ms is outside 0.01..200" in capsys.readouterr().err
    assert main(["bench", "serve", "--model-ms", "1", "--model", str(small_model)]) == 2
    assert "without --model" in capsys.readouterr().err


def test_compare_spin_runs_each_design_parked_and_spinning_in_the_same_round(
    small_model: Path, tmp_path: Path
) -> None:
    out = tmp_path / "spin.json"
    argv = ["bench", "serve", "--model", str(small_model), "--seconds", "0.3", "--samplers", "2"]
    code = main([*argv, "--traffic", "", "--compare-spin-us", "300", "--json", str(out), "--no-progress"])
    report = json.loads(out.read_text())
    assert code == 0, report["verdicts"]
    rows = report["results"]
    assert [r["label"] for r in rows] == ["bare (limit)", "served x2", "served x2 @spin 300 us"]
    parked, spun = rows[1], rows[2]
    # this test's samplers share CPUs that no kernel isolated: by default they park
    assert parked["sampler_spin_us"] == 0 and "park" in parked["sampler_spin_reason"]
    assert spun["sampler_spin_us"] == 300 and spun["sampler_spin_reason"] == "spin_us=300 given"
    assert spun["ratio_to_bare"] == pytest.approx(spun["samples_per_s"] / rows[0]["samples_per_s"])
    assert report["settings"]["compare_spin_us"] == 300
    # the targets are decided on the default rows only
    assert [t["target"] for t in report["targets_met"] if "x2" in t["target"]] == [
        "served x2 >= 95% of bare at batch 16"
    ]


def test_compare_two_phase_runs_each_design_with_both_sampler_calls_and_their_stages(
    small_model: Path, tmp_path: Path
) -> None:
    """Samplers make the one call (``infer_or_pending``) by default, and with --compare-two-phase the
    same design runs again with ``start``/``finish``: both with every stage of the round trip."""
    out = tmp_path / "calls.json"
    argv = [
        "bench",
        "serve",
        "--model",
        str(small_model),
        "--seconds",
        "0.3",
        "--samplers",
        "2",
        "--traffic",
        "",
    ]
    code = main([*argv, "--compare-two-phase", "--breakdown", "--json", str(out), "--no-progress"])
    report = json.loads(out.read_text())
    assert code == 0, report["verdicts"]
    rows = report["results"]
    assert [r["label"] for r in rows] == ["bare (limit)", "served x2", "served x2 @two-phase"]
    assert report["settings"]["sampler_call"] == "one-call" and report["settings"]["compare_two_phase"]
    for row in rows[1:]:
        assert not row["error"] and row["sampler_costs"]["vol_cs"] > 0
        stages = row["stages_us"]
        assert all(p["n"] == row["latency_ms"]["n"] and p["p50"] >= 0 for p in stages.values())
        assert stages["compute_us"]["mean"] > 0 and stages["copy_in_us"]["mean"] > 0
        assert sum(p["mean"] for p in stages.values()) <= row["latency_ms"]["mean"] * 1000 * 1.01
    assert [t["target"] for t in report["targets_met"] if "x2" in t["target"]] == [
        "served x2 >= 95% of bare at batch 16"
    ]
