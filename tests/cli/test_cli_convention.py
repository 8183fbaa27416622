"""One CLI convention across every command (lowtail.options): --json FILE or '-', the same flag names
for the same things, defaults in --help, --no-progress where progress is drawn, errors prefixed with the
subcommand, output paths checked before any work, and a --help that does not import numpy."""

from __future__ import annotations

import argparse
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from lowtail.cli.main import build_parser, main

# Commands that draw a progress bar (lowtail.render.progress) must offer --no-progress.
PROGRESS_COMMANDS = {"lowtail validate", "lowtail demo ray", "lowtail bench queue", "lowtail bench serve"}
# One name per meaning; the old spellings stay as aliases of the canonical one.
CANONICAL = {"--png": "--plot", "--duration": "--seconds", "--n": "--samples"}


def _loaded(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    """A benchmark subparser is a placeholder until chosen: parse its --help to load the real one."""
    with pytest.raises(SystemExit):
        parser.parse_args([*name.split()[1:], "--help"])
    return parser


def _bench_names(parser: argparse.ArgumentParser) -> list[str]:
    bench = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices["bench"]
    return list(next(a for a in bench._actions if isinstance(a, argparse._SubParsersAction)).choices)


def all_parsers() -> Iterator[argparse.ArgumentParser]:
    """Every parser and subparser, each benchmark's real one included (not its placeholder)."""
    parser = build_parser()
    for name in _bench_names(parser):
        _loaded(parser, f"lowtail bench {name}")
    stack = [parser]
    while stack:
        p = stack.pop()
        yield p
        for action in p._actions:
            if isinstance(action, argparse._SubParsersAction):
                stack.extend(action.choices.values())


def options(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {s: a for a in p._actions for s in a.option_strings}


def test_every_json_option_takes_a_file_or_dash(capsys: pytest.CaptureFixture[str]) -> None:
    seen = []
    for p in all_parsers():
        json_opt = options(p).get("--json")
        if json_opt is None:
            continue
        seen.append(p.prog)
        assert json_opt.nargs is None and json_opt.metavar == "FILE", p.prog
        assert json_opt.type is not None and json_opt.type("-") == "-", p.prog
    capsys.readouterr()
    assert {"lowtail topology", "lowtail plan", "lowtail validate", "lowtail bench queue"} <= set(seen)


def test_one_name_per_meaning_old_spellings_are_aliases() -> None:
    for p in all_parsers():
        opts = options(p)
        for old, new in CANONICAL.items():
            if old in opts:
                assert new in opts[old].option_strings, f"{p.prog}: {old} without {new}"


def test_progress_can_be_turned_off_wherever_it_is_drawn() -> None:
    with_flag = {p.prog for p in all_parsers() if "--no-progress" in options(p)}
    assert with_flag >= PROGRESS_COMMANDS


def test_help_shows_defaults(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["validate", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: /dev/shm)" in out and "(default: auto)" in out
    assert "bytes the runtime needs in /dev/shm (default: 0)" in out  # 0 == False must not hide it
    with pytest.raises(SystemExit):
        main(["demo", "ray", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "(default: False)" not in out  # an off switch says nothing by showing it


def test_unwritable_json_path_fails_before_any_probe_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["validate", "--json", str(tmp_path / "nonexistent" / "r.json")])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert "lowtail validate: error: argument --json" in err and "does not exist" in err


@pytest.mark.parametrize(
    "argv",
    [
        ["validate", "--html", "/etc/hostname/report.html"],
        ["bench", "queue", "--plot", "/nonexistent/q.png"],
        ["demo", "ray", "--json", "/nonexistent/d.json"],
        ["topology", "--json", "/"],
    ],
)
def test_bad_output_paths_are_usage_errors(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    assert "error: argument" in capsys.readouterr().err


def test_only_json_may_write_to_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "serve", "--plot", "-"])
    assert exc.value.code == 2
    assert "only accepted by --json" in capsys.readouterr().err


def test_errors_name_the_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "queue", "--transports", "carrier_pigeon"]) == 2
    assert capsys.readouterr().err.startswith("lowtail bench queue: --transports 'carrier_pigeon'")


def test_json_dash_prints_only_json(
    machine_roots: dict[str, tuple[Path, Path]], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    s, p = machine_roots["epyc_1s_nps1"]
    assert main(["plan", "--sysfs-root", str(s), "--procfs-root", str(p), "--json", "-"]) == 0
    assert capsys.readouterr().out.lstrip().startswith("{")
    out = tmp_path / "plan.json"
    assert main(["plan", "--sysfs-root", str(s), "--procfs-root", str(p), "--json", str(out)]) == 0
    assert "Kernel arguments" in capsys.readouterr().out and out.read_text().startswith("{")


@pytest.mark.parametrize("argv", [["--help"], ["--version"], ["bench", "--help"]])
def test_help_and_version_do_not_import_numpy_ray_or_openvino(argv: list[str]) -> None:
    # The startup cost is what a lazy import removes; timing it here would be a latency assertion.
    code = (
        "import sys\nfrom lowtail.cli.main import main\n"
        f"try:\n    main({argv!r})\nexcept SystemExit:\n    pass\n"
        "print(sorted(m for m in ('numpy', 'ray', 'openvino', 'matplotlib') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize(
    ("argv", "prog"),
    [
        (["validate", "--bogus"], "lowtail validate"),
        (["bench", "queue", "--bogus", "x"], "lowtail bench queue"),
        (["shm", "ls", "--bogus"], "lowtail shm ls"),
        (["compare", "a.json", "b.json", "--bogus"], "lowtail compare"),
    ],
)
def test_an_unknown_flag_is_reported_by_its_subcommand(
    argv: list[str], prog: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2 and f"{prog}: error: unrecognized arguments: --bogus" in err
    assert err.startswith(f"usage: {prog}")  # its own usage, not the top-level one


@pytest.mark.parametrize(
    ("argv", "near"),
    [(["valdate"], "'validate'"), (["bench", "queu"], "'queue'"), (["tb-reprot"], "'tb-report'")],
)
def test_a_mistyped_command_gets_the_nearest_one(
    argv: list[str], near: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2 and f"did you mean {near}?" in err


def test_a_command_nothing_like_any_gets_no_guess(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        build_parser().parse_args(["zzz"])
    assert "did you mean" not in capsys.readouterr().err
