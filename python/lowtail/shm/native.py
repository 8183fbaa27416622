"""Which implementation of the queue's hot path runs: the native core (``lowtail_native``, Rust) or Python.

The native core (the ``lowtail-native`` wheel, built from ``native/`` by maturin) implements the same
protocol as ``lowtail.shm.client`` / ``lowtail.shm.server`` on the words ``lowtail.shm.layout``
describes: publication, the spin and the park of a client, the claim, the answer words and the
wake-ups of a worker. Its offsets are generated from ``layout.py`` at build time
(``native/gen_layout.py``); an extension built against another layout (its ``LAYOUT_DIGEST`` differs from
the one computed here) is refused and the Python path runs.

The Python path is the reference and the fallback: it runs when the extension is not installed,
on a platform the queue does not support, or when ``LOWTAIL_PURE_PYTHON=1``. ``implementation()`` says
which runs and why (``lowtail validate``, ``status()`` and every bench report print it). The choice is
made per mapping, at attach: a client and a worker in one process may use different paths (the
differential tests pair them every way).
"""

from __future__ import annotations

import hashlib
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import ModuleType
from typing import Any

from lowtail.shm import layout, payload
from lowtail.shm.futex import is_supported_platform

ENV_PURE_PYTHON = "LOWTAIL_PURE_PYTHON"

# The constants the generator writes, in its order (native/gen_layout.py keeps the same two lists).
LAYOUT_NAMES = [
    "MAGIC",
    "VERSION",
    "PAGE",
    "MAX_LANES",
    "H_MAGIC",
    "H_GEOM0",
    "H_GEOM1",
    "H_GEOM2",
    "H_CREATOR",
    "H_WORKER_PID",
    "H_WORKER_EPOCH",
    "H_WORKER_SLEEP",
    "H_DOORBELLS",
    "LANE_BASE",
    "L_GEN",
    "L_PID",
    "L_PARKED",
    "L_TAIL",
    "L_RESP_COUNT",
    "L_RING",
    "SLOT_BYTES",
    "S_REQ_SEQ",
    "S_REQ_LEN",
    "S_REQ_STATE",
    "S_SUBMIT_NS",
    "S_WITHDRAWN",
    "S_RESP_SEQ",
    "S_CLAIM_SEQ",
    "S_RESP_LEN",
    "S_RESP_STATUS",
    "S_CLAIM_NS",
    "S_DONE_NS",
    "S_CALL_ENGINE_NS",
    "S_CALL",
    "CALL_BATCH_MASK",
    "CALL_DESCHEDULE_SHIFT",
    "FREE",
    "WRITING",
    "READY",
    "INHERITED",
    "ST_OK",
    "ST_FAILED",
    "ST_BAD_REQUEST",
    "ST_TOO_LARGE",
    "ST_WORKER_DIED",
    "ST_CLIENT_GONE",
    "ST_WITHDRAWN",
    "WORKER_LOCK_BYTE",
]
PAYLOAD_NAMES = ["ALIGN", "FLAG_EXTERNAL", "HEADER_VERSION", "MAX_ARRAYS", "MAX_RANK", "MAX_DIM"]


def layout_constants() -> list[tuple[str, int]]:
    """Every constant the native core is built with, from the running Python package."""
    out = [(n, int(getattr(layout, n))) for n in LAYOUT_NAMES]
    out += [(f"P_{n}", int(getattr(payload, n))) for n in PAYLOAD_NAMES]
    out.append(("P_DTYPE_COUNT", len(payload.DTYPES)))
    return out


def layout_digest() -> str:
    """The hash of ``layout_constants`` an extension must carry to be used."""
    text = "".join(f"{n}={v};" for n, v in layout_constants())
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@dataclass(frozen=True)
class Implementation:
    """Which hot path runs (``name``: "native" or "python") and why."""

    name: str
    reason: str
    version: str = ""

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "reason": self.reason, "version": self.version}

    def __str__(self) -> str:
        return f"{self.name} ({self.reason})"


def _load() -> tuple[ModuleType | None, Implementation]:
    if os.environ.get(ENV_PURE_PYTHON, "") not in ("", "0"):
        return None, Implementation("python", f"{ENV_PURE_PYTHON}={os.environ[ENV_PURE_PYTHON]}")
    if not is_supported_platform():
        return None, Implementation("python", "the native core is built for x86-64 Linux only")
    try:
        import lowtail_native  # type: ignore[import-not-found, import-untyped, unused-ignore]
    except ImportError as e:
        return None, Implementation("python", f"the native core is not installed ({e})")
    got = getattr(lowtail_native, "LAYOUT_DIGEST", "")
    if got != layout_digest():
        return None, Implementation(
            "python",
            f"the installed native core was built for layout {got}, this package's is {layout_digest()}: "
            f"rebuild it (make native)",
        )
    version = str(getattr(lowtail_native, "VERSION", ""))
    missing = [name for name in SEGMENT_CALLS if not hasattr(getattr(lowtail_native, "Segment", None), name)]
    missing += [name for name in MODULE_CALLS if not hasattr(lowtail_native, name)]
    poller_class = getattr(lowtail_native, "Poller", None)
    missing += [f"Poller.{name}" for name in POLLER_CALLS if not hasattr(poller_class, name)]
    if missing:
        return None, Implementation(
            "python",
            f"the installed native core ({version}) lacks {', '.join(missing)}: it was built from older "
            f"sources; rebuild it (make native)",
        )
    api = re.match(r"(\d+)\.(\d+)", version or "")
    if api and (int(api[1]), int(api[2])) > MIN_VERSION[:2]:  # (0.x: a newer minor's calls may differ)
        known = ".".join(map(str, MIN_VERSION[:2]))
        return None, Implementation(
            "python",
            f"the installed native core ({version}) is newer than {known}.x, whose calls this package "
            f"makes: install the core built with this package (make native)",
        )
    if _version_tuple(version) < MIN_VERSION:
        oldest = ".".join(map(str, MIN_VERSION))
        return None, Implementation(
            "python",
            f"the installed native core ({version or 'no VERSION'}) is older than {oldest}, whose calls this "
            f"package makes: rebuild it (make native)",
        )
    return lowtail_native, Implementation(
        "native", f"lowtail_native {version} loaded{_array_reads(lowtail_native)}", version
    )


def _array_reads(core: ModuleType) -> str:
    """What the reports add when the core reads arrays through buffer exports (its check of numpy's
    array fields failed, or ``LOWTAIL_NATIVE_ARRAY_EXPORTS`` is set): slower, the same answers."""
    direct = getattr(core, "direct_array_reads", None)
    if direct is None:
        return ""
    import numpy as np

    return "" if direct(np.ndarray) else "; arrays read through buffer exports"


# What this package calls on a native Segment: an extension built before one of them existed (the same
# layout, older sources) is refused as a whole, not met by an AttributeError mid-request.
SEGMENT_CALLS = (
    "publish",
    "spin",
    "park",
    "claim",
    "take",
    "header",
    "gather",
    "answer",
    "answer_rows",
    "wake_lanes",
    "wakes",
)
POLLER_CALLS = ("accept", "bind", "poll_bound", "resume_bound")  # bound once since 0.13.0


# And what it calls on the module: the client's round trip (copy-in and publication, the answer's read
# and copy-out, and since 0.14.0 both in one call for ``infer``), the plans those take, the serving
# loop's recorder (since 0.9.0) and the answer of a known layout that ``Batch.complete`` calls first
# (since 0.12.0). A call whose arguments change gets a new name, so an extension built before the
# change is refused here rather than called with the wrong arguments.
MODULE_CALLS = (
    "send_request",
    "receive_answer",
    "round_trip",
    "RequestPlan",
    "AnswerPlan",
    "CallRecorder",
    "complete_known",
)
# The oldest core whose calls take what this package passes: under the same names, receive_answer
# gained its park slice in 0.5.0 and took the caller's arrays as its copy in 0.6.0 (AnswerPlan the
# array type), and declines arrays that share memory since 0.6.1; KnownOutputs (and the core's answer of
# a known layout) take a batch's requests and a plan per request size since 0.7.0, and round_trip
# reports a failed read of an answer it found as answered (counted where it was found) since 0.15.0;
# complete_known reads the worker's segment, known layouts and outstanding requests from its
# _answer_with since 0.16.0; the worker's wait spins in the core (Poller.spin_bound) and round_trip takes
# the client's _Prediction to learn into as its last argument since 0.17.0. So an older build is refused
# by its version.
MIN_VERSION = (0, 17, 0)


def _version_tuple(version: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in version.split("."))
    except ValueError:
        return ()


_module, _impl = _load()
# tests: force a path for the mappings attached next (``use``); one element, so no global statement
_forced: list[bool | None] = [None]


def core() -> ModuleType | None:
    """The native module for a mapping attached now, or None for the Python path."""
    if _forced[0] is False:
        return None
    return _module


def implementation() -> Implementation:
    """What a mapping attached now uses, and why."""
    if _forced[0] is False and _module is not None:
        return Implementation("python", "the Python path was chosen for this mapping (use(native=False))")
    return _impl


def available() -> bool:
    return _module is not None


@contextmanager
def use(native: bool) -> Iterator[None]:
    """Attach with the native core (``native=True``, which must be available) or the Python path.

    For the tests that pair the two paths; the default (no ``use``) is the native core when it loads.
    """
    if native and _module is None:
        raise RuntimeError(f"the native core is not available: {_impl.reason}")
    prev, _forced[0] = _forced[0], native
    try:
        yield
    finally:
        _forced[0] = prev


def segment(buffer: Any, geo: layout.Geometry) -> Any:
    """A native ``Segment`` over a mapping of geometry ``geo``, or None on the Python path."""
    mod = core()
    if mod is None:
        return None
    return mod.Segment(buffer, geo.lanes, geo.spl, geo.req_bytes, geo.resp_bytes, geo.total)


def core_of(seg: Any) -> ModuleType:
    """The native module a ``Segment`` (``segment``) comes from: its round-trip calls and plans."""
    return sys.modules[type(seg).__module__]


def poller(tails: list[int], spl: int) -> Any:
    """The worker's poll in the core (``lowtail_native.Poller``) from the lanes' tails, for a worker whose
    mapping has a native ``Segment``."""
    if _module is None:
        raise RuntimeError(f"the native core is not available: {_impl.reason}")
    return _module.Poller(tails, spl)
