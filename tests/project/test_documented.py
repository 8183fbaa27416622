"""What the docs say about defaults and exit statuses is what the code does: the options table of
docs/validation.md against the parser, and the README's exit-status table against real runs."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest

from lowtail.cli.main import main
from tests.cli.test_cli_convention import all_parsers, options

ROOT = Path(__file__).resolve().parents[2]


def _table_rows(text: str, header: str) -> list[list[str]]:
    block = text[text.index(header) :]
    rows = []
    for line in block.splitlines()[2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip("|").split("|")])
    return rows


def test_every_documented_default_is_the_parsers() -> None:
    rows = _table_rows((ROOT / "docs/validation.md").read_text(), "| command | option | default |")
    assert len(rows) >= 10
    parsers = {p.prog: p for p in all_parsers()}
    for command, option, documented in rows:
        parser = parsers[f"lowtail {command.strip('`')}"]
        action = options(parser)[option.strip("`")]
        value = re.match(r"`([^`]*)`", documented)
        assert value, documented
        want = value.group(1)
        if isinstance(action.default, int | float):
            assert action.default == float(want), (command, option, action.default, want)
        elif action.default not in (None, []):
            assert str(action.default) == want, (command, option, action.default, want)
        # the default the user sees in --help is the documented one (computed defaults included)
        flat = " ".join(parser.format_help().split())
        shown = [w.rstrip(",") for w in re.findall(r"default: ([^\s;)]+)", flat)]
        assert want in shown or f"{want}.0" in shown, (command, option, want, shown)


def _report(status: str, value: float) -> dict[str, Any]:
    check = {"name": "deschedule", "kind": "probe", "status": status, "value": value, "unit": "ms"}
    return {"host": {"hostname": "n"}, "checks": [check], "summary": {"status": status}}


def _exit_table() -> dict[str, set[int]]:
    rows = _table_rows((ROOT / "README.md").read_text(), "| command | exit status |")
    return {cmd.strip("`"): {int(n) for n in re.findall(r"(?<![\w.])(\d+) ", text)} for cmd, text in rows}


def test_the_readme_documents_each_commands_exit_statuses() -> None:
    assert _exit_table() == {
        "lowtail validate": {0, 1, 2, 130},
        "lowtail compare": {0, 1, 2},
        "lowtail bench ...": {0, 1, 2, 130},
    }


def test_validate_exits_as_documented(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.fixtures.machines import MACHINES, write_machine

    s, p = write_machine(tmp_path, MACHINES["vmware_88_rt500"])
    roots = ["--sysfs-root", str(s), "--procfs-root", str(p)]
    assert main(["validate", *roots, "--only", "topology", "--allow-virtual"]) == 0
    assert main(["validate", *roots, "--only", "rt_budget"]) == 1
    assert main(["validate", *roots, "--only", "nonsense"]) == 2
    from lowtail.cli.commands import validate_cmd
    from lowtail.validation import runner

    real = runner.run

    def interrupted(opts: runner.Options) -> runner.Report:
        r = real(opts)
        r.summary["interrupted"] = True
        return r

    monkeypatch.setattr(validate_cmd, "run", interrupted)
    assert main(["validate", *roots, "--only", "topology", "--allow-virtual"]) == 130


def test_compare_exits_as_documented(tmp_path: Path) -> None:
    files = {}
    for name, doc in (("good", _report("pass", 0.02)), ("bad", _report("fail", 5.0)), ("junk", {"a": 1})):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(doc))
    assert main(["compare", str(files["bad"]), str(files["good"])]) == 0
    assert main(["compare", str(files["good"]), str(files["bad"])]) == 1
    assert main(["compare", str(files["good"]), str(files["junk"])]) == 2


def test_bench_exits_0_whatever_the_targets_unless_check() -> None:
    import argparse

    from lowtail.benchmarks.report import exit_code

    missed = [{"target": "t", "met": False}, {"target": "u", "met": None}]
    assert exit_code(argparse.Namespace(check=False), missed) == 0
    assert exit_code(argparse.Namespace(check=True), missed) == 1
    assert exit_code(argparse.Namespace(check=True), missed[1:]) == 0  # undecided is not a miss
    with_targets = {p.prog for p in all_parsers() if "--check" in options(p)}
    assert {"lowtail bench queue", "lowtail bench serve"} <= with_targets  # lanes/ndslot grade nothing
    assert main(["bench", "queue", "--transports", "carrier_pigeon"]) == 2


def test_bench_queue_interrupted_exits_130_with_a_partial_report(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lowtail.benchmarks import queue_bench

    def ctrl_c(*args: Any, **kwargs: Any) -> Any:
        raise KeyboardInterrupt

    monkeypatch.setattr(queue_bench, "measure", ctrl_c)
    out = tmp_path / "q.json"
    argv = ["bench", "queue", "--transports", "lowtail", "--samples", "100", "--no-progress"]
    assert main([*argv, "--json", str(out)]) == 130
    doc = json.loads(out.read_text())
    assert doc["interrupted"] is True and doc["complete"] is False and doc["transports"] == {}
    assert "INTERRUPTED" in capsys.readouterr().out
