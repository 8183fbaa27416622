"""What a sampler needs to reach an inference actor, and the rules for using it.

An ``Endpoint`` is published by an inference actor (``lowtail.actors.inference``) and used by
the sampler-side client (``lowtail.actors.inference_client``). Shared memory is node-local: an endpoint
carries its node id, and a client refuses one of another node (``CrossNodeAttach``) before attaching anything.
"""

from __future__ import annotations

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
