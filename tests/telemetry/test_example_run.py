"""The example runs shipped for tb-report: what the generator writes today, and read as documented."""

from __future__ import annotations

from pathlib import Path

import pytest

from lowtail.cli.main import main
from lowtail.telemetry import example_run

SHIPPED = Path(__file__).resolve().parents[2] / "docs/tb-report-example"


def test_the_shipped_example_is_what_the_generator_writes(tmp_path: Path) -> None:
    written = example_run.write(tmp_path)
    assert sorted(p.relative_to(tmp_path) for p in written) == sorted(
        p.relative_to(SHIPPED) for p in SHIPPED.rglob("*tfevents*")
    )
    for p in written:
        assert p.read_bytes() == (SHIPPED / p.relative_to(tmp_path)).read_bytes(), p


def test_tb_report_reads_the_shipped_example_as_the_readme_shows(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tb-report", str(SHIPPED / "vmware"), str(SHIPPED / "baremetal")]) == 0
    out = capsys.readouterr().out
    assert "batch_recv_ms / learn_total_ms = 2615.9 / 2774.8 = 94.3%" in out
    assert "samples/s: mean 735.0" in out and "samples/s: mean 9000.0" in out
    readme = (SHIPPED.parents[1] / "README.md").read_text()
    assert "lowtail tb-report docs/tb-report-example/vmware docs/tb-report-example/baremetal" in readme
