"""Children that their parent ends: started deaf to the terminal's Ctrl-C.

Standard library only (``lowtail.node`` is shipped to hosts by Ansible).
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def deaf_to_ctrl_c() -> Iterator[None]:
    """Start children with SIGINT ignored inside this block.

    The disposition survives exec, and a Python started with SIGINT ignored keeps it so (the signal
    module installs its KeyboardInterrupt handler only over the default), so a Ctrl-C to the process
    group cannot raise a traceback in a child still importing numpy or OpenVINO; the parent, which
    does get the KeyboardInterrupt, ends its children itself (a child may install its own SIGINT
    handler once it runs). A Ctrl-C while a child is spawned is lost to the parent: milliseconds on an
    idle host, longer on a loaded one (a run at load 10 lost one sent 2 s into a design; how long the
    window was is not measured). A child already running with its own handler (a serving worker)
    still gets it and stops, so the parent goes on without it until a second Ctrl-C.
    """
    if threading.current_thread() is not threading.main_thread():
        # Python sets handlers from the main thread only; a child started from another thread (an
        # actor's supervisor) belongs to a process no terminal's Ctrl-C reaches.
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
