"""Ctrl-C during each probe: the terminal sends SIGINT to the whole foreground process group, so the
validator and every child it started get it at once. The run stops, no child prints a traceback, no
child, segment or temporary file is left, the partial report is printed and written with
"interrupted": true, and the exit status is 130."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.validation.conftest import PROBE_CPU

# The probe, and the line its progress bar writes to a pipe when it starts measuring.
PROBES = {
    "deschedule": "deschedule cpus",
    "timer": "timer cpus",
    "cyclictest": "cyclictest cpus",
    "oslat": "oslat cpus",
    "shm_rtt": "shm_rtt cpus",
    "inference": "inference cpus",
}


def _session(sid: int) -> dict[int, str]:
    """Every process of session ``sid`` (pid -> comm)."""
    out = {}
    for p in os.listdir("/proc"):
        if not p.isdigit():
            continue
        try:
            stat = Path(f"/proc/{p}/stat").read_text()
        except OSError:
            continue  # exited meanwhile
        comm, fields = stat[stat.index("(") + 1 : stat.rindex(")")], stat.rsplit(")", 1)[1].split()
        # fields 3 and 6 of stat(5): the state (Z: ended, waiting to be reaped) and the session id
        if int(fields[3]) == sid and fields[0] != "Z":
            out[int(p)] = comm
    return out


def _end(proc: subprocess.Popen[str]) -> None:
    """A step of the test failed with the run still going: Ctrl-C it, then kill what is left, and
    remove the segments it named after itself, so a failing test leaves nothing behind."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    for name in os.listdir("/dev/shm"):
        if f".{proc.pid}." in name:
            os.unlink(f"/dev/shm/{name}")


@pytest.mark.parametrize("probe", list(PROBES))
def test_ctrl_c_during_a_probe_stops_cleanly_with_a_partial_report(probe: str, tmp_path: Path) -> None:
    if probe in ("cyclictest", "oslat") and not any(
        Path(d, probe).exists() for d in os.environ.get("PATH", "").split(":")
    ):
        pytest.fail(f"{probe} is not installed: `make system-deps` installs rt-tests")
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    js = tmp_path / "r.json"
    after = "deschedule" if probe == "timer" else "timer"  # a probe that never starts
    argv = [sys.executable, "-m", "lowtail.cli.main", "validate", "--only", f"rt_budget,{probe},{after}"]
    argv += ["--cpus", str(PROBE_CPU), "--samples", "2000000", "--seconds", "120", "--json", str(js)]
    proc = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # its own process group, as a shell gives a foreground job
        env={**os.environ, "TMPDIR": str(scratch)},
    )
    try:
        assert proc.stderr is not None
        seen = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            seen.append(line)
            if not line or line.startswith(PROBES[probe]):
                break
        assert seen[-1].startswith(PROBES[probe]), "".join(seen)
        wait_until = time.monotonic() + 60  # the probe's children start (inference builds a model first)
        while len(children := _session(proc.pid)) < 2 and time.monotonic() < wait_until:
            time.sleep(0.1)
        assert len(children) >= 2, children  # the validator and at least one measuring child
        time.sleep(1.0)  # ... and measure
        os.killpg(proc.pid, signal.SIGINT)
        t0 = time.monotonic()
        out, err = proc.communicate(timeout=60)
        stopped_s = time.monotonic() - t0
    finally:
        _end(proc)
    err = "".join(seen) + err
    assert proc.returncode == 130, err[-3000:]
    assert stopped_s < 30, stopped_s  # "at once": a generous bound that proves no hang
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    assert "result: INTERRUPTED" in out and "rt_budget" in out
    doc = json.loads(js.read_text())
    assert doc["summary"]["interrupted"] is True and doc["summary"]["status"] != "pass"
    by = {c["name"]: c for c in doc["checks"]}
    assert by["rt_budget"]["status"] != "skip"  # what ran before Ctrl-C is kept
    assert by[probe]["status"] == "skip" and by[probe]["reason"] == "interrupted while it ran: no verdict"
    assert by[after]["status"] == "skip" and by[after]["reason"] == "not run: interrupted"
    assert _session(proc.pid) == {}  # every child ended
    for pid in children:
        assert not Path(f"/dev/shm/cyclictest{pid}").exists()  # rt-tests' running statistics
    assert [n for n in os.listdir("/dev/shm") if f".{proc.pid}." in n] == []  # lowtail's segments
    assert list(scratch.iterdir()) == []
