"""The shared-memory inference queue: samplers (clients) -> one pinned worker -> back, without locks.

Roles: the *server* (``InferenceQueue.create``, e.g. the Ray inference actor) owns the segment; each
*client* (``QueueClient.attach``, a sampler) registers once and owns one *lane* of slots; one *worker*
(``QueueWorker.attach``, the pinned OpenVINO process) claims requests in batches and answers them.

Layout of the control segment ``lowtail.q.<pidns>.<pid>.<token>`` (little-endian; every field is an
aligned u64 unless noted; L = lanes, S = slots per lane, g = lane * S + slot)::

  offset                     size   field              single writer
  -- header (page 0) --------------------------------------------------------------------------
  0                          8      magic "LOWTAILQ"   creator, before anyone attaches
  8                          4+4    version, lanes     creator
  16                         4+4    slots/lane, request bytes   creator
  24                         4+4    response bytes, numa node (+1, 0 = none)   creator
  32                         8      creator pid        creator
  64                         8      worker pid (0 none) worker (attach / close)
  72                         8      worker epoch       worker (+1 per attach)
  128                        8      worker_sleep       worker writes 1 to park, 0 on waking; a client
                                                       writes 0 to wake it (the one shared-writer word:
                                                       both stores are idempotent, a stray one costs a
                                                       spurious wake-up). Low 32 bits are the futex.
  192 + 8*l                  8      doorbell[l]        client of lane l: requests published so far
  -- lane table at 4096, LANE_BYTES = align64(128 + 8*S) per lane ---------------------------------
  +0                         8      gen                client of the lane (+1 per registration)
  +8                         8      owner pid          client of the lane
  +16                        8      client_parked      client of the lane (1 while in futex_wait)
  +64                        8      tail               worker: requests of this lane taken
  +72                        8      resp_count         worker: +1 per answer; low 32 bits: futex
  +128 + 8*k                 8      ring[k]            client: slot of its request number k (mod S)
  -- slot table at align64(4096 + L*LANE_BYTES), 128 bytes per slot g ---------------------------
  +0   req_seq   +8 req_len   +16 req_state (FREE/WRITING/READY)   +24 submit_ns    client
  +64  resp_seq  +72 claim_seq  +80 resp_len  +88 resp_status  +96 claim_ns  +104 done_ns   worker
  -- request regions at align4096(...), request_bytes each, then response regions -------------
  payloads in the ``lowtail.shm.payload`` format; a payload that does not fit goes to an ndarray slot.

Publication: the writer fills the payload and the other words, then stores one sequence word last
(the doorbell for a request, resp_seq for an answer). This relies on x86-64 TSO: aligned 8-byte
stores are atomic and are never reordered with earlier stores, and loads are never reordered with
earlier loads, so a reader that sees the new sequence number sees everything written before it.
CPython writes a memoryview item of format "Q" with one 8-byte ``memcpy``, which compilers emit as
a single ``mov``. On another architecture this module refuses to run.

Slot states (the seed's, kept for diagnostics): FREE, WRITING, READY (req_seq > claim_seq),
PROCESSING (claim_seq == req_seq > resp_seq), DONE or ERROR (resp_seq == req_seq, by resp_status,
until the client has read it and wrote FREE).

Waiting: each side spins (bounded) on the word it waits for, then parks on a futex after setting
its parked word, a full barrier, and a re-check; the other side publishes, executes a full
barrier, and makes the wake-up system call only when it sees the parked word set (see
``lowtail.shm.futex``). Every park has a timeout, which is also when a client checks worker liveness.

Liveness: the worker holds an OFD write lock on byte 0 of the segment file, a client on byte
1 + lane (``lowtail.shm.ofd_lock``); the kernel releases them when the holder dies, so a killed client's
lane is free at once, and a client finds a dead worker at its next park timeout. A new client of a
lane bumps its gen; the worker skips the payload of an answer whose lane gen changed since the
claim (the fence), and the new client does not reuse a slot until the dead client's request in it
has been answered.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
import struct
import time
import weakref
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lowtail.shm import numa, ofd_lock
from lowtail.shm import payload as ndslot
from lowtail.shm.errors import (
    BadConfig,
    BadRequest,
    LaneBusy,
    LaneUnavailable,
    NumaError,
    PayloadTooLarge,
    QueueError,
    QueueTimeout,
    RequestFailed,
    SegmentNotFound,
    ShmTooSmall,
    WorkerDied,
)
from lowtail.shm.futex import full_barrier, futex_wait, futex_wake, is_supported_platform
from lowtail.shm.payload import Arrays, AttachedSlots, NdarraySlot, NdarraySlotPool, PayloadLayout, Spec
from lowtail.shm.segments import SHM_DIR, Segment, attach_segment, create_segment, parse_name, sweep_dead

__all__ = [
    "BadConfig",
    "BadRequest",
    "Batch",
    "InferenceQueue",
    "LaneBusy",
    "LaneUnavailable",
    "NdarraySlot",
    "NumaError",
    "PayloadTooLarge",
    "Pending",
    "QueueClient",
    "QueueConfig",
    "QueueDescriptor",
    "QueueError",
    "QueueSnapshot",
    "QueueTimeout",
    "QueueWorker",
    "RequestFailed",
    "SegmentNotFound",
    "ShmTooSmall",
    "Ticket",
    "WorkerDied",
]

MAGIC = int.from_bytes(b"LOWTAILQ", "little")
VERSION = 1
PAGE = 4096
MAX_LANES = 256  # OFD lock bytes 1..256; doorbells fit page 0 with room to spare

H_MAGIC, H_GEOM0, H_GEOM1, H_GEOM2, H_CREATOR = 0, 8, 16, 24, 32
H_WORKER_PID, H_WORKER_EPOCH, H_WORKER_SLEEP, H_DOORBELLS = 64, 72, 128, 192
LANE_BASE = PAGE
L_GEN, L_PID, L_PARKED, L_TAIL, L_RESP_COUNT, L_RING = 0, 8, 16, 64, 72, 128
SLOT_BYTES = 128
S_REQ_SEQ, S_REQ_LEN, S_REQ_STATE, S_SUBMIT_NS = 0, 8, 16, 24
S_RESP_SEQ, S_CLAIM_SEQ, S_RESP_LEN, S_RESP_STATUS, S_CLAIM_NS, S_DONE_NS = 64, 72, 80, 88, 96, 104
# The same fields as u64 word indices from a slot's first word ``si``: the hot paths read
# ``q[si + W_RESP_SEQ]``, never a bare number.
W_REQ_SEQ, W_REQ_LEN, W_REQ_STATE, W_SUBMIT_NS = (
    S_REQ_SEQ >> 3,
    S_REQ_LEN >> 3,
    S_REQ_STATE >> 3,
    S_SUBMIT_NS >> 3,
)
W_RESP_SEQ, W_CLAIM_SEQ, W_RESP_LEN = S_RESP_SEQ >> 3, S_CLAIM_SEQ >> 3, S_RESP_LEN >> 3
W_RESP_STATUS, W_CLAIM_NS, W_DONE_NS = S_RESP_STATUS >> 3, S_CLAIM_NS >> 3, S_DONE_NS >> 3

FREE, WRITING, READY = 0, 1, 2
STATE_NAMES = ("FREE", "WRITING", "READY", "PROCESSING", "DONE", "ERROR")
ST_OK, ST_FAILED, ST_BAD_REQUEST, ST_TOO_LARGE, ST_WORKER_DIED, ST_CLIENT_GONE = 0, 1, 2, 3, 4, 5
_STATUS_ERRORS: dict[int, type[QueueError]] = {
    ST_FAILED: RequestFailed,
    ST_BAD_REQUEST: BadRequest,
    ST_TOO_LARGE: PayloadTooLarge,
    ST_WORKER_DIED: WorkerDied,
    ST_CLIENT_GONE: RequestFailed,
}
PURE_SPIN_NS = 20_000  # a client spins without system calls this long, then yields while spinning
PARK_SLICE_S = 0.02  # a parked client re-checks worker liveness this often (50 wake-ups/s, ~0.05% CPU)
WORKER_PARK_SLICE_S = 0.25


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class QueueConfig:
    """Geometry and behaviour of a queue; validated at construction (``BadConfig`` names the field)."""

    lanes: int = 16
    slots_per_lane: int = 16
    # A normal batch, 16 x 512 float32 observations (32,832 B with its header), and its answer (the default
    # policy model's 16 x 63 float32, 4,544 B) fit inline; the segment stays 48 KiB per slot as before.
    request_bytes: int = 36864
    response_bytes: int = 12288
    numa_node: int | None = None
    max_batch_slots: int = 16
    max_batch_samples: int = 16
    min_batch_samples: int = 8
    # Under load the worker waits up to this long for more samples when a batch is below
    # min_batch_samples and another lane is active; a lone client never waits for it.
    coalesce_us: int = 200
    mode: int = 0o600
    shm_dir: str = SHM_DIR
    max_ndslot_bytes: int = 256 << 20  # a payload above this (or 0 to disable) raises PayloadTooLarge
    client_spin_us: int = 200  # spin this long for an answer before parking
    worker_idle_us: int = 2000  # the worker spins this long after its last request before parking

    def __post_init__(self) -> None:
        def check(name: str, ok: bool, expected: str) -> None:
            if not ok:
                raise BadConfig(f"QueueConfig.{name}={getattr(self, name)!r}: expected {expected}")

        check("lanes", 1 <= self.lanes <= MAX_LANES, f"1..{MAX_LANES}")
        check("slots_per_lane", 1 <= self.slots_per_lane <= 4096, "1..4096")
        for name in ("request_bytes", "response_bytes"):
            v = getattr(self, name)
            check(name, v >= 256 and v % 64 == 0 and v < 1 << 31, "a multiple of 64 in 256..2^31")
        check("numa_node", self.numa_node is None or self.numa_node >= 0, "None or a node number >= 0")
        check("max_batch_slots", self.max_batch_slots >= 1, ">= 1")
        check("max_batch_samples", self.max_batch_samples >= 1, ">= 1")
        check(
            "min_batch_samples",
            1 <= self.min_batch_samples <= self.max_batch_samples,
            f"1..max_batch_samples ({self.max_batch_samples})",
        )
        check("coalesce_us", 0 <= self.coalesce_us <= 100_000, "0..100000 (a bounded window)")
        check("mode", 0 <= self.mode <= 0o777, "permission bits such as 0o600")
        check("max_ndslot_bytes", self.max_ndslot_bytes >= 0, ">= 0 (0 disables ndarray slots)")
        check("client_spin_us", 0 <= self.client_spin_us <= 1_000_000, "0..1000000")
        check("worker_idle_us", 0 <= self.worker_idle_us <= 10_000_000, "0..10000000")

    @property
    def slots(self) -> int:
        return self.lanes * self.slots_per_lane


@dataclass(frozen=True)
class _Geometry:
    lanes: int
    spl: int
    req_bytes: int
    resp_bytes: int
    lane_bytes: int
    slot_base: int
    req_base: int
    resp_base: int
    total: int

    @classmethod
    def of(cls, lanes: int, spl: int, req_bytes: int, resp_bytes: int) -> _Geometry:
        lane_bytes = _align(L_RING + 8 * spl, 64)
        slot_base = _align(LANE_BASE + lanes * lane_bytes, 64)
        req_base = _align(slot_base + lanes * spl * SLOT_BYTES, PAGE)
        resp_base = req_base + lanes * spl * req_bytes
        total = _align(resp_base + lanes * spl * resp_bytes, PAGE)
        return cls(lanes, spl, req_bytes, resp_bytes, lane_bytes, slot_base, req_base, resp_base, total)

    def lane(self, lane: int, field_off: int) -> int:
        """u64 index of a lane field."""
        return (LANE_BASE + lane * self.lane_bytes + field_off) >> 3

    def slot(self, g: int, field_off: int) -> int:
        return (self.slot_base + g * SLOT_BYTES + field_off) >> 3

    def req_off(self, g: int) -> int:
        return self.req_base + g * self.req_bytes

    def resp_off(self, g: int) -> int:
        return self.resp_base + g * self.resp_bytes


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


DESCRIPTOR_VERSION = 1


@dataclass(frozen=True)
class QueueDescriptor:
    """What a client or worker needs to attach: small plain data.

    It crosses processes as ``to_bytes`` (versioned JSON, checked field by field by ``from_bytes``),
    never as a pickle: the receiver of a pickle runs whatever the sender chose.
    """

    name: str
    config: QueueConfig
    hostname: str
    boot_id: str

    @property
    def path(self) -> Path:
        return Path(self.config.shm_dir) / self.name

    def to_bytes(self) -> bytes:
        doc = {"version": DESCRIPTOR_VERSION, "name": self.name, "hostname": self.hostname,
               "boot_id": self.boot_id, "config": asdict(self.config)}  # fmt: skip
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> QueueDescriptor:
        """The descriptor ``to_bytes`` made; ``BadConfig`` names any field that is not what it wrote."""
        try:
            doc = json.loads(raw)
        except (ValueError, UnicodeDecodeError) as e:
            raise BadConfig(f"queue descriptor: not JSON ({e})") from None
        want = {"version", "name", "hostname", "boot_id", "config"}
        if not isinstance(doc, dict) or set(doc) != want:
            got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
            raise BadConfig(f"queue descriptor: keys {got}, expected {sorted(want)}")
        if doc["version"] != DESCRIPTOR_VERSION:
            raise BadConfig(f"queue descriptor version {doc['version']!r}, expected {DESCRIPTOR_VERSION}")
        for key in ("name", "hostname", "boot_id"):
            if not isinstance(doc[key], str):
                raise BadConfig(f"queue descriptor {key}={doc[key]!r}: expected a string")
        parts = parse_name(doc["name"])
        if parts is None or parts.kind != "q":
            raise BadConfig(f"queue descriptor name {doc['name']!r}: expected a lowtail.q.* segment name")
        cfg = doc["config"]
        fields = {f.name for f in dataclasses.fields(QueueConfig)}
        if not isinstance(cfg, dict) or set(cfg) != fields:
            got = sorted(cfg) if isinstance(cfg, dict) else cfg
            raise BadConfig(f"queue descriptor config keys {got!r}, expected {sorted(fields)}")
        for key, value in cfg.items():
            ok = (
                isinstance(value, str)
                if key == "shm_dir"
                else type(value) is int or (key == "numa_node" and value is None)
            )
            if not ok:
                raise BadConfig(f"queue descriptor config {key}={value!r}: wrong type")
        return cls(doc["name"], QueueConfig(**cfg), doc["hostname"], doc["boot_id"])


class _Mapped:
    """A segment mapped with the u64 word view and byte view every role uses."""

    def __init__(self, seg: Segment, geo: _Geometry) -> None:
        self.seg = seg
        self.geo = geo
        self.mem = memoryview(seg.mm)
        self.q = self.mem.cast("Q")
        self.buf: np.ndarray[Any, Any] = np.frombuffer(seg.mm, np.uint8)
        self._anchor = np.frombuffer(seg.mm, np.uint64)
        self.base_addr = int(self._anchor.ctypes.data)

    def addr(self, index: int) -> int:
        """Address of the u64 word at ``index`` (its low 32 bits are the futex word)."""
        return self.base_addr + index * 8

    def close(self) -> None:
        # A view a caller still holds (batch inputs kept past complete()) must not keep the segment
        # file alive: the mapping then lives until that view is collected, the name is unlinked now.
        with contextlib.suppress(BufferError):
            self.q.release()
            self.mem.release()
        del self.buf
        del self._anchor
        self.seg.close()


def _attach(desc: QueueDescriptor) -> _Mapped:
    if not is_supported_platform():
        raise QueueError("the queue's publication protocol assumes x86-64 (TSO) store ordering on Linux")
    local_boot = _boot_id()
    if desc.boot_id and local_boot and desc.boot_id != local_boot:
        raise SegmentNotFound(
            f"queue {desc.name} lives on host {desc.hostname} (boot {desc.boot_id[:8]}), this is "
            f"{socket.gethostname()} (boot {local_boot[:8]}): shared memory is node-local, use an "
            f"inference endpoint on this node"
        )
    seg = attach_segment(desc.name, desc.config.shm_dir, desc.config.mode)
    cfg = desc.config
    geo = _Geometry.of(cfg.lanes, cfg.slots_per_lane, cfg.request_bytes, cfg.response_bytes)
    m = _Mapped(seg, geo)
    if m.q[H_MAGIC >> 3] != MAGIC or seg.size < geo.total:
        m.close()
        raise SegmentNotFound(f"{desc.path} is not a lowtail queue of this geometry (magic or size mismatch)")
    return m


def _deadline_ns(now: int, timeout: float) -> int:
    """``now`` + ``timeout`` seconds in ns; ``math.inf`` waits without end (no OverflowError)."""
    if not timeout >= 0:  # also NaN
        raise QueueError(f"timeout={timeout!r}: expected seconds >= 0 (math.inf to wait without end)")
    return now + int(timeout * 1e9) if timeout < 1e9 else now + (1 << 62)


def _write_message(m: _Mapped, g: int, message: str) -> int:
    raw = message.encode("utf-8", "replace")[: m.geo.resp_bytes]
    off = m.geo.resp_off(g)
    m.buf[off : off + len(raw)] = np.frombuffer(raw, np.uint8)
    return len(raw)


def _read_message(m: _Mapped, g: int, n: int) -> str:
    off = m.geo.resp_off(g)
    n = max(0, min(n, m.geo.resp_bytes))
    return bytes(m.buf[off : off + n]).decode("utf-8", "replace")


# --------------------------------------------------------------------------------------------------
# Server: owns the segment
# --------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LaneSnapshot:
    lane: int
    owner_pid: int
    alive: bool
    gen: int
    states: tuple[str, ...]


@dataclass(frozen=True)
class QueueSnapshot:
    name: str
    worker_pid: int
    worker_alive: bool
    lanes: tuple[LaneSnapshot, ...]
    counts: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


class InferenceQueue:
    """The queue's owner: creates, sizes, binds and pre-faults the segment; ``close`` unlinks it."""

    def __init__(self, desc: QueueDescriptor, mapped: _Mapped) -> None:
        self.descriptor = desc
        self._m = mapped

    @classmethod
    def create(cls, config: QueueConfig | None = None) -> InferenceQueue:
        cfg = config or QueueConfig()
        if not is_supported_platform():
            raise QueueError("the queue's publication protocol assumes x86-64 (TSO) store ordering on Linux")
        sweep_dead(cfg.shm_dir)  # stale segments of dead owners, before we add ours
        geo = _Geometry.of(cfg.lanes, cfg.slots_per_lane, cfg.request_bytes, cfg.response_bytes)
        if cfg.numa_node is not None:
            numa.node_cpus(cfg.numa_node)  # a clear NumaError for an unknown node, before any allocation

        def place(mm: Any) -> None:
            if cfg.numa_node is not None:
                numa.bind(mm, cfg.numa_node)

        seg = create_segment("q", geo.total, cfg.shm_dir, cfg.mode, place)
        try:
            numa.prefault(seg.mm, cfg.numa_node)
            m = _Mapped(seg, geo)
        except BaseException:
            seg.close()
            raise
        q = m.q
        q[H_GEOM0 >> 3] = VERSION | (cfg.lanes << 32)
        q[H_GEOM1 >> 3] = cfg.slots_per_lane | (cfg.request_bytes << 32)
        q[H_GEOM2 >> 3] = cfg.response_bytes | ((0 if cfg.numa_node is None else cfg.numa_node + 1) << 32)
        q[H_CREATOR >> 3] = os.getpid()
        q[H_MAGIC >> 3] = MAGIC  # last: an attacher checks it
        desc = QueueDescriptor(seg.name, cfg, socket.gethostname(), _boot_id())
        return cls(desc, m)

    def __enter__(self) -> InferenceQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if not self._m.seg.closed:
            self._m.close()
            # ndarray slots of a killed worker or client outlive their pool: the queue's end is theirs
            sweep_dead(self.descriptor.config.shm_dir)

    @property
    def nbytes(self) -> int:
        return self._m.geo.total

    def placement(self) -> dict[str, int]:
        """Pages of the segment per NUMA node (move_pages with no target nodes)."""
        return numa.placement(self._m.seg.mm)

    def snapshot(self) -> QueueSnapshot:
        m, geo, q = self._m, self._m.geo, self._m.q
        fd = m.seg.fd
        lanes: list[LaneSnapshot] = []
        counts = dict.fromkeys(STATE_NAMES, 0)
        for lane in range(geo.lanes):
            states: list[str] = []
            for s in range(geo.spl):
                g = lane * geo.spl + s
                st = _slot_state(q, geo, g)
                counts[st] += 1
                states.append(st)
            lanes.append(
                LaneSnapshot(
                    lane,
                    int(q[geo.lane(lane, L_PID)]),
                    ofd_lock.held(fd, 1 + lane),
                    int(q[geo.lane(lane, L_GEN)]),
                    tuple(states),
                )
            )
        return QueueSnapshot(
            self.descriptor.name, int(q[H_WORKER_PID >> 3]), ofd_lock.held(fd, 0), tuple(lanes), counts
        )


def _slot_state(q: memoryview, geo: _Geometry, g: int) -> str:
    req_state = q[geo.slot(g, S_REQ_STATE)]
    req, claim, resp = q[geo.slot(g, S_REQ_SEQ)], q[geo.slot(g, S_CLAIM_SEQ)], q[geo.slot(g, S_RESP_SEQ)]
    if req_state == WRITING:
        return "WRITING"
    if resp == req and req_state == READY:
        return "DONE" if q[geo.slot(g, S_RESP_STATUS)] == ST_OK else "ERROR"
    if req_state == FREE and resp == req:
        return "FREE"
    if claim == req:
        return "PROCESSING"
    return "READY"


# --------------------------------------------------------------------------------------------------
# Client: one lane, the hot path of a sampler
# --------------------------------------------------------------------------------------------------


@dataclass
class Ticket:
    """A submitted request; ``QueueClient.wait`` turns it into outputs once."""

    slot: int
    seq: int
    batch: int
    submit_ns: int
    consumed: bool = False


class Pending:
    """The seed's two-phase async form: ``client.start(...)`` returns at once, ``finish`` waits."""

    def __init__(self, client: QueueClient, ticket: Ticket) -> None:
        self.client = client
        self.ticket = ticket

    def done(self) -> bool:
        """True when the answer is there (``finish`` then returns without waiting)."""
        return self.client.ready(self.ticket)

    def finish(self, timeout: float = 1.0) -> Arrays:
        return self.client.wait(self.ticket, timeout)


class QueueClient:
    """A sampler's end of the queue: one lane, up to ``slots_per_lane`` requests in flight.

    Not thread-safe: one client per thread (a sampler loop); a process may hold several. Attach
    after ``fork``/``spawn``, never before: a forked child would share the lane's lifetime lock.
    """

    def __init__(self, desc: QueueDescriptor, m: _Mapped, lane: int, spin_us: int) -> None:
        self.descriptor = desc
        self.lane = lane
        self._m = m
        cfg, geo = desc.config, m.geo
        self._cfg = cfg
        self._spin_ns = spin_us * 1000
        q = m.q
        self._gen = int(q[geo.lane(lane, L_GEN)]) + 1
        q[geo.lane(lane, L_GEN)] = self._gen
        q[geo.lane(lane, L_PID)] = os.getpid()
        q[geo.lane(lane, L_PARKED)] = 0
        self._g0 = lane * geo.spl
        self._head = int(q[H_DOORBELLS // 8 + lane])
        self._doorbell_i = H_DOORBELLS // 8 + lane
        self._ring_i = geo.lane(lane, L_RING)
        self._parked_i = geo.lane(lane, L_PARKED)
        self._count_i = geo.lane(lane, L_RESP_COUNT)
        self._free: list[int] = []
        # Slots with a request in flight -> its ticket (a weak reference), or None once nobody waits
        # for it (a dead predecessor's, an abandoned or failed ticket's). A slot whose ticket is gone
        # is reusable as soon as the worker answered it (or fenced it): the worker writes nothing
        # to an answered slot, so reuse cannot cross answers.
        self._inflight: dict[int, weakref.ref[Ticket] | None] = {}
        published = self._published_slots()
        for s in range(geo.spl):
            g = self._g0 + s
            req = q[geo.slot(g, S_REQ_SEQ)]
            if req == q[geo.slot(g, S_RESP_SEQ)] or (
                req != q[geo.slot(g, S_CLAIM_SEQ)] and s not in published
            ):
                # answered, or written by a predecessor killed before its doorbell: the worker can
                # never reach it (it is in no ring position it will read), so it is ours at once
                q[geo.slot(g, S_REQ_STATE)] = FREE
                self._free.append(s)
            else:
                self._inflight[s] = None
        self._free.reverse()  # pop() hands out slot 0 first
        self._pool = NdarraySlotPool(cfg.shm_dir, cfg.mode, cfg.numa_node)
        self._nd_req: dict[int, NdarraySlot] = {}
        self._attached = AttachedSlots()
        self._req_views: dict[int, tuple[PayloadLayout, Arrays]] = {}
        self._resp_views: dict[int, tuple[bytes, Arrays]] = {}
        self._timing = (0, 0, 0, 0)
        self._closed = False

    @classmethod
    def attach(cls, desc: QueueDescriptor, spin_us: int | None = None) -> QueueClient:
        """Map the queue and take a free lane (the only step that may contend: OFD byte locks)."""
        m = _attach(desc)
        try:
            for lane in range(m.geo.lanes):
                if ofd_lock.try_lock(m.seg.fd, 1 + lane):
                    return cls(desc, m, lane, desc.config.client_spin_us if spin_us is None else spin_us)
        except BaseException:
            m.close()
            raise
        m.close()
        raise LaneUnavailable(
            f"all {desc.config.lanes} lanes of queue {desc.name} are held by live clients; "
            f"create the queue with more lanes"
        )

    def __enter__(self) -> QueueClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def generation(self) -> int:
        return self._gen

    @property
    def last_timing(self) -> dict[str, int]:
        """Of the last answer taken: time queued before the claim, claim to answer, and round trip (ns)."""
        submit, claim, done, end = self._timing
        return {"queue_wait_ns": claim - submit, "infer_ns": done - claim, "round_trip_ns": end - submit}

    def close(self) -> None:
        """Give the lane back; requests still in flight are abandoned (their answers are dropped)."""
        if self._closed:
            return
        self._closed = True
        self._req_views.clear()
        self._resp_views.clear()
        self._m.q[self._m.geo.lane(self.lane, L_PID)] = 0
        ofd_lock.unlock(self._m.seg.fd, 1 + self.lane)  # a view kept past close must not hold the lane
        self._attached.close()
        self._pool.close()
        self._m.close()

    def _published_slots(self) -> set[int]:
        """Slots the worker may still take: ring positions [tail, doorbell) of this lane.

        Read tail first: the worker only moves it forward, so the positions it can still read are a
        subset of those read here.
        """
        q, geo = self._m.q, self._m.geo
        tail = q[geo.lane(self.lane, L_TAIL)]
        head = q[H_DOORBELLS // 8 + self.lane]
        if not 0 <= head - tail <= geo.spl:
            return set(range(geo.spl))  # corrupt words: trust nothing, wait for answers
        ring = geo.lane(self.lane, L_RING)
        return {int(q[ring + k % geo.spl]) for k in range(tail, head)}

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        q, geo = self._m.q, self._m.geo
        for s, ref in list(self._inflight.items()):
            ticket = ref() if ref is not None else None
            if ticket is not None and not ticket.consumed:
                continue  # someone may still wait() for it
            g = self._g0 + s
            if q[geo.slot(g, S_REQ_SEQ)] == q[geo.slot(g, S_RESP_SEQ)]:
                del self._inflight[s]
                q[geo.slot(g, S_REQ_STATE)] = FREE
                return s
        raise LaneBusy(
            f"all {geo.spl} slots of lane {self.lane} have requests in flight; wait() for one (or "
            f"abandon() it) before submitting more; an abandoned request's slot returns once it is answered"
        )

    def abandon(self, ticket: Ticket) -> None:
        """Nobody will wait for ``ticket``: its slot is reused once the worker answered it.

        Dropping the ticket has the same effect (the client holds it weakly).
        """
        ticket.consumed = True
        if ticket.slot in self._inflight:
            self._inflight[ticket.slot] = None

    def _write_external(self, s: int, g: int, plan: PayloadLayout, arrays: Mapping[str, Any]) -> int:
        """A payload too large for the slot: arrays into a pooled ndarray slot, its name in the header."""
        self._req_views.pop(g, None)  # the header written below replaces any cached inline one
        nd = self._nd_req.pop(s, None)
        if nd is not None and nd.capacity < plan.ext_bytes:
            self._pool.release(nd)
            nd = None
        if nd is None:
            nd = self._pool.acquire(plan.ext_bytes)
        self._nd_req[s] = nd
        nd.write(arrays, plan.spec)
        return ndslot.write_header(self._m.buf, self._m.geo.req_off(g), nd.name, plan.spec)

    def _check_size(self, plan: PayloadLayout) -> None:
        geo = self._m.geo
        limit = self._cfg.max_ndslot_bytes
        if plan.ext_bytes > limit:
            raise PayloadTooLarge(
                f"request of {plan.ext_bytes} bytes ({_spec_text(plan.spec)}) exceeds the "
                f"{geo.req_bytes}-byte slot and the ndarray-slot limit of {limit} bytes"
            )
        if ndslot.inline_nbytes(plan.spec, "x" * 64) > geo.req_bytes:
            raise PayloadTooLarge(
                f"the header of {_spec_text(plan.spec)} alone exceeds the {geo.req_bytes}-byte slot"
            )

    # -- hot path: submit, wait --------------------------------------------------------------------

    def submit(self, arrays: Mapping[str, np.ndarray[Any, Any]]) -> Ticket:
        """Write the request into a slot of this lane and publish it; returns at once."""
        if self._closed:
            raise QueueError("submit on a closed QueueClient")
        plan = ndslot.plan_of(arrays)
        m = self._m
        geo, q = m.geo, m.q
        inline = plan.inline_end <= geo.req_bytes
        if not inline:
            self._check_size(plan)
        s = self._free.pop() if self._free else self._take_slot()
        g = self._g0 + s
        si = (geo.slot_base >> 3) + g * (SLOT_BYTES >> 3)
        q[si + W_REQ_STATE] = WRITING
        try:
            if inline:
                cached = self._req_views.get(g)
                off = geo.req_off(g)
                # Written every time (~0.3 us): a header another process overwrote heals at once.
                m.mem[off : off + len(plan.prefix_bytes)] = plan.prefix_bytes
                if cached is None or cached[0] is not plan:
                    cached = (plan, ndslot.views(m.buf, plan.inline_layout, off))
                    self._req_views[g] = cached
                    nd = self._nd_req.pop(s, None)
                    if nd is not None:
                        self._pool.release(nd)
                for name, view in cached[1].items():
                    np.copyto(view, arrays[name], casting="no")
                nbytes = plan.inline_end
            else:
                nbytes = self._write_external(s, g, plan, arrays)
        except BaseException:
            q[si + W_REQ_STATE] = FREE
            self._free.append(s)
            raise
        seq = q[si + W_REQ_SEQ] + 1
        now = time.monotonic_ns()
        q[si + W_REQ_LEN] = nbytes
        q[si + W_SUBMIT_NS] = now
        q[si + W_REQ_SEQ] = seq
        q[si + W_REQ_STATE] = READY
        head = self._head
        q[self._ring_i + head % geo.spl] = s
        self._head = head + 1
        q[self._doorbell_i] = head + 1  # publication: everything above is visible before this (TSO)
        full_barrier()  # order the doorbell store before the load of worker_sleep (Dekker)
        if q[H_WORKER_SLEEP >> 3]:
            q[H_WORKER_SLEEP >> 3] = 0
            futex_wake(m.addr(H_WORKER_SLEEP >> 3))
        ticket = Ticket(s, seq, plan.batch, now)
        self._inflight[s] = weakref.ref(ticket)
        return ticket

    def ready(self, ticket: Ticket) -> bool:
        g = self._g0 + ticket.slot
        return bool(self._m.q[self._m.geo.slot(g, S_RESP_SEQ)] == ticket.seq)

    def wait(self, ticket: Ticket, timeout: float = 1.0) -> Arrays:
        """Outputs of ``ticket`` (copies owned by the caller). Raises QueueTimeout, WorkerDied, ..."""
        if ticket.consumed:
            raise QueueError(f"ticket for slot {ticket.slot} seq {ticket.seq} was already waited for")
        m = self._m
        q = m.q
        g = self._g0 + ticket.slot
        si = (m.geo.slot_base >> 3) + g * (SLOT_BYTES >> 3)
        seq = ticket.seq
        if q[si + W_RESP_SEQ] != seq:
            clock = time.monotonic_ns
            now = clock()
            spin_end = now + self._spin_ns
            yield_from = now + PURE_SPIN_NS
            while q[si + W_RESP_SEQ] != seq:
                now = clock()
                if now > yield_from:
                    # Past a typical round trip: let other runnable tasks on this CPU (other samplers)
                    # go first. sched_yield returns at once when nobody else is runnable.
                    if now > spin_end:
                        self._park(ticket, si, timeout)
                        break
                    os.sched_yield()
        return self._take_answer(ticket, g, si)

    def _park(self, ticket: Ticket, si: int, timeout: float) -> None:
        m = self._m
        q = m.q
        seq, resp_i = ticket.seq, si + W_RESP_SEQ
        clock = time.monotonic_ns
        start = clock()
        deadline = _deadline_ns(start, timeout)
        dead_worker = 0
        parked_i, count_i = self._parked_i, self._count_i
        while True:
            expected = q[count_i]
            q[parked_i] = 1
            full_barrier()  # order the parked store before the re-check below (Dekker)
            if q[resp_i] == seq:
                q[parked_i] = 0
                return
            now = clock()
            if q[H_WORKER_PID >> 3] != 0 and not ofd_lock.held(m.seg.fd, 0):
                # A dead worker fails only what it had claimed (it may have run it); an unclaimed
                # request stays queued for the next worker: at most once, and never lost.
                dead_worker = int(q[H_WORKER_PID >> 3])
                if q[si + W_CLAIM_SEQ] == seq:
                    q[parked_i] = 0
                    if q[resp_i] == seq:
                        return
                    ticket.consumed = True  # the next worker answers it WorkerDied; then the slot returns
                    self._inflight[ticket.slot] = None
                    raise WorkerDied(
                        f"the worker (pid {dead_worker}) of queue {self.descriptor.name} died processing "
                        f"request seq {seq} in lane {self.lane}; it may or may not have run and is not "
                        f"retried"
                    )
            if now >= deadline:
                q[parked_i] = 0
                why = (
                    f"the worker (pid {dead_worker}) is dead; the request waits, unclaimed, for the next"
                    if dead_worker
                    else "the request stays in flight"
                )
                raise QueueTimeout(
                    f"no answer within {(now - start) / 1e9:.3f} s for request seq {seq} in lane {self.lane} "
                    f"of queue {self.descriptor.name} ({why}; wait again, abandon() or drop the ticket)"
                )
            futex_wait(m.addr(count_i), expected, min((deadline - now) / 1e9, PARK_SLICE_S))
            q[parked_i] = 0
            if q[resp_i] == seq:
                return

    def _take_answer(self, ticket: Ticket, g: int, si: int) -> Arrays:
        m = self._m
        geo, q, buf = m.geo, m.q, m.buf
        status = q[si + W_RESP_STATUS]
        self._timing = (ticket.submit_ns, q[si + W_CLAIM_NS], q[si + W_DONE_NS], time.monotonic_ns())
        try:
            if status != ST_OK:
                raise _STATUS_ERRORS.get(status, RequestFailed)(_read_message(m, g, q[si + W_RESP_LEN]))
            off = geo.resp_off(g)
            ext, plan, raw = ndslot.read_plan(m.mem, m.q, off, geo.resp_bytes)
            if ext is not None:
                views = self._attached.get(ext, self._cfg.shm_dir, self._cfg.mode).arrays(plan.spec)
            else:
                cached = self._resp_views.get(g)
                if cached is not None and cached[0] == raw:
                    views = cached[1]
                else:
                    if plan.inline_end > geo.resp_bytes:
                        raise RequestFailed(
                            f"corrupt answer: {plan.inline_end}-byte layout in a {geo.resp_bytes} B slot"
                        )
                    views = ndslot.views(buf, plan.inline_layout, off)
                    self._resp_views[g] = (raw, views)
            return {k: v.copy() for k, v in views.items()}
        finally:
            ticket.consumed = True
            q[si + W_REQ_STATE] = FREE
            self._inflight.pop(ticket.slot, None)
            self._free.append(ticket.slot)

    def infer(self, arrays: Mapping[str, np.ndarray[Any, Any]], timeout: float = 1.0) -> Arrays:
        return self.wait(self.submit(arrays), timeout)

    def start(self, arrays: Mapping[str, np.ndarray[Any, Any]]) -> Pending:
        return Pending(self, self.submit(arrays))


def _spec_text(spec: Spec) -> str:
    return ", ".join(f"{name}: {np.dtype(d).name}{list(shape)}" for name, d, shape in spec)


# --------------------------------------------------------------------------------------------------
# Worker: the single consumer
# --------------------------------------------------------------------------------------------------


class _Item:
    """One claimed request (worker-private)."""

    __slots__ = ("claim_ns", "done", "g", "gen", "inputs", "lane", "plan", "seq", "si", "submit_ns")

    def __init__(  # noqa: PLR0917 - built once per request on the hot path: positional is cheapest
        self, lane: int, g: int, si: int, seq: int, gen: int, submit_ns: int, claim_ns: int
    ) -> None:
        self.lane = lane
        self.g = g
        self.si = si
        self.seq = seq
        self.gen = gen
        self.submit_ns = submit_ns
        self.claim_ns = claim_ns
        self.plan: PayloadLayout | None = None
        self.inputs: Arrays | None = None
        self.done = False


class Batch:
    """Requests claimed together: merged inputs, and per-request completion."""

    def __init__(self, worker: QueueWorker, items: list[_Item]) -> None:
        self._worker = worker
        self._items = items
        self.sizes = [it.plan.batch for it in items if it.plan is not None]
        self.queue_wait_ns = [it.claim_ns - it.submit_ns for it in items]
        # CLOCK_MONOTONIC of the poll that took the earliest request: the worker times claim work from it
        self.claimed_ns = min([it.claim_ns for it in items], default=0)
        parts = [it.inputs for it in items if it.inputs is not None]
        if len(parts) == 1:
            self.inputs: Arrays = parts[0]  # zero-copy views of the request slot (or ndarray slot)
        else:
            self.inputs = {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}

    def __len__(self) -> int:
        return len(self._items)

    @property
    def total(self) -> int:
        return sum(self.sizes)

    @property
    def lanes(self) -> list[int]:
        return [it.lane for it in self._items]

    def complete(self, outputs: Mapping[str, np.ndarray[Any, Any]]) -> None:
        """Split ``outputs`` (leading dimension = total samples) per request and answer each.

        The input views are invalid afterwards: a client may reuse its slot as soon as it is answered.
        """
        total = self.total
        try:
            plan = ndslot.plan_of(outputs)
        except BadRequest as e:
            self.fail(f"worker outputs: {e}")
            raise
        if plan.batch != total:
            got = ", ".join(f"{name}={shape}" for name, _, shape in plan.spec)
            msg = f"worker outputs must share the batch's leading dimension {total}: got {got}"
            self.fail(msg)
            raise BadRequest(msg)
        worker = self._worker
        if len(self._items) == 1:
            it = self._items[0]
            if not it.done:
                worker._answer(it, ST_OK, outputs, plan, "")
        else:
            off = 0
            for it in self._items:
                assert it.plan is not None
                n = it.plan.batch
                if not it.done:
                    part = {k: v[off : off + n] for k, v in outputs.items()}
                    worker._answer(it, ST_OK, part, plan.with_batch(n), "")
                off += n
        worker._wake_parked(self._items)

    def fail(self, message: str) -> None:
        for it in self._items:
            if not it.done:
                self._worker._answer(it, ST_FAILED, None, None, message)
        self._worker._wake_parked(self._items)

    def fail_request(self, i: int, message: str) -> None:
        it = self._items[i]
        if not it.done:
            self._worker._answer(it, ST_FAILED, None, None, message)
            self._worker._wake_parked([it])


class QueueWorker:
    """The single consumer. Holds the worker lock (byte 0) for its lifetime; publishes its pid."""

    def __init__(self, desc: QueueDescriptor, m: _Mapped, idle_us: int) -> None:
        self.descriptor = desc
        self._m = m
        cfg, geo, q = desc.config, m.geo, m.q
        self._cfg = cfg
        self._idle_ns = idle_us * 1000
        prev = int(q[H_WORKER_PID >> 3])
        q[H_WORKER_PID >> 3] = os.getpid()
        q[H_WORKER_EPOCH >> 3] = q[H_WORKER_EPOCH >> 3] + 1
        q[H_WORKER_SLEEP >> 3] = 0
        self._tails = [int(q[geo.lane(lane, L_TAIL)]) for lane in range(geo.lanes)]
        # u64 indices of each lane's fields, computed once for the hot path
        self._ring_i = [geo.lane(lane, L_RING) for lane in range(geo.lanes)]
        self._gen_i = [geo.lane(lane, L_GEN) for lane in range(geo.lanes)]
        self._tail_i = [geo.lane(lane, L_TAIL) for lane in range(geo.lanes)]
        self._count_i = [geo.lane(lane, L_RESP_COUNT) for lane in range(geo.lanes)]
        self._parked_i = [geo.lane(lane, L_PARKED) for lane in range(geo.lanes)]
        self._db_i = H_DOORBELLS >> 3
        self._doorbells = q[self._db_i : self._db_i + geo.lanes]
        self._drained = b""
        self._seen = bytes(8 * geo.lanes)  # the doorbells at the last poll (zeros: look at every used lane)
        self._leftover: list[int] = []  # lanes the last poll left with requests it did not take
        self._head_of = struct.Struct("<Q").unpack_from
        self._pool = NdarraySlotPool(cfg.shm_dir, cfg.mode, cfg.numa_node)
        self._nd_resp: dict[int, NdarraySlot] = {}
        self._attached = AttachedSlots()
        self._in_views: dict[int, tuple[bytes, Arrays]] = {}
        self._out_views: dict[int, tuple[PayloadLayout, Arrays]] = {}
        self._carry: list[_Item] = []
        self._outstanding: dict[int, _Item] = {}
        self._last_work_ns = time.monotonic_ns()
        self._lane_seen_ns = [0] * geo.lanes
        self._lane_gen = [0] * geo.lanes  # the gen whose ndarray slots _attached holds, per lane
        self._active: list[int] = []
        self._rr = 0
        self.fenced = 0  # lanes fenced for an impossible control word (diagnostics, tests)
        self._closed = False
        self.restarted_failed = self._fail_orphans(prev)

    @classmethod
    def attach(cls, desc: QueueDescriptor, idle_us: int | None = None) -> QueueWorker:
        m = _attach(desc)
        if not ofd_lock.try_lock(m.seg.fd, 0):
            pid = m.q[H_WORKER_PID >> 3]
            m.close()
            raise QueueError(f"queue {desc.name} already has a live worker (pid {pid}); one worker per queue")
        return cls(desc, m, desc.config.worker_idle_us if idle_us is None else idle_us)

    def __enter__(self) -> QueueWorker:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _fail_orphans(self, prev_pid: int) -> int:
        """Answer WorkerDied for every request a previous worker left PROCESSING."""
        m = self._m
        geo, q = m.geo, m.q
        orphans: list[_Item] = []
        for g in range(geo.lanes * geo.spl):
            si = geo.slot(g, 0)
            req = q[si + W_REQ_SEQ]
            if q[si + W_CLAIM_SEQ] == req and q[si + W_RESP_SEQ] != req:
                lane = g // geo.spl
                it = _Item(lane, g, si, int(req), int(q[geo.lane(lane, L_GEN)]), 0, 0)
                msg = f"worker restarted: the previous worker (pid {prev_pid}) died processing this request"
                self._answer(it, ST_WORKER_DIED, None, None, msg)
                orphans.append(it)
        self._wake_parked(orphans)
        return len(orphans)

    def close(self) -> None:
        """Answer what was claimed but not completed ("worker closed"), release the lock, unmap."""
        if self._closed:
            return
        self._closed = True
        pending = self._carry + [it for it in self._outstanding.values() if not it.done]
        for it in pending:
            if not it.done:
                self._answer(it, ST_FAILED, None, None, "worker closed before answering")
        self._wake_parked(pending)
        self._carry.clear()
        self._outstanding.clear()
        self._in_views.clear()
        self._out_views.clear()
        self._doorbells.release()
        self._m.q[H_WORKER_PID >> 3] = 0
        # Unlock explicitly: a mapping still exported to a caller's view (batch inputs kept past
        # complete()) keeps the open file description, and with it the lock, alive after close(fd).
        ofd_lock.unlock(self._m.seg.fd, 0)
        self._attached.close()
        self._pool.close()
        self._m.close()

    def reclaimable_lanes(self) -> list[int]:
        """Lanes whose client died (the kernel already released their locks; the next attach takes them)."""
        m = self._m
        return [
            lane
            for lane in range(m.geo.lanes)
            if m.q[m.geo.lane(lane, L_PID)] and not ofd_lock.held(m.seg.fd, 1 + lane)
        ]

    # -- hot path: claim, answer -------------------------------------------------------------------

    def claim(self, timeout: float = 0.05) -> Batch | None:
        """The next batch, or None after ``timeout`` seconds without a request."""
        if self._closed:
            raise QueueError("claim on a closed QueueWorker")
        if self._carry:
            carried, self._carry = self._carry, []
            return self._batch(carried)
        m = self._m
        q = m.q
        clock = time.monotonic_ns
        now = clock()
        deadline = _deadline_ns(now, timeout)
        sleep_i = H_WORKER_SLEEP >> 3
        items: list[_Item] = []
        doorbells, poll = self._doorbells, self._poll
        while True:
            if doorbells.tobytes() != self._drained:
                poll(items)
                if items:
                    return self._coalesce(items)
            now = clock()
            if now >= deadline:
                return None
            if now - self._last_work_ns < self._idle_ns:
                continue
            q[sleep_i] = 1
            full_barrier()  # order the sleep store before the doorbell re-check (Dekker)
            poll(items)
            if items:
                q[sleep_i] = 0
                return self._coalesce(items)
            futex_wait(m.addr(sleep_i), 1, min((deadline - now) / 1e9, WORKER_PARK_SLICE_S))
            q[sleep_i] = 0

    def _poll(self, items: list[_Item]) -> None:
        """Take published requests within the batch limits, fairly across lanes.

        Every lane whose doorbell is ahead of its tail is looked at, one request per lane per round,
        starting after the lane that was served last: a ready request waits for at most one request
        of each other lane (tested with 8 clients; measured by ``lowtail bench queue``). ``_drained``
        (the doorbells fully taken) is only recorded when no lane was left with work.
        """
        raw = self._doorbells.tobytes()
        if raw == self._drained:
            return  # nothing new in any lane: one 8*L-byte compare instead of L word reads
        tails = self._tails
        lanes, spl = len(tails), self._m.geo.spl
        # The lanes to look at: those whose doorbell moved since the last poll and those it left with
        # work, found by XOR-ing the doorbell bytes with the last ones seen (a few big-int operations
        # per moved lane): idle attached lanes cost nothing. Unpacking and comparing all L lanes in
        # Python added ~5 us per claim at 256 lanes (``lowtail bench lanes``, docs/benchmarks.md).
        moved = int.from_bytes(raw, "little") ^ int.from_bytes(self._seen, "little")
        look = set(self._leftover)
        base = 0
        while moved:
            low = ((moved & -moved).bit_length() - 1) >> 6
            look.add(base + low)
            moved >>= (low + 1) << 6
            base += low + 1
        self._seen = raw
        head_of = self._head_of
        heads = {lane: head_of(raw, lane << 3)[0] for lane in look}
        cfg = self._cfg
        max_slots, max_samples = cfg.max_batch_slots, cfg.max_batch_samples
        samples = sum(it.plan.batch for it in items if it.plan is not None)
        now = time.monotonic_ns()
        start = self._rr
        order = sorted(lane for lane in look if heads[lane] != tails[lane])
        pending = [lane for lane in order if lane >= start] + [lane for lane in order if lane < start]
        full = False
        while pending and not full:
            again: list[int] = []
            for lane in pending:
                if len(items) >= max_slots or samples >= max_samples:
                    full = True
                    break
                head, tail = heads[lane], tails[lane]
                if not 0 < head - tail <= spl:  # more published than the lane has slots: impossible
                    self._fence(lane, f"doorbell {head} with tail {tail} and {spl} slots per lane")
                    continue
                it = self._take(lane, tail, now)
                if it is not None and it.plan is not None:
                    if items and samples + it.plan.batch > max_samples:
                        self._carry.append(it)  # claimed already: first in the next batch
                        full = True
                    else:
                        items.append(it)
                        samples += it.plan.batch
                self._rr = (lane + 1) % lanes
                if tails[lane] != heads[lane]:
                    again.append(lane)
            pending = again
        self._leftover = [lane for lane in look if heads[lane] != tails[lane]]
        self._drained = b"" if pending or full else raw  # full: lanes after the cut were not looked at

    def _take(self, lane: int, tail: int, now: int) -> _Item | None:
        """Claim the request at ring position ``tail`` of ``lane`` and advance the tail past it.

        claim_seq is stored before the tail: a worker killed between the two leaves a claimed request
        that the next worker answers ``WorkerDied`` and then skips when it finds it in the ring (a
        request already claimed is never taken twice). Returns None for a position that holds no
        claimable request (a bad request, answered here, or a duplicate).
        """
        q, geo = self._m.q, self._m.geo
        s = q[self._ring_i[lane] + tail % geo.spl]
        self._tails[lane] = tail + 1
        if s >= geo.spl:
            q[self._tail_i[lane]] = tail + 1
            self._fence(lane, f"ring entry {s} at position {tail}, expected a slot 0..{geo.spl - 1}")
            return None
        g = lane * geo.spl + s
        si = (geo.slot_base >> 3) + g * (SLOT_BYTES >> 3)
        seq = q[si + W_REQ_SEQ]
        if q[si + W_CLAIM_SEQ] == seq or q[si + W_RESP_SEQ] == seq:
            q[self._tail_i[lane]] = tail + 1
            return None  # claimed (by us or a dead predecessor) or answered: never twice
        it = _Item(lane, g, si, seq, q[self._gen_i[lane]], q[si + W_SUBMIT_NS], now)
        q[si + W_CLAIM_NS] = now
        q[si + W_CLAIM_SEQ] = seq  # PROCESSING
        q[self._tail_i[lane]] = tail + 1
        self._lane_seen_ns[lane] = now
        self._decode(it)
        return it

    def _fence(self, lane: int, why: str) -> None:
        """An impossible control word in ``lane``: fail its unanswered requests, resynchronise the tail.

        The worker goes on serving the other lanes. A well-behaved client of the lane sees its
        requests fail with ``BadRequest`` naming the word; its next request is served normally.
        """
        m = self._m
        q, geo = m.q, m.geo
        head = q[self._db_i + lane]
        failed: list[_Item] = []
        gen = q[self._gen_i[lane]]
        for s in range(geo.spl):
            g = lane * geo.spl + s
            si = (geo.slot_base >> 3) + g * (SLOT_BYTES >> 3)
            seq = q[si + W_REQ_SEQ]
            # Only requests nobody claimed: a claimed one is answered by its claimer, exactly once.
            if seq != q[si + W_RESP_SEQ] and seq != q[si + W_CLAIM_SEQ]:
                it = _Item(lane, g, si, seq, gen, q[si + W_SUBMIT_NS], time.monotonic_ns())
                q[si + W_CLAIM_SEQ] = seq
                self._answer(it, ST_BAD_REQUEST, None, None, f"lane {lane} fenced: {why}")
                failed.append(it)
        self._tails[lane] = head
        q[self._tail_i[lane]] = head
        self.fenced += 1
        self._wake_parked(failed)

    def _decode(self, it: _Item) -> None:
        m = self._m
        geo, buf = m.geo, m.buf
        g = it.g
        off = geo.req_off(g)
        try:
            ext, plan, raw = ndslot.read_plan(m.mem, m.q, off, geo.req_bytes)
            if ext is not None:
                if self._lane_gen[it.lane] != it.gen:  # a new client: unmap what the last one sent
                    self._attached.drop_lane(it.lane)
                    self._lane_gen[it.lane] = it.gen
                slot = self._attached.get(ext, self._cfg.shm_dir, self._cfg.mode, it.lane)
                views = slot.arrays(plan.spec)
            else:
                cached = self._in_views.get(g)
                if cached is not None and cached[0] == raw:
                    views = cached[1]
                else:
                    if plan.inline_end > geo.req_bytes:
                        raise BadRequest(
                            f"request layout of {plan.inline_end} B exceeds the {geo.req_bytes} B slot"
                        )
                    views = ndslot.views(buf, plan.inline_layout, off)
                    self._in_views[g] = (raw, views)
        except Exception as e:  # whatever a request holds, it fails alone
            bad = not isinstance(e, QueueError) or isinstance(e, BadRequest)
            self._answer(it, ST_BAD_REQUEST if bad else ST_FAILED, None, None, str(e))
            self._wake_parked([it])
            return
        it.plan, it.inputs = plan, views

    def _coalesce(self, items: list[_Item]) -> Batch:
        cfg = self._cfg
        if cfg.coalesce_us > 0 and len(items) < cfg.max_batch_slots:
            samples = sum(it.plan.batch for it in items if it.plan is not None)
            if samples < cfg.min_batch_samples:
                now = time.monotonic_ns()
                in_batch = {it.lane for it in items}
                recent = now - 50_000_000
                # Wait only when another lane was active lately: a lone client is never held.
                if any(t > recent and lane not in in_batch for lane, t in enumerate(self._lane_seen_ns)):
                    end = now + cfg.coalesce_us * 1000
                    while time.monotonic_ns() < end and len(items) < cfg.max_batch_slots:
                        self._poll(items)
                        if sum(it.plan.batch for it in items if it.plan is not None) >= cfg.min_batch_samples:
                            break
        self._last_work_ns = time.monotonic_ns()
        return self._batch(items)

    def _batch(self, items: list[_Item]) -> Batch:
        if len(items) > 1:
            key = items[0].plan.merge_key if items[0].plan is not None else ()
            same = [it for it in items if it.plan is not None and it.plan.merge_key == key]
            if len(same) != len(items):
                self._carry.extend(it for it in items if it not in same)  # a batch of their own next
            items = same
        for it in items:
            self._outstanding[it.g] = it
        return Batch(self, items)

    def _answer(
        self,
        it: _Item,
        status: int,
        arrays: Mapping[str, np.ndarray[Any, Any]] | None,
        plan: PayloadLayout | None,
        message: str,
    ) -> None:
        m = self._m
        q, geo = m.q, m.geo
        g, si = it.g, it.si
        n = 0
        if q[self._gen_i[it.lane]] != it.gen:  # the lane changed hands since the claim: fenced
            status, message = ST_CLIENT_GONE, "the client that sent this request is gone"
        elif status == ST_OK and arrays is not None and plan is not None:
            try:
                if plan.inline_end <= geo.resp_bytes:
                    cached = self._out_views.get(g)
                    off = geo.resp_off(g)
                    m.mem[off : off + len(plan.prefix_bytes)] = plan.prefix_bytes  # heals, as above
                    if cached is None or cached[0] is not plan:
                        cached = (plan, ndslot.views(m.buf, plan.inline_layout, off))
                        self._out_views[g] = cached
                    for name, view in cached[1].items():
                        np.copyto(view, arrays[name], casting="no")
                    n = plan.inline_end
                else:
                    n = self._answer_external(g, plan, arrays)
            except QueueError as e:
                status, message = (ST_TOO_LARGE if isinstance(e, PayloadTooLarge) else ST_FAILED), str(e)
        if status != ST_OK:
            self._out_views.pop(g, None)
            n = _write_message(m, g, message)
        q[si + W_RESP_LEN] = n
        q[si + W_RESP_STATUS] = status
        q[si + W_DONE_NS] = time.monotonic_ns()
        q[si + W_RESP_SEQ] = it.seq  # publication of the answer: everything above is visible before it (TSO)
        ci = self._count_i[it.lane]
        q[ci] = (q[ci] + 1) & 0xFFFFFFFF
        it.done = True
        self._outstanding.pop(g, None)

    def _answer_external(
        self, g: int, plan: PayloadLayout, arrays: Mapping[str, np.ndarray[Any, Any]]
    ) -> int:
        geo = self._m.geo
        need, limit = plan.ext_bytes, self._cfg.max_ndslot_bytes
        if need > limit or ndslot.inline_nbytes(plan.spec, "x" * 64) > geo.resp_bytes:
            raise PayloadTooLarge(
                f"answer of {need} bytes ({_spec_text(plan.spec)}) exceeds the {geo.resp_bytes}-byte "
                f"slot and the ndarray-slot limit of {limit} bytes"
            )
        self._out_views.pop(g, None)
        nd = self._nd_resp.get(g)
        if nd is None or nd.capacity < need:
            if nd is not None:
                self._pool.release(nd)
            nd = self._pool.acquire(need)
            self._nd_resp[g] = nd
        nd.write(arrays, plan.spec)
        return ndslot.write_header(self._m.buf, geo.resp_off(g), nd.name, plan.spec)

    def _wake_parked(self, items: list[_Item]) -> None:
        if not items:
            return
        m = self._m
        q = m.q
        full_barrier()  # order the answers' stores before the loads of client_parked (Dekker)
        if len(items) == 1:
            lane = items[0].lane
            if q[self._parked_i[lane]]:
                futex_wake(m.addr(self._count_i[lane]))
            return
        for lane in {it.lane for it in items}:
            if q[self._parked_i[lane]]:
                futex_wake(m.addr(self._count_i[lane]))
