"""``bench lanes`` and ``bench ndslot`` write a report page like the other benchmarks (the results table,
the plot, the settings and the host, the JSON folded away) and a stamped JSON."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from lowtail import __version__
from lowtail.cli.main import main


@pytest.mark.parametrize(
    ("argv", "header"),
    [
        (["bench", "lanes", "--seconds", "0.2", "--lanes", "1", "--active", "1"], "claim p50"),
        (["bench", "ndslot", "--seconds", "0.1", "--sizes-kib", "64"], "ndslot GB/s"),
    ],
)
def test_scaling_benches_write_an_html_report_and_stamped_json(
    argv: list[str], header: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    page, doc = tmp_path / "r.html", tmp_path / "r.json"
    assert main([*argv, "--html", str(page), "--json", str(doc), "-q"]) == 0
    report = json.loads(doc.read_text())
    name = argv[1]
    assert (report["schema"], report["schema_version"]) == (f"lowtail.bench.{name}", 1)
    assert report["lowtail_version"] == __version__
    html = page.read_text()
    assert f"lowtail bench {name}" in html and header in html
    assert re.search(r'<img [^>]*src="data:image/png;base64,', html)  # the plot, embedded
    assert "Settings" in html and "duration_s" in html and "Host" in html and "loadavg_before" in html
    assert "<details" in html  # the JSON folded away, not a page of it
    assert "Traceback" not in capsys.readouterr().err
