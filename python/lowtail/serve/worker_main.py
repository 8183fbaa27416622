"""Entry point of the pinned inference worker process (the child side of ``lowtail.serve.worker_process``).

Only the standard library is imported at module level, on purpose: the worker pins itself to its leased
CPU before numpy or OpenVINO are imported, so every thread they create inherits the one-CPU mask and
OpenVINO sizes its pool from it. Everything that needs numpy is imported inside ``main`` after pinning,
and the queue descriptor arrives as bytes (``QueueDescriptor.to_bytes``, JSON) for the same reason.

Order of work:
 1. pin to the CPU (and verify), nice -20 where permitted, timer slack 1 ns, SCHED_FIFO detection;
 2. import numpy/OpenVINO, compile with one thread and an explicit precision (checked), bind tensors;
 3. attach to the queue as its single consumer, freeze the GC, report ready to the parent; a standby
    (``WorkerProcess.start(..., standby=True)``) instead compiles in SCHED_IDLE, maps the queue, parks,
    and becomes the consumer the moment the live worker is gone (``WorkerStandby``);
 4. serve: claim -> infer -> complete/fail, with SCHED_FIFO while batches keep coming (within the RT budget)
    and per-call metrics.
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import time
import traceback
from dataclasses import dataclass
from multiprocessing import reduction
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from lowtail.node.signals import hear_ctrl_c
from lowtail.serve import pinning
from lowtail.serve.config import WorkerConfig

if TYPE_CHECKING:  # numpy and OpenVINO load only after pinning (module docstring)
    from lowtail.serve.engine import Engine
    from lowtail.serve.stats_segment import StatsSegment
    from lowtail.shm.queue import QueueWorker

log = logging.getLogger(__name__)

_stop = {"signalled": False}


class InheritedFd:
    """An fd handed to the spawned child through multiprocessing's own fd passing.

    ``DupFd`` must be called while the Process object is being pickled (that is when the spawning Popen
    can register the fd to be kept open in the child), hence the ``__reduce__``.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        return (_rebuild_fd, (reduction.DupFd(self.fd),))


def _rebuild_fd(dup: Any) -> InheritedFd:
    return InheritedFd(int(dup.detach()))


def _on_sigterm(signum: int, frame: Any) -> None:
    _stop["signalled"] = True


def thread_count() -> int:
    return len(os.listdir("/proc/self/task"))


def main(
    *,
    cpu: int,
    model_path: str,
    descriptor: bytes,
    stats_fd: InheritedFd,
    conn: Connection,
    config: dict[str, Any],
    parent_pid: int,
    standby: bool = False,
) -> None:
    cfg = WorkerConfig(**config)
    role = "standby" if standby else "primary"
    logging.basicConfig(
        level=cfg.log_level,
        format="%(asctime)s %(levelname)s lowtail.serve.worker_process[" + cfg.name + " " + role
        + " pid %(process)d] %(message)s",
        stream=sys.stderr,
    )  # fmt: skip
    signal.signal(signal.SIGTERM, _on_sigterm)
    signal.signal(signal.SIGINT, _on_sigterm)  # Ctrl-C reaches the whole group: stop as on SIGTERM, quietly
    hear_ctrl_c()  # started with SIGINT blocked: a Ctrl-C sent while it started arrives now
    # The parent as it named itself when it spawned this process. A getppid() here would return the
    # reaper if the parent died while this process started, and the orphan would never notice.
    ppid = parent_pid
    ready: dict[str, Any] = {"pid": os.getpid(), "cpu": cpu, "role": role}
    idle_class = False
    try:
        # 1. Before any heavy import.
        nice, fifo, idle_class = _pin(cpu, cfg, standby, ready)
        # 2. Heavy imports, now pinned.
        stats, engine = _load(model_path, stats_fd, cfg, ready)

        # 3. Attach (as the worker, or as its standby) and report.
        from lowtail.shm.queue import QueueDescriptor, QueueWorker
        from lowtail.shm.server import WorkerStandby

        desc = QueueDescriptor.from_bytes(descriptor)
        holder: QueueWorker | WorkerStandby = (
            WorkerStandby.attach(desc) if standby else QueueWorker.attach(desc)
        )
    except BaseException as e:
        detail = "".join(traceback.format_exception_only(type(e), e)).strip()
        log.error("worker failed to start: %s", detail)
        conn.send({"failed": detail, **ready})
        conn.close()
        sys.exit(1)

    _settle_in(holder, stats, standby=standby, idle_class=idle_class, nice=nice, ready=ready, ppid=ppid)
    from lowtail.serve import stats_segment as ws

    stats.header[ws.STATE] = ws.STANDBY if standby else ws.SERVING  # before ready: serving() is true then
    conn.send({"ready": True, **ready})
    conn.close()
    code = _run(holder, engine, stats, fifo, cpu=cpu, config=cfg, ready=ready, ppid=ppid)
    sys.exit(code)


def _settle_in(
    holder: Any, stats: Any, *, standby: bool, idle_class: bool, nice: Any, ready: dict[str, Any], ppid: int
) -> None:
    """Between a successful start and the ready report: freeze the GC, say which queue core runs, leave
    SCHED_IDLE (a standby), and exit if the parent went while this process started."""
    gc.collect()
    gc.freeze()  # everything built so far stays out of every later collection
    from lowtail.shm import native  # after pinning: it imports numpy

    ready["queue_core"] = native.implementation().to_dict()  # the native core or the Python path, and why
    ready["gc_frozen"] = gc.get_freeze_count()
    ready["threads"] = thread_count()
    from lowtail.serve import stats_segment as ws

    stats.header[ws.PID] = os.getpid()
    stats.header[ws.HEARTBEAT] = time.monotonic_ns()
    if idle_class:
        # Parked it uses no CPU in any class; woken in SCHED_IDLE it would wait for its CPU to have
        # nothing else to run (a shared CPU, the dead worker's last moments): leave it before parking.
        err = pinning.leave_idle_class(nice.achieved)
        ready["standby_sched_idle_reason"] = f"left before parking: {err or 'ok'}"
        if err:
            log.warning("the standby stays in SCHED_IDLE: %s", err)
    if os.getppid() != ppid:  # died while this process imported and compiled: nobody to serve
        log.warning("parent %d is gone before the worker was ready; exiting", ppid)
        holder.close()
        stats.close()
        sys.exit(0)


def _pin(cpu: int, cfg: WorkerConfig, standby: bool, ready: dict[str, Any]) -> tuple[Any, Any, bool]:
    """Pin to the CPU, raise the priority, detect SCHED_FIFO and (a standby) enter SCHED_IDLE, before any
    heavy import; what was achieved goes into ``ready``. Returns (nice, fifo, in the idle class)."""
    idle_class = False
    ready["preloaded_before_pin"] = sorted(m for m in ("numpy", "openvino") if m in sys.modules)
    pinning.pin_thread_to_cpu(cpu)
    ready["affinity"] = sorted(os.sched_getaffinity(0))
    nice = pinning.raise_priority(cfg.nice)
    ready["nice"] = {"requested": nice.requested, "achieved": nice.achieved, "error": nice.error}
    ready["timer_slack_ns"] = pinning.set_timer_slack_ns(1)
    fifo = pinning.SchedFifo(cfg.fifo_priority, budget_share=pinning.rt_budget_share())
    if cfg.sched_fifo:
        fifo.detect()
    else:
        fifo.reason = "disabled by configuration"
    ready["sched_fifo"] = fifo.available
    ready["sched_fifo_reason"] = fifo.reason
    if standby:
        # Import and compile in SCHED_IDLE: the primary on this CPU keeps it. Only when the nice value
        # was granted: leaving SCHED_IDLE before parking needs the same permission.
        why = (
            pinning.enter_idle_class()
            if nice.error is None
            else f"not entered: leaving it again needs the permission nice {cfg.nice} lacked"
        )
        idle_class = why is None
        ready["standby_sched_idle"] = idle_class
        ready["standby_sched_idle_reason"] = why or "entered"

    return nice, fifo, idle_class


def _load(
    model_path: str, stats_fd: InheritedFd, cfg: WorkerConfig, ready: dict[str, Any]
) -> tuple[Any, Any]:
    """Attach the stats segment and compile the model (warmed up where asked), now pinned."""
    from lowtail.serve.engine import Engine
    from lowtail.serve.stats_segment import StatsSegment

    stats = StatsSegment.attach(stats_fd.fd)
    engine = Engine(model_path, precision=cfg.precision, max_batch=cfg.max_batch)
    ready["precision"] = engine.precision
    ready["compiled"] = engine.properties()
    ready["inputs"] = {k: [str(d), list(s)] for k, (d, s) in engine.inputs.items()}
    ready["outputs"] = engine.output_names
    if cfg.warm_up:
        t_warm = time.monotonic()
        warm_up(engine, cfg.max_batch)
        ready["warm_up_s"] = round(time.monotonic() - t_warm, 3)
    if cfg.probe_cpu_view:
        # How many threads OpenVINO would choose by itself: 1 when it sees only the pinned CPU.
        probe = engine.core.compile_model(str(engine.xml), "CPU")
        ready["openvino_default_threads"] = int(probe.get_property("INFERENCE_NUM_THREADS"))
        del probe

    return stats, engine


def _run(
    holder: Any,
    engine: Any,
    stats: Any,
    fifo: Any,
    *,
    cpu: int,
    config: WorkerConfig,
    ready: dict[str, Any],
    ppid: int,
) -> int:
    """Serve (a standby first waits to take over) until stopped; the exit code. The queue and the stats
    segment are closed and the final state written whatever happens."""
    from lowtail.serve import stats_segment as ws
    from lowtail.shm.queue import QueueWorker

    cfg = config
    code = 0
    qworker = holder if isinstance(holder, QueueWorker) else None
    try:
        if qworker is None:
            log.info("standby on CPU %d: model compiled, queue attached, parked", cpu)
            qworker = wait_to_take_over(holder, stats, ppid)
            if qworker is None:
                return code  # stopped, or its parent went, before a takeover
            log.info(
                "took over the queue: %d requests the dead worker had claimed answered WorkerDied",
                qworker.restarted_failed,
            )
        serve(qworker=qworker, engine=engine, stats=stats, fifo=fifo, cpu=cpu, config=cfg, ready=ready,
              ppid=ppid)  # fmt: skip
    except BaseException:
        log.exception("worker loop failed")
        code = 1
    finally:
        (qworker or holder).close()
        stats.header[ws.STATE] = ws.FAILED_STATE if code else ws.STOPPED
        stats.close()
    return code


def warm_up(engine: Engine, max_batch: int) -> None:
    """One inference of zeros at every shape the engine will run up to ``max_batch``, before serving.

    OpenVINO sets a dynamic-batch model up for a shape at its first inference of it (shape inference,
    memory, kernels): 14-64 ms per size measured here against ~1 ms warm, which the first request of
    each size would pay, and all of them right after a standby takes over. The engine runs padded
    shapes only (``padded_batch``: powers of two), so that is log2(max_batch) + 1 calls, not max_batch.
    """
    import numpy as np

    from lowtail.serve.engine import padded_batch

    sizes = sorted({padded_batch(n) for n in range(1, max_batch + 1)})
    for n in sizes:
        engine.infer({k: np.zeros((n, *shape), dtype) for k, (dtype, shape) in engine.inputs.items()}, n)


# The serving loop's housekeeping (heartbeat and thread count when idle, the parent always) at most this
# often: a killed actor's worker leaves within it, idle or busy.
HOUSEKEEPING_NS = 500_000_000

# A standby checks for stop requests and its parent this often while it waits (no CPU in between).
STANDBY_CHECK_S = 0.25


def wait_to_take_over(holder: Any, stats: StatsSegment, ppid: int) -> QueueWorker | None:
    """Park until the live worker is gone, then be the worker; None when asked to stop or orphaned."""
    from lowtail.serve import stats_segment as ws

    h = stats.words
    while not _stop["signalled"] and not h[ws.STOP]:
        worker: QueueWorker | None = holder.take_over(STANDBY_CHECK_S)
        if worker is not None:
            h[ws.TAKEOVER_NS] = time.monotonic_ns()
            return worker
        h[ws.HEARTBEAT] = time.monotonic_ns()
        if os.getppid() != ppid:
            log.warning("parent %d is gone; the standby exits", ppid)
            return None
    return None


# Batches per entry of ``_serve_batches``: CPython 3.11 specializes a function's bytecode (attribute
# loads, list stores, calls) only after the function has been called 8 times, so a serving loop that
# never returns runs generic bytecode for ever (about 3,400 of its ~90,000 instructions per call beyond
# infer(), counted by benchmarks/worker-instructions.py). Returning every 64 batches specializes it
# after ~500 batches and costs one call per 64.
BATCHES_PER_ENTRY = 64


@dataclass(slots=True)
class _Loop:
    """What the serving loop keeps between two entries of ``_serve_batches``: its bound callables, the
    stamp list and the next housekeeping time (the loop's start: the parent is first checked after the
    first call, or on the first empty claim)."""

    claim: Any
    claim_timeout: float
    drop_when_idle: bool
    engine: Any
    fifo: Any
    h: Any
    malformed: Any
    next_check: int
    per_call: bool
    ppid: int
    rec: Any
    st: list[int]


def serve(
    *,
    qworker: QueueWorker,
    engine: Engine,
    stats: StatsSegment,
    fifo: pinning.SchedFifo,
    cpu: int,
    config: WorkerConfig,
    ready: dict[str, Any],
    ppid: int,
) -> None:
    """The serving loop. Hot path first, idle housekeeping after it; it ends when the parent ``ppid``
    (the pid the parent gave when it spawned this process) is gone.

    Everything between two ``infer()`` calls runs with cold caches (a call streams the model's weights
    through L2), so the loop touches as little as it can: one clock (CLOCK_MONOTONIC through the vDSO,
    the queue's clock too), the stats header as a memoryview, bound methods, and no policy switch between
    back-to-back batches in the default FIFO scope (``bench serve --breakdown`` shows each stage). The
    stamps it takes go to the recorder's ``record`` (``call_recorder.new_recorder``); on the native path
    the core's recorder takes them itself (``begin_call`` with SCHED_FIFO's ``enter``, ``start_engine``,
    and ``finish_call``, which answers and records), all inside the batch's block. A batch lives in a
    ``with`` block: whatever goes wrong inside fails that batch's requests alone and the loop claims the next.
    The loop itself is ``_serve_batches``, entered again every ``BATCHES_PER_ENTRY`` batches.
    """
    from lowtail.serve import stats_segment as ws
    from lowtail.serve.call_recorder import new_recorder, stamps
    from lowtail.serve.engine import MalformedInput

    h = stats.words
    # ``ppid`` is the parent's own pid (main), not read here: once ready is sent the parent may exit at
    # once, and a getppid() after that returns the reaper's pid, so the orphan would serve forever.
    threads = int(ready["threads"])
    rec = new_recorder(stats, fifo, hero=config.name, cpu=cpu, threads=threads,
                       slow_engine_cpu_ms=config.slow_engine_cpu_ms, slow_total_ms=config.slow_total_ms,
                       stats_every=config.stats_every)  # fmt: skip
    try:  # the recorder holds the stats mapping (native: a buffer export) until closed
        h[ws.THREADS] = threads
        h[ws.FIFO] = int(fifo.available)
        h[ws.HEARTBEAT] = time.monotonic_ns()
        h[ws.STATE] = ws.SERVING
        log.info(
            "serving on CPU %d: precision=%s sched_fifo=%s (scope %s) nice=%d threads=%d",
            cpu,
            engine.precision,
            fifo.available,
            config.fifo_scope,
            ready["nice"]["achieved"],
            threads,
        )
        loop = _Loop(
            claim=qworker.claim, claim_timeout=config.claim_timeout_s,
            drop_when_idle=config.fifo_scope == "work", engine=engine, fifo=fifo, h=h,
            malformed=MalformedInput, next_check=time.monotonic_ns(), per_call=config.fifo_scope == "call",
            ppid=ppid, rec=rec,
            st=stamps(),  # one list, refilled per call: the stamps record() reads by name
        )  # fmt: skip
        while _serve_batches(loop, BATCHES_PER_ENTRY):
            pass
    finally:
        rec.close()


def _serve_batches(loop: _Loop, budget: int) -> bool:
    """Serve up to ``budget`` batches; False when the loop is to end (stopped, or the parent is gone).

    The hot path: each pair of stamps (the core's on the native path) is a breakdown column (``call_stats``).
    """
    from lowtail.serve import stats_segment as ws

    # CLOCK_MONOTONIC for every wall time (perf_counter is the same clock on Linux, and the queue stamps
    # claims with it); the CPU clocks are system calls (~0.6 us each warm), the process one sums threads.
    clock, ptime, ttime = time.monotonic_ns, time.process_time_ns, time.thread_time_ns
    claim, check, infer, rec = loop.claim, loop.engine.check, loop.engine.infer, loop.rec
    record, fifo, h, st, malformed = rec.record, loop.fifo, loop.h, loop.st, loop.malformed
    # The native recorder's calls (their docstrings) take the stamps and answer in the core; else None
    core = [getattr(rec, name, None) for name in ("begin_call", "start_engine", "finish_call")]
    begin, start_engine, finish = core if None not in core else (None, None, None)
    enter, leave = fifo.enter, fifo.leave
    per_call, drop_when_idle, claim_timeout = loop.per_call, loop.drop_when_idle, loop.claim_timeout
    next_check, stop_i, stop = loop.next_check, ws.STOP, _stop
    from lowtail.serve import call_stats as cs  # each stamp's index bound by its name, beside it

    T0, TH0, C0, M0, F0, K0, ET0 = cs.T0, cs.TH0, cs.C0, cs.M0, cs.F0, cs.K0, cs.ET0  # fmt: skip
    EC0, E0, E1, ET1, EC1, A0, A1 = cs.EC0, cs.E0, cs.E1, cs.ET1, cs.EC1, cs.A0, cs.A1  # fmt: skip
    F1, TH1, C1, T1, WK, WN = cs.F1, cs.TH1, cs.C1, cs.T1, cs.WK, cs.WN  # fmt: skip
    try:
        while budget and not stop["signalled"] and not h[stop_i]:
            # Busy, claims never come back empty: the parent is checked here after a call (answered or
            # failed, so a worker failing every batch still notices), at most twice a second.
            if (t0 := st[T0]) >= next_check:
                next_check = t0 + HOUSEKEEPING_NS
                if _orphaned(loop.ppid):
                    return False
            batch = claim(0.0 if drop_when_idle and fifo.active else claim_timeout)  # 0: no system call
            if batch is None:
                leave()  # nothing ready: never spin or park in SCHED_FIFO
                h[ws.FIFO_SWITCHES] = fifo.switches
                now = clock()
                if now >= next_check:  # idle housekeeping, at most twice a second
                    next_check = now + HOUSEKEEPING_NS
                    if _idle_housekeeping(h, rec, loop.ppid, now):
                        return False
                continue
            budget -= 1
            try:
                with batch:
                    if begin is not None:
                        inputs = begin(batch, st)
                    else:
                        st[T0] = t0 = clock()
                        sampled = rec.sampled
                        st[TH0] = th0 = ttime()
                        st[C0] = ptime() if sampled else 0
                        st[M0] = clock()
                        enter()  # no system call when already in SCHED_FIFO
                        st[F0] = clock()
                        inputs = batch.inputs
                    try:
                        n = check(inputs, batch.layout)  # the queue's layout of them: one lookup
                    except (malformed, ValueError) as e:
                        leave()
                        h[ws.FAILED] += fail_malformed(batch, e)
                        continue
                    if start_engine is not None:
                        start_engine(st)
                    else:
                        st[K0] = clock()
                        st[ET0] = ttime()
                        st[EC0] = ptime() if sampled else 0
                        st[E0] = e0 = clock()
                    try:
                        outputs = infer(inputs, n)
                    except Exception as e:
                        leave()
                        h[ws.FAILED] += _inference_failed(batch, e)
                        continue
                    if finish is not None:
                        finish(batch, outputs, n, st, per_call)
                    else:
                        st[E1] = e1 = clock()
                        st[ET1] = et1 = ttime()
                        st[EC1] = ptime() if sampled else 0
                        st[A0] = a0 = clock()
                        # The answers carry the call's engine time and deschedule so far (RequestTiming);
                        # it returns its wakes' cost (ns, lanes), unpacked: a slice store cost ~2,500 instr.
                        st[WK], st[WN] = batch.complete(
                            outputs, engine_ns=e1 - e0, deschedule_ns=a0 - t0 - et1 + th0
                        )
                        st[A1] = a1 = clock()
                        if per_call:
                            leave()
                        st[F1] = clock() if per_call else a1  # no SCHED_FIFO call after it: no clock read
                        st[TH1] = ttime()
                        st[C1] = ptime() if sampled else 0
                        st[T1] = clock()
                        record(batch.queue_wait_ns, batch.claimed_ns, n, st)
            except Exception:  # the batch's block answered what it had not: it fails alone
                leave()
                h[ws.FAILED] += batch.failed
                log.exception(
                    "serving a batch of %d requests failed (%d answered failed)", len(batch), batch.failed
                )
                now = clock()
                if now >= next_check and (next_check := now + HOUSEKEEPING_NS) and _orphaned(loop.ppid):
                    return False
    finally:
        loop.next_check = next_check
    return budget == 0


def _idle_housekeeping(h: Any, rec: Any, ppid: int, now: int) -> bool:
    """The idle loop's bookkeeping (at most twice a second): the heartbeat and the thread count into the
    stats header; whether the parent is gone (then the worker exits)."""
    from lowtail.serve import stats_segment as ws

    h[ws.HEARTBEAT] = now
    h[ws.THREADS] = rec.threads = thread_count()
    return _orphaned(ppid)


def _orphaned(ppid: int) -> bool:
    """Whether the parent that started this worker is gone (its actor was killed): then it exits."""
    if os.getppid() == ppid:
        return False
    log.warning("parent %d is gone; exiting", ppid)
    return True


def _inference_failed(batch: Any, error: Exception) -> int:
    """Fail a batch whose ``infer()`` raised; returns the number of requests failed."""
    batch.fail(f"inference failed: {type(error).__name__}: {error}")
    log.error("inference failed for %d requests: %s", len(batch.sizes), error)
    return len(batch.sizes)


def fail_malformed(batch: Any, error: Exception) -> int:
    """Fail a batch whose inputs do not fit the model; returns the number of requests failed.

    The queue merges only requests with the same names, dtypes and per-sample shapes, so a request that
    does not fit the model is never in a batch with one that does: failing the batch fails it alone.
    """
    batch.fail(f"malformed request: {error}")
    return len(batch.sizes)
