"""The pinned OpenVINO inference worker: a spawned process serving one queue from one leased CPU.

Parent-side handle (stable API; the Ray inference actor uses exactly this)::

from lowtail.serve.worker_process import WorkerConfig, WorkerProcess

    w = WorkerProcess.start(queue.descriptor, cpu=5, model_dir="model/", config=WorkerConfig(name="hero3"))
    info = w.wait_ready(timeout_s=60)      # dict: pid, affinity, nice, sched_fifo, precision, threads, ...
                                         # raises WorkerStartFailed with the child's error
    w.pid, w.cpu, w.alive()
    batch = w.calls(since=cursor)        # CallBatch(rows, cursor, lost): per-call rows (metrics.CALL_FIELDS)
    rep = w.report(since=cursor)         # WorkerReport: percentiles per field, counters, state
    iso = w.isolation()                  # IsolationReport: threads, masks, the 1:1 CPU test
    w.stop(timeout_s=5)                    # ask, then SIGTERM, then SIGKILL; frees the stats segment
    # restart after a crash: WorkerProcess.start(...) again with the same descriptor; attaching fails
    # whatever the dead worker left in flight (WorkerDied) and serves new requests.
    s = WorkerProcess.start(queue.descriptor, cpu=5, model_dir="model/", standby=True)
    s.wait_ready(timeout_s=60)["role"]   # "standby": compiled, attached, parked in SCHED_IDLE, no CPU
    s.serving()                          # False until the worker dies; then it serves at once

    m = measure_pinned(cpu=5, calls=3000)   # for validation: a queue + worker on CPU 5 driven by this
                                            # thread; PinnedMeasurement(rows, report, isolation, ready)

The child (``lowtail.serve.worker_main``) pins itself before importing numpy or OpenVINO. The handle
also makes the child *born* pinned: ``start`` pins the calling thread to the CPU for the instant of the
spawn (the child inherits the mask of the thread that forks it) and restores it, so even code that runs
before the entry function (multiprocessing re-imports the parent's ``__main__`` module in a spawned
child) is on the leased CPU. The calling thread's mask is restored whatever happens.

Metrics travel through a memfd shared with the child (``lowtail.serve.stats_segment``): the worker
writes one row per call; percentiles are computed here, on the parent's CPU, never on the inference core.
"""

from __future__ import annotations

import multiprocessing
import os
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import psutil

from lowtail.errors import LowtailError
from lowtail.node import cpulist
from lowtail.node.signals import deaf_to_ctrl_c
from lowtail.serve import call_stats as metrics
from lowtail.serve import stats_segment as workerstats
from lowtail.serve import worker_main
from lowtail.serve.config import WorkerConfig
from lowtail.serve.model import find_model_xml
from lowtail.serve.pinning import start_pinned

if TYPE_CHECKING:
    from lowtail.shm.queue import QueueConfig

__all__ = [
    "BadMeasurement",
    "IsolationReport",
    "PinnedMeasurement",
    "WorkerConfig",
    "WorkerProcess",
    "WorkerReport",
    "WorkerRowsMissing",
    "WorkerStartFailed",
    "WorkerStartTimeout",
    "WorkerStopped",
    "measure_pinned",
]


class WorkerStartFailed(LowtailError, RuntimeError):
    """The worker exited or reported an error before it was ready to serve."""


class WorkerStartTimeout(LowtailError, TimeoutError):
    """The worker did not report ready in time (it is still running; stop it)."""


class WorkerExited(LowtailError, ProcessLookupError):
    """The worker process is gone, so its threads cannot be read."""


class WorkerStopped(LowtailError, RuntimeError):
    """The handle was stopped: its stats segment (rows, counters, state) is gone."""


class BadMeasurement(LowtailError, ValueError):
    """``measure_pinned`` was asked for no calls or empty batches."""


class WorkerRowsMissing(LowtailError, RuntimeError):
    """The worker did not write the call rows a measurement waited for."""


@dataclass(frozen=True)
class IsolationReport:
    pid: int
    cpu: int
    threads: int
    masks: dict[str, int]  # cpulist -> threads with that mask
    all_on_cpu: bool  # every thread of the worker may run only on its CPU
    serving_thread_share: float  # the serving thread's share of the process's CPU time
    # process CPU / thread CPU inside infer(): ~1.0 when isolated (no other thread ran in the call)
    engine_cpu_ratio: float
    engine_calls: int
    ok: bool
    detail: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass(frozen=True)
class WorkerReport:
    state: str
    calls: int
    lost: int
    samples: int
    failed_requests: int
    slow_calls: int
    sched_fifo: bool
    threads: int
    fifo_switches: int = 0  # scheduling-policy changes (the "call" scope makes two per batch)
    fifo_cooldowns: int = 0  # SCHED_FIFO holds cut short to stay inside the RT budget
    percentiles: dict[str, metrics.Percentiles] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["percentiles"] = metrics.percentiles_dict(self.percentiles)
        return d


# A process whose engine calls show more than this much process CPU per unit of thread CPU had other
# threads running during inference: not isolated.
ISOLATION_RATIO_LIMIT = 1.10


class WorkerProcess:
    def __init__(
        self, proc: Any, conn: Any, stats: workerstats.StatsSegment, cpu: int, config: WorkerConfig
    ) -> None:
        self._proc = proc
        self._pid = int(proc.pid)
        self._conn = conn
        self._stats: workerstats.StatsSegment | None = stats
        self.cpu = cpu
        self.config = config
        self.ready_info: dict[str, Any] | None = None
        self.exitcode: int | None = None

    @classmethod
    def start(
        cls,
        descriptor: Any,
        cpu: int,
        model_dir: str | Path,
        config: WorkerConfig | None = None,
        *,
        standby: bool = False,
    ) -> WorkerProcess:
        """Spawn the worker of ``descriptor``'s queue on ``cpu`` (returns at once; ``wait_ready`` waits).

        ``standby=True``: a hot standby on the same CPU. It compiles the model, maps the queue and reports
        ready (``"role": "standby"``), then parks without using CPU until the queue's worker is gone, and
        takes over at once: the requests the dead worker had claimed fail ``WorkerDied``, every other one
        is served. ``serving()`` says which of the two it is now.
        """
        config = config or WorkerConfig()
        xml = find_model_xml(model_dir)
        ctx = multiprocessing.get_context("spawn")
        parent_conn, child_conn = ctx.Pipe(duplex=False)
        stats = workerstats.StatsSegment.create(config.ring_capacity)
        proc = ctx.Process(
            target=worker_main.main,
            kwargs={
                "cpu": cpu,
                "model_path": str(xml),
                "descriptor": descriptor.to_bytes(),
                "stats_fd": worker_main.InheritedFd(stats.fd),
                "conn": child_conn,
                "config": asdict(config),
                "standby": standby,
                "parent_pid": os.getpid(),  # the child compares getppid() with it: a parent gone early shows
            },
            name=f"lowtail-worker-{config.name or cpu}" + ("-standby" if standby else ""),
            daemon=True,
        )
        worker = None
        try:
            with deaf_to_ctrl_c():  # it hears Ctrl-C once its own handler (a quiet stop) is set
                start_pinned(proc, cpu)
                worker = cls(proc, parent_conn, stats, cpu, config)
        except BaseException:  # a Ctrl-C held by the block is raised as it ends: stop what it started
            if worker is not None:
                worker.stop(timeout_s=0)
            else:
                stats.close()
                parent_conn.close()
            raise
        finally:
            child_conn.close()
        return worker

    @property
    def pid(self) -> int:
        return self._pid

    def alive(self) -> bool:
        return self._stats is not None and bool(self._proc.is_alive())

    def serving(self) -> bool:
        """Whether this process is the queue's worker now (a standby: only once it took over)."""
        return self.alive() and self._segment().word(workerstats.STATE) == workerstats.SERVING

    @property
    def took_over_ns(self) -> int:
        """A standby: CLOCK_MONOTONIC when it became the queue's worker (0: it has not, or not a standby)."""
        return self._segment().word(workerstats.TAKEOVER_NS)

    def wait_ready(self, timeout_s: float = 60.0) -> dict[str, Any]:
        """Block until the worker serves; its start-up report (pinning, priority, precision, threads)."""
        if self.ready_info is not None:
            return self.ready_info
        try:
            got = self._conn.poll(timeout_s)
            msg = self._conn.recv() if got else None
        except (EOFError, OSError):
            msg = None
            got = True
        if msg is None:
            if not got and self.alive():
                raise WorkerStartTimeout(
                    f"worker pid {self.pid} on CPU {self.cpu}: not ready after {timeout_s} s"
                )
            self._proc.join(5)
            raise WorkerStartFailed(
                f"worker pid {self.pid} on CPU {self.cpu} exited with code {self._proc.exitcode} before ready"
            )
        if "failed" in msg:
            self._proc.join(5)
            raise WorkerStartFailed(f"worker on CPU {self.cpu} failed to start: {msg['failed']}")
        info: dict[str, Any] = dict(msg)
        self.ready_info = info
        return info

    def _segment(self) -> workerstats.StatsSegment:
        if self._stats is None:
            raise WorkerStopped(f"worker pid {self.pid} was stopped; its stats are gone")
        return self._stats

    def calls(self, since: int = 0) -> workerstats.CallBatch:
        """Per-call rows written since cursor ``since`` (pass back ``.cursor`` for the next window)."""
        return self._segment().read_calls(since)

    def report(self, since: int = 0) -> WorkerReport:
        s = self._segment()
        batch = s.read_calls(since)
        return WorkerReport(
            state=workerstats.STATE_NAMES.get(s.word(workerstats.STATE), "unknown"),
            calls=int(batch.rows.shape[0]),
            lost=batch.lost,
            samples=s.word(workerstats.SAMPLES),
            failed_requests=s.word(workerstats.FAILED),
            slow_calls=s.word(workerstats.SLOW),
            sched_fifo=bool(s.word(workerstats.FIFO)),
            threads=s.word(workerstats.THREADS),
            fifo_switches=s.word(workerstats.FIFO_SWITCHES),
            fifo_cooldowns=s.word(workerstats.FIFO_COOLDOWNS),
            percentiles=metrics.summarize(batch.rows),
        )

    def isolation(self) -> IsolationReport:
        """The worker's threads, their CPU masks and the 1:1 test (process CPU ~ thread CPU)."""
        s = self._segment()
        masks: dict[str, int] = {}
        cpu_s: dict[int, float] = {}  # utime + stime per thread, as psutil reads /proc/PID/task/TID/stat
        try:
            proc = psutil.Process(self.pid)
            if proc.status() == psutil.STATUS_ZOMBIE:
                raise psutil.ZombieProcess(self.pid)  # killed, not yet reaped: its one thread is no worker
            threads = proc.threads()
        except psutil.NoSuchProcess:  # ZombieProcess is one
            raise WorkerExited(f"worker pid {self.pid} on CPU {self.cpu} has exited") from None
        for t in threads:
            try:
                mask = cpulist.format(os.sched_getaffinity(t.id))  # the syscall takes a thread id
            except ProcessLookupError:
                continue  # a thread that just exited
            masks[mask] = masks.get(mask, 0) + 1
            cpu_s[t.id] = t.user_time + t.system_time
        total = sum(cpu_s.values())
        share = cpu_s.get(self.pid, 0.0) / total if total else 1.0
        engine_thread = s.word(workerstats.ENGINE_THREAD)
        ratio = s.word(workerstats.ENGINE_CPU) / engine_thread if engine_thread else float("nan")
        all_on_cpu = all(cpulist.parse(m) == {self.cpu} for m in masks)
        ratio_ok = not engine_thread or ratio <= ISOLATION_RATIO_LIMIT
        problems = []
        if not all_on_cpu:
            problems.append(f"thread masks {masks}, expected all {self.cpu}")
        if not ratio_ok:
            problems.append(
                f"process/thread CPU in infer() = {ratio:.2f}, expected <= {ISOLATION_RATIO_LIMIT}"
            )
        return IsolationReport(
            pid=self.pid,
            cpu=self.cpu,
            threads=len(cpu_s),
            masks=masks,
            all_on_cpu=all_on_cpu,
            serving_thread_share=share,
            engine_cpu_ratio=ratio,
            engine_calls=s.word(workerstats.COUNT),
            ok=all_on_cpu and ratio_ok,
            detail="; ".join(problems) or "isolated",
        )

    def kill(self) -> None:
        """SIGKILL, as a crash would (for tests and for a hung worker)."""
        self._proc.kill()

    def stop(self, timeout_s: float = 5.0) -> int | None:
        """Ask the worker to finish its batch and exit; SIGTERM, then SIGKILL if it does not. Idempotent."""
        if self._stats is not None:
            if self.alive():
                self._stats.header[workerstats.STOP] = 1
                self._proc.join(timeout_s)
            if self.alive():
                self._proc.terminate()
                self._proc.join(2.0)
            if self.alive():
                self._proc.kill()
                self._proc.join(2.0)
            self._proc.join(0)
            self.exitcode = self._proc.exitcode
            self._stats.close()
            self._stats = None
            self._conn.close()
            if self.exitcode is not None:
                self._proc.close()  # its sentinel fd
        return self.exitcode

    def __enter__(self) -> WorkerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@dataclass(frozen=True)
class PinnedMeasurement:
    rows: Any  # numpy (calls, len(metrics.CALL_FIELDS)): one row per engine call
    report: WorkerReport
    isolation: IsolationReport
    ready: dict[str, Any]


def measure_pinned(
    cpu: int,
    model_dir: str | Path | None = None,
    *,
    client_cpu: int | None = None,
    batch: int = 16,
    calls: int = 3000,
    config: WorkerConfig | None = None,
    on_call: Callable[[int], None] | None = None,
) -> PinnedMeasurement:
    """Serve ``calls`` batches of ``batch`` samples through a fresh queue to a worker pinned on ``cpu``.

    ``on_call(k)`` is told after each of the measured calls (k = 1..calls), for a progress bar.

    The calling thread is the client (pinned to ``client_cpu`` for the run when given, then restored).
    Without ``model_dir`` the default policy model is built in a temporary directory. The worker is
    stopped and the queue unlinked before returning; the rows stay.
    """
    import tempfile

    import numpy as np

    from lowtail.serve.model import ModelSpec, feature_input, write_model
    from lowtail.shm.queue import InferenceQueue

    if calls < 1 or batch < 1:
        raise BadMeasurement(f"calls={calls}, batch={batch}: expected both >= 1")
    with tempfile.TemporaryDirectory(prefix="lowtail-measure-") as tmp:
        spec = ModelSpec()
        xml = find_model_xml(model_dir) if model_dir is not None else write_model(tmp, spec)
        name, features = feature_input(xml)
        cfg = _measure_queue_config(batch, features)
        x = {name: np.random.default_rng(0).standard_normal((batch, features), dtype=np.float32)}
        saved = os.sched_getaffinity(0)
        with InferenceQueue.create(cfg) as queue:
            w = WorkerProcess.start(queue.descriptor, cpu, xml, config or WorkerConfig(name="measure"))
            try:
                ready = w.wait_ready(120)
                if client_cpu is not None:
                    os.sched_setaffinity(0, {client_cpu})
                cursor = _drive_calls(w, queue.descriptor, x, calls, on_call)
                rows = w.calls(cursor).rows
                return PinnedMeasurement(rows, w.report(cursor), w.isolation(), ready)
            finally:
                os.sched_setaffinity(0, saved)
                w.stop()


def _measure_queue_config(batch: int, features: int) -> QueueConfig:
    """One lane of two slots, each large enough for ``batch`` float32 samples of ``features``."""
    from lowtail.shm.queue import QueueConfig

    payload = batch * features * 4 + 4096
    payload += -payload % 64
    return QueueConfig(
        lanes=1,
        slots_per_lane=2,
        request_bytes=payload,
        response_bytes=payload,
        max_batch_samples=batch,
        min_batch_samples=1,
    )


def _drive_calls(
    w: WorkerProcess,
    descriptor: Any,
    x: Mapping[str, Any],
    calls: int,
    on_call: Callable[[int], None] | None,
) -> int:
    """Warm the worker up, then send ``calls`` requests of ``x``; the cursor where the measured rows start."""
    from lowtail.shm.queue import QueueClient

    warm = min(100, calls)  # page faults, first futex waits
    with QueueClient.attach(descriptor) as client:
        for _ in range(warm):
            client.infer(x, timeout_s=30)
        # One request per engine call (one client, closed loop); the worker writes a call's
        # row just after answering it, so wait for the row before taking the cursor.
        cursor = _wait_for_rows(w, warm)
        for k in range(1, calls + 1):
            client.infer(x, timeout_s=30)
            if on_call is not None:
                on_call(k)
        _wait_for_rows(w, warm + calls)
    return cursor


def _wait_for_rows(w: WorkerProcess, count: int, timeout_s: float = 10.0) -> int:
    deadline = time.monotonic() + timeout_s
    while (cursor := w.calls(count).cursor) < count:
        if time.monotonic() > deadline:
            raise WorkerRowsMissing(f"worker pid {w.pid} wrote {cursor} call rows, expected {count}")
        time.sleep(0.001)
    return count
