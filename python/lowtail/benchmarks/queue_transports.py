"""The transports ``lowtail bench queue`` compares, each a server process plus a client in the caller.

- ``lowtail``: ``lowtail.shm.queue``.
- ``seed_flock_poll``: the baseline, the predecessor system's SharedInferenceQueue re-implemented as it
  worked: 256 slots with int32 states FREE/WRITING/READY/PROCESSING/DONE/ERROR, ``fcntl.flock`` around
  slot allocation and claiming, pickled request/response dicts in 16 KiB / 32 KiB slot regions, arrays
  in preallocated, reused shared ndarray segments described by bundles, and ``time.sleep(0.0005)`` polling
  on both sides; the worker sleep-polls until 8 samples are ready and takes at most 16 per batch. One
  simplification: the worker reads each request's sample count from an int32 array beside the lengths
  instead of unpickling the request during its pre-scan.
- ``mp_pipe``: ``multiprocessing.Pipe`` with pickle. ``tcp_pickle``: length-prefixed pickle over TCP
  loopback (the predecessor's socket version). ``ray_actor``: a plain Ray actor method call.
- ``spin_floor``: two pinned processes ping-ponging a sequence word and copying the same payload through
  shared memory: what Python can do at best, the floor.
- ``iceoryx2_busy``, ``iceoryx2_waitset``: the best production peer, Eclipse iceoryx2, when its optional
  package imports (lowtail.benchmarks.iceoryx2_transport).

Every server runs in a ``spawn`` child pinned to its own CPU; every echo computes the same thing
(``obs[:, :64]`` as a contiguous float32 array). Every spin and wait here is bounded by a deadline.
"""

from __future__ import annotations

import contextlib
import fcntl
import io
import logging
import multiprocessing as mp
import os
import pickle
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import Callable
from multiprocessing.context import SpawnContext, SpawnProcess
from pathlib import Path
from typing import Any

import numpy as np

from lowtail.node.signals import deaf_to_ctrl_c
from lowtail.shm import native, segments
from lowtail.shm.queue import (
    InferenceQueue,
    QueueClient,
    QueueConfig,
    QueueDescriptor,
    QueueTimeout,
    QueueWorker,
)

Arrays = dict[str, np.ndarray[Any, Any]]
RoundTrip = Callable[[Arrays], Arrays]

# The baselines keep their pickled dicts (that is the predecessor design's cost), but even here nothing is
# unpickled that could name arbitrary code: only numpy arrays and plain containers are allowed back.
_PICKLE_ALLOWED = {("numpy._core.numeric", "_frombuffer"), ("numpy", "dtype"), ("numpy", "ndarray")}


class _ArraysUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in _PICKLE_ALLOWED:
            raise pickle.UnpicklingError(
                f"refusing to unpickle {module}.{name}: only numpy arrays are expected"
            )
        return super().find_class(module, name)


def arrays_loads(data: bytes | memoryview) -> Any:
    """Unpickle ``data`` allowing only numpy arrays and plain containers (never a named callable)."""
    return _ArraysUnpickler(io.BytesIO(data)).load()


def echo(obs: np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    return np.ascontiguousarray(obs[:, :64])


PRIORITIES = ("normal", "nice", "fifo")


def prepare(cpu: int | None, prio: str) -> None:
    """Pin the calling thread to ``cpu`` and set its priority: ``nice`` -20, or ``fifo`` (SCHED_FIFO 50).

    The same priority is given to every transport's client and server, so the comparison stays fair;
    ``fifo`` keeps other tenants of a shared machine from preempting the measured processes.
    """
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    with contextlib.suppress(PermissionError):
        if prio == "nice":
            os.setpriority(os.PRIO_PROCESS, 0, -20)
        elif prio == "fifo":
            os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(50))


def restore_priority(nice: int) -> None:
    with contextlib.suppress(PermissionError):
        os.sched_setscheduler(0, os.SCHED_OTHER, os.sched_param(0))
        os.setpriority(os.PRIO_PROCESS, 0, nice)


def _ctx() -> SpawnContext:
    return mp.get_context("spawn")


class Transport:
    """A server in a child process and the caller's client: start, round_trip, stop."""

    name = ""

    def __init__(self, worker_cpu: int | None, prio: str) -> None:
        self.worker_cpu = worker_cpu
        self.prio = prio
        self.proc: SpawnProcess | None = None

    def start(self) -> None:
        raise NotImplementedError

    def round_trip(self, arrays: Arrays) -> Arrays:
        raise NotImplementedError

    def stop(self) -> None:
        """Stop the server, then (in the subclasses) close what start() made. Safe after a start() that
        failed anywhere, even between creating the server's Process and starting it, and safe twice."""
        stop_event = getattr(self, "stop_event", None)  # a server that polls a stop flag exits on its own
        # Only a live server is told: one killed while it read the event holds the event's lock for ever,
        # and setting it would wait on that lock (a SIGKILLed iceoryx2 waitset server hung a CI run)
        if stop_event is not None and (self.proc is None or self.proc.pid is None or self.proc.is_alive()):
            stop_event.set()
        if self.proc is not None:
            _end_process(self.proc, grace_s=10)
            self.proc = None

    def _take(self, name: str) -> Any:
        """Remove and return the attribute ``name``, None if start() never made it: what stop() closes is
        closed once, however often stop() runs."""
        return vars(self).pop(name, None)


def _end_process(proc: SpawnProcess, grace_s: float) -> None:
    """Give a process told to stop ``grace_s`` to leave, then terminate it, then kill it."""
    if proc.pid is None:  # never started (Process.join asserts a started process): nothing to end
        return
    proc.join(grace_s)
    if proc.is_alive():
        proc.terminate()
        proc.join(grace_s)
    if proc.is_alive():
        proc.kill()
        proc.join(5)


# -- lowtail --------------------------------------------------------------------------------------


def lowtail_config() -> QueueConfig:
    # 64 KiB request slots: the 32 KiB request fits a slot (16 KiB would send it through an ndarray segment).
    return QueueConfig(request_bytes=65536, response_bytes=32768)


def _lowtail_worker(desc: QueueDescriptor, cpu: int | None, prio: str, stop: Any, python_path: bool) -> None:
    prepare(cpu, prio)
    with native.use(False) if python_path else contextlib.nullcontext():
        worker = QueueWorker.attach(desc)
    with worker as w:
        while not stop.is_set():
            b = w.claim(timeout_s=0.05)
            if b is not None:
                with b:
                    b.complete({"logits": echo(b.inputs["obs"])})


class LowtailTransport(Transport):
    """lowtail's queue on the path this process loads (the native core when it loads)."""

    name = "lowtail"
    python_path = False  # both ends on the Python path, whatever loads

    def start(self) -> None:
        self.server = InferenceQueue.create(lowtail_config())
        self.stop_event = _ctx().Event()
        self.proc = _ctx().Process(
            target=_lowtail_worker,
            args=(self.server.descriptor, self.worker_cpu, self.prio, self.stop_event, self.python_path),
        )
        with deaf_to_ctrl_c():  # the run stops it (stop()), a Ctrl-C is the run's
            self.proc.start()
        # A spawned worker takes over a second to attach on a loaded host: a client's first request
        # timing out meanwhile would measure the start-up, not the queue.
        deadline = time.monotonic() + 60
        while not self.server.snapshot().worker_alive:
            if not self.proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"lowtail worker did not attach (exit code {self.proc.exitcode})")
            time.sleep(0.005)
        # The harness gives the latency client a CPU of its own (pinned alone, as a sample: lease
        # would), which this host may not isolate: spin as a client on an isolated CPU does.
        with native.use(False) if self.python_path else contextlib.nullcontext():
            self.client = QueueClient.attach(
                self.server.descriptor, spin_us=self.server.descriptor.config.client_spin_us
            )

    def round_trip(self, arrays: Arrays) -> Arrays:
        return self.client.infer(arrays, timeout_s=10.0)

    def stop(self) -> None:
        super().stop()
        if (client := self._take("client")) is not None:
            client.close()
        if (server := self._take("server")) is not None:
            server.close()


class LowtailPythonTransport(LowtailTransport):
    """lowtail's queue with both ends on the Python path (``native.use(False)``): the native core's
    gain, measured in the same run."""

    name = "lowtail_python"
    python_path = True


# -- the predecessor's design ----------------------------------------------------------------------------

FLOCK_POLL_SLOTS = 256
FLOCK_POLL_REQ_BYTES = 16384
FLOCK_POLL_RESP_BYTES = 32768
FLOCK_POLL_POLL_S = 0.0005
FLOCK_POLL_MIN_BATCH = 8
FLOCK_POLL_MAX_BATCH = 16
S_FREE, S_WRITING, S_READY, S_PROCESSING, S_DONE, S_ERROR = range(6)


class FlockPollNdarraySlot:
    """The predecessor's SharedNdarraySlot: arrays in their own segment, described by a picklable bundle."""

    def __init__(self, seg: segments.Segment, spec: dict[str, tuple[tuple[int, ...], str]]) -> None:
        self.seg = seg
        self.arrays: Arrays = {}
        off = 0
        for name, (shape, dtype) in spec.items():
            n = int(np.prod(shape)) * np.dtype(dtype).itemsize
            self.arrays[name] = np.ndarray(shape, dtype, buffer=seg.mm, offset=off)
            off += (n + 63) & ~63
        self.bundle = {"name": seg.name, "spec": spec}

    @classmethod
    def create(cls, spec: dict[str, tuple[tuple[int, ...], str]]) -> FlockPollNdarraySlot:
        size = sum((int(np.prod(s)) * np.dtype(d).itemsize + 63) & ~63 for s, d in spec.values())
        return cls(segments.create_segment("nd", size), spec)

    @classmethod
    def attach(cls, bundle: dict[str, Any]) -> FlockPollNdarraySlot:
        return cls(segments.attach_segment(bundle["name"]), bundle["spec"])

    def close(self) -> None:
        self.arrays.clear()
        self.seg.close()


class FlockPollQueue:
    """The predecessor's SharedInferenceQueue: int32 state array, flock-guarded allocation, sleep polling."""

    def __init__(self, seg: segments.Segment, lock_path: str) -> None:
        self.seg = seg
        n = FLOCK_POLL_SLOTS
        self.states = np.ndarray((n,), np.int32, buffer=seg.mm, offset=0)
        self.request_lens = np.ndarray((n,), np.int32, buffer=seg.mm, offset=4 * n)
        self.response_lens = np.ndarray((n,), np.int32, buffer=seg.mm, offset=8 * n)
        self.batch_sizes = np.ndarray((n,), np.int32, buffer=seg.mm, offset=12 * n)
        self.req_base = 16 * n
        self.resp_base = self.req_base + n * FLOCK_POLL_REQ_BYTES
        self.buf = memoryview(seg.mm)
        self.lock_fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o600)

    @staticmethod
    def nbytes() -> int:
        return 16 * FLOCK_POLL_SLOTS + FLOCK_POLL_SLOTS * (FLOCK_POLL_REQ_BYTES + FLOCK_POLL_RESP_BYTES)

    def close(self) -> None:
        del self.states, self.request_lens, self.response_lens, self.batch_sizes
        self.buf.release()
        os.close(self.lock_fd)
        self.seg.close()

    def acquire_free_slot(self, timeout_s: float) -> int:
        deadline = time.monotonic() + timeout_s
        while True:
            fcntl.flock(self.lock_fd, fcntl.LOCK_EX)
            try:
                free = np.flatnonzero(self.states == S_FREE)
                if free.size:
                    idx = int(free[0])
                    self.states[idx] = S_WRITING
                    return idx
            finally:
                fcntl.flock(self.lock_fd, fcntl.LOCK_UN)
            if time.monotonic() > deadline:
                raise TimeoutError("no free slot")
            time.sleep(FLOCK_POLL_POLL_S)

    def submit_request(self, request: dict[str, Any], timeout_s: float) -> int:
        idx = self.acquire_free_slot(timeout_s)
        payload = pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)
        off = self.req_base + idx * FLOCK_POLL_REQ_BYTES
        self.buf[off : off + len(payload)] = payload
        self.request_lens[idx] = len(payload)
        self.batch_sizes[idx] = int(request.get("batch_size", 1))
        self.states[idx] = S_READY
        return idx

    def claim_ready_slots(self, max_wait_s: float) -> list[int]:
        """Phase 1: pre-scan until min batch samples are READY (bounded); phase 2: READY -> PROCESSING."""
        start = time.monotonic()
        while True:
            ready = np.flatnonzero(self.states == S_READY)
            if ready.size and (
                int(self.batch_sizes[ready].sum()) >= FLOCK_POLL_MIN_BATCH
                or time.monotonic() - start > max_wait_s
            ):
                break
            if time.monotonic() - start > max_wait_s:
                return []
            time.sleep(FLOCK_POLL_POLL_S)
        fcntl.flock(self.lock_fd, fcntl.LOCK_EX)
        try:
            ready = np.flatnonzero(self.states == S_READY)
            taken: list[int] = []
            samples = 0
            for idx in ready:
                if taken and samples + int(self.batch_sizes[idx]) > FLOCK_POLL_MAX_BATCH:
                    break
                taken.append(int(idx))
                samples += int(self.batch_sizes[idx])
            self.states[taken] = S_PROCESSING
        finally:
            fcntl.flock(self.lock_fd, fcntl.LOCK_UN)
        return taken

    def read_request(self, idx: int) -> dict[str, Any]:
        off = self.req_base + idx * FLOCK_POLL_REQ_BYTES
        return arrays_loads(self.buf[off : off + int(self.request_lens[idx])])  # type: ignore[no-any-return]

    def complete_slot(self, idx: int, response: dict[str, Any]) -> None:
        payload = pickle.dumps(response, protocol=pickle.HIGHEST_PROTOCOL)
        off = self.resp_base + idx * FLOCK_POLL_RESP_BYTES
        self.buf[off : off + len(payload)] = payload
        self.response_lens[idx] = len(payload)
        self.states[idx] = S_DONE

    def await_response(self, idx: int, timeout_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout_s
        while self.states[idx] not in (S_DONE, S_ERROR):
            if time.monotonic() > deadline:
                raise TimeoutError(f"slot {idx}: no response within {timeout_s} s")
            time.sleep(FLOCK_POLL_POLL_S)
        off = self.resp_base + idx * FLOCK_POLL_RESP_BYTES
        response: dict[str, Any] = arrays_loads(self.buf[off : off + int(self.response_lens[idx])])
        self.states[idx] = S_FREE
        return response


def _flock_poll_worker(name: str, lock_path: str, cpu: int | None, prio: str, stop: Any) -> None:
    prepare(cpu, prio)
    q = FlockPollQueue(segments.attach_segment(name), lock_path)
    attached: dict[str, FlockPollNdarraySlot] = {}

    def slot(bundle: dict[str, Any]) -> FlockPollNdarraySlot:
        s = attached.get(bundle["name"])
        if s is None:
            s = attached[bundle["name"]] = FlockPollNdarraySlot.attach(bundle)
        return s

    try:
        while not stop.is_set():
            taken = q.claim_ready_slots(max_wait_s=0.05)
            for idx in taken:
                req = q.read_request(idx)
                obs = slot(req["input_bundle"]).arrays["obs"][: req["batch_size"]]
                out = slot(req["output_bundle"]).arrays["logits"]
                out[: req["batch_size"]] = echo(obs)
                q.complete_slot(
                    idx, {"ok": True, "batch_size": req["batch_size"], "done_s": time.monotonic()}
                )
    finally:
        for s in attached.values():
            s.close()
        q.close()


class FlockPollClient:
    """The predecessor's InferenceShmClientAsync, one endpoint: pooled input/output ndarray segments."""

    def __init__(self, name: str, lock_path: str, obs_shape: tuple[int, int]) -> None:
        self.q = FlockPollQueue(segments.attach_segment(name), lock_path)
        self.input_slot = FlockPollNdarraySlot.create({"obs": (obs_shape, "float32")})
        self.output_slot = FlockPollNdarraySlot.create({"logits": ((obs_shape[0], 64), "float32")})

    def infer(self, arrays: Arrays) -> Arrays:
        obs = arrays["obs"]
        self.input_slot.arrays["obs"][: len(obs)] = obs  # written straight into shared memory
        idx = self.q.submit_request(
            {
                "input_bundle": self.input_slot.bundle,
                "output_bundle": self.output_slot.bundle,
                "batch_size": len(obs),
                "enqueue_time_s": time.monotonic(),
            },
            timeout_s=10.0,
        )
        response = self.q.await_response(idx, timeout_s=10.0)
        return {"logits": self.output_slot.arrays["logits"][: response["batch_size"]].copy()}

    def close(self) -> None:
        self.input_slot.close()
        self.output_slot.close()
        self.q.close()


class FlockPollTransport(Transport):
    name = "seed_flock_poll"

    def start(self) -> None:
        self.seg = segments.create_segment("q", FlockPollQueue.nbytes())
        fd, self.lock_path = tempfile.mkstemp(prefix="lowtail-flock-poll-", suffix=".lock")
        os.close(fd)
        self.stop_event = _ctx().Event()
        self.proc = _ctx().Process(
            target=_flock_poll_worker,
            args=(self.seg.name, self.lock_path, self.worker_cpu, self.prio, self.stop_event),
        )
        with deaf_to_ctrl_c():  # the run stops it (stop()), a Ctrl-C is the run's
            self.proc.start()
        self.client = FlockPollClient(self.seg.name, self.lock_path, (16, 512))

    def round_trip(self, arrays: Arrays) -> Arrays:
        return self.client.infer(arrays)

    def stop(self) -> None:
        super().stop()
        if (client := self._take("client")) is not None:
            client.close()
        if (seg := self._take("seg")) is not None:
            seg.close()
        if (lock_path := self._take("lock_path")) is not None:
            Path(lock_path).unlink(missing_ok=True)


# -- multiprocessing Pipe, TCP ---------------------------------------------------------------------


def _pipe_worker(conn: Any, cpu: int | None, prio: str) -> None:
    prepare(cpu, prio)
    while True:
        msg = conn.recv()
        if msg is None:
            return
        conn.send({"logits": echo(msg["obs"])})


class PipeTransport(Transport):
    name = "mp_pipe"

    def start(self) -> None:
        self.conn, child = _ctx().Pipe(duplex=True)
        self.proc = _ctx().Process(target=_pipe_worker, args=(child, self.worker_cpu, self.prio))
        try:
            with deaf_to_ctrl_c():  # the run stops it (stop()), a Ctrl-C is the run's
                self.proc.start()
        finally:  # the server's end, whether or not the server started
            child.close()

    def round_trip(self, arrays: Arrays) -> Arrays:
        self.conn.send(arrays)
        out: Arrays = self.conn.recv()
        return out

    def stop(self) -> None:
        conn = self._take("conn")
        if conn is not None:
            with contextlib.suppress(OSError):
                conn.send(None)  # the server's cue to return
        super().stop()
        if conn is not None:
            conn.close()


_LEN = struct.Struct("<Q")


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ConnectionError("peer closed")
        got += k
    return bytes(buf)


def _send_msg(sock: socket.socket, obj: Any) -> None:
    payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_LEN.pack(len(payload)) + payload)


def _recv_msg(sock: socket.socket) -> Any:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    return arrays_loads(_recv_exact(sock, n))


def _tcp_worker(port_out: Any, cpu: int | None, prio: str) -> None:
    prepare(cpu, prio)
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port_out.put(srv.getsockname()[1])
        srv.settimeout(30)
        conn, _ = srv.accept()
        with conn:
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while True:
                try:
                    msg = _recv_msg(conn)
                except ConnectionError:
                    return
                _send_msg(conn, {"logits": echo(msg["obs"])})


class TcpTransport(Transport):
    name = "tcp_pickle"

    def start(self) -> None:
        port_q = _ctx().Queue()
        self.proc = _ctx().Process(target=_tcp_worker, args=(port_q, self.worker_cpu, self.prio))
        with deaf_to_ctrl_c():  # the run stops it (stop()), a Ctrl-C is the run's
            self.proc.start()
        port = port_q.get(timeout=60)
        self.sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def round_trip(self, arrays: Arrays) -> Arrays:
        _send_msg(self.sock, arrays)
        out: Arrays = _recv_msg(self.sock)
        return out

    def stop(self) -> None:
        if (sock := self._take("sock")) is not None:
            sock.close()  # the server sees its peer gone and returns
        super().stop()


# -- Ray ---------------------------------------------------------------------------------------------


class RayTransport(Transport):
    name = "ray_actor"

    def start(self) -> None:
        os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # Ray 2.60 enables token auth for local clusters
        import ray

        self.ray = ray
        # Ray's session directory (sockets, logs) in a directory of this run's, removed at stop: left to
        # itself Ray keeps /tmp/ray/session_* after shutdown. Short: it holds Unix sockets (108 bytes).
        self.tmp = tempfile.mkdtemp(prefix="lt-bench-ray-")
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            logging_level=logging.ERROR,
            configure_logging=True,
            _temp_dir=self.tmp,
        )

        @ray.remote(num_cpus=0)
        class EchoActor:
            def __init__(self, cpu: int | None, prio: str) -> None:
                prepare(cpu, prio)

            def infer(self, arrays: Arrays) -> Arrays:
                return {"logits": echo(arrays["obs"])}

        self.actor = EchoActor.remote(self.worker_cpu, self.prio)  # type: ignore[attr-defined]
        ray.get(self.actor.infer.remote({"obs": np.zeros((1, 512), np.float32)}), timeout=120)

    def round_trip(self, arrays: Arrays) -> Arrays:
        out: Arrays = self.ray.get(self.actor.infer.remote(arrays), timeout=60)
        return out

    def stop(self) -> None:
        if hasattr(self, "ray"):
            self.ray.shutdown()
        if hasattr(self, "tmp"):
            shutil.rmtree(self.tmp, ignore_errors=True)


# -- the floor ----------------------------------------------------------------------------------------

_FLOOR_REQ = 32768
_FLOOR_RESP = 4096


def _floor_views(mm: Any) -> tuple[memoryview, np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    # word 0: request seq (client); word 8: answer seq (server); word 16: server ready (server)
    words = memoryview(mm).cast("Q")
    req = np.ndarray((16, 512), np.float32, buffer=mm, offset=128)
    resp = np.ndarray((16, 64), np.float32, buffer=mm, offset=128 + _FLOOR_REQ)
    return words, req, resp


def _floor_worker(name: str, cpu: int | None, prio: str, stop: Any) -> None:
    prepare(cpu, prio)
    seg = segments.attach_segment(name)
    words, req, resp = _floor_views(seg.mm)
    last = 0
    words[16] = 1  # ready: pinned and attached
    try:
        while not stop.is_set():
            deadline = time.monotonic() + 0.05  # bounded spin: re-check the stop flag
            while words[0] == last:
                if time.monotonic() > deadline:
                    break
            else:
                last = words[0]
                # The answer's 4 KiB gathered from the request in place, as lowtail's server reads it
                # (until 2026-12-07 the whole 32 KiB request was copied first: no floor for lowtail).
                np.copyto(resp, echo(req))
                words[8] = last
    finally:
        words.release()
        del req, resp
        seg.close()


def _await_ready(proc: SpawnProcess, ready: Callable[[], bool], name: str) -> None:
    """Wait up to 120 s for a floor server's ready word; sleep, not spin: a spinning FIFO client would
    starve the starting server."""
    deadline = time.monotonic() + 120
    while not ready():
        if time.monotonic() > deadline or not proc.is_alive():
            raise RuntimeError(f"{name}: the server did not start")
        time.sleep(0.01)


class SpinFloorTransport(Transport):
    name = "spin_floor"

    def start(self) -> None:
        self.seg = segments.create_segment("q", 128 + _FLOOR_REQ + _FLOOR_RESP)
        self.stop_event = _ctx().Event()
        self.proc = _ctx().Process(
            target=_floor_worker, args=(self.seg.name, self.worker_cpu, self.prio, self.stop_event)
        )
        with deaf_to_ctrl_c():  # the run stops it (stop()), a Ctrl-C is the run's
            self.proc.start()
        self.words, self.req, self.resp = _floor_views(self.seg.mm)
        self.seq = 0
        _await_ready(self.proc, lambda: self.words[16] == 1, self.name)

    def round_trip(self, arrays: Arrays) -> Arrays:
        np.copyto(self.req, arrays["obs"])
        self.seq += 1
        seq = self.seq
        self.words[0] = seq
        deadline = time.monotonic() + 10.0
        words = self.words
        while words[8] != seq:
            if time.monotonic() > deadline:
                raise TimeoutError("spin_floor: no answer in 10 s")
        return {"logits": self.resp.copy()}

    def stop(self) -> None:
        super().stop()
        if (words := self._take("words")) is not None:  # made after the server started: may be missing
            words.release()
        for view in ("req", "resp"):  # views of the segment, dropped before it is unmapped
            self._take(view)
        if (seg := self._take("seg")) is not None:
            seg.close()


# -- the native floor -------------------------------------------------------------------------------

_NATIVE_FLOOR_C = Path(__file__).with_name("native") / "floor.c"
_FLOOR_SEG = 128 + _FLOOR_REQ + _FLOOR_RESP


def build_native_floor(out_dir: str) -> str:
    """Compile ``native/floor.c`` with the host's C compiler into ``out_dir`` (a private directory: a
    shared library loaded from a world-writable place could be someone else's); returns its path."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise RuntimeError("native_floor needs a C compiler (cc or gcc, or CC=...): none found")
    lib = os.path.join(out_dir, "lowtail_floor.so")
    import subprocess

    subprocess.run(
        [cc, "-O2", "-march=native", "-shared", "-fPIC", "-o", lib, str(_NATIVE_FLOOR_C)],
        check=True,
        capture_output=True,
    )
    return lib


def _load_floor(lib: str) -> Any:
    import ctypes

    so = ctypes.CDLL(lib)
    so.floor_serve.argtypes = [ctypes.c_void_p]
    so.floor_serve.restype = ctypes.c_uint64
    so.floor_round_trip.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_uint64, ctypes.c_uint64]
    so.floor_round_trip.restype = ctypes.c_int
    return so


def _native_floor_worker(lib: str, name: str, cpu: int | None, prio: str) -> None:
    prepare(cpu, prio)
    seg = segments.attach_segment(name)
    anchor = np.frombuffer(seg.mm, np.uint8)
    try:
        _load_floor(lib).floor_serve(anchor.ctypes.data)  # returns once the client sets the stop word
    finally:
        del anchor
        seg.close()


class NativeFloorTransport(Transport):
    """The native two-process spin floor: C on both sides (``native/floor.c``), the same copies as the
    queue's round trip; the harness's Python call around it (one ctypes call) is its only Python."""

    name = "native_floor"

    def start(self) -> None:
        self.tmp = tempfile.mkdtemp(prefix="lowtail-floor-")
        lib = build_native_floor(self.tmp)
        self.seg = segments.create_segment("q", _FLOOR_SEG)
        self.mem = np.frombuffer(self.seg.mm, np.uint8)
        self.words = self.mem[:32].view(np.uint64)
        self.proc = _ctx().Process(
            target=_native_floor_worker, args=(lib, self.seg.name, self.worker_cpu, self.prio)
        )
        with deaf_to_ctrl_c():  # the run stops it (stop()), a Ctrl-C is the run's
            self.proc.start()
        self.so = _load_floor(lib)
        self.base = self.mem.ctypes.data
        self.out = np.empty((16, 64), np.float32)
        self.out_p = self.out.ctypes.data
        self.seq = 0
        _await_ready(self.proc, lambda: self.words[2] == 1, self.name)

    def round_trip(self, arrays: Arrays) -> Arrays:
        obs = arrays["obs"]
        if obs.shape != (16, 512) or obs.dtype != np.float32 or not obs.flags.c_contiguous:
            raise ValueError(
                f"native_floor carries 16 x 512 C-contiguous float32, got {obs.shape} {obs.dtype}"
            )
        self.seq += 1
        if self.so.floor_round_trip(self.base, obs.ctypes.data, self.out_p, self.seq, 10_000_000_000):
            raise TimeoutError("native_floor: no answer in 10 s")
        return {"logits": self.out.copy()}

    def stop(self) -> None:
        if (words := getattr(self, "words", None)) is not None:
            words[3] = 1  # the server's stop word
        super().stop()
        for view in ("words", "mem"):  # views of the segment, dropped before it is unmapped
            self._take(view)
        if (seg := self._take("seg")) is not None:
            seg.close()
        if (tmp := self._take("tmp")) is not None:
            shutil.rmtree(tmp, ignore_errors=True)


TRANSPORTS: dict[str, type[Transport]] = {
    t.name: t
    for t in (
        LowtailTransport,
        LowtailPythonTransport,
        FlockPollTransport,
        PipeTransport,
        TcpTransport,
        RayTransport,
        SpinFloorTransport,
        NativeFloorTransport,
    )
}

# Optional peers (python/pyproject.toml's group "peer"): each module registers its transports into
# TRANSPORTS when its package imports; otherwise MISSING names the package and why it did not import.
PEER_PACKAGES = {"iceoryx2_busy": "iceoryx2", "iceoryx2_waitset": "iceoryx2"}
MISSING: dict[str, str] = {}
try:
    import lowtail.benchmarks.iceoryx2_transport  # noqa: F401
except ImportError as e:
    MISSING.update(dict.fromkeys(("iceoryx2_busy", "iceoryx2_waitset"), str(e)))


# -- throughput with concurrent clients -------------------------------------------------------------


def _throughput_client(  # noqa: PLR0917 - a process target: positional arguments
    kind: str, target: Any, cpu: int | None, prio: str, flag: Any, out: Any
) -> None:
    # Several clients share one CPU here: under SCHED_FIFO the first would never let the others run
    # (no time slicing within a FIFO priority), so clients time-share at nice -20 in the fifo mode too.
    prepare(cpu, "nice" if prio == "fifo" else prio)
    obs = np.random.default_rng(os.getpid()).standard_normal((16, 512)).astype(np.float32)
    if kind == "lowtail":
        client: Any = QueueClient.attach(target)
    else:
        client = FlockPollClient(target[0], target[1], (16, 512))
    try:
        client.infer({"obs": obs})
        out.put("ready")
        deadline = time.monotonic() + 120
        while flag.value == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        n = 0
        while flag.value == 1:  # counts only answers inside the parent's window
            client.infer({"obs": obs})
            n += 1
        out.put(n)
    finally:
        client.close()


def throughput(  # noqa: PLR0917
    kind: str, clients: int, seconds: float, worker_cpu: int | None, client_cpu: int | None, prio: str
) -> float:
    """Requests per second served to ``clients`` concurrent closed-loop client processes, one window."""
    ctx = _ctx()
    t: LowtailTransport | FlockPollTransport = (
        LowtailTransport(worker_cpu, prio) if kind == "lowtail" else FlockPollTransport(worker_cpu, prio)
    )
    flag = ctx.RawValue("i", 0)  # 0 wait, 1 run, 2 stop: one shared word, no lock on the clients' loop
    procs: list[SpawnProcess] = []
    try:
        t.start()  # inside: a Ctrl-C while its server (deaf to it) attaches must still stop the server
        target: Any = t.server.descriptor if isinstance(t, LowtailTransport) else (t.seg.name, t.lock_path)
        out = ctx.Queue()
        procs = [
            ctx.Process(target=_throughput_client, args=(kind, target, client_cpu, prio, flag, out))
            for _ in range(clients)
        ]
        with deaf_to_ctrl_c():  # the flag stops them
            for p in procs:
                p.start()
        for _ in procs:
            if out.get(timeout=120) != "ready":
                raise RuntimeError("throughput client failed to start")
        t0 = time.monotonic()
        flag.value = 1
        time.sleep(seconds)
        flag.value = 2
        window = time.monotonic() - t0
        total = sum(out.get(timeout=120) for _ in procs)
        for p in procs:
            p.join(30)
        return float(total) / window
    finally:
        try:
            _end_clients(procs, flag)
        finally:  # a second Ctrl-C during the clients' joins still stops the server
            t.stop()


def _end_clients(procs: list[SpawnProcess], flag: Any) -> None:
    """Stop the window's clients whatever ended it (a Ctrl-C they are deaf to, an error): the flag
    first, then the signals for any that do not leave."""
    flag.value = 2
    for p in procs:
        _end_process(p, grace_s=5)


# -- fairness: how long a ready request waits while other lanes are served ------------------------


def _fairness_client(  # noqa: PLR0917 - a process target: positional arguments
    desc: QueueDescriptor, depth: int, start_s: float, cpu: int | None, prio: str, flag: Any, out: Any
) -> None:
    prepare(cpu, "nice" if prio == "fifo" else prio)
    obs = np.random.default_rng(os.getpid()).standard_normal((16, 512)).astype(np.float32)
    waits: list[int] = []
    with QueueClient.attach(desc) as client:
        out.put("ready")
        deadline = time.monotonic() + 120
        while flag.value == 0 and time.monotonic() < deadline:
            time.sleep(0.001)
        time.sleep(start_s)  # staggered: a lane that starts while others are busy must not starve
        inflight = [client.submit({"obs": obs}) for _ in range(depth)]
        while flag.value == 1:  # every lane keeps ``depth`` requests ready: the worker is never idle
            try:
                client.wait(inflight[0], timeout_s=0.2)
            except QueueTimeout:
                continue  # a starved lane: the ticket stays valid, look at the flag again
            inflight.pop(0)
            waits.append(client.last_timing["queue_wait_ns"])
            inflight.append(client.submit({"obs": obs}))
        unanswered = 0
        for t in inflight:
            try:
                client.wait(t, timeout_s=2.0)
            except QueueTimeout:
                unanswered += 1
    out.put((os.getpid(), np.asarray(waits, np.int64).tobytes(), unanswered))


def fairness(  # noqa: PLR0917
    clients: int, depth: int, seconds: float, worker_cpu: int | None, client_cpu: int | None, prio: str
) -> list[tuple[np.ndarray[Any, Any], int]]:
    """Per client, the queue waits (ns, submit to claim) of the requests answered in one window, and
    how many of its requests were still unanswered 2 s after the window.

    ``clients`` saturating lanes with ``depth`` requests each in flight: the wait of a ready request
    while the worker serves the other lanes is what fair claiming bounds; a starved lane answers 0.
    """
    ctx = _ctx()
    stagger = seconds / (2 * clients)  # client i starts i x this into the window: the last at its middle
    t = LowtailTransport(worker_cpu, prio)
    flag = ctx.RawValue("i", 0)
    procs: list[SpawnProcess] = []
    try:
        t.start()  # inside: a Ctrl-C while its server (deaf to it) attaches must still stop the server
        out = ctx.Queue()
        procs = [
            ctx.Process(
                target=_fairness_client,
                args=(t.server.descriptor, depth, stagger * i, client_cpu, prio, flag, out),
            )
            for i in range(clients)
        ]
        with deaf_to_ctrl_c():  # the flag stops them
            for p in procs:
                p.start()
        for _ in procs:
            if out.get(timeout=120) != "ready":
                raise RuntimeError("fairness client failed to start")
        flag.value = 1
        time.sleep(seconds)
        flag.value = 2
        got = [out.get(timeout=120) for _ in procs]
        for p in procs:
            p.join(30)
        return [(np.frombuffer(raw, np.int64), unanswered) for _, raw, unanswered in sorted(got)]
    finally:
        try:
            _end_clients(procs, flag)
        finally:  # a second Ctrl-C during the clients' joins still stops the server
            t.stop()
