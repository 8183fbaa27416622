"""``end_resource_tracker``: a command that spawned a child leaves no process of its own behind when it
ends. Spawning starts multiprocessing's resource tracker as a child of the caller; without this it
outlives the command for a moment (a loaded host's Ctrl-C test of ``lowtail validate`` caught it)."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import multiprocessing, os, sys, time
from lowtail.node.process import end_resource_tracker
child = multiprocessing.get_context("spawn").Process(target=time.sleep, args=(0,))
child.start()
child.join()
if sys.argv[1] == "end":
    end_resource_tracker()
kids = set()
for tid in os.listdir("/proc/self/task"):
    kids |= set(open(f"/proc/self/task/{tid}/children").read().split())
print(" ".join(sorted(kids)))
"""


@pytest.mark.parametrize("end", [True, False], ids=["ended", "left-alone"])
def test_the_spawn_helper_is_reaped_before_the_command_ends(end: bool) -> None:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, "end" if end else "keep"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout.split()
    if end:
        assert out == []  # the tracker was stopped and waited for: no child left
    else:
        assert len(out) == 1  # the control: spawning does leave the tracker as a child


def test_it_does_nothing_when_nothing_was_spawned() -> None:
    code = (
        "import sys; from lowtail.node.process import end_resource_tracker; end_resource_tracker(); "
        "print('multiprocessing.resource_tracker' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"  # not even imported


LIVE = """
import gc, multiprocessing, sys
from lowtail.node.process import end_resource_tracker
gc.disable()  # as on a run where no full collection came between a transport's end and the command's
class Transport:
    pass
t = Transport()
t.stop_event = multiprocessing.get_context("spawn").Event()  # 5 named semaphores, registered
t.me = t  # a reference cycle: only a collection frees it
del t
if sys.argv[1] == "alive":
    keep = multiprocessing.get_context("spawn").Event()  # still referenced when the command ends
end_resource_tracker()
"""


@pytest.mark.parametrize("held", ["cycle", "alive"])
def test_semaphores_left_when_the_command_ends_are_not_unlinked_under_their_owner(held: str) -> None:
    """Stopping the tracker makes it unlink every semaphore still registered; an Event that outlived its
    transport (a cycle not yet collected, or one still referenced) then failed in its own finalizer at
    exit with five sem_unlink FileNotFoundError tracebacks and '5 leaked semaphore objects'."""
    out = subprocess.run(
        [sys.executable, "-c", LIVE, held], capture_output=True, text=True, timeout=60, check=True
    )
    assert "FileNotFoundError" not in out.stderr and "leaked" not in out.stderr, out.stderr
