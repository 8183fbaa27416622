"""Differential fuzzing of the payload header decoder: the native core's (``lowtail_native.decode_header``,
Rust) against the Python reference (``lowtail.shm.payload.decode_header``) on bytes a hostile process
could write. Both must accept the same inputs with the same result and refuse the same ones; the native
one must never crash. The ndarray segment-name decoding is part of the header, so it is fuzzed with it.

Two engines:
- ``run(seconds)``: a seeded mutation fuzzer (flips, interesting bytes and dims, inserts, deletes,
  splices) over the corpus in ``tests/shm/fuzz/corpus``, for a stated time; no extra package. The slow
  test (tests/shm/test_native_fuzz.py) runs it.
- ``python tests/shm/fuzz/header_fuzz.py [-max_total_time=N] tests/shm/fuzz/corpus``: coverage-guided
  with atheris (PyPI) when it is installed; new inputs it finds can be kept in the corpus.

The first byte of an input is the external flag (odd: the payload claims an ndarray segment); the rest is
the header. Each input is also written into a request slot's region and claimed through the core's
``Segment.take`` (the prefix word's bounds, the decode and its cache, as the worker runs them) against
the Python worker's ``payload.read_header``; with bit 1 of the first byte set, the rest is the region's
raw bytes, its prefix word included, so a hostile length or flag word is fuzzed too.

Slot names are mutated field by field as well (``_NAME_VALID``, ``_NAME_EDGES``: the pid namespace
at 2^64, the pid at 2^22, leading zeros, the token's length and case), since a byte flip rarely lands
on a bound. And the
client's answer read (``check_answer``): a response region whose prefix and header are a mutation of
the key a client cached from a valid answer, read by the core's ``receive_answer`` against the Python
client's rule (the cached layout holds only when the region starts with the key byte for byte, and
then every array is the region's bytes at its offset).
"""

from __future__ import annotations

import functools
import random
import struct
import sys
import time
from pathlib import Path
from typing import Any

CORPUS = Path(__file__).with_name("corpus")


def _python(raw: bytes, external: bool) -> Any:
    from lowtail.shm import payload
    from lowtail.shm.errors import BadRequest

    try:
        ext, spec = payload.decode_header(raw, external)
    except BadRequest:
        return None
    codes = {d: i + 1 for i, d in enumerate(payload.DTYPES)}
    return ext, [(name, codes[d], list(shape)) for name, d, shape in spec]


def _native(raw: bytes, external: bool) -> Any:
    import lowtail_native  # type: ignore[import-not-found, unused-ignore]

    try:
        ext, arrays = lowtail_native.decode_header(raw, external)
    except ValueError:
        return None
    return ext, [(name, code, list(shape)) for name, code, shape in arrays]


def check(data: bytes) -> None:
    """One input: both decoders agree, alone and through a claim (an AssertionError names the input)."""
    if not data:
        return
    external, raw = bool(data[0] & 1), data[1:]
    want, got = _python(raw, external), _native(raw, external)
    assert got == want, (
        f"decoders disagree on external={external} header={raw!r}: python {want!r}, native {got!r}"
    )
    check_claimed(data)


class _Region:
    """One lane of one slot in an anonymous mapping, seen by the core (``Segment``) and by Python."""

    REQ = 1024

    def __init__(self) -> None:
        import mmap

        import lowtail_native  # type: ignore[import-not-found, unused-ignore]

        from lowtail.shm.layout import Geometry

        self.geo = geo = Geometry.of(1, 1, self.REQ, 64)
        self.mm = mmap.mmap(-1, geo.total)
        self.mem = memoryview(self.mm)
        self.q = self.mem.cast("Q")
        self.seg = lowtail_native.Segment(self.mm, 1, 1, self.REQ, 64, geo.total)
        self.tail = 0


@functools.cache
def _region() -> _Region:
    return _Region()


def _claimed_python(r: _Region, region: bytes) -> Any:
    from lowtail.shm import payload
    from lowtail.shm.errors import BadRequest

    try:
        ext, layout, _ = payload.read_header(r.mem, r.q, r.geo.req_off(0), r.geo.req_bytes)
    except BadRequest:
        return None
    codes = {d: i + 1 for i, d in enumerate(payload.DTYPES)}
    return ext, [(name, codes[d], list(shape)) for name, d, shape in layout.spec]


def check_claimed(data: bytes) -> None:
    """``data`` in a request region, claimed by the core's ``take``: accepted and decoded as
    ``payload.read_header`` does, or refused when it refuses."""
    from lowtail.shm.layout import L_RING, W_REQ_SEQ

    r = _region()
    off, n = r.geo.req_off(0), r.geo.req_bytes
    if data[0] & 2:
        region = data[1 : 1 + n]
    else:
        region = struct.pack("<II", len(data) - 1, data[0] & 1) + data[1:]
        region = region[:n]
    r.mem[off : off + n] = region + bytes(n - len(region))
    si = r.geo.slot_word(0)
    r.q[si + W_REQ_SEQ] += 1  # a new request in the slot: claimable
    r.q[r.geo.lane(0, L_RING)] = 0  # ring[0]: slot 0
    kind, _, _, _, _, hdr = r.seg.take(0, r.tail, 1)
    r.tail += 1
    assert kind == 0, f"the region's request was not claimed (kind {kind})"
    got = None
    if not isinstance(hdr, str):
        ext, arrays = r.seg.header(hdr)
        got = ext, [(name, code, list(shape)) for name, code, shape in arrays]
    want = _claimed_python(r, region)
    assert got == want, (
        f"claimed header disagrees on region={region[:64]!r}...: python {want!r}, native {got!r}"
    )


class _AnswerRegion:
    """The response region of one slot, seen by the core and by Python, answered once per check."""

    RESP = 4096

    def __init__(self) -> None:
        import mmap

        import lowtail_native  # type: ignore[import-not-found, unused-ignore]

        from lowtail.shm.layout import Geometry

        self.geo = geo = Geometry.of(1, 1, 64, self.RESP)
        self.mm = mmap.mmap(-1, geo.total)
        self.mem = memoryview(self.mm)
        self.q = self.mem.cast("Q")
        self.seg = lowtail_native.Segment(self.mm, 1, 1, 64, self.RESP, geo.total)
        self.seq = 0


@functools.cache
def _answer_region() -> _AnswerRegion:
    return _AnswerRegion()


def answer_keys(pool: list[bytes]) -> list[tuple[bytes, Any]]:
    """(key, plan) for each seed that is a valid inline answer fitting the region: its prefix and header
    bytes as ``payload.read_header`` returns them, and the core's ``AnswerPlan`` the client builds."""
    import lowtail_native  # type: ignore[import-not-found, unused-ignore]
    import numpy as np

    from lowtail.shm import payload
    from lowtail.shm.errors import BadRequest

    r = _answer_region()
    off, out = r.geo.resp_off(0), []
    for data in pool:
        if not data or data[0] & 3:
            continue
        region = struct.pack("<II", len(data) - 1, 0) + data[1:]
        if len(region) > r.RESP:
            continue
        r.mem[off : off + r.RESP] = region + bytes(r.RESP - len(region))
        try:
            ext, layout, raw = payload.read_header(r.mem, r.q, off, r.RESP)
        except BadRequest:
            continue
        if ext is None and layout.inline_end <= r.RESP:
            arrays = [(a.name, a.offset, a.nbytes, tuple(a.shape), a.dtype) for a in layout.inline_layout]
            out.append((raw, (lowtail_native.AnswerPlan(raw, arrays, np.empty), layout.inline_layout)))
    return out


def check_answer(key: bytes, plan: Any, region: bytes, ok: bool, copy: bool) -> None:
    """``region`` (key-shaped bytes, the arrays after) answered in the slot: the core's read is what the
    Python client's rule gives (key equal: the arrays at their offsets; else, or an error status, None)."""
    import lowtail_native  # type: ignore[import-not-found, unused-ignore]
    import numpy as np

    from lowtail.shm.layout import ST_FAILED, ST_OK, W_RESP_SEQ, W_RESP_STATUS

    r = _answer_region()
    off, si = r.geo.resp_off(0), r.geo.slot_word(0)
    r.mem[off : off + r.RESP] = region[: r.RESP].ljust(r.RESP, b"\0")
    r.seq += 1
    r.q[si + W_RESP_STATUS] = ST_OK if ok else ST_FAILED
    r.q[si + W_RESP_SEQ] = r.seq
    got = lowtail_native.receive_answer(r.seg, 0, 0, r.seq, plan[0], copy)
    assert got[0] is True and got[2] == (ST_OK if ok else ST_FAILED)
    same = ok and bytes(r.mem[off : off + len(key)]) == key
    if not same:
        assert got[7] is None, f"the core read an answer whose header is not the key: {region[:64]!r}..."
        return
    if not copy or not plan[1]:
        assert got[7] is True, f"key equal, not taken as the cached layout: {region[:64]!r}..."
        return
    arrays = got[7]
    assert isinstance(arrays, dict), f"key equal, the core did not read the arrays: {region[:64]!r}..."
    assert list(arrays) == [a.name for a in plan[1]]
    for a in plan[1]:
        want = np.frombuffer(bytes(r.mem[off + a.offset : off + a.offset + a.nbytes]), a.dtype).reshape(
            a.shape
        )
        assert arrays[a.name].dtype == want.dtype and arrays[a.name].shape == want.shape
        assert arrays[a.name].tobytes() == want.tobytes(), f"array {a.name} read other bytes"


def seeds() -> list[bytes]:
    """The corpus: valid headers of many shapes (written by ``write_corpus``) and what was kept since."""
    return [p.read_bytes() for p in sorted(CORPUS.glob("*"))] if CORPUS.is_dir() else []


def write_corpus() -> int:
    """Write the seed inputs: headers the encoder makes for varied specs, inline and external."""
    from lowtail.shm import payload

    specs = [
        (("x", "<f4", (1, 4)),),
        (("obs", "<f4", (16, 512)),),
        (("a", "|u1", (3,)), ("b", "<i8", (3, 2, 2)), ("é", "<c16", (3, 1, 1, 1, 1, 1, 1, 1))),
        (("mask", "|b1", (8, 0)), ("v", "<f2", (8, 7))),
    ]
    names = [
        None,
        "lowtail.nd.4026531836.123.0123456789ab",
        "lowtail.nd.0.1.ffffffffffff",
        f"lowtail.nd.{(1 << 64) - 1}.{1 << 22}.0123456789ab",  # both bounds, accepted
    ]
    CORPUS.mkdir(parents=True, exist_ok=True)
    n = 0
    for i, spec in enumerate(specs):
        for j, name in enumerate(names):
            raw = payload.encode_header(name, spec)
            (CORPUS / f"seed-{i}-{j}").write_bytes(bytes([1 if name else 0]) + raw)
            n += 1
    return n


_INTERESTING = [0, 1, 2, 3, 7, 8, 9, 14, 15, 63, 64, 65, 127, 128, 254, 255]
_DIMS = [0, 1, -1, 2**40 - 1, 2**40, 2**63 - 1, -(2**63)]
# A slot name's fields at and around their bounds (pid namespace, pid, token): valid ones, and edges
# (each valid or not: 2^64 - 1 and 2^22 are accepted, one more is not).
_NAME_VALID = (
    ["0", "1", "4026531836", str(2**64 - 1)],
    ["1", str(2**22 - 1), str(2**22), "9999"],
    ["0123456789ab", "ffffffffffff", "000000000000"],
)
_NAME_EDGES = (
    ["00", "01", str(2**64), "9" * 20, "1" + "0" * 19, "1" + "0" * 20, "-1", "+1", " 1", "", "\u0661"],
    ["0", "01", str(2**22 + 1), "9999999", "10000000", "+1", "1_0", ""],
    ["0123456789AB", "0123456789a", "0123456789abc", "0123456789ag", "", "0123456789a/"],
)
_NAME_PREFIXES = [b"lowtail.q.", b"lowtail.nd", b"Lowtail.nd.", b"lowtail.nd.."]


def _mutate_name(b: bytearray, rnd: random.Random) -> bytearray:
    """Rebuild the slot name of an external input (``b[0]`` odd, a header at ``b[1:]``): valid fields
    but one at an edge (or none), now and then another prefix or a fourth part; its length byte follows.
    Other inputs are returned as they are."""
    if len(b) < 5 or not b[0] & 1 or b[0] & 2:
        return b
    old = b[3]
    fields = [rnd.choice(f) for f in _NAME_VALID]
    k = rnd.randrange(4)
    if k < 3:
        fields[k] = rnd.choice(_NAME_EDGES[k])
    if rnd.random() < 0.1:
        fields.append(rnd.choice(_NAME_VALID[2]))
    prefix = rnd.choice(_NAME_PREFIXES) if rnd.random() < 0.1 else b"lowtail.nd."
    name = prefix + ".".join(fields).encode()
    if len(name) > 255:
        return b
    return b[:3] + bytearray([len(name)]) + b[4:5] + name + b[5 + old :]


def mutate(data: bytes, rnd: random.Random, pool: list[bytes]) -> bytes:
    b = bytearray(data)
    for _ in range(rnd.randint(1, 4)):
        op = rnd.randrange(8)
        pos = rnd.randrange(len(b) + 1)
        if op == 0 and b:
            b[pos % len(b)] ^= 1 << rnd.randrange(8)
        elif op == 1 and b:
            b[pos % len(b)] = rnd.choice(_INTERESTING)
        elif op == 2:
            b[pos:pos] = bytes(rnd.randrange(256) for _ in range(rnd.randint(1, 8)))
        elif op == 3 and b:
            del b[pos : pos + rnd.randint(1, 8)]
        elif op == 4 and len(b) >= 9:
            at = rnd.randrange(len(b) - 8)
            b[at : at + 8] = struct.pack("<q", rnd.choice(_DIMS))
        elif op == 5 and pool:
            other = rnd.choice(pool)
            cut = rnd.randrange(len(other) + 1)
            b = b[:pos] + bytearray(other[cut:])
        elif op == 6:
            b[0:1] = bytes([rnd.randrange(2)])
        elif op == 7:
            b = _mutate_name(b, rnd)
    return bytes(b)


def run(seconds: float, seed: int = 0) -> int:
    """Mutate the corpus for ``seconds``; returns the inputs checked (raises on a disagreement)."""
    rnd = random.Random(seed)
    pool = seeds()
    if not pool:
        raise RuntimeError(f"no fuzz corpus in {CORPUS}")
    for s in pool:
        check(s)
    keys = answer_keys(pool)
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        for _ in range(200):
            check(mutate(rnd.choice(pool), rnd, pool))
            key, plan = rnd.choice(keys)
            # half the answers carry the key itself (the common case: the arrays are read), half a
            # mutation of it; the bytes after the key are the answer's arrays, random
            head = key if rnd.random() < 0.5 else mutate(b"\0" + key, rnd, [])[1:]
            tail = rnd.randbytes(rnd.randrange(_AnswerRegion.RESP))
            check_answer(key, plan, head + tail[len(head) :], rnd.random() < 0.9, rnd.random() < 0.8)
        n += 200
    return n


if __name__ == "__main__":
    if sys.argv[1:] == ["--write-corpus"]:
        print(f"{write_corpus()} seeds in {CORPUS}")
        sys.exit(0)
    import atheris  # type: ignore[import-not-found, unused-ignore]

    with atheris.instrument_imports(include=["lowtail.shm.payload", "lowtail.shm.segments"]):
        from lowtail.shm import payload  # noqa: F401 - instrumented: the reference decoder's branches
    atheris.Setup(sys.argv, check)
    atheris.Fuzz()
