"""Terminal tables fit the terminal: the widest columns wrap, words stay whole, nothing is cut."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowtail.render import table

WHY = (
    "khugepaged collapses and direct compaction stall threads on page faults; set transparent_hugepage never"
)


def test_a_wide_table_wraps_its_widest_column_and_keeps_every_word() -> None:
    text = table.render(
        ["check", "status", "why"], [["thp", "WARN", WHY], ["rt_budget", "PASS", "ok"]], width=60
    )
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 60
    assert " ".join(
        " ".join(line.split()[2:]) if i == 0 else line[19:].strip() for i, line in enumerate(lines[2:5])
    )
    body = " ".join(line[19:].strip() for line in lines[2:] if not line.startswith("rt_budget"))
    assert body.split() == WHY.split()  # every word of the explanation, in order, none broken
    assert lines[0].split() == ["check", "status", "why"]


def test_a_narrow_table_is_unchanged_and_columns_honour_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert table.render(["a", "b"], [["1", "2"]]) == "a  b\n-  -\n1  2"
    monkeypatch.setenv("COLUMNS", "100")
    assert table.terminal_width() == 100


def test_validate_and_compare_tables_fit_100_columns(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from lowtail.cli.main import main
    from tests.fixtures.machines import MACHINES, write_machine

    monkeypatch.setenv("COLUMNS", "100")
    tmp = Path(__import__("tempfile").mkdtemp(prefix="lowtail-table-"))
    try:
        s, p = write_machine(tmp, MACHINES["vmware_88_rt500"])
        roots = ["--sysfs-root", str(s), "--procfs-root", str(p)]
        assert main(["validate", *roots, "--json", str(tmp / "r.json")]) == 1
        out = capsys.readouterr().out
        assert "Needs attention:" in out and max(len(line) for line in out.splitlines()) <= 100, out
        doc = json.loads((tmp / "r.json").read_text())
        assert any(len(c.get("reason", "")) > 60 for c in doc["checks"])  # long reasons were wrapped, not cut
        for c in doc["checks"]:  # every word of every reason is printed (only a longer one, a path, breaks)
            assert all(w in out for w in c.get("reason", "").split() if len(w) <= table.MAX_FLOOR), c
        assert main(["compare", str(tmp / "r.json"), str(tmp / "r.json")]) == 0
        out = capsys.readouterr().out
        assert max(len(line) for line in out.splitlines()) <= 100
    finally:
        import shutil

        shutil.rmtree(tmp)


def test_shm_ls_shows_sizes_in_binary_units_and_modes_as_chmod_writes_them() -> None:
    from lowtail.cli.commands.shm_cmd import _rows, human_bytes
    from lowtail.shm.segments import SegmentInfo

    assert [human_bytes(n) for n in (512, 4096, 1536, 25 * 2**20, 3 * 2**30)] == [
        "512 B",
        "4 KiB",
        "1.5 KiB",
        "25 MiB",
        "3 GiB",
    ]
    info = SegmentInfo("lowtail.q.1.2.ab", "/dev/shm/lowtail.q.1.2.ab", "q", 2, "alive", 24576, "0o600", 0)
    assert _rows([info])[0][4:6] == ["24 KiB", "0600"]


def test_colour_only_on_a_terminal_and_never_with_no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    import io

    from lowtail.render import style

    class Tty(io.StringIO):
        def isatty(self) -> bool:
            return True

    monkeypatch.delenv("NO_COLOR", raising=False)
    assert style.paint("result: FAIL", "fail", Tty()) == "\033[1;31mresult: FAIL\033[0m"
    assert style.paint("result: FAIL", "fail", io.StringIO()) == "result: FAIL"  # piped
    monkeypatch.setenv("NO_COLOR", "1")
    assert style.paint("result: FAIL", "fail", Tty()) == "result: FAIL"
