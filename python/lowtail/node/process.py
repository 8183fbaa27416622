"""Process and boot identity read from procfs: what tells a live owner from a recycled pid or a reboot;
and ending the children a command started (a probe, the resource tracker) before it returns.

Standard library only (shipped to hosts by Ansible).
"""

from __future__ import annotations

import gc
import subprocess
import sys
from pathlib import Path
from typing import Any


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


def end_child(proc: subprocess.Popen[Any], timeout_s: float = 5.0) -> None:
    """SIGTERM (so the child can clean up after itself), SIGKILL if it is still there after ``timeout_s``;
    reaped either way."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def end_resource_tracker() -> None:
    """Stop multiprocessing's resource tracker, if this process started one, and reap it.

    Spawning a child (the pinned worker) starts the tracker as a child of this process; left alone, it
    ends only after this process has exited and it has read EOF, so for a moment a finished command
    still has a child in its session (a Ctrl-C'd ``lowtail validate`` seemed to leave one behind). Call
    it once every spawned child has been stopped, on the way out.
    """
    module = sys.modules.get("multiprocessing.resource_tracker")
    if module is None:
        return  # nothing was spawned: no tracker to end
    # A stopped tracker unlinks every semaphore still registered with it; the Event (five semaphores)
    # of an object that outlived its child then fails in its own finalizer at exit (sem_unlink:
    # FileNotFoundError) and the tracker reports it leaked. Objects only a reference cycle keeps are
    # collected first, which unlinks and unregisters theirs; any still alive keep the tracker running
    # until this process exits, as Python does by default.
    gc.collect()
    if _semaphores_alive():
        return
    stop = getattr(module._resource_tracker, "_stop", None)  # CPython 3.8+; private, so looked up
    if stop is not None:
        stop()


def _semaphores_alive() -> bool:
    """Whether a multiprocessing semaphore of this process still waits for its cleanup (the finalizer
    ``SemLock`` registers when it creates a named semaphore)."""
    synchronize = sys.modules.get("multiprocessing.synchronize")
    if synchronize is None:
        return False
    util = sys.modules["multiprocessing.util"]  # imported by synchronize; its registry is private
    cleanup = synchronize.SemLock._cleanup
    return any(getattr(f, "_callback", None) is cleanup for f in list(util._finalizer_registry.values()))
