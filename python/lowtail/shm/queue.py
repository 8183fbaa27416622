"""The shared-memory inference queue: samplers (clients) -> one pinned worker -> back, without locks.

Roles: the *server* (``InferenceQueue.create``, e.g. the Ray inference actor) owns the segment; each
*client* (``QueueClient.attach``, a sampler) registers once and owns one *lane* of slots; one *worker*
(``QueueWorker.attach``, the pinned OpenVINO process) claims requests in batches and answers them.

This module only re-exports the queue's public names, so callers keep importing them from here.
The queue lives in four parts, split at its seams:

- ``lowtail.shm.layout``: every field of the segment (offset, size, single writer), the publication
  and waiting rules, the named offsets and word indices, and the geometry.
- ``lowtail.shm.control``: ``QueueConfig``, ``QueueDescriptor``, attaching, and ``InferenceQueue``
  (create, snapshot, close, sweep); lane and worker liveness.
- ``lowtail.shm.client``: ``QueueClient``, ``Ticket``, ``Pending``, ``RequestTiming``, ``HeldOutputs``,
  ``wait_first``; the hot path ``submit`` / ``wait``, and ``withdraw``.
- ``lowtail.shm.server``: ``QueueWorker``, ``Batch``, ``WorkerStandby``; the hot path ``claim`` /
  ``answer``, fencing, and a standby's takeover.
"""

from __future__ import annotations

from lowtail.shm.client import HeldOutputs, Pending, QueueClient, RequestTiming, Ticket, wait_first
from lowtail.shm.control import InferenceQueue, LaneSnapshot, QueueConfig, QueueDescriptor, QueueSnapshot
from lowtail.shm.control import attach_mapped as _attach  # noqa: F401 - the fuzzers in tests/shm map with it
from lowtail.shm.errors import (
    AnswerLost,
    BadConfig,
    BadRequest,
    BatchClosed,
    LaneBusy,
    LaneUnavailable,
    NumaError,
    PayloadTooLarge,
    QueueError,
    QueueTimeout,
    RequestFailed,
    RequestWithdrawn,
    SegmentNotFound,
    ShmTooSmall,
    WorkerDied,
)
from lowtail.shm.layout import (
    H_DOORBELLS,
    H_WORKER_EPOCH,
    H_WORKER_PID,
    H_WORKER_SLEEP,
    L_GEN,
    L_RING,
    L_TAIL,
    S_CLAIM_SEQ,
    S_REQ_LEN,
    S_REQ_SEQ,
    S_REQ_STATE,
    S_RESP_SEQ,
    S_SUBMIT_NS,
)
from lowtail.shm.payload import NdarraySegment
from lowtail.shm.server import Batch, QueueWorker, WorkerStandby

__all__ = [
    "AnswerLost",
    "BadConfig",
    "BadRequest",
    "Batch",
    "BatchClosed",
    "HeldOutputs",
    "InferenceQueue",
    "LaneBusy",
    "LaneSnapshot",
    "LaneUnavailable",
    "NdarraySegment",
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
    "RequestTiming",
    "RequestWithdrawn",
    "SegmentNotFound",
    "ShmTooSmall",
    "Ticket",
    "WorkerDied",
    "WorkerStandby",
    "wait_first",
]
# The offsets stay importable from here for tools that write single words (the fuzzers in tests/shm).
__all__ += [
    "H_DOORBELLS",
    "H_WORKER_EPOCH",
    "H_WORKER_PID",
    "H_WORKER_SLEEP",
    "L_GEN",
    "L_RING",
    "L_TAIL",
    "S_CLAIM_SEQ",
    "S_REQ_LEN",
    "S_REQ_SEQ",
    "S_REQ_STATE",
    "S_RESP_SEQ",
    "S_SUBMIT_NS",
]
