"""Children that their parent ends: started deaf to the terminal's Ctrl-C.

Standard library only (``lowtail.node`` is shipped to hosts by Ansible).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from multiprocessing import resource_tracker

_CTRL_C = {signal.SIGINT}


@contextlib.contextmanager
def deaf_to_ctrl_c() -> Iterator[None]:
    """Start children with SIGINT blocked inside this block; a Ctrl-C meanwhile reaches this process at
    its end.

    A blocked mask survives fork and exec (multiprocessing's spawn and subprocess leave it as it is),
    and a blocked signal stays pending, so a Ctrl-C to the process group cannot raise a traceback in a
    child still importing numpy or OpenVINO. A child that stops on Ctrl-C unblocks SIGINT once its own
    handler is set (``hear_ctrl_c``) and then gets the one it was sent while it started; any other
    child never sees one, and the parent ends it.

    This process does not lose a Ctrl-C either: in the main thread one sent inside the block is held
    and raised (KeyboardInterrupt, or whatever SIGINT's handler does) as the block ends, after its
    last statement, so whatever the block started is registered for cleanup by then. A process that
    ignores SIGINT goes on ignoring it. From another thread only that thread's mask changes: Python
    runs signal handlers in the main thread, which gets the Ctrl-C as usual.
    """
    # Starting the tracker unblocks SIGINT in the calling thread: it must not happen inside the block
    # (a first spawn starts it). Should the tracker die and a spawn in the block restart it, the
    # children started after that in the block hear Ctrl-C; this process still holds one.
    resource_tracker.ensure_running()
    main = threading.current_thread() is threading.main_thread()
    old_handler = signal.getsignal(signal.SIGINT) if main else None
    pressed: list[int] = []
    # Blocked in this thread only, a Ctrl-C goes to another thread (numpy's, OpenVINO's) and Python
    # would run the handler in the main thread inside the block: hold it in a handler of our own.
    hold = main and old_handler not in (signal.SIG_IGN, None)  # None: set outside Python, not ours to swap
    if hold:
        signal.signal(signal.SIGINT, lambda signum, frame: pressed.append(signum))
    old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _CTRL_C)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)  # one held pending reaches `pressed` now
        if hold:
            signal.signal(signal.SIGINT, old_handler)
            if pressed:
                signal.raise_signal(signal.SIGINT)  # to the handler it was meant for, as if sent now


def hear_ctrl_c() -> None:
    """In a child started by ``deaf_to_ctrl_c``, once its SIGINT handler is set: take Ctrl-C from now on,
    the one sent while it started first."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _CTRL_C)
