"""The queue's control plane: its configuration and descriptor, creating, attaching to and sweeping segments.

``InferenceQueue.create`` (the owner, e.g. the Ray inference actor) sweeps the segments of dead
owners, then creates, sizes, NUMA-binds and pre-faults the segment and writes its header (magic
last); ``close`` unlinks it. ``attach_mapped`` is the one attach path of clients and workers: it
refuses a foreign host or boot and a segment whose magic or size does not match the descriptor.
The field layout is in ``lowtail.shm.layout``.

Liveness: the worker holds an OFD write lock on byte 0 of the segment file, a client on byte
1 + lane (``lowtail.shm.ofd_lock``); the kernel releases them when the holder dies, so a killed client's
lane is free at once, and a client finds a dead worker at its next park timeout. A new client of a
lane bumps its gen (``QueueClient`` registers); the worker skips the payload of an answer whose lane
gen changed since the claim (the fence), and the new client does not reuse a slot until the dead
client's request in it has been answered. ``QueueWorker.reclaimable_lanes`` lists lanes whose client died.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import socket
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lowtail.node.process import boot_id
from lowtail.shm import native, numa, ofd_lock
from lowtail.shm.errors import BadConfig, QueueError, SegmentNotFound
from lowtail.shm.futex import is_supported_platform
from lowtail.shm.layout import (
    FREE,
    HW_CREATOR,
    HW_GEOM0,
    HW_GEOM1,
    HW_GEOM2,
    HW_MAGIC,
    HW_WORKER_PID,
    INHERITED,
    L_GEN,
    L_PID,
    MAGIC,
    MAX_LANES,
    READY,
    S_CLAIM_SEQ,
    S_REQ_SEQ,
    S_REQ_STATE,
    S_RESP_SEQ,
    S_RESP_STATUS,
    ST_OK,
    STATE_NAMES,
    VERSION,
    WORKER_LOCK_BYTE,
    WRITING,
    Geometry,
    client_lock_byte,
)
from lowtail.shm.payload import Spec
from lowtail.shm.segments import (
    SHM_DIR,
    Segment,
    attach_segment,
    create_segment,
    parse_name,
    private_dir,
    sweep_dead,
)


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
    # A client alone on an isolated CPU spins up to this long for an answer that is due, then parks;
    # any other client parks at once (client.py: QueueClient.attach's spin_us).
    client_spin_us: int = 200
    worker_idle_us: int = 2000  # the worker spins this long after its last request before parking

    def __post_init__(self) -> None:
        def check(name: str, ok: bool, expected: str) -> None:
            if not ok:
                raise BadConfig(f"QueueConfig.{name}={getattr(self, name)!r}: expected {expected}")

        check("lanes", 1 <= self.lanes <= MAX_LANES, f"1..{MAX_LANES}")
        # A request's ring position is its number modulo the slots; the number wraps at 2^64, which only
        # a power of two divides, so any other count gives two requests in flight one position there.
        spl = self.slots_per_lane
        check("slots_per_lane", 1 <= spl <= 4096 and spl & (spl - 1) == 0, "a power of two in 1..4096")
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
        check("max_ndslot_bytes", self.max_ndslot_bytes >= 0, ">= 0 (0 disables ndarray segments)")
        check("client_spin_us", 0 <= self.client_spin_us <= 1_000_000, "0..1000000")
        check("worker_idle_us", 0 <= self.worker_idle_us <= 10_000_000, "0..10000000")

    @property
    def slots(self) -> int:
        return self.lanes * self.slots_per_lane


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
        return private_dir(self.config.shm_dir) / self.name

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


class Mapped:
    """A segment mapped with the u64 word view and byte view every role uses."""

    def __init__(self, seg: Segment, geo: Geometry) -> None:
        self.seg = seg
        self.geo = geo
        self.mem = memoryview(seg.mm)
        self.q = self.mem.cast("Q")
        self.buf: np.ndarray[Any, Any] = np.frombuffer(seg.mm, np.uint8)
        self._anchor = np.frombuffer(seg.mm, np.uint64)
        self.base_addr = int(self._anchor.ctypes.data)
        # The native core over this mapping (lowtail.shm.native), or None: the Python path.
        self.native: Any = native.segment(seg.mm, geo)

    def addr(self, index: int) -> int:
        """Address of the u64 word at ``index`` (its low 32 bits are the futex word)."""
        return self.base_addr + index * 8

    def close(self) -> None:
        if self.native is not None:
            self.native.close()  # its export of the mapping first, or the mapping cannot close
        # A view a caller still holds (batch inputs kept past complete()) must not keep the segment
        # file alive: the mapping then lives until that view is collected, the name is unlinked now.
        with contextlib.suppress(BufferError):
            self.q.release()
            self.mem.release()
        del self.buf
        del self._anchor
        self.seg.close()


def attach_mapped(desc: QueueDescriptor) -> Mapped:
    """Map an existing queue for a client or worker: this host and boot, its magic, at least its size."""
    if not is_supported_platform():
        raise QueueError("the queue's publication protocol assumes x86-64 (TSO) store ordering on Linux")
    local_boot = boot_id()
    if desc.boot_id and local_boot and desc.boot_id != local_boot:
        raise SegmentNotFound(
            f"queue {desc.name} lives on host {desc.hostname} (boot {desc.boot_id[:8]}), this is "
            f"{socket.gethostname()} (boot {local_boot[:8]}): shared memory is node-local, use an "
            f"inference endpoint on this node"
        )
    seg = attach_segment(desc.name, desc.config.shm_dir, desc.config.mode)
    cfg = desc.config
    geo = Geometry.of(cfg.lanes, cfg.slots_per_lane, cfg.request_bytes, cfg.response_bytes)
    m = Mapped(seg, geo)
    if m.q[HW_MAGIC] != MAGIC or seg.size < geo.total:
        m.close()
        raise SegmentNotFound(f"{desc.path} is not a lowtail queue of this geometry (magic or size mismatch)")
    return m


def deadline_ns(now: int, timeout_s: float) -> int:
    """``now`` + ``timeout_s`` seconds in ns; ``math.inf`` waits without end (no OverflowError)."""
    if not timeout_s >= 0:  # also NaN
        raise QueueError(f"timeout_s={timeout_s!r}: expected seconds >= 0 (math.inf to wait without end)")
    return now + int(timeout_s * 1e9) if timeout_s < 1e9 else now + (1 << 62)


def spec_text(spec: Spec) -> str:
    """Arrays of a spec as ``name: dtype[shape]``, for the size errors of both sides."""
    return ", ".join(f"{name}: {np.dtype(d).name}{list(shape)}" for name, d, shape in spec)


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

    def __init__(self, desc: QueueDescriptor, mapped: Mapped) -> None:
        self.descriptor = desc
        self._m = mapped

    @classmethod
    def create(cls, config: QueueConfig | None = None) -> InferenceQueue:
        cfg = config or QueueConfig()
        if not is_supported_platform():
            raise QueueError("the queue's publication protocol assumes x86-64 (TSO) store ordering on Linux")
        sweep_dead(cfg.shm_dir)  # stale segments of dead owners, before we add ours
        geo = Geometry.of(cfg.lanes, cfg.slots_per_lane, cfg.request_bytes, cfg.response_bytes)
        if cfg.numa_node is not None:
            numa.node_cpus(cfg.numa_node)  # a clear NumaError for an unknown node, before any allocation

        def place(mm: Any) -> None:
            if cfg.numa_node is not None:
                numa.bind(mm, cfg.numa_node)

        seg = create_segment("q", geo.total, cfg.shm_dir, cfg.mode, place)
        try:
            numa.prefault(seg.mm, cfg.numa_node)
            m = Mapped(seg, geo)
        except BaseException:
            seg.close()
            raise
        q = m.q
        q[HW_GEOM0] = VERSION | (cfg.lanes << 32)
        q[HW_GEOM1] = cfg.slots_per_lane | (cfg.request_bytes << 32)
        q[HW_GEOM2] = cfg.response_bytes | ((0 if cfg.numa_node is None else cfg.numa_node + 1) << 32)
        q[HW_CREATOR] = os.getpid()
        q[HW_MAGIC] = MAGIC  # last: an attacher checks it
        desc = QueueDescriptor(seg.name, cfg, socket.gethostname(), boot_id())
        return cls(desc, m)

    def __enter__(self) -> InferenceQueue:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if not self._m.seg.closed:
            self._m.close()
            # ndarray segments of a killed worker or client outlive their pool: the queue's end is theirs
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
                    ofd_lock.held(fd, client_lock_byte(lane)),
                    int(q[geo.lane(lane, L_GEN)]),
                    tuple(states),
                )
            )
        return QueueSnapshot(
            self.descriptor.name,
            int(q[HW_WORKER_PID]),
            ofd_lock.held(fd, WORKER_LOCK_BYTE),
            tuple(lanes),
            counts,
        )


def _slot_state(q: memoryview, geo: Geometry, g: int) -> str:
    req_state = q[geo.slot(g, S_REQ_STATE)]
    req, claim, resp = q[geo.slot(g, S_REQ_SEQ)], q[geo.slot(g, S_CLAIM_SEQ)], q[geo.slot(g, S_RESP_SEQ)]
    if req_state == WRITING:
        return "WRITING"
    if resp == req and req_state in (READY, INHERITED):  # answered, not yet read
        return "DONE" if q[geo.slot(g, S_RESP_STATUS)] == ST_OK else "ERROR"
    if req_state == FREE and resp == req:
        return "FREE"
    if claim == req:
        return "PROCESSING"
    return "READY"
