"""The processes of ``lowtail bench soak``: inference actors, clients and a vandal client.

Each runs in a spawned process (entry functions below) so that the soak can SIGKILL it like a crash.

- ``actor_main``: an inference actor without Ray. It runs ``lowtail.actors.inference``'s own actor
  class (its supervisor: promote the standby, start a new one, restart a worker) around a queue it
  creates, and publishes its ``Endpoint`` in a registry directory (the stand-in for Ray's actor names).
- ``client_main``: a sampler's ``InferenceClient`` over the replicas of one hero, at a fixed request
  rate, timing each request from its intended send time; it withdraws some requests and checks every
  answer against the reference computed by the soak. Each request's fate goes to the soak as fixed
  records on a pipe (``REC``), so a client killed mid-run leaves only whole records behind.
- ``vandal_main``: a client writing garbage into its own lane's words while it sends requests.
"""

from __future__ import annotations

import contextlib
import os
import random
import signal
import struct
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lowtail.actors.endpoint import Endpoint

NODE = "soak-local"  # every endpoint's node id: one host, no Ray
STOP_FILE = "stop"  # in the registry: every client leaves
BEHIND_S = 1.0  # a client this far behind its schedule skips the sends it missed

# One record per event: client id, request seq, kind, error code, intended send time, end time (both
# CLOCK_MONOTONIC seconds; for SENT the end time is when it really went). 32 bytes; a write of at most
# PIPE_BUF bytes to a pipe is atomic (pipe(7)), so a killed client never leaves half a record.
REC = struct.Struct("<IIBB6xdd")
RECORDS_PER_WRITE = 4096 // REC.size
SENT, ANSWERED, WRONG, FAILED, REFUSED, WITHDRAWN, LOST, BYE = range(8)
KIND_NAMES = ("sent", "answered", "wrong answer", "failed", "refused", "withdrawn", "lost", "bye")
# Error classes a client reports by index (the last is anything else, by its name in the client's log).
ERRORS = (
    "WorkerDied",
    "RequestLost",
    "RequestWithdrawn",
    "SegmentNotFound",
    "LaneBusy",
    "QueueError",
    "other",
)


@dataclass(frozen=True)
class ClientPlan:
    hero: str
    cid: int
    registry: str
    rate_hz: float
    leave_after_s: float
    withdraw_share: float
    timeout_s: float
    seed: int


def write_atomically(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def read_endpoint(registry: str, actor: str) -> Endpoint | None:
    """The endpoint ``actor`` last published (None before its first)."""
    try:
        return Endpoint.from_bytes((Path(registry) / f"{actor}.endpoint").read_bytes())
    except FileNotFoundError:
        return None


# -- the inference actor ----------------------------------------------------------------------------------


def _actor_without_ray(spec: Any, cpu: int) -> Any:
    """The Ray actor's class without Ray: its supervisor and endpoint() are the code under test; only its
    constructor (lease from the node allocator, Ray's runtime context) is replaced by these fields."""
    from lowtail.actors.inference import InferenceActorImpl
    from lowtail.shm.queue import InferenceQueue

    impl = InferenceActorImpl.__new__(InferenceActorImpl)
    impl._init_error = None
    impl._spec, impl._node, impl._nice, impl._metrics = spec, NODE, None, None
    impl._lease = _Lease(cpu=cpu, node=0)  # type: ignore[assignment]
    impl._lock, impl._stop = threading.Lock(), threading.Event()
    impl._worker = impl._standby = impl._standby_starter = impl._failed = None
    impl._restarts, impl._kills = [], []
    impl._deaths = impl._promotions = impl._cursor = 0
    impl._queue = InferenceQueue.create(spec.queue)
    impl._worker_cfg = spec.worker
    return impl


def actor_main(
    *, hero: str, index: int, cpu: int, model_dir: str, registry: str, worker: Any, queue: Any
) -> None:
    """Create the queue, start the worker and its standby, publish the endpoint, supervise until SIGTERM."""
    from lowtail.actors.inference import InferenceSpec
    from lowtail.shm.segments import sweep_dead

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the soak: the soak stops us (SIGTERM)
    sweep_dead(kinds=("q",))  # a killed incarnation's queue, as the Ray actor does on a restart
    spec = InferenceSpec(hero=hero, index=index, model_dir=model_dir, worker=worker, queue=queue)
    impl = _actor_without_ray(spec, cpu)
    status = Path(registry) / f"{hero}.{index}.status"
    last: tuple[Any, ...] = ()
    try:
        impl._start_worker()
        impl._start_standby()
        while not stop.wait(spec.supervise_interval_s):
            with impl._lock:
                if impl._failed is None:
                    impl._check_workers_locked()
                w, sb = impl._worker, impl._standby
                now = (
                    None if w is None or not w.alive() else w.pid,
                    None if sb is None or not sb.alive() else sb.pid,
                    impl._deaths,
                    impl._failed,
                )
            if now != last:
                if now[0] is not None:
                    write_atomically(Path(registry) / f"{hero}.{index}.endpoint", impl.endpoint().to_bytes())
                doc = {
                    "pid": os.getpid(),
                    "worker": now[0],
                    "standby": now[1],
                    "deaths": now[2],
                    "failed": now[3],
                }
                write_atomically(status, repr(doc).encode())
                last = now
    finally:
        impl._stop.set()
        if impl._standby_starter is not None:
            impl._standby_starter.join(timeout=spec.ready_timeout_s + 10)
        for w in (impl._standby, impl._worker):
            if w is not None:
                w.stop()
        impl._queue.close()


@dataclass(frozen=True)
class _Lease:
    cpu: int
    node: int


def read_status(registry: str, actor: str) -> dict[str, Any] | None:
    import ast

    try:
        doc = ast.literal_eval((Path(registry) / f"{actor}.status").read_text())
    except (FileNotFoundError, SyntaxError, ValueError):
        return None
    return doc if isinstance(doc, dict) else None


# -- the clients ------------------------------------------------------------------------------------------


class _Records:
    """Buffered records, written whole (at most PIPE_BUF bytes per write) to the soak's pipe."""

    def __init__(self, fd: int, cid: int) -> None:
        self.fd, self.cid, self.buf, self.at = fd, cid, bytearray(), time.monotonic()

    def add(self, seq: int, kind: int, code: int = 0, t0: float = 0.0, t1: float = 0.0) -> None:
        self.buf += REC.pack(self.cid, seq, kind, code, t0, t1)
        if len(self.buf) >= RECORDS_PER_WRITE * REC.size or time.monotonic() - self.at > 0.05:
            self.flush()

    def flush(self) -> None:
        step = RECORDS_PER_WRITE * REC.size
        for i in range(0, len(self.buf), step):
            os.write(self.fd, self.buf[i : i + step])
        self.buf.clear()
        self.at = time.monotonic()


def _registry_client(registry: str) -> Any:
    """``InferenceClient`` whose re-resolve reads the registry instead of asking Ray for the actor."""
    from lowtail.actors.endpoint import queue_owner
    from lowtail.actors.inference_client import InferenceClient
    from lowtail.node.process import process_start_time

    class RegistryClient(InferenceClient):
        def _resolve_in_background(self, t: Any) -> None:
            # The one Ray call of the client (ray.get_actor + endpoint()) as the registry answers it: an
            # endpoint whose queue owner lives. Synchronous: it is a file read, and the caller polls.
            t.resolved, t.resolve_error = None, None
            name = t.endpoint.actor.removeprefix("lowtail-infer-").replace("-", ".", 1)
            ep = read_endpoint(registry, name)
            pid, start = (0, None) if ep is None else queue_owner(ep)
            if ep is None or not pid or start is None or process_start_time(pid) != start:
                t.resolve_error = f"{name}: no live actor in the registry yet"
            else:
                t.resolved = ep
            t.resolver = threading.Thread(target=lambda: None, daemon=True)
            t.resolver.start()

    return RegistryClient


def _attach(plan: ClientPlan, actors: list[str]) -> Any:
    """The client over the replicas whose actor lives now (a killed one's queue may be swept already),
    retried while none does."""
    from lowtail.actors.endpoint import queue_owner
    from lowtail.errors import LowtailError
    from lowtail.node.process import process_start_time
    from lowtail.shm.errors import QueueError

    deadline = time.monotonic() + 60.0
    while True:
        eps = []
        for a in actors:
            ep = read_endpoint(plan.registry, a)
            pid, start = (0, None) if ep is None else queue_owner(ep)
            if ep is not None and pid and start is not None and process_start_time(pid) == start:
                eps.append(ep)
        try:
            if eps:
                return _registry_client(plan.registry)(eps, node_id=NODE, timeout_s=plan.timeout_s)
        except (QueueError, LowtailError):
            pass  # an actor died between the look and the attach
        if time.monotonic() > deadline:
            raise TimeoutError(f"client {plan.cid}: no live replica of hero {plan.hero} within 60 s")
        time.sleep(0.2)


def client_main(
    plan: ClientPlan, refs: list[tuple[np.ndarray, dict[str, np.ndarray]]], fd: int, actors: list[str]
) -> None:
    """Send ``refs`` inputs at ``plan.rate_hz`` to the hero's replicas until ``leave_after_s``; every
    request ends in exactly one record (or the process is killed)."""
    from lowtail.actors.endpoint import EndpointDown

    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C of the soak: we leave by its stop file
    rec = _Records(fd, plan.cid)
    rng = random.Random(plan.seed)
    client = _attach(plan, actors)
    period = 1.0 / plan.rate_hz
    start = time.monotonic()
    due = start
    seq = skipped = 0
    stop_file, looked = Path(plan.registry) / STOP_FILE, start
    try:
        while time.monotonic() - start < plan.leave_after_s:
            now = time.monotonic()
            if now - looked > 0.2:  # the soak's end: leave as a client leaves, every request settled
                looked = now
                if stop_file.exists():
                    break
            if now < due:
                time.sleep(due - now)
            if now - due > BEHIND_S:
                # A starved client (a loaded host) skips what it could not send in time rather than
                # timing a backlog of its own making; the skipped sends are counted, not hidden.
                missed = int((now - due) / period)
                skipped += missed
                due += missed * period
            intended, due = due, due + period
            k = rng.randrange(len(refs))
            x, expected = refs[k]
            rec.add(seq, SENT, 0, intended, time.monotonic())  # its schedule, and when it really went
            # Written before the request goes: a client killed with it in flight leaves it counted (cut by
            # the kill), not unknown. One small pipe write per request.
            rec.flush()
            try:
                p = client.start({"obs": x})
            except EndpointDown as e:
                rec.add(seq, REFUSED, 0, intended, time.monotonic())
                seq += 1
                time.sleep(min(e.retry_in_s, 0.5))
                continue
            if rng.random() < plan.withdraw_share and p.pending.withdraw():
                # Taken back unclaimed: never runs. The client's count of requests in flight on that
                # replica is what finish() or abandon() would have lowered.
                client._targets[p.target].in_flight -= 1
                rec.add(seq, WITHDRAWN, 0, intended, time.monotonic())
                seq += 1
                continue
            _settle(client, p, expected, rec, seq=seq, intended=intended)
            seq += 1
    finally:
        rec.add(seq, BYE, 0, float(skipped), time.monotonic())
        rec.flush()
        client.close()


def _settle(
    client: Any, p: Any, expected: dict[str, np.ndarray], rec: _Records, *, seq: int, intended: float
) -> None:
    """Wait for one request and record how it ended: answered (checked against ``expected``), wrong,
    lost (abandoned after its timeout) or failed with a named error."""
    from lowtail.errors import LowtailError
    from lowtail.shm.errors import QueueError, QueueTimeout

    try:
        out = client.finish(p)
    except QueueTimeout:
        client.abandon(p)
        rec.add(seq, LOST, 0, intended, time.monotonic())
    except (QueueError, LowtailError) as e:
        name = type(e).__name__
        code = ERRORS.index(name) if name in ERRORS else len(ERRORS) - 1
        rec.add(seq, FAILED, code, intended, time.monotonic())
    else:
        done = time.monotonic()
        ok = set(out) == set(expected) and all(
            out[n].shape == v.shape and np.allclose(out[n], v, rtol=1e-3, atol=1e-4)
            for n, v in expected.items()
        )
        rec.add(seq, ANSWERED if ok else WRONG, 0, intended, done)


def vandal_main(*, descriptor: Any, x: np.ndarray, seconds: float, seed: int, fd: int, cid: int) -> None:
    """Attach a lane, then write garbage into its words (doorbell, ring, slot words, request header)
    while sending requests for ``seconds``. Its own requests may fail or time out: that is its lane."""
    from lowtail.shm import layout
    from lowtail.shm.errors import QueueError
    from lowtail.shm.queue import QueueClient

    rng = np.random.default_rng(seed)
    rec = _Records(fd, cid)
    answered = refused = 0
    stop = threading.Event()
    with QueueClient.attach(descriptor) as c:
        m, lane = c._m, c.lane
        geo = m.geo

        def vandal() -> None:
            while not stop.is_set():
                v = int(rng.integers(0, 2**63)) if rng.random() < 0.5 else int(rng.integers(0, 64))
                k = int(rng.integers(0, geo.spl))
                g = lane * geo.spl + k
                what = int(rng.integers(0, 4))
                if what == 0:
                    m.q[layout.HW_DOORBELLS + lane] = v
                elif what == 1:
                    m.q[geo.lane(lane, layout.L_RING) + k] = v
                elif what == 2:
                    word = int(rng.choice([layout.S_REQ_SEQ, layout.S_REQ_LEN, layout.S_REQ_STATE]))
                    m.q[geo.slot(g, word)] = v
                else:
                    off = geo.req_off(g) + int(rng.integers(0, 64))
                    m.mem[off : off + 8] = rng.integers(0, 256, 8, np.uint8).tobytes()
                time.sleep(0.001)

        th = threading.Thread(target=vandal, daemon=True)
        th.start()
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end:
                try:
                    c.infer({"obs": x}, timeout_s=0.5)
                    answered += 1
                except QueueError:
                    refused += 1
                    time.sleep(0.01)
        finally:
            stop.set()
            th.join()
    rec.add(answered, BYE, min(refused, 255), 0.0, time.monotonic())
    rec.flush()


def freeze_holding_requests(pid: int, descriptor: Any, timeout_s: float) -> int:
    """SIGSTOP the worker ``pid`` at a moment it holds claimed requests (thawed and tried again until
    ``timeout_s``) and return how many it holds; it stays stopped for the SIGKILL that follows."""
    from lowtail.shm import layout
    from lowtail.shm.control import attach_mapped

    m = attach_mapped(descriptor)
    q, geo = m.q, m.geo
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            os.kill(pid, signal.SIGSTOP)
            held = 0
            for g in range(geo.lanes * geo.spl):  # PROCESSING: claim_seq == req_seq > resp_seq
                claim = q[geo.slot(g, layout.S_CLAIM_SEQ)]
                held += (
                    bool(claim)
                    and claim == q[geo.slot(g, layout.S_REQ_SEQ)] != q[geo.slot(g, layout.S_RESP_SEQ)]
                )
            if held or time.monotonic() > deadline:
                return held
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.001)
    except ProcessLookupError:
        return 0  # it died meanwhile (the soak kills nothing twice)
    finally:
        del q
        m.close()


def kill_quietly(pid: int | None, sig: int = signal.SIGKILL) -> bool:
    if not pid:
        return False
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)
        return True
    return False
