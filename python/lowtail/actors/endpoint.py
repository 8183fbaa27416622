"""What a sampler needs to reach an inference actor, and the rules for using it.

An ``Endpoint`` is published by an inference actor (``lowtail.actors.inference``) and used by
the sampler-side client (``lowtail.actors.inference_client``). Shared memory is node-local: an endpoint
carries its node id, and a client refuses one of another node (``CrossNodeAttach``) before attaching anything.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lowtail.errors import LowtailError
from lowtail.node.process import process_start_time

if TYPE_CHECKING:
    from lowtail.shm.control import QueueDescriptor

log = logging.getLogger(__name__)


class CrossNodeAttach(LowtailError, RuntimeError):
    """A client asked to use an inference actor on another node (shared memory is node-local)."""


class NoEndpoints(LowtailError, ValueError):
    """A client was given no inference actors to talk to."""


class EndpointDown(LowtailError, RuntimeError):
    """No inference actor of this client can take a request now; nothing was submitted.

    ``retry_in_s`` is when the next re-resolve attempt is due (the back-off): sleep, do not spin.
    """

    def __init__(self, message: str, retry_in_s: float) -> None:
        super().__init__(message)
        self.retry_in_s = retry_in_s


ACTOR_NAMESPACE = "lowtail"


@dataclass(frozen=True)
class Endpoint:
    """What a sampler needs to reach one inference actor: published by the actor, small and picklable."""

    actor: str
    owner: str  # the lease owner, infer:<hero>:<index>
    node_id: str
    cpu: int
    numa_node: int
    descriptor: QueueDescriptor
    worker_pid: int

    def to_bytes(self) -> bytes:
        """JSON for a file or socket outside Ray (Ray pickles its own copies between its processes)."""
        doc = {k: getattr(self, k) for k in _PLAIN_FIELDS}
        doc["descriptor"] = self.descriptor.to_bytes().decode()
        return json.dumps(doc, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> Endpoint:
        """The endpoint ``to_bytes`` made, checked field by field: never a pickle, which would run whatever
        its writer chose. ``BadEndpoint`` names the field that is not what ``to_bytes`` writes."""
        from lowtail.shm.control import QueueDescriptor
        from lowtail.shm.errors import QueueError

        try:
            doc = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise BadEndpoint(f"endpoint: not JSON ({e})") from None
        want = {*_PLAIN_FIELDS, "descriptor"}
        if not isinstance(doc, dict) or set(doc) != want:
            got = sorted(doc) if isinstance(doc, dict) else type(doc).__name__
            raise BadEndpoint(f"endpoint: keys {got}, expected {sorted(want)}")
        for key, kind in _PLAIN_FIELDS.items():
            if type(doc[key]) is not kind:
                raise BadEndpoint(f"endpoint {key}={doc[key]!r}: expected {kind.__name__}")
        if not isinstance(doc["descriptor"], str):
            raise BadEndpoint(f"endpoint descriptor={doc['descriptor']!r}: expected a string")
        try:
            descriptor = QueueDescriptor.from_bytes(doc["descriptor"].encode())
        except QueueError as e:
            raise BadEndpoint(f"endpoint descriptor: {e}") from None
        return cls(descriptor=descriptor, **{k: doc[k] for k in _PLAIN_FIELDS})


_PLAIN_FIELDS: dict[str, type] = {
    "actor": str, "owner": str, "node_id": str, "cpu": int, "numa_node": int, "worker_pid": int
}  # fmt: skip


class BadEndpoint(LowtailError, ValueError):
    """Bytes that are not an endpoint ``Endpoint.to_bytes`` wrote."""


def queue_owner(ep: Endpoint) -> tuple[int, int | None]:
    """The process that created ``ep``'s queue (its inference actor) and its start time."""
    from lowtail.shm.segments import parse_name

    parts = parse_name(ep.descriptor.path.name)
    pid = 0 if parts is None else parts.pid
    return pid, process_start_time(pid) if pid else None


def check_same_node(endpoints: Sequence[Endpoint], here: str) -> None:
    """Refuse endpoints of another node before anything is attached (waiting on them would hang)."""
    remote = [ep for ep in endpoints if ep.node_id != here]
    if remote:
        names = ", ".join(f"{ep.actor} (node {ep.node_id})" for ep in remote)
        raise CrossNodeAttach(
            f"inference endpoints {names} are not on this node ({here}): shared-memory queues are "
            "node-local; place samplers with their inference actors (NodeAffinitySchedulingStrategy) "
            "and pass only the endpoints of their own node"
        )
