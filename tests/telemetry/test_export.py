"""TensorBoard and Prometheus export under the predecessor's names, read back the way a reader would."""

from __future__ import annotations

import math
import urllib.request
from pathlib import Path

import pytest

from lowtail.telemetry.export import (
    P999_DESCHEDULE_TAG,
    SAMPLES_PER_S_TAG,
    PrometheusExport,
    TensorBoardExport,
    WindowStats,
    scalars,
    window_stats,
)
from lowtail.telemetry.tfevents import read_scalars


def test_window_percentiles_are_nearest_rank_with_their_count() -> None:
    s = WindowStats.of(float(v) for v in range(1, 1001))
    assert (s.n, s.p50, s.p99, s.p999, s.max, s.mean) == (1000, 500.0, 990.0, 999.0, 1000.0, 500.5)
    empty = WindowStats.of([])
    assert empty.n == 0 and math.isnan(empty.p999)


def test_scalars_use_the_predecessors_tag_names() -> None:
    stats = window_stats(
        {
            "infer_exec_ms": [10.0, 20.0, 30.0],
            "deschedule_ms": [0.01, 0.02, 5.0],
            "batch_size": [8, 16],
            "x": [],
        }
    )
    tags = scalars(stats, samples_per_s=735.0)
    assert tags["sample_infos/sl_remote_infer_exec_ms"] == 20.0
    assert tags["sample_infos/sl_remote_infer_exec_max_ms"] == 30.0
    assert tags["sample_infos/sl_remote_infer_exec_p999_ms"] == 30.0
    assert tags["sample_infos/sl_remote_batch_size_max"] == 16.0
    assert tags[P999_DESCHEDULE_TAG] == 5.0 and P999_DESCHEDULE_TAG.endswith("/p999_deschedule_ms")
    assert tags[SAMPLES_PER_S_TAG] == 735.0
    assert not any("sl_remote_x" in t for t in tags)  # an empty series writes nothing, not NaN


def test_tensorboard_event_files_carry_the_tags(tmp_path: Path) -> None:
    tb = TensorBoardExport(tmp_path)
    for step in range(3):
        tb.write(step, scalars(window_stats({"deschedule_ms": [0.02 * (step + 1)]})))
    tb.close()
    assert tb.path == tmp_path / "model_dispatcher"
    got = read_scalars(tb.path)[P999_DESCHEDULE_TAG]
    assert got.steps == [0, 1, 2]
    assert got.values[2] == pytest.approx(0.06)


def test_prometheus_serves_the_gauges_on_its_port() -> None:
    prom = PrometheusExport(node="n1", port=0, addr="127.0.0.1")
    try:
        prom.update("infer:0:0", window_stats({"deschedule_ms": [0.5] * 999 + [470.0]}), samples_per_s=12.5)
        assert prom.port
        with urllib.request.urlopen(f"http://127.0.0.1:{prom.port}/metrics", timeout=5) as r:
            text = r.read().decode()
    finally:
        prom.close()
    assert 'lowtail_p999_deschedule_ms{node="n1",source="infer:0:0"} 0.5' in text
    assert 'lowtail_sl_remote_deschedule_ms{node="n1",source="infer:0:0",stat="max"} 470.0' in text
    assert 'lowtail_sl_remote_deschedule_ms{node="n1",source="infer:0:0",stat="n"} 1000.0' in text
    assert 'lowtail_sl_remote_samples_per_s{node="n1",source="infer:0:0"} 12.5' in text
