"""Children started deaf to Ctrl-C: from the main thread, and from a worker thread (an actor's
supervisor restarting its worker), where Python cannot change a signal's disposition."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading

from lowtail.node.signals import deaf_to_ctrl_c


def test_a_child_started_inside_ignores_sigint_and_the_handler_comes_back() -> None:
    before = signal.getsignal(signal.SIGINT)
    with deaf_to_ctrl_c():
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        child = subprocess.run(
            [sys.executable, "-c", "import signal; print(signal.getsignal(signal.SIGINT) == signal.SIG_IGN)"],
            capture_output=True, text=True, check=True, timeout=60,
        )  # fmt: skip
    assert child.stdout.strip() == "True"  # the child keeps it: no KeyboardInterrupt while it imports
    assert signal.getsignal(signal.SIGINT) is before


def test_it_is_a_no_op_outside_the_main_thread() -> None:
    errors: list[BaseException] = []

    def start_from_a_thread() -> None:
        try:
            with deaf_to_ctrl_c():
                pass
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=start_from_a_thread)
    t.start()
    t.join(timeout=10)
    assert errors == []


def test_children_of_the_test_session_get_ctrl_c_whatever_started_it() -> None:
    """The Ctrl-C tests send SIGINT to a command they start: it must not inherit SIGINT ignored from a
    run started in the background (`nohup make test &`), which tests/conftest.py undoes."""
    code = "import signal; print(signal.getsignal(signal.SIGINT) is signal.default_int_handler)"
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert done.stdout.strip() == "True", done.stdout + done.stderr
