"""Process and boot identity read from procfs: what tells a live owner from a recycled pid or a reboot.

Standard library only (shipped to hosts by Ansible).
"""

from __future__ import annotations

from pathlib import Path


def process_start_time(pid: int, proc_root: str | Path = "/proc") -> int | None:
    """The process's start time in clock ticks since boot (``/proc/PID/stat`` field 22), or None if gone.

    Recorded with every lease so a recycled pid is not mistaken for the owner. A zombie counts as gone.
    """
    try:
        raw = (Path(proc_root) / str(pid) / "stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # comm (field 2) may contain spaces and parentheses: fields after it start past the last ')'.
    fields = raw[raw.rfind(")") + 2 :].split()
    if not fields or fields[0] in ("Z", "X", "x"):
        return None
    return int(fields[19])


def boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""
