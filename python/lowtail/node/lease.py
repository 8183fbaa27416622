"""CPU leases: one node's isolated CPUs handed out to exactly one owner each.

Without Ray (``lowtail.actors.allocator`` wraps it in a per-node actor): the pool is the plan's isolated
CPUs, not whatever the allocator's own affinity mask happens to be; an owner can ask to be near a CPU or a
NUMA node (same L3 group first, then same node); dead owners are reclaimed (a process that is gone, a Ray
actor that is dead); and the table lives in a JSON file on the node so a restarted allocator rebuilds it.

Owners are named ``infer:<hero>:<actor>``, ``sample:<name>`` or ``other:<name>``: three kinds, which the
audit line groups by.

Concurrency: every operation holds a thread lock and, when the table has a state file, an ``flock`` on
a lock file next to it, and re-reads the file first. So any number of threads and processes sharing a
state directory agree on one table: the Ray actor is the normal single writer, the file lock is what
makes a restart race or a second process on the node safe too. This is control plane (a lease is
taken once per actor), never the inference hot path.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import math
import os
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from lowtail.errors import LowtailError
from lowtail.node import cpulist
from lowtail.node.plan import Plan, load_plan, make_plan
from lowtail.node.process import boot_id, process_start_time
from lowtail.node.topology import read_topology

log = logging.getLogger(__name__)

KINDS: tuple[str, ...] = ("infer", "sample", "other")
DEFAULT_PLAN_PATH = Path("/etc/lowtail/plan.json")
DEFAULT_STATE_DIR = Path("/run/lowtail")
STATE_FILE = "leases.json"
LOCK_FILE = "leases.lock"
STATE_VERSION = 1
# A table of a few hundred CPUs x share is tens of KiB; anything far larger is not one we wrote
# (and json would take minutes over it while every lease call waits on the lock).
MAX_STATE_BYTES = 4 << 20
TEMP_PREFIX = ".leases."
# How long a lease call waits for the node-wide lock: a holder stopped (SIGSTOP, a debugger) or hung
# must not block every other owner's acquire forever; holders keep it for milliseconds.
LOCK_TIMEOUT_S = 10.0

_NAME = r"[A-Za-z0-9_.\-]+"
_OWNER_RE = {
    "infer": re.compile(rf"infer:{_NAME}:{_NAME}"),
    "sample": re.compile(rf"sample:{_NAME}(?::{_NAME})*"),
    "other": re.compile(rf"other:{_NAME}(?::{_NAME})*"),
}


class LeaseError(LowtailError, RuntimeError):
    """Base class of every lease error."""


class BadOwner(LeaseError, ValueError):
    """An owner name that is not ``infer:<hero>:<actor>``, ``sample:<name>`` or ``other:<name>``."""


class BadPlacement(LeaseError, ValueError):
    """A ``near`` hint naming a CPU or NUMA node this allocator does not know."""


class LeaseExhausted(LeaseError):
    """Every CPU of the pool is leased to a live owner."""


class PoolMismatch(LeaseExhausted):
    """The plan's isolated CPUs and the CPUs this process's cgroup allows share none."""


class PlanNotFound(LeaseError):
    """In a pod, no host plan is visible: leasing from a plan computed inside the pod would be wrong."""


class OwnerConflict(LeaseError):
    """An owner name already held by another live process (two actors given the same name)."""


class LeaseStateError(LeaseError):
    """The state file exists but cannot be read as a lease table (it is left in place for a person)."""


def owner_kind(owner: str) -> str:
    """Validate an owner name and return its kind (``infer``, ``sample`` or ``other``)."""
    if not isinstance(owner, str):
        raise BadOwner(f"owner {owner!r}: expected a string")
    kind = owner.partition(":")[0]
    pattern = _OWNER_RE.get(kind)
    if pattern is None or not pattern.fullmatch(owner):
        raise BadOwner(
            f"owner {owner!r}: expected 'infer:<hero>:<actor>', 'sample:<name>' or 'other:<name>' "
            "where names are letters, digits, '_', '.' or '-' (sample/other names may have ':' parts)"
        )
    return kind


# --- liveness ------------------------------------------------------------------------------------------


def pid_alive(lease: Lease) -> bool:
    """The default liveness check: the owner's process exists and is the same process (start time).

    Every lease records a pid and its start time; one without (a table from an older version) has
    no owner anybody can check, so it counts as dead and is reclaimed.
    """
    if lease.pid is None or lease.pid_start is None:
        return False
    return process_start_time(lease.pid) == lease.pid_start


# --- the table -----------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Lease:
    owner: str
    cpu: int
    node: int
    l3: int
    pid: int | None = None
    pid_start: int | None = None
    actor_id: str | None = None  # Ray actor id (hex) when the owner is a Ray actor
    acquired_at: float = 0.0
    placement: str = "any"  # how the near hint was met: same-l3, same-node, other-node, any

    @property
    def kind(self) -> str:
        return self.owner.partition(":")[0]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: object) -> Lease:
        """A lease as ``to_dict`` wrote it; ``ValueError`` naming the field for anything else (no coercion:
        a cpu of 3.9 is not CPU 3)."""
        if not isinstance(data, dict):
            raise ValueError(f"a lease is an object, got {type(data).__name__}")
        unknown = set(data) - _LEASE_FIELDS.keys()
        missing = {"owner", "cpu", "node", "l3"} - set(data)
        if unknown or missing:
            raise ValueError(f"lease keys: unknown {sorted(unknown)}, missing {sorted(missing)}")
        for key, value in data.items():
            if not _LEASE_FIELDS[key](value):
                raise ValueError(f"lease {data.get('owner')!r}: {key}={value!r} has the wrong type")
        if data["cpu"] < 0 or (data.get("pid") is not None and not 0 < data["pid"] < 1 << 22):
            raise ValueError(
                f"lease {data['owner']!r}: cpu {data['cpu']} or pid {data.get('pid')} out of range"
            )
        return cls(**data)


def _int(v: object) -> bool:
    return type(v) is int


def _opt_int(v: object) -> bool:
    return v is None or type(v) is int


_PLACEMENTS = ("same-l3", "same-node", "other-node", "any")
_LEASE_FIELDS: dict[str, Callable[[object], bool]] = {
    "owner": lambda v: isinstance(v, str),
    "cpu": _int,
    "node": _int,
    "l3": _int,
    "pid": _opt_int,
    "pid_start": _opt_int,
    "actor_id": lambda v: v is None or isinstance(v, str),
    "acquired_at": lambda v: type(v) in (int, float) and math.isfinite(v),  # type: ignore[arg-type]
    "placement": lambda v: v in _PLACEMENTS,
}


@dataclass(frozen=True)
class CpuPlace:
    node: int
    l3: int


def _places(plan: Plan) -> dict[int, CpuPlace]:
    node_of = {cpu: node for node, (hk, iso) in plan.per_node.items() for cpu in hk | iso}
    places: dict[int, CpuPlace] = {}
    for pool in plan.l3_pools:
        for cpu in pool.cpus:
            places[cpu] = CpuPlace(node=node_of.get(cpu, pool.node), l3=pool.index)
    for cpu, node in node_of.items():
        places.setdefault(cpu, CpuPlace(node=node, l3=-1))
    return places


LivenessCheck = Callable[[Lease], bool]
_PLACEMENT_ORDER = {"same-l3": 0, "same-node": 1, "other-node": 2, "any": 0}


def _state_dir(path: Path) -> Path:
    """The lease table's directory, created if missing; a symlink or a file there is refused."""
    try:
        path.mkdir(mode=0o755, parents=True, exist_ok=True)
    except OSError as e:
        raise LeaseStateError(f"lease state directory {path}: cannot create it ({e})") from None
    if path.is_symlink() or not path.is_dir():
        raise LeaseStateError(
            f"lease state directory {path} is a symlink or not a directory: expected a "
            f"directory of its own (a symlink there could redirect the table anywhere)"
        )
    return path


class LeaseAllocator:
    """Leases the isolated CPUs of one node's plan.

    ``pool`` replaces the plan's isolated CPUs (any CPUs of the plan) and ``share`` lets that many
    owners hold one CPU: both exist for demos on machines too small to isolate anything (a 2-vCPU VM);
    the audit line and ``describe()`` say so, and real nodes use neither.
    """

    def __init__(
        self,
        plan: Plan,
        *,
        state_dir: str | Path | None = None,
        pool: Iterable[int] | None = None,
        allowed: Iterable[int] | None = None,
        allowed_source: str = "given",
        share: int = 1,
        alive: LivenessCheck = pid_alive,
        audit_interval_s: float = 30.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._places = _places(plan)
        self._isolated = plan.isolated
        self.pool, self.excluded = self._lease_pool(plan, pool, allowed, allowed_source)
        if share < 1:
            raise ValueError(f"share {share}: expected at least 1 owner per CPU")
        self.share = share
        self.overridden = pool is not None
        self._alive = alive
        self._audit_interval = audit_interval_s
        self._clock = clock
        self._last_audit = clock()
        self._lock = threading.RLock()
        self._leases: dict[str, Lease] = {}
        self.state_dir = None if state_dir is None else _state_dir(Path(state_dir))
        self.dropped_on_start: list[tuple[Lease, str]] = []
        with self._transaction():
            self.dropped_on_start = self._rebuild()

    def _lease_pool(
        self, plan: Plan, pool: Iterable[int] | None, allowed: Iterable[int] | None, allowed_source: str
    ) -> tuple[frozenset[int], frozenset[int]]:
        """The CPUs to lease (the plan's isolated ones, or ``pool``) that are allowed here, and the chosen
        ones that are not."""
        chosen = frozenset(plan.isolated if pool is None else pool)
        unknown = chosen - self._places.keys()
        if unknown:
            raise BadPlacement(
                f"pool CPUs {cpulist.format(unknown)} are not in the plan; "
                f"the plan covers {cpulist.format(self._places)}"
            )
        excluded = frozenset() if allowed is None else chosen - frozenset(allowed)
        leasable = chosen - excluded
        if not leasable:
            what = "demo pool" if pool is not None else "plan's isolated CPUs"
            raise PoolMismatch(
                f"empty lease pool: the {what} {cpulist.format(chosen) or '-'} and the CPUs allowed here "
                f"{cpulist.format(frozenset(allowed or ())) or '-'} ({allowed_source}) share no CPU; "
                "expected the cgroup's cpuset to include isolated CPUs of this node's plan (is the plan "
                "the host's? in a pod, mount /etc/lowtail/plan.json or set LOWTAIL_PLAN)"
            )
        if excluded:
            log.warning(
                "lease pool %s: isolated CPUs %s are outside the CPUs allowed here (%s)",
                cpulist.format(leasable),
                cpulist.format(excluded),
                allowed_source,
            )
        return leasable, excluded

    # --- persistence -----------------------------------------------------------------------------------

    @property
    def state_path(self) -> Path | None:
        return None if self.state_dir is None else self.state_dir / STATE_FILE

    @contextlib.contextmanager
    def _transaction(self) -> Iterator[None]:
        """Hold the thread lock and the node-wide file lock; load before, save after (if no error)."""
        with self._lock:
            if self.state_dir is None:
                yield
                return
            lock = self.state_dir / LOCK_FILE
            try:
                fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            except OSError as e:
                raise LeaseStateError(
                    f"lease lock {lock}: cannot open it ({e}); expected a plain file, a symlink is refused"
                ) from None
            try:
                self._lock_file(fd, lock)
                self._remove_stale_temps()
                before = self._load()
                self._leases = dict(before)
                yield
                if self._leases != before:
                    try:
                        self._save()
                    except OSError as e:  # a full or read-only file system: the table stays as it was
                        raise LeaseStateError(
                            f"lease state {self.state_path}: cannot save it ({e})"
                        ) from None
            finally:
                os.close(fd)  # closing drops the flock

    @staticmethod
    def _lock_file(fd: int, path: Path) -> None:
        deadline = time.monotonic() + LOCK_TIMEOUT_S
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LeaseStateError(
                        f"lease lock {path}: held by another process for more than {LOCK_TIMEOUT_S:.0f} s "
                        f"(stopped or hung?); find it with fuser {path}"
                    ) from None
                time.sleep(0.005)

    def _load(self) -> dict[str, Lease]:
        path = self.state_path
        assert path is not None

        def bad(problem: str) -> LeaseStateError:
            return LeaseStateError(f"lease state {path}: {problem}; move it away to start empty")

        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with open(fd, "rb") as f:
                raw = f.read(MAX_STATE_BYTES + 1)
        except FileNotFoundError:
            return {}
        except OSError as e:
            raise bad(f"cannot read it ({e.strerror}; a symlink is refused)") from None
        if len(raw) > MAX_STATE_BYTES:
            raise bad(f"larger than {MAX_STATE_BYTES} bytes, not a table this allocator wrote")
        try:
            data = json.loads(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise bad(f"not UTF-8 ({e.reason} at byte {e.start})") from None
        except RecursionError:
            raise bad("nested too deeply to be a lease table") from None
        except json.JSONDecodeError as e:
            raise bad(f"not JSON ({e})") from None
        except ValueError as e:  # an integer of more digits than int() converts
            raise bad(f"not a table this allocator wrote ({e})") from None
        if not isinstance(data, dict) or not isinstance(data.get("leases"), list):
            raise bad("expected an object with a 'leases' list")
        if data.get("boot_id") is not None and not isinstance(data["boot_id"], str):
            raise bad(f"boot_id={data['boot_id']!r}: expected a string")
        if data.get("boot_id") and data["boot_id"] != boot_id():
            # pids from another boot mean nothing; a persistent state dir survives reboots.
            log.warning("lease state %s is from another boot: starting with an empty table", path)
            return {}
        out: dict[str, Lease] = {}
        for i, entry in enumerate(data["leases"]):
            try:
                lease = Lease.from_dict(entry)
                owner_kind(lease.owner)  # a bogus owner is refused here, not a KeyError in an audit later
            except ValueError as e:
                raise bad(f"lease {i}: {e}") from None
            if lease.owner in out:
                raise bad(f"lease {i}: owner {lease.owner!r} appears twice")
            out[lease.owner] = lease
        return out

    def _remove_stale_temps(self) -> None:
        """Temp files of a contender killed while saving (only a holder of the file lock writes one, so
        under that lock every one left is stale)."""
        assert self.state_dir is not None
        for name in os.listdir(self.state_dir):
            if name.startswith(TEMP_PREFIX):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.state_dir / name)

    def _save(self) -> None:
        path = self.state_path
        assert path is not None and self.state_dir is not None
        data = {
            "version": STATE_VERSION,
            "boot_id": boot_id(),
            "pool": cpulist.format(self.pool),
            "share": self.share,
            "leases": [lease.to_dict() for lease in sorted(self._leases.values(), key=lambda x: x.owner)],
        }
        # Write a temp file in the same directory, fsync, rename: a crash leaves the old or the new table.
        fd, tmp = tempfile.mkstemp(prefix=TEMP_PREFIX, dir=self.state_dir)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o600)  # like its lock: owners' pids and actor ids are the node's business
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            raise

    def _rebuild(self) -> list[tuple[Lease, str]]:
        """Drop leases of dead owners and of CPUs no longer in the pool; return what was dropped and why."""
        dropped: list[tuple[Lease, str]] = []
        for owner, lease in list(self._leases.items()):
            reason = None
            if lease.cpu not in self.pool:
                reason = f"CPU {lease.cpu} is no longer in the pool {cpulist.format(self.pool)}"
            elif not self._alive(lease):
                reason = "owner is dead"
            if reason:
                del self._leases[owner]
                dropped.append((lease, reason))
                log.warning("lease %s on CPU %d dropped at start: %s", owner, lease.cpu, reason)
        if self._overfull():
            # A state written with a larger share: keep the oldest holders of each CPU.
            for lease in sorted(self._leases.values(), key=lambda x: x.acquired_at):
                if sum(1 for x in self._leases.values() if x.cpu == lease.cpu) > self.share:
                    del self._leases[lease.owner]
                    dropped.append((lease, f"CPU {lease.cpu} over its share of {self.share}"))
        return dropped

    def _overfull(self) -> bool:
        counts: dict[int, int] = {}
        for lease in self._leases.values():
            counts[lease.cpu] = counts.get(lease.cpu, 0) + 1
        return any(n > self.share for n in counts.values())

    # --- leasing ---------------------------------------------------------------------------------------

    def acquire(
        self,
        owner: str,
        *,
        near_cpu: int | None = None,
        near_node: int | None = None,
        pid: int | None = None,
        actor_id: str | None = None,
    ) -> Lease:
        """Lease a CPU to ``owner`` (the same CPU again if it holds one) and return the lease.

        ``near_cpu``: prefer that CPU's L3 group, then its NUMA node. ``near_node``: prefer that node.
        ``pid`` (default: the calling process) / ``actor_id`` identify the owner for reclaiming when it
        dies: every lease records a live pid and its start time. An owner name held by a live process
        is ``OwnerConflict`` for any other process, whether it gave a pid or not.
        """
        owner_kind(owner)
        self._check_near(near_cpu, near_node)
        if pid is None:
            pid = os.getpid()
        if type(pid) is not int or not 0 < pid < 1 << 22:
            raise LeaseError(f"owner {owner!r}: pid {pid!r} is not a process id")
        start = process_start_time(pid)
        if start is None:
            raise LeaseError(f"owner {owner!r}: pid {pid} is not a running process")
        with self._transaction():
            held = self._leases.get(owner)
            if held is not None:
                same = held.pid == pid and held.pid_start == start
                if not same and self._alive(held):
                    raise OwnerConflict(
                        f"owner {owner!r} holds CPU {held.cpu} for live pid {held.pid}; pid {pid} asked "
                        "under the same name: owner names must be unique per node"
                    )
                # The same owner again (a restarted actor keeps its name): same CPU, new identity.
                held = replace(held, pid=pid, pid_start=start, actor_id=actor_id)
                self._leases[owner] = held
                return held
            return self._lease_new_locked(owner, near_cpu, near_node, pid=pid, start=start, actor_id=actor_id)

    def _check_near(self, near_cpu: int | None, near_node: int | None) -> None:
        if near_cpu is not None and near_node is not None:
            raise BadPlacement(f"near_cpu={near_cpu} and near_node={near_node}: give at most one")
        if near_cpu is not None and near_cpu not in self._places:
            raise BadPlacement(
                f"near_cpu={near_cpu}: not a CPU of this node ({cpulist.format(self._places)})"
            )
        nodes = {p.node for p in self._places.values()}
        if near_node is not None and near_node not in nodes:
            raise BadPlacement(f"near_node={near_node}: this node's NUMA nodes are {sorted(nodes)}")

    def _lease_new_locked(
        self,
        owner: str,
        near_cpu: int | None,
        near_node: int | None,
        *,
        pid: int,
        start: int,
        actor_id: str | None,
    ) -> Lease:
        """A free CPU for a new owner, reclaiming dead owners' CPUs if none is free."""
        choice = self._choose(near_cpu, near_node)
        if choice is None and self._reclaim_locked():
            choice = self._choose(near_cpu, near_node)
        if choice is None:
            raise LeaseExhausted(f"no free CPU for {owner!r}: {self._exhaustion_detail()}")
        cpu, placement = choice
        place = self._places[cpu]
        lease = Lease(
            owner=owner,
            cpu=cpu,
            node=place.node,
            l3=place.l3,
            pid=pid,
            pid_start=start,
            actor_id=actor_id,
            acquired_at=time.time(),
            placement=placement,
        )
        self._leases[owner] = lease
        log.info("lease %s -> CPU %d (node %d, l3 %d, %s)", owner, cpu, place.node, place.l3, placement)
        return lease

    def _choose(self, near_cpu: int | None, near_node: int | None) -> tuple[int, str] | None:
        load: dict[int, int] = {}
        for lease in self._leases.values():
            load[lease.cpu] = load.get(lease.cpu, 0) + 1
        free = [cpu for cpu in self.pool if load.get(cpu, 0) < self.share]
        if not free:
            return None
        free_in_l3: dict[int, int] = {}
        for cpu in free:
            free_in_l3[self._places[cpu].l3] = free_in_l3.get(self._places[cpu].l3, 0) + 1

        def placement(cpu: int) -> str:
            p = self._places[cpu]
            if near_cpu is not None:
                ref = self._places[near_cpu]
                return "same-l3" if p.l3 == ref.l3 else "same-node" if p.node == ref.node else "other-node"
            if near_node is not None:
                return "same-node" if p.node == near_node else "other-node"
            return "any"

        def key(cpu: int) -> tuple[int, int, int, int, int]:
            # Fewest holders first (matters only with share > 1), then isolated before housekeeping
            # (matters only with a demo pool), then the placement; without a hint the L3 group with the
            # most free CPUs, leaving room next to each lease for the samplers that will ask to be near
            # it; then the lowest number.
            spread = -free_in_l3[self._places[cpu].l3] if near_cpu is None and near_node is None else 0
            isolated = 0 if cpu in self._isolated else 1
            return (load.get(cpu, 0), isolated, _PLACEMENT_ORDER[placement(cpu)], spread, cpu)

        best = min(free, key=key)
        return best, placement(best)

    def _exhaustion_detail(self) -> str:
        by_kind = {k: 0 for k in KINDS}
        for lease in self._leases.values():
            by_kind[lease.kind] += 1
        per_node: dict[int, int] = {}
        per_l3: dict[int, int] = {}
        for cpu in self.pool:
            per_node[self._places[cpu].node] = per_node.get(self._places[cpu].node, 0) + 1
            per_l3[self._places[cpu].l3] = per_l3.get(self._places[cpu].l3, 0) + 1
        nodes = ", ".join(f"node {n}: {c}" for n, c in sorted(per_node.items()))
        return (
            f"pool {cpulist.format(self.pool)} has {len(self.pool)} CPUs ({nodes}; {len(per_l3)} L3 groups) "
            f"x share {self.share}, all leased to live owners "
            f"({', '.join(f'{k}={n}' for k, n in by_kind.items())})"
        )

    def release(self, owner: str) -> Lease | None:
        """Give back ``owner``'s CPU; returns the lease, or None if it held none."""
        owner_kind(owner)
        with self._transaction():
            lease = self._leases.pop(owner, None)
            if lease is not None:
                log.info("lease %s released CPU %d", owner, lease.cpu)
            return lease

    def reclaim(self) -> list[Lease]:
        """Drop the leases of dead owners; returns them."""
        with self._transaction():
            return self._reclaim_locked()

    def _reclaim_locked(self) -> list[Lease]:
        dead = [lease for lease in self._leases.values() if not self._alive(lease)]
        for lease in dead:
            del self._leases[lease.owner]
            log.warning("lease %s on CPU %d reclaimed: owner is dead", lease.owner, lease.cpu)
        return dead

    # --- reading ---------------------------------------------------------------------------------------

    def leases(self) -> list[Lease]:
        with self._transaction():
            return sorted(self._leases.values(), key=lambda x: (x.cpu, x.owner))

    def get(self, owner: str) -> Lease | None:
        owner_kind(owner)
        with self._transaction():
            return self._leases.get(owner)

    def by_kind(self) -> dict[str, list[Lease]]:
        groups: dict[str, list[Lease]] = {k: [] for k in KINDS}
        for lease in self.leases():
            groups[lease.kind].append(lease)
        return groups

    def audit_line(self) -> str:
        """One line, grouped by kind: ``leases infer=2 [3,5] sample=1 [4] other=0 [-] free=5/8``."""
        groups = self.by_kind()
        used = {lease.cpu for kind in groups.values() for lease in kind}
        parts = [f"{k}={len(v)} [{cpulist.format(x.cpu for x in v) or '-'}]" for k, v in groups.items()]
        line = f"leases {' '.join(parts)} free={len(self.pool - used)}/{len(self.pool)}"
        if self.overridden or self.share > 1:
            line += f" DEMO(pool={cpulist.format(self.pool)} share={self.share})"
        return line

    def tick(self) -> str | None:
        """Reclaim dead owners and, every ``audit_interval_s``, log and return the audit line."""
        self.reclaim()
        now = self._clock()
        if now - self._last_audit < self._audit_interval:
            return None
        self._last_audit = now
        line = self.audit_line()
        log.info("%s", line)
        return line

    def describe(self) -> dict[str, Any]:
        """Pool and leases as one JSON-able dict (what ``lowtail demo ray --json`` records)."""
        return {
            "pool": cpulist.format(self.pool),
            "excluded": cpulist.format(self.excluded),
            "share": self.share,
            "demo_override": self.overridden or self.share > 1,
            "state_file": None if self.state_path is None else str(self.state_path),
            "leases": [lease.to_dict() for lease in self.leases()],
        }


def locate_plan(path: str | Path | None = None) -> tuple[Plan, str]:
    """This node's plan and where it came from: ``path``, else ``$LOWTAIL_PLAN``, else
    /etc/lowtail/plan.json (written by the runtime role), else computed from the local topology with the
    default housekeeping, except in a Kubernetes pod, where that computation would see only the pod's
    cpuset and the kubelet's view, not the host's plan: there it is a ``PlanNotFound``."""
    chosen = path or os.environ.get("LOWTAIL_PLAN")
    if chosen:
        return load_plan(chosen), str(chosen)
    if DEFAULT_PLAN_PATH.exists():
        return load_plan(DEFAULT_PLAN_PATH), str(DEFAULT_PLAN_PATH)
    if os.environ.get("KUBERNETES_SERVICE_HOST"):
        raise PlanNotFound(
            f"running in a Kubernetes pod without the host's plan: neither LOWTAIL_PLAN is set nor "
            f"{DEFAULT_PLAN_PATH} exists; expected the host's plan mounted read-only (the lowtail_k8s "
            "RayCluster does this) rather than one computed from the pod's view"
        )
    return make_plan(read_topology()), "computed from this machine's topology (default housekeeping)"


def node_plan(path: str | Path | None = None) -> Plan:
    """This node's plan (see ``locate_plan``)."""
    return locate_plan(path)[0]
