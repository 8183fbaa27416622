"""compare refuses what is not a report it can read, as exit 2 with the file named, never a traceback."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from lowtail.cli.main import main


def _report(n: Any = 1000) -> dict[str, Any]:
    per_cpu = {"1": {"n": n}}
    data = {"all": {"ladder_worst_cpu": []}, "per_cpu": per_cpu}
    checks = [{"name": "deschedule", "status": "pass", "kind": "probe", "value": 0.1, "data": data}]
    return {"host": {"hostname": "h"}, "checks": checks, "summary": {"status": "pass"}}


HOSTILE = {
    "deep": "[" * 1_000_000,
    "digits": '{"host": {}, "checks": [], "summary": {"status": "pass"}, "x": ' + "7" * 5000 + "}",
    "overflow": json.dumps(
        {
            "host": {},
            "checks": [],
            "summary": {"status": "pass", "headline": {"p999_deschedule_ms": 1, "n": 10**400, "max_ms": 1}},
        }
    ),
}


@pytest.mark.parametrize("kind", sorted(HOSTILE))
def test_a_hostile_report_is_exit_2_naming_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], kind: str
) -> None:
    bad, good = tmp_path / "bad.json", tmp_path / "good.json"
    bad.write_text(HOSTILE[kind])
    good.write_text(json.dumps(_report()))
    assert main(["compare", str(good), str(bad)]) == 2
    err = capsys.readouterr().err
    assert str(bad) in err and "Traceback" not in err


def test_a_non_numeric_per_cpu_count_does_not_break_the_html_page(tmp_path: Path) -> None:
    before, after, page = tmp_path / "b.json", tmp_path / "a.json", tmp_path / "c.html"
    before.write_text(json.dumps(_report("many")))
    after.write_text(json.dumps(_report()))
    # 3: a report without intervals is not compared on its values (incomplete), never a crash
    assert main(["compare", str(before), str(after), "--html", str(page)]) in (0, 1, 3)
    assert "deschedule" in page.read_text()
