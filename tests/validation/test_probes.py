"""Probes on this machine's real kernel. Nothing here asserts a latency is low (the machine is shared and
noisy); the hog test asserts that a stall is detected, which is behaviour."""

from __future__ import annotations

import importlib
import importlib.util
import json
import shutil
from collections.abc import Callable
from pathlib import Path
from subprocess import Popen

import pytest

from lowtail.validation.check import Status, histogram_stats, tail_stats
from lowtail.validation.probes import ProbeOptions, probe_deschedule, probe_timer
from lowtail.validation.rttests import cyclictest_cmd, oslat_cmd, parse_cyclictest, parse_oslat, probe_rt_test
from lowtail.validation.runtime_probes import probe_numa, probe_shm_rtt
from tests.validation.conftest import PROBE_CPU

DATA = Path(__file__).parent / "data"


def test_a_cpu_hog_on_the_probed_cpu_makes_deschedule_fail(hog: Callable[[int], Popen[bytes]]) -> None:
    hog(PROBE_CPU)
    # 3000 samples of ~100 us: with a hog sharing the CPU, the scheduler switches every few ms, so about
    # one sample in thirty waits a whole slice (>= 1 ms) -- far more than the 0.1 % a p99.9 tolerates.
    check = probe_deschedule(ProbeOptions(cpus=frozenset({PROBE_CPU}), samples=3000, progress=False))
    assert check.status is Status.FAIL, check.evidence
    stats = check.data["per_cpu"][str(PROBE_CPU)]
    assert stats["n"] == 3000
    assert stats["p999"] > 1.0
    # The scheduler saw it too: the thread waited runnable, and was switched out involuntarily.
    assert stats["run_delay_ms"] > 1.0
    assert stats["nonvoluntary_switches"] > 0
    assert check.reason.startswith(f"deschedule p99.9 {check.value:.4g} ms on CPU {PROBE_CPU} (n=3000")


def test_deschedule_reports_every_sample_with_n_and_max() -> None:
    check = probe_deschedule(ProbeOptions(cpus=frozenset({PROBE_CPU}), samples=500, progress=False))
    assert check.status in (Status.PASS, Status.WARN, Status.FAIL)
    stats = check.data["per_cpu"][str(PROBE_CPU)]
    assert stats["n"] == 500 == len(check.samples[PROBE_CPU])
    assert stats["p50"] <= stats["p99"] <= stats["p999"] <= stats["max"] == max(check.samples[PROBE_CPU])
    assert check.value == stats["p999"]
    assert "over" in stats and "run_delay_ms" in stats and "steal_ms" in stats


def test_timer_probe_measures_wakeups_on_the_pinned_cpu() -> None:
    check = probe_timer(
        ProbeOptions(cpus=frozenset({PROBE_CPU}), samples=500, interval_us=200, progress=False)
    )
    stats = check.data["per_cpu"][str(PROBE_CPU)]
    assert stats["n"] == 500
    assert 0 <= stats["p50"] <= stats["max"]
    assert "timer slack 1 ns" in check.evidence[0]


def _expand(hist: dict[str, int]) -> list[float]:
    return [int(k) / 1000 for k, v in sorted(hist.items(), key=lambda kv: int(kv[0])) for _ in range(v)]


def test_cyclictest_json_from_this_machine_is_parsed() -> None:
    doc = json.loads((DATA / "cyclictest-kvm-2vcpu.json").read_text())
    assert "cmdline:" in doc  # rt-tests' keys with a colon
    per_cpu = parse_cyclictest(doc)
    t = doc["thread"]["0"]
    s = per_cpu[1]
    assert s["n"] == t["cycles"] == 8613
    assert s["overflows"] == t["cycles"] - sum(t["histogram"].values()) == 78
    assert s["max"] == t["max"] / 1000
    # 78 of 8613 beyond the 400 us histogram: the p99.9 is among them, reported as the maximum.
    assert s["p999"] == s["max"]
    samples = _expand(t["histogram"]) + [t["max"] / 1000] * 78
    assert s["p50"] == tail_stats(samples)["p50"]


def test_oslat_json_from_this_machine_is_parsed() -> None:
    doc = json.loads((DATA / "oslat-kvm-2vcpu.json").read_text())
    per_cpu = parse_oslat(doc)
    t = doc["thread"]["0"]
    s = per_cpu[t["cpu"]]
    assert s["n"] == sum(t["histogram"].values())
    assert s["max"] == t["max"] / 1000
    assert s["p50"] == 0.001  # 1 us buckets: the loop almost always comes round in 1 us


def test_histogram_percentiles_are_nearest_rank() -> None:
    hist = {"1": 998, "5": 1, "9": 1}
    s = histogram_stats(hist, 9)
    assert (s["n"], s["p50"], s["p999"], s["max"]) == (1000, 1, 5, 9)


def test_rt_tests_commands_pin_explicitly() -> None:
    ct = cyclictest_cmd(frozenset({2, 3}), 5, 0, Path("/x.json"), fifo=True)
    assert {"--duration=5", "--affinity=2-3", "--threads=2", "--mainaffinity=0", "--default-system"} <= set(
        ct
    )
    assert oslat_cmd(frozenset({2, 3}), 5, 0, Path("/x.json"))[:7] == [
        "oslat",
        "-D",
        "5",
        "-c",
        "2-3",
        "-C",
        "0",
    ]


@pytest.mark.skipif(shutil.which("cyclictest") is None, reason="rt-tests not installed (.ci/run installs it)")
def test_cyclictest_runs_for_real_and_is_graded() -> None:
    from lowtail.validation.probes import DEFAULT_LIMITS

    check = probe_rt_test(
        "cyclictest",
        frozenset({PROBE_CPU}),
        duration_s=1,
        main_cpu=0,
        limits=DEFAULT_LIMITS["cyclictest"],
        fifo=False,
        progress_enabled=False,
    )
    assert check.status is not Status.SKIP
    stats = check.data["per_cpu"][str(PROBE_CPU)]
    assert stats["n"] > 1000  # 1 s at 200 us
    assert "--default-system" in check.evidence[0]


def test_shm_rtt_measures_the_queue_or_names_what_is_missing() -> None:
    check = probe_shm_rtt(ProbeOptions(cpus=frozenset({PROBE_CPU}), main_cpu=0, samples=300, progress=False))
    if importlib.util.find_spec("lowtail.shm.queue") is None:
        assert check.status is Status.SKIP
        assert "lowtail.shm.queue is not installed" in check.reason
    else:
        assert check.status is not Status.SKIP, check.reason
        # one client CPU measured (which one of the pair is the probe's choice), every sample kept
        assert [stats["n"] for stats in check.data["per_cpu"].values()] == [300]


def test_numa_probe_reads_where_a_bound_segments_pages_are() -> None:
    check = probe_numa(ProbeOptions(cpus=frozenset({PROBE_CPU}), main_cpu=0, progress=False))
    if importlib.util.find_spec("lowtail.shm.queue") is None:
        assert check.status is Status.SKIP
        assert "lowtail.shm.queue is not installed" in check.reason
        return
    # Placement is not a latency: a segment bound with mbind and pre-faulted has every page on its node.
    assert check.status is Status.PASS, check.evidence
    pages = check.data["pages"]
    assert pages and all(sum(p.values()) > 0 for p in pages.values())
    assert all(set(p) == {f"node{node}"} for node, p in pages.items())


def test_inference_probe_measures_the_pinned_worker_or_names_what_is_missing() -> None:
    from lowtail.validation.runtime_probes import probe_inference

    check = probe_inference(
        ProbeOptions(cpus=frozenset({PROBE_CPU}), main_cpu=0, samples=300, progress=False)
    )
    worker = importlib.util.find_spec("lowtail.serve.worker_process")
    if worker is None or not hasattr(
        importlib.import_module("lowtail.serve.worker_process"), "measure_pinned"
    ):
        assert check.status is Status.SKIP
        assert "lowtail.serve.worker_process" in check.reason
        return
    assert check.status is not Status.SKIP, check.reason
    stats = check.data["per_cpu"][str(PROBE_CPU)]
    assert stats["n"] == 300
    assert stats["wall_ms_p50"] <= stats["wall_ms_p999"] <= stats["wall_ms_max"]
    assert stats["threads"] >= 1 and "isolation" in stats
