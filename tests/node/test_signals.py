"""Children started deaf to Ctrl-C, and a Ctrl-C sent while they are started reaches their parent after.

The parent runs as its own process (a script below), sent SIGINT to its whole process group as a terminal
does, while it is inside ``deaf_to_ctrl_c`` with a spawned child running: the harness waits for the parent
to say it is inside, sends the Ctrl-C, then lets it go on, so the signal lands in the window every time.
"""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from lowtail.node.signals import deaf_to_ctrl_c

PARENT = r"""
import contextlib, multiprocessing, os, select, signal, sys, threading
from lowtail.node.signals import deaf_to_ctrl_c

def blocked():
    return signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])

def child(conn):
    conn.send(blocked())
    conn.recv()  # held here until the parent is out of its window

if __name__ == "__main__":
    mode = sys.argv[1]
    if mode == "ignored":
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    if mode == "thread":  # a thread that takes signals (as numpy's and OpenVINO's do) while main blocks them
        threading.Thread(target=threading.Event().wait, daemon=True).start()
        wake_r, wake_w = os.pipe()
        os.set_blocking(wake_w, False)
        signal.set_wakeup_fd(wake_w)  # the C-level handler writes here, in whichever thread took it
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    proc = ctx.Process(target=child, args=(theirs,), daemon=True)  # a failing parent does not wait for it
    steps = []
    try:
        with deaf_to_ctrl_c():
            with deaf_to_ctrl_c() if mode == "nested" else contextlib.nullcontext():
                proc.start()  # the first spawn of this process: it starts multiprocessing's tracker too
                child_blocked = mine.recv()
                print("inside", flush=True)
                sys.stdin.readline()  # the harness sent the Ctrl-C before it answered
                if mode == "thread":
                    assert select.select([wake_r], [], [], 30)[0], "the Ctrl-C never reached a thread"
                steps.append("body")
            steps.append("between")
        steps.append("after")
    except KeyboardInterrupt:
        steps.append("KeyboardInterrupt")
    mine.send("go")
    proc.join(60)
    print(" ".join(steps), child_blocked, blocked(), proc.exitcode, flush=True)
"""


def _run_parent(mode: str, tmp_path: Path) -> tuple[list[str], str]:
    """The parent's closing line (steps, child started blocked, parent blocked after, child exit) and
    stderr. A file, not ``-c``: a spawned child imports the parent's ``__main__`` to find its target."""
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    proc = subprocess.Popen(
        [sys.executable, str(script), mode],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert select.select([proc.stdout], [], [], 120)[0], "the parent never got inside the block"
        assert proc.stdout.readline().strip() == "inside", proc.communicate(timeout=60)
        os.killpg(proc.pid, signal.SIGINT)  # pending (or taken by a thread) once killpg returns
        out, err = proc.communicate("go\n", timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    return out.split(), err


@pytest.mark.parametrize("mode", ["main", "thread", "nested"])
def test_a_ctrl_c_while_a_child_is_started_is_raised_as_the_block_ends(mode: str, tmp_path: Path) -> None:
    """The block's statements all run, the KeyboardInterrupt comes as the (outermost) block ends; the
    child, started with SIGINT blocked, never sees the Ctrl-C and exits 0 without a traceback. "thread":
    another thread takes the signal while the main thread blocks it, and Python would run the handler
    in the main thread inside the block if the block held it by its mask alone."""
    words, err = _run_parent(mode, tmp_path)
    steps = words[:-3]
    assert steps == ["body", "between", "KeyboardInterrupt"], err  # nested: "between" is in the outer
    assert words[-3:] == ["True", "False", "0"], err  # child blocked; parent's mask restored; child exit
    assert "Traceback" not in err, err


def test_a_process_that_ignores_sigint_goes_on_ignoring_it(tmp_path: Path) -> None:
    words, err = _run_parent("ignored", tmp_path)
    assert words == ["body", "between", "after", "True", "False", "0"], err
    assert "Traceback" not in err, err


def test_a_child_started_inside_has_sigint_blocked_and_the_handler_and_mask_come_back() -> None:
    before = signal.getsignal(signal.SIGINT)
    code = "print(open('/proc/self/status').read().split('SigBlk:')[1].split()[0])"
    with deaf_to_ctrl_c():
        child = subprocess.run(
            [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
        )
    assert int(child.stdout, 16) & 1 << (signal.SIGINT - 1)  # no KeyboardInterrupt while it imports
    assert signal.getsignal(signal.SIGINT) is before
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_from_another_thread_only_that_thread_blocks_it() -> None:
    """An actor's supervisor restarting its worker: Python cannot change a handler from this thread, and
    the main thread, which runs the handlers, keeps taking Ctrl-C."""
    seen: list[object] = []

    def start_from_a_thread() -> None:
        try:
            with deaf_to_ctrl_c():
                seen.append(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))
            seen.append(signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))
        except BaseException as e:
            seen.append(e)

    handler = signal.getsignal(signal.SIGINT)
    t = threading.Thread(target=start_from_a_thread)
    t.start()
    t.join(timeout=60)
    assert seen == [True, False]
    assert signal.getsignal(signal.SIGINT) is handler
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])


def test_children_of_the_test_session_get_ctrl_c_whatever_started_it() -> None:
    """The Ctrl-C tests send SIGINT to a command they start: it must not inherit SIGINT ignored from a
    run started in the background (`nohup make test &`), or blocked, which tests/conftest.py undoes."""
    code = (
        "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler, "
        "signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, []))"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.split() == ["True", "False"], done.stdout + done.stderr
