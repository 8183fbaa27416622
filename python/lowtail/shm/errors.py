"""Errors of the shared-memory inference queue. Every one is a ``QueueError``; messages name the value."""

from __future__ import annotations

from lowtail.errors import LowtailError


class QueueError(LowtailError):
    """Base class of every error the queue raises."""


class PayloadTooLarge(QueueError):
    """A request or response does not fit its slot and no ndarray segment may carry it."""


class BadRequest(QueueError):
    """Inputs the queue cannot carry: a non-numeric dtype, a batch dimension that disagrees, no arrays."""


class WorkerDied(QueueError):
    """The worker that claimed (or would claim) this request is gone."""


class RequestWithdrawn(QueueError):
    """Its client withdrew this request and the worker saw that before running it: it never ran."""


class QueueTimeout(QueueError, TimeoutError):
    """No answer within the caller's timeout; the request stays in flight and may be waited for again."""


class LaneUnavailable(QueueError):
    """Every lane is held by a live client."""


class LaneBusy(QueueError):
    """Every slot of this client's lane has a request in flight: wait for one before submitting more."""


class ShmTooSmall(QueueError):
    """The shared-memory file system cannot hold the segment (``posix_fallocate`` failed)."""


class AnswerLost(QueueError):
    """The request ran and was answered, but its answer went with its worker before it was read (the
    worker's ndarray segment holding it was unlinked): never send it again. Not a ``SegmentNotFound``,
    which callers treat as a lost attachment and retry elsewhere."""


class RequestFailed(QueueError):
    """The worker failed this request; the message is the worker's."""


class SegmentNotFound(QueueError):
    """A descriptor names a segment that does not exist here (another node, or its owner is gone)."""


class ShmDirUnsafe(SegmentNotFound):
    """lowtail's per-uid directory under the shm mount is a symlink, not a directory, or not ours alone."""


class NumaError(QueueError):
    """A NUMA binding or placement query failed (unknown node, kernel refused)."""


class BadConfig(QueueError, ValueError):
    """A queue configuration value out of range; the message names the field and what is expected."""


class BatchClosed(QueueError):
    """A claimed batch used after its answer, its ``with`` block or its worker's close(): views gone."""
