"""Open-file-description byte locks (``F_OFD_SETLK``): lifetime locks that die with their holder.

An OFD lock belongs to one open file description, so two ``os.open`` of the same file in one process
conflict like two processes would, and the kernel drops the lock when the last descriptor of that
description closes, including when the process is killed with SIGKILL. That makes one byte of a
file a "this owner is alive" flag that needs no pid (pids are reused and differ across PID
namespaces) and no heartbeat. ``F_OFD_GETLK`` tests for a holder without taking anything.
"""

from __future__ import annotations

import errno
import fcntl
import os
import struct

# struct flock on x86-64: short l_type, short l_whence, (pad), off_t l_start, off_t l_len, pid_t l_pid, (pad)
_FLOCK = struct.Struct("=hh4xqqi4x")


def try_lock(fd: int, byte: int) -> bool:
    """Take the write lock on ``byte`` without waiting; False when another description holds it."""
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0))
    except OSError as e:
        if e.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise
    return True


def unlock(fd: int, byte: int) -> None:
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, _FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, byte, 1, 0))


def held(fd: int, byte: int) -> bool:
    """Whether another open file description holds a lock on ``byte`` (ours never counts)."""
    res = fcntl.fcntl(fd, fcntl.F_OFD_GETLK, _FLOCK.pack(fcntl.F_WRLCK, os.SEEK_SET, byte, 1, 0))
    return bool(_FLOCK.unpack(res)[0] != fcntl.F_UNLCK)
