"""The process's one ``ov.Core``: every engine, model read and reference compile shares it.

OpenVINO's CPU plugin (one per ``ov.Core``) gives the thread that makes it an alternate signal stack of
its own, and when it goes gives back the one it found only if its own is still the thread's, then
unmaps its own (``src/plugins/intel_cpu/src/sigstack_manager.cpp``). Two plugins that go in the order
they were made leave the thread's alternate stack pointing at unmapped pages. Python installs its
SIGINT handler with ``SA_ONSTACK``, so the next Ctrl-C is a SIGSEGV instead of a KeyboardInterrupt.
One core, kept for the life of the process, makes one plugin that never goes before the end.
"""

from __future__ import annotations

import functools
import threading
from typing import Any

_lock = threading.Lock()  # functools.cache alone may call its function twice from two threads


@functools.cache
def _make_core() -> Any:
    import openvino as ov

    return ov.Core()


def shared_core() -> Any:
    """The process's ``openvino.Core``, made on first use (openvino imported only then)."""
    with _lock:
        return _make_core()
