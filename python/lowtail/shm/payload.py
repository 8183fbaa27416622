"""Named numpy arrays in shared memory: the payload format of queue slots, and ndarray segments.

A *payload* is a dict of named arrays sharing a leading batch dimension, written into a byte region as

    offset 0   u32  header length H
    offset 4   u32  flags (bit 0: the arrays live in an ndarray segment named in the header)
    offset 8   H    header, fixed binary (version 1, little-endian, no padding):
                      u8 version, u8 array count N (1..64), u8 segment-name length E, u8 zero
                      E bytes: ndarray segment name (ASCII ``lowtail.nd.*``), present iff flags bit 0
                      N times: u8 dtype code, u8 rank R (1..8), u8 name length K (1..255), u8 zero,
                               R x i64 dims (each 0..2^40, the first >= 1 and equal across arrays),
                               K bytes: the array's name (UTF-8)
    align64(8+H)    the arrays, each C-contiguous and 64-byte aligned, in header order: their offsets
                    are computed from the dims (``array_offsets``), never read from the segment

Shared memory holds data, never code: the header is parsed by ``decode_header``, which accepts only
dtypes of the allow-list ``DTYPES`` and refuses any byte it does not expect (``BadRequest`` naming it);
the caller then checks the computed end against the region's size. Both sides cache a decoded header
by its bytes, so a steady stream of same-shaped requests parses nothing.

A *queue slot* is a request's 128-byte control record in the queue segment (``lowtail.shm.layout``)
with its request/response regions. An *ndarray segment* (the predecessor's SharedNdarraySlot) is a
shared-memory segment of its own holding the arrays of a payload too large for a queue slot's region;
its *bundle* (segment name, directory, layout) is plain data (str and tuples) passed by the caller,
never read back from shared memory; both sides map the same pages, so neither side copies more than
the writer's one copy in. Ndarray segments are pooled by the process that created them and reused.
"""

from __future__ import annotations

import math
import os
import struct
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from lowtail.shm import numa
from lowtail.shm.errors import BadRequest, PayloadTooLarge
from lowtail.shm.segments import (
    SHM_DIR,
    Segment,
    attach_segment,
    create_segment,
    open_segment_fd,
    parse_name,
    pid_namespace,
)

ALIGN = 64
FLAG_EXTERNAL = 1
_PREFIX = struct.Struct("<II")
HEADER_VERSION = 1
# The dtypes a payload may carry (little-endian, fixed size): the code on the wire is the index + 1.
DTYPES = ("|b1", "|i1", "<i2", "<i4", "<i8", "|u1", "<u2", "<u4", "<u8", "<f2", "<f4", "<f8", "<c8", "<c16")
_DTYPE_CODE = {d: i + 1 for i, d in enumerate(DTYPES)}
MAX_ARRAYS = 64
MAX_RANK = 8
MAX_DIM = 1 << 40
_HEAD = struct.Struct("<BBBB")


def align(n: int) -> int:
    return (n + ALIGN - 1) & ~(ALIGN - 1)


Spec = tuple[tuple[str, str, tuple[int, ...]], ...]


@dataclass(frozen=True)
class ArrayLayout:
    name: str
    dtype: np.dtype[Any]
    shape: tuple[int, ...]
    offset: int
    nbytes: int


class PayloadLayout:
    """Everything about one payload shape, computed once: spec, batch, header bytes, inline layout.

    Layouts are interned (one object per distinct shape), so the hot paths compare them by identity.
    """

    __slots__ = (
        "_rows",
        "batch",
        "checks",
        "ext_bytes",
        "inline_end",
        "inline_layout",
        "merge_key",
        "prefix_bytes",
        "prefix_header",
        "spec",
    )

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.batch = spec[0][2][0]
        h = header(None, spec)
        self.prefix_bytes = _PREFIX.pack(len(h), 0) + h  # written on every request (memoryview: ~0.3 us)
        self.prefix_header: np.ndarray[Any, Any] = np.frombuffer(self.prefix_bytes, np.uint8)
        self.inline_layout, self.inline_end = array_offsets(spec, 8 + len(h))
        self.ext_bytes = array_offsets(spec, 0)[1]
        self.merge_key = tuple((n, d, shape[1:]) for n, d, shape in spec)  # requests that can be merged
        # What ``matches`` compares: numpy interns the dtypes of the allow-list, so an array of this
        # layout has these very dtype objects (another equal dtype only takes the slow path).
        self.checks = tuple((n, np.dtype(d), shape) for n, d, shape in spec)
        self._rows: dict[int, PayloadLayout] = {}

    def matches(self, arrays: Mapping[str, Any]) -> bool:
        """True when ``arrays`` has exactly this layout: the same names, numpy arrays of these dtypes
        and shapes, nothing else.

        The per-request check of a sender whose requests keep one shape: about half the cost of
        ``validated_layout`` (~0.2 against ~0.4 us for one array), which builds and hashes a key. False
        sends the caller to ``validated_layout``, which validates from scratch.
        """
        try:
            if len(arrays) != len(self.checks):
                return False
            for name, dtype, shape in self.checks:
                a = arrays[name]
                if type(a) is not np.ndarray or a.dtype is not dtype or a.shape != shape:
                    return False
        except (TypeError, KeyError, AttributeError):
            return False  # not a mapping of arrays: validated_layout says what is wrong
        return True

    def with_batch(self, n: int) -> PayloadLayout:
        """The layout of ``n`` rows of this payload (a request's share of a merged answer)."""
        if n == self.batch:
            return self
        hit = self._rows.get(n)
        if hit is None:
            hit = intern_layout(tuple((name, d, (n, *shape[1:])) for name, d, shape in self.spec))
            self._rows[n] = hit
        return hit


_layouts: dict[Spec, PayloadLayout] = {}
_fast_layouts: dict[tuple[tuple[Any, ...], ...], PayloadLayout] = {}


def intern_layout(spec: Spec) -> PayloadLayout:
    hit = _layouts.get(spec)
    if hit is None:
        hit = PayloadLayout(spec)
        _bounded_put(_layouts, spec, hit)
    return hit


def validated_layout(arrays: Mapping[str, Any]) -> PayloadLayout:
    """The (validated) layout of a payload; a shape seen before costs one dict lookup."""
    try:
        key = tuple([(k, a.dtype, a.shape) for k, a in arrays.items()])
        hit = _fast_layouts.get(key)
    except (AttributeError, TypeError):
        hit, key = None, ()
    if hit is None:
        spec, _ = describe(arrays)
        hit = intern_layout(spec)
        if key:
            _bounded_put(_fast_layouts, key, hit)
    return hit


def describe(arrays: Mapping[str, Any]) -> tuple[Spec, int]:
    """Validate a payload and return its spec and batch size.

    Raises BadRequest naming the offending array: not a mapping of numpy arrays, a non-numeric dtype,
    no leading dimension, or batch dimensions that disagree.
    """
    if not isinstance(arrays, Mapping) or not arrays:
        raise BadRequest(f"a payload is a non-empty dict of named numpy arrays, got {type(arrays).__name__}")
    spec: list[tuple[str, str, tuple[int, ...]]] = []
    batch: int | None = None
    first = ""
    for name, arr in arrays.items():
        if not isinstance(arr, np.ndarray):
            raise BadRequest(f"input {name!r} is a {type(arr).__name__}, expected a numpy array")
        if arr.dtype.str not in _DTYPE_CODE:
            raise BadRequest(
                f"input {name!r} has dtype {arr.dtype} ({arr.dtype.str}); expected one of "
                f"{', '.join(np.dtype(d).name for d in DTYPES)} in native (little-endian) order"
            )
        if arr.ndim > MAX_RANK or not 1 <= len(str(name).encode()) <= 255:
            raise BadRequest(
                f"input {name!r} has rank {arr.ndim} and a {len(str(name).encode())}-byte name; "
                f"expected rank 1..{MAX_RANK} and a name of 1..255 bytes"
            )
        if arr.ndim == 0:
            raise BadRequest(f"input {name!r} is a scalar; expected a leading batch dimension")
        if batch is None:
            batch, first = arr.shape[0], name
        elif arr.shape[0] != batch:
            sizes = ", ".join(f"{k}={getattr(v, 'shape', ('-',))[:1]}" for k, v in arrays.items())
            raise BadRequest(
                f"batch dimension disagrees: {name!r} has {arr.shape[0]} rows but {first!r} has {batch} "
                f"({sizes})"
            )
        spec.append((str(name), arr.dtype.str, tuple(int(d) for d in arr.shape)))
    assert batch is not None
    if len(spec) > MAX_ARRAYS:
        raise BadRequest(f"a payload of {len(spec)} arrays; expected at most {MAX_ARRAYS}")
    if batch < 1:
        raise BadRequest(f"batch dimension is {batch}; expected at least 1 row")
    return tuple(spec), batch


_layout_cache: dict[tuple[Spec, int], tuple[tuple[ArrayLayout, ...], int]] = {}
_header_cache: dict[tuple[str | None, Spec], bytes] = {}
_CACHE_MAX = 4096


def _bounded_put(cache: dict[Any, Any], key: Any, value: Any) -> None:
    if len(cache) >= _CACHE_MAX:
        cache.clear()  # shapes that vary without bound must not grow memory without bound
    cache[key] = value


def array_offsets(spec: Spec, base: int) -> tuple[tuple[ArrayLayout, ...], int]:
    """Offsets of each array from ``base`` (64-aligned) and the end offset."""
    key = (spec, base)
    hit = _layout_cache.get(key)
    if hit is not None:
        return hit
    off = align(base)
    out: list[ArrayLayout] = []
    for name, dstr, shape in spec:
        dt = np.dtype(dstr)
        nbytes = math.prod(shape) * dt.itemsize  # Python ints: a hostile shape cannot overflow
        out.append(ArrayLayout(name, dt, shape, off, nbytes))
        off = align(off + nbytes)
    result = (tuple(out), off)
    _bounded_put(_layout_cache, key, result)
    return result


def header(ext_name: str | None, spec: Spec) -> bytes:
    key = (ext_name, spec)
    hit = _header_cache.get(key)
    if hit is None:
        hit = encode_header(ext_name, spec)
        _bounded_put(_header_cache, key, hit)
    return hit


def encode_header(ext_name: str | None, spec: Spec) -> bytes:
    """The binary header of a payload (the format in the module docstring)."""
    ext = b"" if ext_name is None else ext_name.encode("ascii")
    parts = [_HEAD.pack(HEADER_VERSION, len(spec), len(ext), 0), ext]
    for name, dstr, shape in spec:
        raw = name.encode()
        parts.append(_HEAD.pack(_DTYPE_CODE[dstr], len(shape), len(raw), 0))
        parts.append(struct.pack(f"<{len(shape)}q", *shape))
        parts.append(raw)
    return b"".join(parts)


def decode_header(raw: bytes, external: bool) -> tuple[str | None, Spec]:
    """Parse a binary header read from shared memory; anything unexpected is a ``BadRequest``.

    Every read is bounded by ``len(raw)``, every value is checked against the format before use.
    """

    def bad(what: str) -> BadRequest:
        return BadRequest(f"corrupt payload header: {what}")

    n = len(raw)
    if n < _HEAD.size:
        raise bad(f"{n} bytes, expected at least {_HEAD.size}")
    version, count, ext_len, zero = _HEAD.unpack_from(raw, 0)
    if version != HEADER_VERSION or zero:
        raise bad(f"version {version} (reserved byte {zero}), expected version {HEADER_VERSION}")
    if not 1 <= count <= MAX_ARRAYS:
        raise bad(f"{count} arrays, expected 1..{MAX_ARRAYS}")
    if (ext_len > 0) != external:
        raise bad(f"segment-name length {ext_len} disagrees with the external flag ({external})")
    pos = _HEAD.size + ext_len
    if pos > n:
        raise bad(f"segment name of {ext_len} bytes runs past the {n}-byte header")
    ext_name: str | None = None
    if ext_len:
        ext_name = raw[_HEAD.size : pos].decode("ascii", "replace")
        parts = parse_name(ext_name)
        if parts is None or parts.kind != "nd":
            raise bad(f"ndarray segment name {ext_name!r} is not a lowtail.nd.* segment name")
    spec: list[tuple[str, str, tuple[int, ...]]] = []
    names: set[str] = set()
    for i in range(count):
        if pos + _HEAD.size > n:
            raise bad(f"array {i} runs past the {n}-byte header")
        code, rank, name_len, zero = _HEAD.unpack_from(raw, pos)
        pos += _HEAD.size
        if not 1 <= code <= len(DTYPES) or zero:
            raise bad(f"array {i} has dtype code {code}, expected 1..{len(DTYPES)} ({', '.join(DTYPES)})")
        if not 1 <= rank <= MAX_RANK or name_len == 0:
            raise bad(
                f"array {i} has rank {rank} and name length {name_len}, expected 1..{MAX_RANK} and >= 1"
            )
        end = pos + 8 * rank + name_len
        if end > n:
            raise bad(f"array {i} runs past the {n}-byte header")
        shape = struct.unpack_from(f"<{rank}q", raw, pos)
        try:
            name = raw[pos + 8 * rank : end].decode()
        except UnicodeDecodeError:
            raise bad(f"array {i}'s name is not UTF-8") from None
        pos = end
        if any(not 0 <= d < MAX_DIM for d in shape):
            raise bad(f"array {name!r} has dims {list(shape)}, expected each in 0..{MAX_DIM - 1}")
        if name in names:
            raise bad(f"array name {name!r} appears twice")
        names.add(name)
        spec.append((name, DTYPES[code - 1], tuple(shape)))
    if pos != n:
        raise bad(f"{n - pos} trailing bytes after {count} arrays")
    batch = spec[0][2][0]
    if batch < 1 or any(shape[0] != batch for _, _, shape in spec):
        raise bad(f"batch dimension must be >= 1 and the same for all arrays: {spec}")
    return ext_name, tuple(spec)


def inline_nbytes(spec: Spec, ext_name: str | None = None) -> int:
    """Bytes a payload takes in a slot region (the arrays included unless they go to an ndarray segment)."""
    base = 8 + len(header(ext_name, spec))
    if ext_name is not None:
        return base
    return array_offsets(spec, base)[1]


def external_nbytes(spec: Spec) -> int:
    return array_offsets(spec, 0)[1]


_prefixed: dict[tuple[str | None, Spec], bytes] = {}


def write_header(buf: np.ndarray[Any, Any], off: int, ext_name: str | None, spec: Spec) -> int:
    """Write the prefix and header at ``off`` of the uint8 array ``buf``; returns the data base offset."""
    key = (ext_name, spec)
    raw = _prefixed.get(key)
    if raw is None:
        h = header(ext_name, spec)
        raw = _PREFIX.pack(len(h), FLAG_EXTERNAL if ext_name is not None else 0) + h
        _bounded_put(_prefixed, key, raw)
    # One memoryview slice store of the cached bytes (~0.3 us; packing and a numpy slice store: ~1.8 us)
    buf.data[off : off + len(raw)] = raw
    return len(raw)


Arrays = dict[str, np.ndarray[Any, Any]]


_header_layouts: dict[bytes, tuple[str | None, PayloadLayout]] = {}


def read_header(
    mem: memoryview, words: memoryview, off: int, limit: int
) -> tuple[str | None, PayloadLayout, bytes]:
    """Parse the payload at byte ``off`` (8-aligned) of ``mem`` (bytes) / ``words`` (the same as u64).

    Returns (ndarray segment name or None, layout, raw prefix and header bytes).
    """
    word = words[off >> 3]  # the u32 length and the u32 flags of the prefix, in one load
    hlen, flags = word & 0xFFFFFFFF, word >> 32
    if hlen <= 0 or 8 + hlen > limit or flags not in (0, FLAG_EXTERNAL):
        raise BadRequest(
            f"corrupt payload header: length {hlen} flags {flags:#x} in a {limit}-byte region "
            f"(expected flags 0 or {FLAG_EXTERNAL})"
        )
    raw = mem[off : off + 8 + hlen].tobytes()  # with the prefix: the flags are part of the key
    hit = _header_layouts.get(raw)
    if hit is None:
        # The copy re-reads the prefix: decode only a copy whose prefix is the word bounded above, so a
        # writer flipping it in between cannot cache one prefix's decode under another's key.
        if int.from_bytes(raw[:8], "little") != word:
            raise BadRequest("corrupt payload header: its prefix changed while it was read")
        ext, spec = decode_header(raw[8:], flags == FLAG_EXTERNAL)
        hit = (ext, intern_layout(spec))
        _bounded_put(_header_layouts, raw, hit)
    return hit[0], hit[1], raw


def views(buf: np.ndarray[Any, Any], arrays: tuple[ArrayLayout, ...], base: int) -> Arrays:
    """Zero-copy numpy views of the arrays laid out from ``base`` in ``buf``."""
    out: Arrays = {}
    for a in arrays:
        start = base + a.offset
        out[a.name] = buf[start : start + a.nbytes].view(a.dtype).reshape(a.shape)
    return out


def copy_in(dst: dict[str, np.ndarray[Any, Any]], src: Mapping[str, np.ndarray[Any, Any]]) -> None:
    for name, view in dst.items():
        np.copyto(view, src[name], casting="no")


class NdarraySegment:
    """A segment holding one payload's arrays: the predecessor's SharedNdarraySlot, with a pooled lifetime."""

    # Segments this process created and attached, since it started: the "nothing is mapped per
    # request" property is checked through these, not through a timer.
    created = 0
    attached = 0

    def __init__(self, seg: Segment, shm_dir: str) -> None:
        self.segment = seg
        self.shm_dir = shm_dir
        self.buf: np.ndarray[Any, Any] = np.frombuffer(seg.mm, np.uint8)
        self.capacity = seg.size
        # The views of each payload shape this segment held, built once (~1.6 us per request otherwise).
        self._views: dict[Spec, Arrays] = {}

    @property
    def name(self) -> str:
        return self.segment.name

    @classmethod
    def create(
        cls, nbytes: int, shm_dir: str = SHM_DIR, mode: int = 0o600, numa_node: int | None = None
    ) -> NdarraySegment:
        def place(mm: Any) -> None:
            if numa_node is not None:
                numa.bind(mm, numa_node)

        segment = cls(create_segment("nd", max(nbytes, 4096), shm_dir, mode, place), shm_dir)
        NdarraySegment.created += 1
        return segment

    @classmethod
    def attach(cls, name: str, shm_dir: str = SHM_DIR, mode: int = 0o600) -> NdarraySegment:
        segment = cls(attach_segment(name, shm_dir, mode), shm_dir)
        NdarraySegment.attached += 1
        return segment

    @classmethod
    def from_arrays(
        cls, arrays: Mapping[str, np.ndarray[Any, Any]], shm_dir: str = SHM_DIR, mode: int = 0o600
    ) -> tuple[NdarraySegment, dict[str, Any]]:
        """Create a segment holding a copy of ``arrays``; returns it and its picklable bundle."""
        spec, _ = describe(arrays)
        segment = cls.create(external_nbytes(spec), shm_dir, mode)
        return segment, segment.write(arrays, spec)

    def write(self, arrays: Mapping[str, np.ndarray[Any, Any]], spec: Spec) -> dict[str, Any]:
        cached = self._views.get(spec)
        if cached is None:
            lay, end = array_offsets(spec, 0)
            if end > self.capacity:
                raise BadRequest(
                    f"payload of {end} B does not fit ndarray segment {self.name} ({self.capacity} B)"
                )
            cached = self._cache_views(spec, views(self.buf, lay, 0))
        copy_in(cached, arrays)
        return {"name": self.name, "shm_dir": self.shm_dir, "spec": spec}

    def arrays(self, spec: Spec) -> dict[str, np.ndarray[Any, Any]]:
        """Zero-copy views of the payload ``spec`` (the same dict for the same spec: do not mutate it)."""
        cached = self._views.get(spec)
        if cached is None:
            lay, end = array_offsets(spec, 0)
            if end > self.capacity:
                raise BadRequest(
                    f"layout of {end} bytes exceeds ndarray segment {self.name} ({self.capacity} B)"
                )
            cached = self._cache_views(spec, views(self.buf, lay, 0))
        return cached

    def _cache_views(self, spec: Spec, got: Arrays) -> Arrays:
        if len(self._views) >= 16:
            self._views.clear()  # a segment whose shapes vary without bound keeps no more than 16
        self._views[spec] = got
        return got

    @classmethod
    def open_bundle(cls, bundle: Mapping[str, Any]) -> tuple[NdarraySegment, dict[str, np.ndarray[Any, Any]]]:
        """Attach a bundle made by ``from_arrays``/``write``: zero-copy views of the same pages."""
        segment = cls.attach(bundle["name"], bundle["shm_dir"])
        return segment, segment.arrays(bundle["spec"])

    def close(self) -> None:
        self._views.clear()  # the views hold the mapping: drop them before it is unmapped
        del self.buf
        self.segment.close()


# Rotation of ndarray segments (``acquire(rotate=True)``, the client's writes). The worker's core read a
# segment last, so its lines sit in that core's L2 (1 MiB here, 1-2 MiB on current server cores) and the
# client's stores to them each wait for a cross-core invalidation. A segment is therefore written again
# only after about ROTATE_BYTES went through the worker's L2 since it read it: the other segments of the
# rotation, and the worker's copy-in of about one segment. Measured on this 2-vCPU KVM guest (AMD EPYC,
# 1 MiB L2) with a two-process copy loop (``lowtail bench ndslot`` shows the write per
# size): the client's write of 1 MiB into the segment the worker just read took 66-95 us (one run
# 426 us: the bimodal figure of docs/benchmarks.md), 24 us with two segments in turn, as fast as a
# private copy; 2 MiB 108 -> 48 us with two; 512 KiB 54 -> 14 us with four. Above ROTATE_MAX_CAP the
# worker's L2 holds only a segment's tail and a spare costs memory without saving time (4 MiB 143 vs
# 139 us, 8 MiB 375 vs 506 us); below ROTATE_MIN_CAP it takes 8 and more segments (file descriptors
# held by both processes) to save a few microseconds (256 KiB: 29 -> 7 us with eight).
ROTATE_BYTES = 2 << 20
ROTATE_MIN_CAP = 512 << 10
ROTATE_MAX_CAP = 2 << 20


def rotation_spares(capacity: int) -> int:
    """Free segments of ``capacity`` a rotating pool keeps before it reuses one (0: reuse at once)."""
    if not ROTATE_MIN_CAP <= capacity <= ROTATE_MAX_CAP:
        return 0
    return max(1, -(-ROTATE_BYTES // capacity) - 1)  # the worker's copy-in passes one segment's worth


class NdarraySegmentPool:
    """Ndarray segments created by this process, reused by size (power-of-two capacities, at least 64 KiB).

    The free segments are taken least recently released first; with ``rotate`` a size class is first
    grown to ``rotation_spares`` free segments, so the writer cycles through them (see ROTATE_BYTES).
    """

    def __init__(self, shm_dir: str = SHM_DIR, mode: int = 0o600, numa_node: int | None = None) -> None:
        self.shm_dir = shm_dir
        self.mode = mode
        self.numa_node = numa_node
        self._free: list[NdarraySegment] = []
        self._all: list[NdarraySegment] = []

    def acquire(self, nbytes: int, rotate: bool = False) -> NdarraySegment:
        best: NdarraySegment | None = None
        for s in self._free:  # in release order: the first of the smallest capacity is the oldest
            if s.capacity >= nbytes and (best is None or s.capacity < best.capacity):
                best = s
        if best is not None:
            spares = rotation_spares(best.capacity) if rotate else 0
            if spares <= 1 or sum(s.capacity == best.capacity for s in self._free) >= spares:
                self._free.remove(best)
                return best
        cap = max(1 << 16, 1 << (max(nbytes, 1) - 1).bit_length())
        segment = NdarraySegment.create(cap, self.shm_dir, self.mode, self.numa_node)
        self._all.append(segment)
        return segment

    def __len__(self) -> int:
        return len(self._all)

    def release(self, segment: NdarraySegment) -> None:
        self._free.append(segment)

    def close(self) -> None:
        for s in self._all:
            s.close()
        self._all.clear()
        self._free.clear()


class AttachedNdarraySegments:
    """Ndarray segments of other processes, attached once by name and kept for reuse.

    Bounded by mapped bytes, not by count (a count bound let 14 restarted clients' 4 MiB segments fill
    a 64 MiB tmpfs: an unlinked file's pages live as long as a mapping does), least recently used
    out first; ``drop_lane`` unmaps what a lane's previous client sent, when the lane changes hands.
    """

    def __init__(self, limit_bytes: int = 1 << 30) -> None:
        self._segments: OrderedDict[str, tuple[NdarraySegment, int]] = OrderedDict()
        self._limit = limit_bytes
        self.mapped_bytes = 0

    def get(self, name: str, shm_dir: str, mode: int = 0o600, lane: int = 0) -> NdarraySegment:
        hit = self._segments.get(name)
        if hit is not None:
            self._segments.move_to_end(name)
            return hit[0]
        segment = NdarraySegment.attach(name, shm_dir, mode)
        self._segments[name] = (segment, lane)
        self.mapped_bytes += segment.capacity
        while self.mapped_bytes > self._limit and len(self._segments) > 1:
            self._evict(next(iter(self._segments)))
        return segment

    def drop_lane(self, lane: int) -> None:
        for name in [n for n, (_, owner) in self._segments.items() if owner == lane]:
            self._evict(name)

    def _evict(self, name: str) -> None:
        segment, _ = self._segments.pop(name)
        self.mapped_bytes -= segment.capacity
        segment.close()

    def __len__(self) -> int:
        return len(self._segments)

    def close(self) -> None:
        for name in list(self._segments):
            self._evict(name)


class NdarraySegmentReader:
    """The worker's side of clients' ndarray segments: read (``preadv``) into the worker's own memory,
    never mapped.

    A client owns its segment file and may truncate, shrink or punch it at any moment. A mapping of it
    would then SIGBUS the reader at the first access past the new end (or to a page the tmpfs cannot
    back), and no check before the access closes that window. ``read(2)`` cannot fault that way: on
    a truncated file it returns short (the request is refused), on a hole it copies zeros, whatever
    the interleaving. The cost is one copy of the request into a per-slot buffer the worker keeps.
    Before any copy a request is refused when it exceeds ``max_ndslot_bytes``, names a segment its
    lane's client did not create (the pid in the name is not the lane's), or the file is shorter
    than the layout or sparse (fewer blocks than bytes).
    """

    def __init__(self, buffer_limit_bytes: int = 256 << 20) -> None:
        self._fds: OrderedDict[str, tuple[int, int]] = OrderedDict()  # name -> (fd, lane)
        self._bufs: dict[int, np.ndarray[Any, Any]] = {}  # slot g -> its copy of the last request
        self._buf_bytes = 0
        self._buf_limit = buffer_limit_bytes
        self._ns = pid_namespace()

    def read(  # noqa: PLR0917 - the worker's decode passes what it holds
        self, name: str, shm_dir: str, mode: int, lane: int, owner_pid: int, g: int,
        lay: PayloadLayout, limit_bytes: int,
    ) -> Arrays:  # fmt: skip
        need = lay.ext_bytes
        if limit_bytes and need > limit_bytes:
            raise PayloadTooLarge(
                f"request of {need} bytes in ndarray segment {name} exceeds max_ndslot_bytes={limit_bytes}"
            )
        parts = parse_name(name)
        if parts is None or parts.kind != "nd" or parts.pidns != self._ns or parts.pid != owner_pid:
            raise BadRequest(
                f"ndarray segment {name!r} is not one the client of lane {lane} (pid {owner_pid}) created "
                f"in this PID namespace; a request may name only its own client's segments"
            )
        fd = self._fd(name, shm_dir, mode, lane)
        st = os.fstat(fd)
        if st.st_size < need:
            raise BadRequest(f"ndarray segment {name} holds {st.st_size} bytes, the request needs {need}")
        if st.st_blocks * 512 < min(st.st_size, need):
            raise BadRequest(
                f"ndarray segment {name} is sparse ({st.st_blocks * 512} of {st.st_size} bytes backed): "
                f"expected a segment fully allocated by its creator"
            )
        buf = self._buffer(g, need)
        got = os.preadv(fd, [buf.data[:need]], 0)
        if got != need:
            raise BadRequest(
                f"ndarray segment {name} shrank to {got} bytes while read; the request needs {need}"
            )
        return views(buf, array_offsets(lay.spec, 0)[0], 0)

    def _fd(self, name: str, shm_dir: str, mode: int, lane: int) -> int:
        hit = self._fds.get(name)
        if hit is not None:
            self._fds.move_to_end(name)
            return hit[0]
        fd, _ = open_segment_fd(name, shm_dir, mode)
        self._fds[name] = (fd, lane)
        while len(self._fds) > 1024:  # fds, not memory: a bound on what a churning client costs
            os.close(self._fds.popitem(last=False)[1][0])
        return fd

    def _buffer(self, g: int, need: int) -> np.ndarray[Any, Any]:
        buf = self._bufs.get(g)
        if buf is not None and len(buf) >= need:
            return buf
        if buf is not None:
            self._buf_bytes -= len(buf)
        if self._buf_bytes + need > self._buf_limit:
            self._bufs.clear()  # each request is read into memory only until it is answered
            self._buf_bytes = 0
        buf = np.empty(need, np.uint8)
        self._bufs[g] = buf
        self._buf_bytes += need
        return buf

    def lanes(self) -> set[int]:
        """The lanes whose clients' segments this reader holds fds of."""
        return {lane for _, lane in self._fds.values()}

    def drop_lane(self, lane: int) -> None:
        """Close the fds of what a lane's previous client sent (the lane changed hands or was left)."""
        for name in [n for n, (_, owner) in self._fds.items() if owner == lane]:
            os.close(self._fds.pop(name)[0])

    def __len__(self) -> int:
        return len(self._fds)

    def close(self) -> None:
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()
        self._bufs.clear()
        self._buf_bytes = 0


# Names this module used before "segment" came to mean only a queue segment's 128-byte control record and
# the "layout" functions were named for what they do: kept one release, with a DeprecationWarning.
_DEPRECATED = {
    "NdarraySlot": "NdarraySegment",
    "NdarraySlotPool": "NdarraySegmentPool",
    "AttachedSlots": "AttachedNdarraySegments",
    "SlotReader": "NdarraySegmentReader",
    "layout": "array_offsets",
    "layout_for": "intern_layout",
    "layout_of": "validated_layout",
    "read_layout": "read_header",
}


def __getattr__(name: str) -> Any:
    new = _DEPRECATED.get(name)
    if new is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import warnings

    warnings.warn(
        f"lowtail.shm.payload.{name} is renamed {new}; the old name will be removed in the next release",
        DeprecationWarning,
        stacklevel=2,
    )
    return globals()[new]
