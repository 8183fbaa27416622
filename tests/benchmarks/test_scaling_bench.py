"""``lowtail bench lanes`` and ``lowtail bench ndslot`` end to end, briefly: the report, never the speed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowtail.cli.main import main


def test_bench_lanes_reports_round_trip_and_claim_cost_per_configuration(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out, png = tmp_path / "lanes.json", tmp_path / "lanes.png"
    argv = ["bench", "lanes", "--duration", "0.2", "--lanes", "1,16", "--active", "1,2"]
    assert main([*argv, "--json", str(out), "--png", str(png)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["lanes"], r["active"]) for r in rows] == [(1, 1), (16, 1), (16, 2)]  # 2 active need 2 lanes
    for r in rows:
        assert not r["error"]
        assert r["rtt_us"]["n"] > 0 and r["rtt_us"]["p50"] > 0
        # every answered request went through a claimed batch: warm-up, idle lanes' one request, measured
        assert r["claim_us"]["n"] >= 1 and r["claim_us"]["p50"] >= 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "idle lanes must not cost" in capsys.readouterr().out


def test_bench_ndslot_compares_request_throughput_with_a_numpy_copy(tmp_path: Path) -> None:
    out = tmp_path / "nd.json"
    argv = ["bench", "ndslot", "--duration", "0.1", "--sizes-kib", "64,1024", "--json", str(out)]
    assert main([*argv, "--png", str(tmp_path / "nd.png")]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["kib"] for r in rows] == [64, 1024]
    for r in rows:
        assert not r["error"]
        assert r["ndslot"]["n"] >= 5 and r["numpy_copy"]["n"] >= 5
        assert r["ratio"] == pytest.approx(r["ndslot"]["gbps_median"] / r["numpy_copy"]["gbps_median"])


def test_scaling_benches_reject_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "lanes", "--lanes", "0,300"]) == 2
    assert "--lanes '0,300'" in capsys.readouterr().err
    assert main(["bench", "ndslot", "--sizes-kib", "x"]) == 2
    assert "--sizes-kib 'x'" in capsys.readouterr().err
