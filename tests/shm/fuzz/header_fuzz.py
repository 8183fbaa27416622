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
the header.
"""

from __future__ import annotations

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
    """One input: both decoders agree (an AssertionError names the input otherwise)."""
    if not data:
        return
    external, raw = bool(data[0] & 1), data[1:]
    want, got = _python(raw, external), _native(raw, external)
    assert got == want, (
        f"decoders disagree on external={external} header={raw!r}: python {want!r}, native {got!r}"
    )


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
    names = [None, "lowtail.nd.4026531836.123.0123456789ab", "lowtail.nd.0.1.ffffffffffff"]
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


def mutate(data: bytes, rnd: random.Random, pool: list[bytes]) -> bytes:
    b = bytearray(data)
    for _ in range(rnd.randint(1, 4)):
        op = rnd.randrange(7)
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
    return bytes(b)


def run(seconds: float, seed: int = 0) -> int:
    """Mutate the corpus for ``seconds``; returns the inputs checked (raises on a disagreement)."""
    rnd = random.Random(seed)
    pool = seeds()
    if not pool:
        raise RuntimeError(f"no fuzz corpus in {CORPUS}")
    for s in pool:
        check(s)
    end = time.monotonic() + seconds
    n = 0
    while time.monotonic() < end:
        for _ in range(200):
            check(mutate(rnd.choice(pool), rnd, pool))
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
