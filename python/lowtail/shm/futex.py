"""Futex park/wake between processes and a full memory barrier, through ctypes (x86-64 Linux).

Why these three primitives are enough for the queue (see ``lowtail.shm.layout`` for the protocol):

- ``futex_wait``/``futex_wake`` use ``syscall(SYS_futex, ...)`` without ``FUTEX_PRIVATE_FLAG``: the
  word lives in a ``MAP_SHARED`` mapping used by several processes, and a private futex is keyed by
  (mm, address), so a waker in another process would never find the waiter. Every wait has a timeout.
- ``full_barrier`` executes ``mfence``. x86-64 (TSO) never reorders stores with stores nor loads with
  loads, but a store followed by a load of another address may be reordered. The park handshake is
  Dekker-shaped ("set my parked flag, then re-check your sequence word" against "publish my sequence
  word, then check your parked flag"), so each side needs a full barrier between its store and its
  load, or a wake-up can be lost. Python has no fence; we call a 4-byte function (``mfence; ret``)
  mapped executable once per process (~0.1 µs per call, measured on the KVM guest this was built on).
  Where an executable mapping is refused we fall back to ``threading.Lock`` acquire/release, whose
  ``sem_trywait``/``sem_post`` execute ``lock``-prefixed instructions (also full barriers on x86-64).
  The futex timeout bounds the cost of any wake-up lost anyway.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import platform
import threading
from collections.abc import Callable

from lowtail.shm import libc

SYS_FUTEX = 202  # x86-64
FUTEX_WAIT = 0
FUTEX_WAKE = 1
WAKE_ALL = 0x7FFFFFFF


class _Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


_syscall = libc.function("syscall", ctypes.c_long)
_syscall.argtypes = [
    ctypes.c_long,
    ctypes.c_void_p,
    ctypes.c_int,
    ctypes.c_uint,
    ctypes.c_void_p,
    ctypes.c_void_p,
    ctypes.c_uint,
]


def is_supported_platform() -> bool:
    """The queue's publication protocol relies on x86-64 store ordering (TSO)."""
    return platform.machine() in ("x86_64", "AMD64") and os.name == "posix"


def futex_wait(addr: int, expected: int, timeout_s: float) -> bool:
    """Sleep while the 32-bit word at ``addr`` equals ``expected``, at most ``timeout_s``.

    Returns False on timeout, True otherwise (woken, value already different, or a signal): the
    caller always re-checks its condition, so spurious returns are harmless.
    """
    timeout_s = max(timeout_s, 0.0)
    ts = _Timespec(int(timeout_s), int((timeout_s % 1.0) * 1e9))
    rc = _syscall(SYS_FUTEX, addr, FUTEX_WAIT, expected & 0xFFFFFFFF, ctypes.addressof(ts), None, 0)
    return _waited(rc, addr)


def _waited(rc: int, addr: int) -> bool:
    """A FUTEX_WAIT's result: False on timeout, True when woken, changed or interrupted."""
    if rc == 0:
        return True
    err = ctypes.get_errno()
    if err == errno.ETIMEDOUT:
        return False
    if err in (errno.EAGAIN, errno.EINTR):
        return True
    raise OSError(err, f"futex wait on {addr:#x}: {os.strerror(err)}")


def futex_wake(addr: int, count: int = WAKE_ALL) -> int:
    """Wake up to ``count`` waiters on the word at ``addr``; returns how many were woken."""
    rc = _syscall(SYS_FUTEX, addr, FUTEX_WAKE, count, None, None, 0)
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"futex wake on {addr:#x}: {os.strerror(err)}")
    return int(rc)


# The worker's wake-ups, with every argument converted once: ``argtypes`` conversion of seven arguments
# is most of a ctypes call (1.4 us against 0.8 us per wake, warm, on the KVM guest), and a worker wakes
# up to one parked sampler per request it answers. Arguments are ctypes objects of the exact C types
# (long number, pointer, int op, int count), so nothing is left to ctypes' default int conversion.
_wake_raw = libc.function("syscall", ctypes.c_long)
_SYS_FUTEX_L, _FUTEX_WAIT_I, _FUTEX_WAKE_I, _WAKE_ALL_I, _ZERO_I = (
    ctypes.c_long(SYS_FUTEX),
    ctypes.c_int(FUTEX_WAIT),
    ctypes.c_int(FUTEX_WAKE),
    ctypes.c_int(WAKE_ALL),
    ctypes.c_int(0),
)


def wake_handle(addr: int) -> ctypes.c_void_p:
    """The futex word at ``addr`` as the pointer ``futex_wake_all`` takes (build it once per word)."""
    return ctypes.c_void_p(addr)


def futex_wake_all(handle: ctypes.c_void_p) -> int:
    """``futex_wake(addr)`` for a ``wake_handle``: wakes every waiter; returns how many were woken."""
    rc = _wake_raw(_SYS_FUTEX_L, handle, _FUTEX_WAKE_I, _WAKE_ALL_I, None, None, _ZERO_I)
    if rc < 0:
        err = ctypes.get_errno()
        raise OSError(err, f"futex wake on {handle.value or 0:#x}: {os.strerror(err)}")
    return int(rc)


class FutexWaiter:
    """``futex_wait`` on one word with its arguments converted once (the client's park, per request).

    As for ``futex_wake_all``: the argument conversion is most of the call's user-space cost (3.7 us
    against ~1 us per wait that returns EAGAIN at once on the KVM guest this was built on), paid by a
    sampler on every request it parks for. One waiter per thread (its timespec is reused).
    """

    __slots__ = ("_handle", "_ts", "_ts_ref")

    def __init__(self, addr: int) -> None:
        self._handle = ctypes.c_void_p(addr)
        self._ts = _Timespec(0, 0)
        self._ts_ref = ctypes.pointer(self._ts)

    def wait(self, expected: int, timeout_s: float) -> bool:
        """As ``futex_wait(addr, expected, timeout_s)``."""
        timeout_s = max(timeout_s, 0.0)
        ts = self._ts
        ts.tv_sec = int(timeout_s)
        ts.tv_nsec = int((timeout_s % 1.0) * 1e9)
        rc = _wake_raw(
            _SYS_FUTEX_L,
            self._handle,
            _FUTEX_WAIT_I,
            ctypes.c_uint(expected & 0xFFFFFFFF),
            self._ts_ref,
            None,
            _ZERO_I,
        )
        return rc == 0 or _waited(rc, self._handle.value or 0)


_MFENCE_RET = bytes([0x0F, 0xAE, 0xF0, 0xC3])
_PROT_READ_EXEC = 0x1 | 0x4
_keep: list[object] = []  # the code page and its ctypes function live as long as the process


def _make_barrier() -> tuple[Callable[[], None], str]:
    if not is_supported_platform():
        lock = threading.Lock()

        def _lock_barrier() -> None:
            lock.acquire(False)
            lock.release()

        return _lock_barrier, "lock"
    try:
        page = mmap.mmap(-1, mmap.PAGESIZE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        page.write(_MFENCE_RET)
        anchor = ctypes.c_char.from_buffer(page)
        addr = ctypes.addressof(anchor)
        mprotect = libc.function("mprotect", ctypes.c_int, [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int])
        if mprotect(addr, mmap.PAGESIZE, _PROT_READ_EXEC) != 0:
            raise OSError(ctypes.get_errno(), "mprotect")
        fence = ctypes.CFUNCTYPE(None)(addr)
        fence()
        _keep.extend([page, anchor, fence])
        return fence, "mfence"
    except (OSError, ValueError):
        lock = threading.Lock()

        def _fallback() -> None:
            lock.acquire(False)
            lock.release()

        return _fallback, "lock"


full_barrier, BARRIER_KIND = _make_barrier()
