"""Layout of the inference queue's shared-memory segment: every field, its offset, size and single writer.

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
  +0   req_seq   +8 req_len   +16 req_state (FREE/WRITING/READY/INHERITED)   +24 submit_ns    client
  +32  withdrawn                                                                    client
  +64  resp_seq  +72 claim_seq  +80 resp_len  +88 resp_status  +96 claim_ns  +104 done_ns   worker
  +112 call_engine_ns  +120 call (batch samples, bits 0-31 | call deschedule in us, 32-63)   worker

Per slot, the client's words sit on the first cache line, the worker's on the second.
``withdrawn`` holds the seq of a request its client took back (``QueueClient.withdraw``); the
``call`` words are the engine call the answer rode in, written with the answer (before resp_seq):
``infer()`` wall time, the samples of the whole call, and the call's deschedule up to the answer
(wall minus the serving thread's CPU time from the claim to the answer).
  -- request regions at align4096(...), request_bytes each, then response regions -------------
  payloads in the ``lowtail.shm.payload`` format; a payload that does not fit goes to an ndarray segment.

Publication: the writer fills the payload and the other words, then stores one sequence word last
(the doorbell for a request, resp_seq for an answer). This relies on x86-64 TSO: aligned 8-byte
stores are atomic and are never reordered with earlier stores, and loads are never reordered with
earlier loads, so a reader that sees the new sequence number sees everything written before it.
CPython writes a memoryview item of format "Q" with one 8-byte ``memcpy``, which compilers emit as
a single ``mov``. On another architecture the queue refuses to run (``InferenceQueue.create`` and
``attach_mapped`` check ``is_supported_platform``).

Slot states (the predecessor system's, kept for diagnostics): FREE, WRITING, READY (req_seq > claim_seq),
PROCESSING (claim_seq == req_seq > resp_seq), DONE or ERROR (resp_seq == req_seq, by resp_status,
until the client has read it and wrote FREE).
INHERITED: a slot a lane's new client found in flight when it took the lane over (its predecessor's
request, or words it left behind): the client never publishes into it and frees it once answered.
An idle worker answers ``ST_CLIENT_GONE`` an INHERITED request it neither holds nor can still take,
seen so at two sweep passes (``QueueWorker._answer_inherited``): else nobody would ever answer it and
the lane would stay busy for every later client. The new client's own requests are never INHERITED.

Withdrawing a request (taking it back to send it elsewhere), exactly once without a CAS: the client
stores ``withdrawn = seq``, executes a full barrier and loads ``claim_seq``; the worker stores
``claim_seq = seq``, executes a full barrier and loads ``withdrawn``. Dekker again: at least one side
sees the other's store. A client that finds its request unclaimed owns it (``withdraw`` is True), and
the worker then sees the mark and answers ``ST_WITHDRAWN`` without running it (which also frees the
slot); a client that finds it claimed lets it run (``withdraw`` is False), unless the worker also saw
the mark, in which case it answers ``ST_WITHDRAWN`` and ``wait`` raises ``RequestWithdrawn``: never run,
safe to send elsewhere. Either way a request runs at most once, and its client knows whether it did.

Waiting: each side spins (bounded) on the word it waits for, then parks on a futex after setting
its parked word, a full barrier, and a re-check; the other side publishes, executes a full
barrier, and makes the wake-up system call only when it sees the parked word set (see
``lowtail.shm.futex``). Every park has a timeout, which is also when a client checks worker liveness.

Takeover: a hot standby (``lowtail.shm.server.WorkerStandby``) maps the segment and waits for the
worker lock; the kernel releases a dead worker's lock, the standby takes it, writes the worker pid and
epoch, answers what the dead worker had claimed (claim_seq == req_seq != resp_seq) ``ST_WORKER_DIED``
and goes on from each lane's tail word: the unclaimed requests are served once, the claimed never rerun.

The protocol around these words lives with its writers: ``lowtail.shm.control`` (create, attach,
liveness), ``lowtail.shm.client`` (submit, wait, withdraw) and ``lowtail.shm.server`` (claim, answer,
fence, takeover).
"""

from __future__ import annotations

from dataclasses import dataclass

MAGIC = int.from_bytes(b"LOWTAILQ", "little")
VERSION = 1
PAGE = 4096
MAX_LANES = 256  # OFD lock bytes 1..256; doorbells fit page 0 with room to spare
# The OFD byte locks on the segment file (``lowtail.shm.ofd_lock``): the worker holds byte 0 for its
# lifetime, the client of lane l byte 1 + l (``client_lock_byte``).
WORKER_LOCK_BYTE = 0
CLIENT_LOCK_BYTE0 = 1


def client_lock_byte(lane: int) -> int:
    """The OFD lock byte a client holds for its lane while it lives."""
    return CLIENT_LOCK_BYTE0 + lane


H_MAGIC, H_GEOM0, H_GEOM1, H_GEOM2, H_CREATOR = 0, 8, 16, 24, 32
H_WORKER_PID, H_WORKER_EPOCH, H_WORKER_SLEEP, H_DOORBELLS = 64, 72, 128, 192
# The header fields as u64 word indices: ``q[HW_WORKER_PID]``, as ``W_*`` are for slot words.
HW_MAGIC, HW_GEOM0, HW_GEOM1, HW_GEOM2, HW_CREATOR = (
    H_MAGIC >> 3,
    H_GEOM0 >> 3,
    H_GEOM1 >> 3,
    H_GEOM2 >> 3,
    H_CREATOR >> 3,
)
HW_WORKER_PID, HW_WORKER_EPOCH = H_WORKER_PID >> 3, H_WORKER_EPOCH >> 3
HW_WORKER_SLEEP, HW_DOORBELLS = H_WORKER_SLEEP >> 3, H_DOORBELLS >> 3
LANE_BASE = PAGE
L_GEN, L_PID, L_PARKED, L_TAIL, L_RESP_COUNT, L_RING = 0, 8, 16, 64, 72, 128
SLOT_BYTES = 128
S_REQ_SEQ, S_REQ_LEN, S_REQ_STATE, S_SUBMIT_NS, S_WITHDRAWN = 0, 8, 16, 24, 32
S_RESP_SEQ, S_CLAIM_SEQ, S_RESP_LEN, S_RESP_STATUS, S_CLAIM_NS, S_DONE_NS = 64, 72, 80, 88, 96, 104
S_CALL_ENGINE_NS, S_CALL = 112, 120
CALL_BATCH_MASK, CALL_DESCHEDULE_SHIFT = 0xFFFFFFFF, 32
# The counters (gen, doorbell, tail, req_seq) wrap modulo 2^64: a lane's previous holder may leave one
# at its maximum. Sequences and gens skip 0, which a slot's claim_seq and resp_seq (and the worker's
# record of a lane's gen) hold before the first: the next of 2^64 - 1 is 1.
U64_MAX, U64_WRAP = (1 << 64) - 1, 1 << 64
# The same fields as u64 word indices from a slot's first word ``si``: the hot paths read
# ``q[si + W_RESP_SEQ]``, never a bare number.
W_REQ_SEQ, W_REQ_LEN, W_REQ_STATE, W_SUBMIT_NS = (
    S_REQ_SEQ >> 3,
    S_REQ_LEN >> 3,
    S_REQ_STATE >> 3,
    S_SUBMIT_NS >> 3,
)
W_WITHDRAWN = S_WITHDRAWN >> 3
W_RESP_SEQ, W_CLAIM_SEQ, W_RESP_LEN = S_RESP_SEQ >> 3, S_CLAIM_SEQ >> 3, S_RESP_LEN >> 3
W_RESP_STATUS, W_CLAIM_NS, W_DONE_NS = S_RESP_STATUS >> 3, S_CLAIM_NS >> 3, S_DONE_NS >> 3
W_CALL_ENGINE_NS, W_CALL = S_CALL_ENGINE_NS >> 3, S_CALL >> 3

FREE, WRITING, READY, INHERITED = 0, 1, 2, 3
STATE_NAMES = ("FREE", "WRITING", "READY", "PROCESSING", "DONE", "ERROR")
ST_OK, ST_FAILED, ST_BAD_REQUEST, ST_TOO_LARGE, ST_WORKER_DIED, ST_CLIENT_GONE = 0, 1, 2, 3, 4, 5
ST_WITHDRAWN = 6  # claimed after its client withdrew it: not run


def align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


@dataclass(frozen=True)
class Geometry:
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
    def of(cls, lanes: int, spl: int, req_bytes: int, resp_bytes: int) -> Geometry:
        lane_bytes = align(L_RING + 8 * spl, 64)
        slot_base = align(LANE_BASE + lanes * lane_bytes, 64)
        req_base = align(slot_base + lanes * spl * SLOT_BYTES, PAGE)
        resp_base = req_base + lanes * spl * req_bytes
        total = align(resp_base + lanes * spl * resp_bytes, PAGE)
        return cls(lanes, spl, req_bytes, resp_bytes, lane_bytes, slot_base, req_base, resp_base, total)

    def lane(self, lane: int, field_off: int) -> int:
        """u64 index of a lane field."""
        return (LANE_BASE + lane * self.lane_bytes + field_off) >> 3

    def slot(self, g: int, field_off: int) -> int:
        return (self.slot_base + g * SLOT_BYTES + field_off) >> 3

    def slot_word(self, g: int) -> int:
        """u64 index of slot ``g``'s first word: the ``si`` that ``W_*`` indices are added to."""
        return (self.slot_base + g * SLOT_BYTES) >> 3

    def req_off(self, g: int) -> int:
        return self.req_base + g * self.req_bytes

    def resp_off(self, g: int) -> int:
        return self.resp_base + g * self.resp_bytes
