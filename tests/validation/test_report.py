"""`lowtail validate` end to end: exit statuses, the JSON schema, the HTML with its plots, compare."""

from __future__ import annotations

import base64
import json
import math
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path
from subprocess import Popen

import pytest

from lowtail.cli.main import main
from lowtail.validation.compare import compare, load_report, render_table
from tests.fixtures.machines import MACHINES, write_machine
from tests.validation.conftest import PROBE_CPU

PNG = b"\x89PNG\r\n\x1a\n"


class _Images(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.images: list[bytes] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        src = dict(attrs).get("src") or ""
        if tag == "img" and src.startswith("data:image/png;base64,"):
            self.images.append(base64.b64decode(src.split(",", 1)[1], validate=True))


def test_live_report_json_has_host_checks_and_summary(live_report: tuple[Path, Path, int]) -> None:
    js, _, rc = live_report
    doc = json.loads(js.read_text())
    stamp = {"schema", "schema_version", "lowtail_version"}
    assert set(doc) == stamp | {"host", "settings", "checks", "summary"}
    assert (doc["schema"], doc["schema_version"]) == ("lowtail.validate", 1) and doc["lowtail_version"]
    assert doc["settings"]["samples_per_cpu"] == 1000 and doc["summary"]["interrupted"] is False
    assert rc == (1 if doc["summary"]["status"] == "fail" else 0)
    host = doc["host"]
    assert host["kernel"] and host["cmdline"] and host["cpu_model"] and host["versions"]["lowtail"]
    assert host["probe_cpus"]["cpus"] == str(PROBE_CPU)
    names = [c["name"] for c in doc["checks"]]
    assert names == ["rt_budget", "thp", "steal", "deschedule", "timer", "cyclictest", "shm_rtt"]
    for c in doc["checks"]:
        assert {"name", "status", "value", "threshold", "evidence"} <= set(c)
        assert c["status"] in ("pass", "warn", "fail", "skip")
        if c["status"] == "skip":
            assert c["reason"]
    for c in (c for c in doc["checks"] if c["kind"] == "probe" and c["status"] != "skip"):
        for stats in c["data"]["per_cpu"].values():
            assert stats["n"] > 0 and "max" in stats and "p999" in stats
    head = doc["summary"]["headline"]
    assert head["n"] == 1000 and head["p999_deschedule_ms"] <= head["max_ms"]


def test_live_report_html_embeds_the_plots(live_report: tuple[Path, Path, int]) -> None:
    _, html, _ = live_report
    parser = _Images()
    parser.feed(html.read_text())
    # deschedule, timer and cyclictest CDFs and the heat strip (fewer only if cyclictest is missing).
    assert len(parser.images) >= 3
    assert all(img.startswith(PNG) for img in parser.images)


def test_exit_status_1_when_a_check_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    sys_root, proc_root = write_machine(tmp_path, MACHINES["vmware_88_rt500"])
    roots = ["--sysfs-root", str(sys_root), "--procfs-root", str(proc_root)]
    assert main(["validate", *roots, "--only", "rt_budget"]) == 1
    out = capsys.readouterr().out
    assert "rt_budget" in out and "FAIL" in out
    assert main(["validate", *roots, "--only", "topology", "--allow-virtual"]) == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--only", "rt_budget,nonsense"], "unknown check(s) nonsense"),
        (["--cpus", "999"], "CPUs 999 are not online"),
        (["--cpus", "1-x"], "bad element"),
        (["--samples", "0"], "--samples 0"),
        (["--threshold", "deschedule=1:0.1"], "PASS_MAX <= WARN_MAX"),
        (["--threshold", "bogus=1:2"], "PROBE one of"),
        (["--plan", "/nonexistent/plan.json"], "cannot read plan /nonexistent/plan.json"),
        (["--sysfs-root", "/nonexistent"], "missing /nonexistent/devices/system/cpu/online"),
    ],
)
def test_exit_status_2_when_it_cannot_run(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["validate", "--only", "rt_budget", *args]) == 2
    assert message in capsys.readouterr().err


def test_json_to_stdout_is_the_whole_report(capsys: pytest.CaptureFixture[str]) -> None:
    main(["validate", "--only", "rt_budget,dev_shm", "--json", "-"])
    doc = json.loads(capsys.readouterr().out)
    assert [c["name"] for c in doc["checks"]] == ["rt_budget", "dev_shm"]


def test_compare_puts_the_deschedule_headline_first(
    live_report: tuple[Path, Path, int],
    hog: Callable[[int], Popen[bytes]],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    before_path = tmp_path / "before.json"
    hog(PROBE_CPU)
    main(
        [
            "validate",
            "--only",
            "rt_budget,deschedule",
            "--cpus",
            str(PROBE_CPU),
            "--samples",
            "1000",
            "--no-progress",
            "--json",
            str(before_path),
        ]
    )
    after_path, _, _ = live_report
    html = tmp_path / "compare.html"
    # The two runs are minutes apart on a shared host: the values may move either way, so the exit
    # status is read on the statuses alone (the hog's run fails deschedule; nothing can turn into a fail).
    # The after run has checks the before run did not run: incomplete, exit 3.
    assert main(["compare", str(before_path), str(after_path), "--status-only", "--html", str(html)]) == 3
    out = " ".join(capsys.readouterr().out.split())
    text = out[out.index("headline p99.9 deschedule") :]
    before, after = load_report(before_path), load_report(after_path)
    b, a = before["summary"]["headline"], after["summary"]["headline"]
    assert text.startswith(f"headline p99.9 deschedule: {b['p999_deschedule_ms']:.4g} ms [")
    assert f"(n=1,000, max {b['max_ms']:.4g} ms) -> {a['p999_deschedule_ms']:.4g} ms [" in text
    cmp = compare(before, after, tolerance=math.inf)
    assert cmp["checks"][0]["name"] == "deschedule"
    assert cmp["headline"]["ratio"] == pytest.approx(b["p999_deschedule_ms"] / a["p999_deschedule_ms"])
    assert {r["name"] for r in cmp["checks"]} >= {"rt_budget", "deschedule", "timer", "thp"}
    assert render_table(cmp).splitlines()[-1].startswith("result: INCOMPLETE")
    assert "timer" in cmp["not_compared"] and cmp["not_measured"] == []
    parser = _Images()
    parser.feed(html.read_text())
    assert len(parser.images) == 2 and all(i.startswith(PNG) for i in parser.images)


def test_compare_rejects_a_file_that_is_not_a_report(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "x.json"
    bad.write_text('{"checks": []}')
    assert main(["compare", str(bad), str(bad)]) == 2
    assert "not a lowtail validate report" in capsys.readouterr().err


def test_probes_leave_no_segment_process_or_temporary_file_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import os
    import tempfile

    # Other test suites share this machine's /dev/shm and /tmp: look only at what this process makes
    # (segment names carry the creator's pid) and give it a temporary directory of its own.
    mine = f".{os.getpid()}."
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))

    def segments() -> set[str]:
        return {name for name in os.listdir("/dev/shm") if mine in name}

    def children() -> set[int]:
        me = str(os.getpid())
        out = set()
        for p in os.listdir("/proc"):
            try:
                if p.isdigit() and Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()[1] == me:
                    out.add(int(p))
            except OSError:
                continue  # a process that just exited
        return out

    before, kids = segments(), children()
    rc = main(
        [
            "validate",
            "--only",
            "deschedule,timer,cyclictest,shm_rtt,numa",
            "--cpus",
            str(PROBE_CPU),
            "--samples",
            "300",
            "--duration",
            "1",
            "--no-progress",
            "--json",
            str(tmp_path / "r.json"),
        ]
    )
    assert rc in (0, 1)
    doc = json.loads((tmp_path / "r.json").read_text())
    assert {c["name"] for c in doc["checks"] if c["status"] != "skip"} >= {"deschedule", "timer"}
    assert segments() - before == set()
    assert children() - kids == set()
    assert list(scratch.iterdir()) == []
