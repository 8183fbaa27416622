"""A tiny stand-in for ``systemctl``, for the one service the kubelet role's window manages, on a test
host whose PID 1 is not systemd.

It answers what ``ansible.builtin.systemd_service`` and the role's health gate ask (``show``,
``is-active``, ``start``, ``stop``, ``restart``) for the unit named in its state file, and starts that
unit's command as a Type=simple service would: ``start`` returns once the process runs; ActiveState is
``active`` while it runs, ``failed`` after it exited non-zero, ``inactive`` otherwise; MainPID is the
service's process. It never restarts a process that exits (NRestarts stays 0, which the role's gate
also compares). Each service process runs under a small monitor process that records its exit status.

Installed by the test as ``<dir>/systemctl`` (a copy of this file with ``STATE`` filled in), first on
PATH for the ansible-playbook run.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

STATE = Path("@STATE@")  # {"unit": name, "argv": [...], "log": path}


def _read(name: str) -> str:
    try:
        return (STATE.parent / name).read_text().strip()
    except OSError:
        return ""


def _main_pid() -> int:
    pid = _read("mainpid")
    if not pid or _read("rc"):
        return 0
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    return 0 if stat.rsplit(")", 1)[1].split()[0] == "Z" else int(pid)


def _active() -> str:
    if _main_pid():
        return "active"
    rc = _read("rc")
    return "failed" if rc and rc != "0" else "inactive"


def _monitor(argv: list[str], log: str) -> None:
    """The service's parent: runs it, records its pid and, when it ends, its exit status."""
    for name in ("rc", "mainpid"):
        (STATE.parent / name).unlink(missing_ok=True)
    with open(log, "ab") as out:
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    (STATE.parent / "mainpid").write_text(str(proc.pid))
    signal.signal(signal.SIGTERM, lambda *_: proc.terminate())
    rc = proc.wait()
    (STATE.parent / "rc").write_text(str(rc))


def _start(state: dict[str, object]) -> None:
    if _main_pid():
        return
    (STATE.parent / "rc").unlink(missing_ok=True)
    (STATE.parent / "mainpid").unlink(missing_ok=True)
    subprocess.Popen(
        [sys.executable, __file__, "__monitor__"],
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    deadline = time.monotonic() + 30
    while not (_read("mainpid") or _read("rc")) and time.monotonic() < deadline:
        time.sleep(0.05)


def _stop() -> None:
    pid = _main_pid()
    if not pid:
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 60
    while not _read("rc") and time.monotonic() < deadline:
        time.sleep(0.1)
    if not _read("rc"):
        os.kill(pid, signal.SIGKILL)
        while not _read("rc"):
            time.sleep(0.1)


def main(args: list[str]) -> int:
    state = json.loads(STATE.read_text())
    if args[:1] == ["__monitor__"]:
        _monitor(state["argv"], state["log"])
        return 0
    words = [a for a in args if not a.startswith("-")]
    props = [a.split("=", 1)[1] for a in args if a.startswith("--property=")]
    if not words:
        print("systemctl stand-in: expected a command", file=sys.stderr)
        return 1
    command, units = words[0], [u.strip("'").removesuffix(".service") for u in words[1:]]
    if units and units != [state["unit"]]:
        print(f"Unit {units[0]}.service could not be found.", file=sys.stderr)
        return 4 if command == "show" else 5
    if command == "show":
        active = _active()
        values = {
            "Id": f"{state['unit']}.service",
            "LoadState": "loaded",
            "ActiveState": active,
            "SubState": {"active": "running", "failed": "failed"}.get(active, "dead"),
            "MainPID": str(_main_pid()),
            "NRestarts": "0",
            "UnitFileState": "enabled",
        }
        for k, v in values.items():
            if not props or k in props:
                print(f"{k}={v}")
        return 0
    if command == "is-active":
        print(_active())
        return 0 if _active() == "active" else 3
    if command in ("start", "restart", "stop"):
        if command != "start":
            _stop()
        if command != "stop":
            _start(state)
        return 0
    if command in ("daemon-reload", "is-enabled"):
        print("enabled" if command == "is-enabled" else "", end="")
        return 0
    print(f"systemctl stand-in: {command!r} is not supported", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
