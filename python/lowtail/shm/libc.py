"""The C library, loaded once for every lowtail module that calls it through ctypes.

``CDLL(None)`` is the libc the interpreter is already linked against (no second copy, no
``find_library`` search); ``use_errno=True`` so callers can read ``ctypes.get_errno()`` after a
failed call. ``function`` hands each caller a function pointer of its own: attribute access on a
CDLL returns one shared object, so one module's ``argtypes`` for ``syscall`` (futex) would reject
another module's call (mbind with different arguments).
"""

from __future__ import annotations

import ctypes
from typing import Any

LIBC = ctypes.CDLL(None, use_errno=True)


def function(name: str, restype: Any = ctypes.c_int, argtypes: list[Any] | None = None) -> Any:
    """A new ctypes function pointer for libc's ``name`` (``LIBC[name]`` is never cached)."""
    f = LIBC[name]
    f.restype = restype
    if argtypes is not None:
        f.argtypes = argtypes
    return f
