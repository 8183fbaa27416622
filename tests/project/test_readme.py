"""The README's commands and flags exist: every fenced `lowtail ...` line parses with the real parser,
every `make ...` target is known to make (`make -n`), every playbook it names is a file, and every
`--flag` it mentions belongs to some lowtail command (or to ansible-playbook)."""

from __future__ import annotations

import re
import shlex
import subprocess
from pathlib import Path

import pytest

from lowtail.cli.main import build_parser
from tests.cli.test_cli_convention import all_parsers, options

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
ANSIBLE_FLAGS = {"--check", "--diff", "--tags"}


def fenced_lines() -> list[list[str]]:
    """Each command line of the README's fenced blocks as tokens, comments dropped, venv prefix removed."""
    text = README.read_text()
    blocks = re.findall(r"^\s*```(?:sh|console|bash)?\n(.*?)^\s*```", text, flags=re.M | re.S)
    lines = []
    for block in blocks:
        for raw in block.splitlines():
            tokens = shlex.split(raw, comments=True)
            if tokens:
                tokens[0] = tokens[0].removeprefix(".venv/bin/")
                lines.append(tokens)
    return lines


def commands(program: str) -> list[list[str]]:
    return [t for t in fenced_lines() if t[0] == program]


def test_the_readme_shows_the_two_commands_and_the_cli() -> None:
    assert {"demo", "test"} <= {t[1] for t in commands("make")}
    assert len(commands("lowtail")) >= 5


@pytest.mark.parametrize("tokens", commands("lowtail"), ids=shlex.join)
def test_readme_lowtail_line_parses(
    tokens: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.chdir(tmp_path)  # output paths in the examples are relative: they must be creatable here
    parser = build_parser()
    try:
        args = parser.parse_args(tokens[1:])
    except SystemExit as e:  # --help and --version exit 0; a bad flag or subcommand exits 2
        assert e.code == 0, capsys.readouterr().err
        return
    assert callable(args.func)


@pytest.mark.parametrize("tokens", commands("make"), ids=shlex.join)
def test_readme_make_target_exists(tokens: list[str]) -> None:
    argv = ["make", "-n", *tokens[1:]]
    proc = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("tokens", commands("ansible-playbook"), ids=shlex.join)
def test_readme_playbooks_exist(tokens: list[str]) -> None:
    playbooks = [t for t in tokens if t.endswith(".yml")]
    assert playbooks and all((ROOT / p).is_file() for p in playbooks), playbooks


def test_every_flag_the_readme_mentions_exists() -> None:
    known = ANSIBLE_FLAGS | {"--help", "--version"}
    for p in all_parsers():
        known |= set(options(p))
    mentioned = set(re.findall(r"(?<![\w-])--[a-z][a-z-]+", README.read_text()))
    assert mentioned - known == set()


def test_a_readme_line_with_an_unknown_flag_would_fail(capsys: pytest.CaptureFixture[str]) -> None:
    # What the parse test relies on: the real parser refuses what does not exist (exit 2).
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["validate", "--no-such-flag"])
    assert e.value.code == 2 and "--no-such-flag" in capsys.readouterr().err
