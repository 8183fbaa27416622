"""-q/--quiet and -v/--verbose: on every parser, and doing what they say on a real command (the
deschedule probe of ``lowtail validate``: a progress bar, a note naming the JSON file, probe processes
started with a command line)."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from lowtail.cli.main import main
from tests.cli.test_cli_convention import all_parsers, options


def test_every_parser_has_quiet_and_verbose() -> None:
    progs = []
    for p in all_parsers():
        opts = options(p)
        progs.append(p.prog)
        assert {"-q", "--quiet", "-v", "--verbose"} <= set(opts), p.prog
        assert opts["-q"] is opts["--quiet"] and opts["-v"] is opts["--verbose"], p.prog
        assert opts["-q"].dest == opts["-v"].dest == "verbosity", p.prog
    assert {
        "lowtail",
        "lowtail validate",
        "lowtail bench queue",
        "lowtail demo ray",
        "lowtail shm ls",
    } <= set(progs)


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        (["-q", "shm", "ls"], -1),
        (["shm", "ls", "-q"], -1),
        (["shm", "ls", "--verbose"], 1),
        (["-v", "shm", "ls"], 1),  # a subcommand's parser must not reset what the top level set
        (["shm", "ls"], 0),
    ],
)
def test_quiet_and_verbose_are_read_wherever_they_are_given(argv: list[str], want: int) -> None:
    from lowtail.cli.main import build_parser
    from lowtail.options import verbosity

    assert verbosity(build_parser().parse_args(argv)) == want


def test_quiet_and_verbose_exclude_each_other(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["shm", "ls", "-q", "-v"])
    assert exc.value.code == 2 and "not allowed with argument" in capsys.readouterr().err


def _validate(tmp_path: Path, *flags: str) -> tuple[subprocess.CompletedProcess[str], dict[str, object]]:
    report = tmp_path / "r.json"
    cpu = max(os.sched_getaffinity(0))
    argv = ["validate", "--only", "deschedule", "--cpus", str(cpu), "--samples", "1000"]
    argv += ["--json", str(report), *flags]
    done = subprocess.run(
        [sys.executable, "-m", "lowtail.cli", *argv], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode in (0, 1), done.stderr
    return done, json.loads(report.read_text())


def test_quiet_prints_the_verdict_and_nothing_else(tmp_path: Path) -> None:
    loud, _ = _validate(tmp_path)
    assert "deschedule cpus" in loud.stderr and "JSON report:" in loud.stdout  # what -q must remove
    quiet, doc = _validate(tmp_path, "-q")
    assert quiet.stderr == ""
    assert "JSON report:" not in quiet.stdout
    assert "deschedule" in quiet.stdout  # the table with the verdict is still there
    assert doc["checks"]  # and the report is written


def test_verbose_logs_the_probe_commands(tmp_path: Path) -> None:
    done, _ = _validate(tmp_path, "-v")
    cpu = max(os.sched_getaffinity(0))
    assert f"lowtail.validation.probe_process deschedule --cpu {cpu} --samples 1000" in done.stderr
    assert "DEBUG" in done.stderr


def test_a_log_record_clears_the_progress_line_on_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    import io
    import logging

    from lowtail.render import console

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    tty = Tty()
    monkeypatch.setattr(sys, "stderr", tty)
    try:
        console.configure(console.VERBOSE)
        logging.getLogger("lowtail.test").debug("started %s", "x")
    finally:
        console.configure(console.NORMAL)
    assert tty.getvalue() == "\r\x1b[KDEBUG lowtail.test: started x\n"


def test_a_log_record_after_stderr_was_replaced_and_closed_goes_to_the_new_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A finished test's capture (or a host program's old stderr) is closed; the next record must not
    # fail flushing it (it did: the call recorder's slow_infer warning raised "I/O on closed file").
    import io
    import logging

    from lowtail.render import console

    old, new = io.TextIOWrapper(io.BytesIO(), encoding="utf-8"), io.StringIO()  # pytest's capture is a file
    console.configure(console.NORMAL)
    monkeypatch.setattr(sys, "stderr", old)
    logging.getLogger("lowtail.test").warning("first")
    old.close()
    monkeypatch.setattr(sys, "stderr", new)
    logging.getLogger("lowtail.test").warning("second")
    assert new.getvalue() == "WARNING lowtail.test: second\n"


def test_the_default_verbosity_does_not_touch_the_loggers_levels() -> None:
    # A host program's (or a test's) own logging keeps working after a lowtail command ran in-process.
    import logging

    from lowtail.render import console

    console.configure(console.QUIET)
    console.configure(console.NORMAL)
    assert logging.getLogger("lowtail").level == logging.NOTSET


def test_argparse_namespace_without_verbosity_is_the_default() -> None:
    from lowtail.options import verbosity

    assert verbosity(argparse.Namespace()) == 0
