"""``lowtail bench serve`` end to end on a tiny model: the report's shape, never its numbers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowtail.cli.main import main


def test_bench_serve_writes_table_json_and_plots(
    small_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "serve.json"
    argv = ["bench", "serve", "--model", str(small_model), "--duration", "0.5", "--samplers", "2"]
    code = main(
        [*argv, "--json", str(out), "--png", str(tmp_path / "s.png"), "--html", str(tmp_path / "s.html")]
    )
    assert code == 0
    report = json.loads(out.read_text())
    designs = [(r["design"], r["samplers"]) for r in report["results"]]
    assert designs == [("bare", 0), ("served", 2)]
    for r in report["results"]:
        assert r["samples"] > 0 and r["latency_ms"]["n"] > 0 and r["deschedule_ms"]["n"] > 0
        assert r["samples_per_s"] == pytest.approx(r["samples"] / r["duration_s"])
        assert r["engine_ms_mean"] > 0 and 0 < r["worker_busy"] <= 1.05 and r["overhead_us_mean"] >= 0
    assert report["best_ratio"] == max(r["ratio_to_bare"] for r in report["results"][1:])
    assert (tmp_path / "s.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "<img" in (tmp_path / "s.html").read_text()
    assert "served x2" in capsys.readouterr().out


def test_bench_serve_rejects_bad_options(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "serve", "--samplers", "1,x"]) == 2
    assert "--samplers '1,x'" in capsys.readouterr().err
    assert main(["bench", "serve", "--cpu", "4095"]) == 2
    assert "--cpu 4095" in capsys.readouterr().err
