"""Shared-memory segments under the shm mount: naming, creation, attachment, listing, sweeping.

Why not ``multiprocessing.shared_memory``: on Python 3.11 every process that attaches a segment
registers it with its resource tracker, which unlinks it when that process exits (CPython #82300;
``track=False`` only exists from 3.13), so a sampler that exits would delete the worker's queue.
We open the file ourselves and ``mmap`` it: nothing unlinks a segment but its owner (``close``) or a
sweep of a dead owner's segments.

Where: not in the shared, world-writable ``/dev/shm`` itself but in a directory of this uid under it,
``<shm_dir>/lowtail-<uid>`` (mode 0700, created on first use). Any user can create any name in
``/dev/shm``; nobody but the owner (and root) can create one in that directory, so what lowtail looks
at, and what listing and sweeping cost, no longer depends on what others put in the mount. The
directory is opened with ``O_NOFOLLOW | O_DIRECTORY`` and its owner and mode checked on every open
(``ShmDirUnsafe`` if it is a symlink, not a directory, another uid's, or open to group/other: a
squatter is named, never trusted); segments are opened relative to its fd (``openat`` with
``O_NOFOLLOW``) under names that cannot hold a ``/``, so no path can leave it.

Names are ``lowtail.<kind>.<pidns>.<pid>.<token>`` (``NAME_RE``, parsed strictly: decimal numbers
without sign or padding, a pid in 1..``PID_MAX``, a 12-digit hex token): ``kind`` is ``q`` (a
queue's control segment) or ``nd`` (an ndarray segment), ``pidns`` the inode of the creator's PID
namespace and ``pid`` the creator's pid in it. Anything else in the directory is ignored and counted.
The liveness of a segment is the liveness of that pid, which is only meaningful inside the same PID
namespace: segments of another namespace (a pod sharing ``/dev/shm`` through hostIPC) are listed as
``unknown`` and never swept.

Capacity is reserved with ``posix_fallocate`` at creation: a tmpfs smaller than the segment gives a
clear ``ShmTooSmall`` now instead of a SIGBUS at the first write to an unbacked page later.
"""

from __future__ import annotations

import contextlib
import errno
import mmap
import os
import re
import secrets
import stat
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path

import psutil

from lowtail.shm.errors import SegmentNotFound, ShmDirUnsafe, ShmTooSmall

SHM_DIR = "/dev/shm"
PREFIX = "lowtail"
KINDS = ("q", "nd")
# The largest pid_max Linux allows (PID_MAX_LIMIT, include/linux/threads.h: 4M on 64-bit): a name
# with a larger pid is not one lowtail made (and psutil.pid_exists raises OverflowError at 2^31).
PID_MAX = 1 << 22
NAME_RE = re.compile(r"lowtail\.(q|nd)\.(0|[1-9][0-9]{0,19})\.([1-9][0-9]{0,6})\.([0-9a-f]{12})")
_DIR_OPEN = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


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


def parse_name(name: object) -> NameParts | None:
    """The parts of a lowtail segment name, or None for anything else (never an exception)."""
    if not isinstance(name, str) or not name.isascii():
        return None
    m = NAME_RE.fullmatch(name)
    if m is None or int(m[2]) >= 1 << 64 or int(m[3]) > PID_MAX:
        return None
    return NameParts(m[1], int(m[2]), int(m[3]), m[4])


def process_alive(pid: int) -> bool:
    """True while ``pid`` is a process: another user's counts (EPERM), and so does an unreaped zombie
    (its creator may still reap it and the name stays its own until then). A thread id is not a process.
    A pid out of Linux's range is no process (psutil would raise OverflowError for it)."""
    if not 0 < pid <= PID_MAX:
        return False
    return bool(psutil.pid_exists(pid))


def private_dir(shm_dir: str = SHM_DIR, uid: int | None = None) -> Path:
    """Where this uid's segments live: ``<shm_dir>/lowtail-<uid>``."""
    return Path(shm_dir) / f"{PREFIX}-{os.geteuid() if uid is None else uid}"


def open_private_dir(shm_dir: str = SHM_DIR, create: bool = False) -> int:
    """An fd of this uid's segment directory, checked: a directory (not a symlink), ours, mode 0700.

    ``create`` makes it first if missing. ``SegmentNotFound`` if it (or the mount) does not exist.
    """
    path = private_dir(shm_dir)
    if create:
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass
        except FileNotFoundError:
            raise SegmentNotFound(f"shared-memory directory {shm_dir} does not exist") from None
    try:
        fd = os.open(path, _DIR_OPEN)
    except FileNotFoundError:
        raise SegmentNotFound(f"{path} does not exist: no lowtail segment of this uid here") from None
    except OSError as e:
        if e.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        kind = "a symlink" if os.path.islink(path) else "not a directory"
        raise ShmDirUnsafe(
            f"refusing {path}: it is {kind} (owner uid {os.lstat(path).st_uid}); lowtail keeps this uid's "
            f"segments in a 0700 directory of its own there: remove the impostor"
        ) from None
    try:
        st = os.fstat(fd)
        if st.st_uid != os.geteuid():
            raise ShmDirUnsafe(
                f"refusing {path}: owned by uid {st.st_uid}, not by this process's uid {os.geteuid()} "
                f"(another user made it first: remove it)"
            )
        if stat.S_IMODE(st.st_mode) != 0o700:
            os.fchmod(fd, 0o700)  # ours: a umask or a chmod must not open it to group or other
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def private_dir_fd(shm_dir: str = SHM_DIR, create: bool = False) -> Iterator[int]:
    fd = open_private_dir(shm_dir, create)
    try:
        yield fd
    finally:
        os.close(fd)


def _check_plain(name: str) -> None:
    if parse_name(name) is None:
        raise SegmentNotFound(f"{name!r} is not a lowtail segment name ({PREFIX}.<kind>.<ns>.<pid>.<tok>)")


class Segment:
    """One mapped segment. ``fd`` stays open for its lifetime (the queue takes OFD locks on it)."""

    def __init__(self, name: str, shm_dir: str, fd: int, mm: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.shm_dir = shm_dir
        self.path = private_dir(shm_dir) / name
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
            unlink_segment(self.shm_dir, self.name)

    @property
    def closed(self) -> bool:
        return self._closed


def unlink_segment(shm_dir: str, name: str) -> None:
    """Unlink ``name`` from this uid's directory (gone already, or the directory gone: nothing to do)."""
    _check_plain(name)
    with contextlib.suppress(FileNotFoundError, SegmentNotFound), private_dir_fd(shm_dir) as dfd:
        os.unlink(name, dir_fd=dfd)


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
    with private_dir_fd(shm_dir, create=True) as dfd:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        fd = os.open(name, flags, mode, dir_fd=dfd)
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
                            f"{shm_dir} cannot hold a {size}-byte segment ({free_bytes(shm_dir)} bytes "
                            f"free): enlarge it (e.g. an emptyDir with medium: Memory and a sizeLimit) or "
                            f"ask for fewer lanes/slots or smaller slots"
                        ) from None
                    raise
            except BaseException:
                mm.close()
                raise
        except BaseException:
            os.close(fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(name, dir_fd=dfd)
            raise
    return Segment(name, shm_dir, fd, mm, owner=True)


def check_owned(fd: int, path: Path, mode: int) -> os.stat_result:
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
    return st


def open_segment_fd(name: str, shm_dir: str = SHM_DIR, mode: int = 0o600) -> tuple[int, os.stat_result]:
    """An fd of an existing segment, opened relative to this uid's directory (``openat``, ``O_NOFOLLOW``,
    a name without ``/``) and checked by ``check_owned``; the caller closes it."""
    _check_plain(name)
    path = private_dir(shm_dir) / name
    with private_dir_fd(shm_dir) as dfd:
        try:
            fd = os.open(name, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        except FileNotFoundError:
            raise SegmentNotFound(
                f"segment {path} does not exist on this host: its owner is gone, or the descriptor was "
                f"made on another node (shared memory is node-local)"
            ) from None
        except OSError as e:
            raise SegmentNotFound(f"refusing to attach {path}: {e.strerror}") from None
    try:
        return fd, check_owned(fd, path, mode)
    except BaseException:
        os.close(fd)
        raise


def attach_segment(name: str, shm_dir: str = SHM_DIR, mode: int = 0o600) -> Segment:
    """Map an existing segment read-write (see ``open_segment_fd`` for what is refused). The caller
    never unlinks it."""
    fd, st = open_segment_fd(name, shm_dir, mode)
    try:
        if st.st_size <= 0:
            raise SegmentNotFound(f"refusing to attach {private_dir(shm_dir) / name}: it is empty")
        mm = mmap.mmap(fd, st.st_size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    except BaseException:
        os.close(fd)
        raise
    return Segment(name, shm_dir, fd, mm, owner=False)


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
    foreign: str = ""  # why this entry is not a segment of ours ("" when it is): never swept

    def to_dict(self) -> dict[str, object]:
        return dict(self.__dict__)


@dataclass(frozen=True)
class Listing:
    """What ``scan`` found: segments (foreign ones flagged) and how many other entries it ignored."""

    dir: str
    segments: list[SegmentInfo]
    ignored: int


def scan(shm_dir: str = SHM_DIR) -> Listing:
    """This uid's directory: every entry named like a segment with its owner's liveness, sorted by
    name, and a count of the entries that are not (ignored, never an exception)."""
    ns, me = pid_namespace(), os.geteuid()
    where = str(private_dir(shm_dir))
    out: list[SegmentInfo] = []
    try:
        dfd = open_private_dir(shm_dir)
    except SegmentNotFound as e:
        if isinstance(e, ShmDirUnsafe):
            raise
        return Listing(where, out, 0)
    ignored = 0
    try:
        for name in sorted(os.listdir(dfd)):
            parts = parse_name(name)
            if parts is None:
                ignored += 1
                continue
            try:
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            liveness = "unknown" if parts.pidns != ns else ("alive" if process_alive(parts.pid) else "dead")
            foreign = []
            if not stat.S_ISREG(st.st_mode):
                foreign.append("symlink" if stat.S_ISLNK(st.st_mode) else "not a regular file")
            if st.st_uid != me:
                foreign.append(f"owned by uid {st.st_uid}")
            mode = oct(stat.S_IMODE(st.st_mode))
            info = SegmentInfo(
                name, f"{where}/{name}", parts.kind, parts.pid, liveness, st.st_size, mode, st.st_uid
            )
            out.append(replace(info, foreign="; ".join(foreign)))
    finally:
        os.close(dfd)
    return Listing(where, out, ignored)


def list_segments(shm_dir: str = SHM_DIR) -> list[SegmentInfo]:
    """Every lowtail segment of this uid under ``shm_dir`` (see ``scan``)."""
    return scan(shm_dir).segments


def sweep_dead(
    shm_dir: str = SHM_DIR, dry_run: bool = False, kinds: tuple[str, ...] = KINDS
) -> list[SegmentInfo]:
    """Unlink this uid's segments of ``kinds`` whose owner is dead (same PID namespace only); returns
    what was (would be) removed. A foreign entry (another uid's, a symlink, a directory) is never touched."""
    removed = [
        s for s in list_segments(shm_dir) if s.liveness == "dead" and not s.foreign and s.kind in kinds
    ]
    if not dry_run:
        for s in removed:
            unlink_segment(shm_dir, s.name)
    return removed


class DeadSweep:
    """``sweep_dead`` in bounded steps, for a process that must not stall on it (the worker's claim).

    Each ``step`` reads directory entries from where the last one stopped and unlinks those of
    ``kinds`` whose owner is dead (same PID namespace, a regular file of this uid: what ``sweep_dead``
    removes) until ``budget_ns`` has passed, at least one entry; a pass ends at the end of the
    directory and the next step starts another. The whole scan cost ~25 us an entry, most of it the
    owner's liveness query: a step asks once per owner pid (a dead owner's 20,000 slots cost one), and
    forgets the answers when it returns, so a pid that is reused later is asked again.
    """

    def __init__(self, shm_dir: str = SHM_DIR, kinds: tuple[str, ...] = KINDS) -> None:
        self.shm_dir = shm_dir
        self.kinds = kinds
        self.removed = 0  # entries unlinked since this object was made
        self.passes = 0  # passes completed
        self._dfd = -1
        self._entries: Iterator[os.DirEntry[str]] | None = None

    @property
    def in_pass(self) -> bool:
        return self._entries is not None

    def step(self, budget_ns: int) -> bool:
        """Sweep for about ``budget_ns``; True when this step finished a pass."""
        start = time.monotonic_ns()
        if self._entries is None:
            try:
                self._dfd = open_private_dir(self.shm_dir)
            except SegmentNotFound:
                return True  # no directory (nothing to sweep), or one refused by name to whoever lists it
            self._entries = os.scandir(self._dfd)
        ns, me, kinds = pid_namespace(), os.geteuid(), self.kinds
        alive: dict[int, bool] = {}
        for entry in self._entries:
            parts = parse_name(entry.name)
            if parts is not None and parts.kind in kinds and parts.pidns == ns:
                live = alive.get(parts.pid)
                if live is None:
                    live = alive[parts.pid] = process_alive(parts.pid)
                if not live:
                    with contextlib.suppress(FileNotFoundError):
                        st = entry.stat(follow_symlinks=False)
                        if stat.S_ISREG(st.st_mode) and st.st_uid == me:
                            os.unlink(entry.name, dir_fd=self._dfd)
                            self.removed += 1
            if time.monotonic_ns() - start >= budget_ns:
                return False
        self.close()
        self.passes += 1
        return True

    def close(self) -> None:
        """End the pass in progress (the next step starts a new one)."""
        if self._entries is not None:
            self._entries.close()  # type: ignore[attr-defined]
            self._entries = None
        if self._dfd >= 0:
            os.close(self._dfd)
            self._dfd = -1
