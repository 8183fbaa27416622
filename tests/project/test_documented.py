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
from tests.validation.test_verdicts import _report

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


def _exit_table() -> dict[str, set[int]]:
    rows = _table_rows((ROOT / "README.md").read_text(), "| command | exit status |")
    return {cmd.strip("`"): {int(n) for n in re.findall(r"(?<![\w.])(\d+) ", text)} for cmd, text in rows}


def test_the_readme_documents_each_commands_exit_statuses() -> None:
    assert _exit_table() == {
        "lowtail validate": {0, 1, 2, 130},
        "lowtail compare": {0, 1, 2, 3},
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
    nop = {"host": {"hostname": "n"}, "checks": [], "summary": {"status": "pass"}}  # validate --no-probes
    for name, doc in (
        ("good", _report("pass", 0.02)),
        ("bad", _report("fail", 5.0)),
        ("junk", {"a": 1}),
        ("nop", nop),
    ):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(doc))
    assert main(["compare", str(files["bad"]), str(files["good"])]) == 0
    assert main(["compare", str(files["good"]), str(files["bad"])]) == 1
    assert main(["compare", str(files["good"]), str(files["junk"])]) == 2
    assert main(["compare", str(files["good"]), str(files["nop"])]) == 3  # nothing measured after


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
    printed = capsys.readouterr().out
    # every bench names the files it wrote, after its table ('JSON report: FILE', docs/cli.md)
    assert printed.index("INTERRUPTED") < printed.index(f"JSON report: {out}"), printed


# ---- claims the docs make about the files and the play ---------------------------------------------


def test_every_shipped_example_report_starts_with_its_schema() -> None:
    """'Every JSON report starts with schema': the validate reports the docs ship as examples included."""
    examples = sorted((ROOT / "docs/validation-examples").glob("*.json"))
    assert examples
    for path in examples:
        doc = json.loads(path.read_text())
        assert isinstance(doc, dict) and list(doc)[:3] == ["schema", "schema_version", "lowtail_version"], (
            path
        )


def test_a_role_readme_that_says_site_yml_imports_a_playbook_is_right() -> None:
    site = (ROOT / "site.yml").read_text()
    for readme in sorted((ROOT / "roles").glob("*/README.md")):
        for playbook in re.findall(r"import_playbook:\s*(\S+)", readme.read_text()):
            assert f"import_playbook: {playbook}" in site, (readme, playbook)
    validate = (ROOT / "roles/lowtail_validate/README.md").read_text()
    assert (
        "`site.yml` does not import it" in validate and "import_playbook: playbooks/validate.yml" not in site
    )


def test_the_heat_strip_is_drawn_only_with_several_cpus_of_one_probe() -> None:
    """docs: 'a heat strip with several CPUs': shm_rtt's client CPU beside a one-CPU probe is not several."""
    from lowtail.validation import report
    from lowtail.validation.check import Limits
    from lowtail.validation.probes import grade

    one = grade("deschedule", {1: [0.01] * 3000}, Limits(0.1, 1.0), "deschedule")
    rtt = grade("shm_rtt", {0: [0.02] * 3000}, Limits(0.1, 1.0), "queue round trip")
    titles = [t for t, _ in report.figures([one, rtt])]
    assert not any(t.startswith("Per-CPU tail") for t in titles), titles
    two = grade("deschedule", {1: [0.01] * 3000, 2: [0.02] * 3000}, Limits(0.1, 1.0), "deschedule")
    assert any(t.startswith("Per-CPU tail") for t, _ in report.figures([two]))
    doc = (ROOT / "docs/validation.md").read_text()
    assert "heat strip" not in doc or "several CPUs" in doc


def test_the_readme_command_list_names_every_subcommand() -> None:
    """A command the README's list leaves out is one a reader never finds (tb-report was)."""
    block = (ROOT / "README.md").read_text().split("## The `lowtail` command", 1)[1].split("```")[1]
    listed = {line.split()[1] for line in block.splitlines() if line.startswith("lowtail ")}
    commands = {p.prog.split()[1] for p in all_parsers() if len(p.prog.split()) == 2}
    missing = commands - listed - {"--help"}
    assert not missing, missing


def test_the_design_names_every_module_of_our_own_in_library() -> None:
    """It said 'two modules of our own' when there were three: the names are listed, and checked."""
    design = " ".join((ROOT / "docs/design.md").read_text().split())
    sentence = design.split("plus the modules of our own in `library/`:", 1)[1].split(".", 1)[0]
    named = set(re.findall(r"`(\w+)`", sentence))
    assert named == {p.stem for p in (ROOT / "library").glob("*.py")}, sentence


def test_the_testing_doc_gives_no_test_count_that_drifts() -> None:
    """docs/testing.md once gave the fast set's size as a figure that was stale a day later."""
    testing = " ".join((ROOT / "docs/testing.md").read_text().split())
    at = testing.index('pytest --collect-only -q -m "not slow" | tail -1')
    around = testing[at - 300 : at + 200]
    assert not re.search(r"\d+ of \d+|\d+ tests|two thirds|half of the tests", around), around


def _report_after_table(out: str, path: Path, table_line: str, schema: str) -> None:
    """'The table is printed before any file is written', the file named, and the file starts with its
    schema stamp."""
    assert out.index(table_line) < out.index(f"JSON report: {path}"), out
    doc = json.loads(path.read_text())
    assert list(doc)[:3] == ["schema", "schema_version", "lowtail_version"], list(doc)[:5]
    assert doc["schema"] == f"lowtail.{schema}"


def test_every_report_starts_with_its_schema_and_is_named_after_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    shm = tmp_path / "shm"
    shm.mkdir()
    for action, line in (("ls", "lowtail segments in"), ("gc", "removed 0 segment(s)")):
        report = tmp_path / f"shm-{action}.json"
        assert main(["shm", action, "--dir", str(shm), "--json", str(report)]) == 0
        _report_after_table(capsys.readouterr().out, report, line, f"shm.{action}")

    report = tmp_path / "model.json"
    argv = [
        "model",
        "build",
        "--out",
        str(tmp_path / "m"),
        "--features",
        "8",
        "--hidden",
        "8",
        "--heads",
        "a:2",
    ]
    assert main([*argv, "--json", str(report)]) == 0
    _report_after_table(capsys.readouterr().out, report, "hidden layers:", "model.build")

    from tests.fixtures.machines import MACHINES, write_machine

    sys_root, proc_root = write_machine(tmp_path / "machine", MACHINES["epyc9634_2s"])
    roots = ["--sysfs-root", str(sys_root), "--procfs-root", str(proc_root)]
    for command, line in (("topology", "L3 groups"), ("plan", "Kernel arguments:")):
        report = tmp_path / f"{command}.json"
        assert main([command, *roots, "--json", str(report)]) == 0
        _report_after_table(capsys.readouterr().out, report, line, command)
    report = tmp_path / "tb.json"
    assert main(["tb-report", str(ROOT / "docs/tb-report-example/vmware"), "--json", str(report)]) == 0
    _report_after_table(capsys.readouterr().out, report, "learner waits for samples", "tb-report")

    from lowtail.demo import local

    class Result:  # the demo's figures are tested in tests/demo; here only what the command does with them
        samples = 1

        def to_dict(self) -> dict[str, Any]:
            return {"samples": 1}

    monkeypatch.setattr(local, "run_demo", lambda opts, progress: Result())
    monkeypatch.setattr(local, "render", lambda result: "demo table")
    report = tmp_path / "demo.json"
    assert main(["demo", "ray", "--seconds", "1", "--no-progress", "--json", str(report)]) == 0
    _report_after_table(capsys.readouterr().out, report, "demo table", "demo.ray")
