"""Shared-memory segments lowtail creates in ``/dev/shm``: naming, creation, attachment, listing, sweeping.

Why not ``multiprocessing.shared_memory``: on Python 3.11 every process that attaches a segment
registers it with its resource tracker, which unlinks it when that process exits (CPython #82300;
``track=False`` only exists from 3.13), so a sampler that exits would delete the worker's queue.
We ``os.open`` the file under the shm directory and ``mmap`` it ourselves: nothing unlinks a segment
but its owner (``close``) or a sweep of a dead owner's segments.

Names are ``lowtail.<kind>.<pidns>.<pid>.<token>``: ``kind`` is ``q`` (a queue's control segment) or
``nd`` (an ndarray slot), ``pidns`` the inode of the creator's PID namespace and ``pid`` the creator's
pid in it. The liveness of a segment is the liveness of that pid, which is only meaningful inside the
same PID namespace: segments of another namespace (a pod sharing ``/dev/shm`` through hostIPC) are
listed as ``unknown`` and never swept.

Capacity is reserved with ``posix_fallocate`` at creation: a tmpfs smaller than the segment gives a
clear ``ShmTooSmall`` now instead of a SIGBUS at the first write to an unbacked page later.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import secrets
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from lowtail.shm.errors import SegmentNotFound, ShmTooSmall

SHM_DIR = "/dev/shm"
PREFIX = "lowtail"
KINDS = ("q", "nd")


def pid_namespace() -> int:
    """Inode of this process's PID namespace (a pid means something only inside its namespace)."""
    try:
        return os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return 0


def segment_name(kind: str, pid: int | None = None) -> str:
    if kind not in KINDS:
        raise ValueError(f"segment kind {kind!r} is not one of {KINDS}")
    return f"{PREFIX}.{kind}.{pid_namespace()}.{os.getpid() if pid is None else pid}.{secrets.token_hex(6)}"


@dataclass(frozen=True)
class NameParts:
    kind: str
    pidns: int
    pid: int
    token: str


def parse_name(name: str) -> NameParts | None:
    """The parts of a lowtail segment name, or None for any other file."""
    parts = name.split(".")
    if len(parts) != 5 or parts[0] != PREFIX or parts[1] not in KINDS:
        return None
    try:
        return NameParts(parts[1], int(parts[2]), int(parts[3]), parts[4])
    except ValueError:
        return None


def process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, owned by someone else
    return True


class Segment:
    """One mapped segment. ``fd`` stays open for its lifetime (the queue takes OFD locks on it)."""

    def __init__(self, name: str, path: Path, fd: int, mm: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.path = path
        self.fd = fd
        self.mm = mm
        self.size = len(mm)
        self.owner = owner
        self._closed = False

    def close(self) -> None:
        """Unmap and close; an owner also unlinks. Callers drop their numpy/memoryview views first."""
        if self._closed:
            return
        self._closed = True
        # A view that still exists somewhere keeps the mapping alive until it is garbage collected;
        # the file itself is never left behind.
        with contextlib.suppress(BufferError):
            self.mm.close()
        os.close(self.fd)
        if self.owner:
            unlink_quietly(self.path)

    @property
    def closed(self) -> bool:
        return self._closed


def unlink_quietly(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def free_bytes(shm_dir: str) -> int:
    st = os.statvfs(shm_dir)
    return st.f_bavail * st.f_frsize


def create_segment(
    kind: str,
    size: int,
    shm_dir: str = SHM_DIR,
    mode: int = 0o600,
    before_allocate: Callable[[mmap.mmap], None] | None = None,
) -> Segment:
    """Create, size and map a new segment; ``before_allocate`` may set a memory policy (mbind).

    Pages are reserved by ``posix_fallocate`` after ``before_allocate`` ran, so a NUMA policy set on
    the mapping applies to their allocation (shmem allocates by the file's shared policy).
    """
    if size <= 0:
        raise ValueError(f"segment size {size} must be > 0")
    name = segment_name(kind)
    path = Path(shm_dir) / name
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    except FileNotFoundError:
        raise SegmentNotFound(f"shared-memory directory {shm_dir} does not exist") from None
    try:
        os.fchmod(fd, mode)  # the umask must not widen or narrow what was asked
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        try:
            if before_allocate is not None:
                before_allocate(mm)
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EFBIG):
                    raise ShmTooSmall(
                        f"{shm_dir} cannot hold a {size}-byte segment ({free_bytes(shm_dir)} bytes free): "
                        f"enlarge it (e.g. an emptyDir with medium: Memory and a sizeLimit) or ask for "
                        f"fewer lanes/slots or smaller slots"
                    ) from None
                raise
        except BaseException:
            mm.close()
            raise
    except BaseException:
        os.close(fd)
        unlink_quietly(path)
        raise
    return Segment(name, path, fd, mm, owner=True)


def check_owned(fd: int, path: Path, mode: int) -> None:
    """Refuse a segment this process must not trust: not a regular file, owned by another uid, or
    with permission bits beyond ``mode``. A file another user planted under a lowtail name would
    otherwise be mapped (and, before payloads were data-only, run as code) by its victim."""
    st = os.fstat(fd)
    problems = []
    if not stat.S_ISREG(st.st_mode):
        problems.append("not a regular file")
    if st.st_uid != os.geteuid():
        problems.append(f"owned by uid {st.st_uid}, not by this process's uid {os.geteuid()}")
    extra = stat.S_IMODE(st.st_mode) & ~mode
    if extra:
        problems.append(
            f"mode {stat.S_IMODE(st.st_mode):#o} has bits {extra:#o} beyond the expected {mode:#o}"
        )
    if problems:
        raise SegmentNotFound(f"refusing to attach {path}: {'; '.join(problems)}")


def attach_segment(name: str, shm_dir: str = SHM_DIR, mode: int = 0o600) -> Segment:
    """Map an existing segment read-write (see ``check_owned`` for what is refused). The caller
    never unlinks it."""
    if parse_name(name) is None:
        raise SegmentNotFound(f"{name!r} is not a lowtail segment name ({PREFIX}.<kind>.<ns>.<pid>.<tok>)")
    path = Path(shm_dir) / name
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SegmentNotFound(
            f"segment {path} does not exist on this host: its owner is gone, or the descriptor was made "
            f"on another node (shared memory is node-local)"
        ) from None
    try:
        check_owned(fd, path, mode)
        size = os.fstat(fd).st_size
        mm = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return Segment(name, path, fd, mm, owner=False)


@dataclass(frozen=True)
class SegmentInfo:
    name: str
    path: str
    kind: str
    pid: int
    liveness: str  # "alive", "dead" or "unknown" (another PID namespace)
    size: int
    mode: str
    uid: int

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


def list_segments(shm_dir: str = SHM_DIR) -> list[SegmentInfo]:
    """Every lowtail segment in ``shm_dir`` with its owner's liveness, sorted by name."""
    ns = pid_namespace()
    out: list[SegmentInfo] = []
    try:
        entries = sorted(os.listdir(shm_dir))
    except FileNotFoundError:
        return out
    for name in entries:
        parts = parse_name(name)
        if parts is None:
            continue
        path = Path(shm_dir) / name
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        liveness = "unknown" if parts.pidns != ns else ("alive" if process_alive(parts.pid) else "dead")
        mode = oct(stat.S_IMODE(st.st_mode))
        out.append(SegmentInfo(name, str(path), parts.kind, parts.pid, liveness, st.st_size, mode, st.st_uid))
    return out


def sweep_dead(shm_dir: str = SHM_DIR, dry_run: bool = False) -> list[SegmentInfo]:
    """Unlink our uid's segments whose owner is dead (same PID namespace only); returns what was
    (would be) removed. Another user's files are theirs, even for root."""
    me = os.geteuid()
    removed = [s for s in list_segments(shm_dir) if s.liveness == "dead" and s.uid == me]
    if not dry_run:
        for s in removed:
            unlink_quietly(Path(s.path))
    return removed
