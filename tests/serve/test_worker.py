"""The pinned worker serving a real queue: real processes, real OpenVINO, real signals."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import openvino as ov
import pytest

from lowtail.errors import LowtailError
from lowtail.serve.call_stats import CALL_FIELDS
from lowtail.serve.model import ModelNotFound, example_inputs, find_model_xml
from lowtail.serve.openvino_core import shared_core
from lowtail.serve.worker_process import (
    WorkerConfig,
    WorkerExited,
    WorkerProcess,
    WorkerReport,
    WorkerStartFailed,
)
from lowtail.shm.queue import (
    InferenceQueue,
    QueueClient,
    QueueConfig,
    QueueTimeout,
    RequestFailed,
    WorkerDied,
)
from tests.serve.conftest import write_slow_model


def report_when(
    w: WorkerProcess, done: Callable[[WorkerReport], bool], timeout_s: float = 30.0
) -> WorkerReport:
    """The worker's report once ``done`` holds for it, or the last one read after ``timeout_s``. The worker
    answers first and counts after (a call's row, a failed request, a policy switch), and a loaded CPU
    can preempt it in between: a count read right after an answer may still lag it."""
    deadline = time.monotonic() + timeout_s
    while not done(report := w.report()) and time.monotonic() < deadline:
        time.sleep(0.005)
    return report


CPU = max(os.sched_getaffinity(0))


def small_queue(**kw: int) -> InferenceQueue:
    cfg = dict(lanes=4, slots_per_lane=4, request_bytes=16384, response_bytes=16384, min_batch_samples=1)
    cfg.update(kw)
    return InferenceQueue.create(QueueConfig(**cfg))  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def served(small_model: Path) -> Iterator[tuple[InferenceQueue, WorkerProcess]]:
    with small_queue() as queue:
        w = WorkerProcess.start(
            queue.descriptor, CPU, small_model, WorkerConfig(name="t", probe_cpu_view=True)
        )
        try:
            w.wait_ready(120)
            yield queue, w
        finally:
            assert w.stop() == 0
    assert not w.alive()


def direct_outputs(model: Path, x: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    compiled = shared_core().compile_model(
        str(find_model_xml(model)), "CPU", {"INFERENCE_PRECISION_HINT": "f32"}
    )
    return {k.get_any_name(): v for k, v in compiled(x).items()}


def test_outputs_through_the_queue_equal_direct_openvino(
    served: tuple[InferenceQueue, WorkerProcess], small_model: Path
) -> None:
    queue, _ = served
    with QueueClient.attach(queue.descriptor) as a, QueueClient.attach(queue.descriptor) as b:
        for batch in (1, 5, 16):
            xa, xb = example_inputs(64, batch, seed=batch), example_inputs(64, batch, seed=100 + batch)
            pa, pb = a.start(xa), b.start(xb)  # both in flight: may be merged into one engine call
            got_a, got_b = pa.finish(timeout_s=30), pb.finish(timeout_s=30)
            for x, got in ((xa, got_a), (xb, got_b)):
                ref = direct_outputs(small_model, x)
                assert set(got) == set(ref) == {"action", "move", "value"}
                for name in ref:
                    assert got[name].dtype == np.float32
                    np.testing.assert_allclose(got[name], ref[name], rtol=1e-5, atol=1e-6)


def test_worker_is_pinned_before_openvino_loads_and_reports_its_setup(
    served: tuple[InferenceQueue, WorkerProcess],
) -> None:
    _, w = served
    info = w.wait_ready()
    assert info["pid"] == w.pid and w.alive()
    assert info["preloaded_before_pin"] == []  # numpy/openvino were not imported before pinning
    assert info["affinity"] == [CPU]
    assert info["openvino_default_threads"] == 1  # left to itself, OpenVINO sees one CPU
    assert info["precision"] == "f32"
    assert info["compiled"]["INFERENCE_PRECISION_HINT"] == "f32"
    assert info["compiled"]["INFERENCE_NUM_THREADS"] == "1"
    assert info["compiled"]["ENABLE_CPU_PINNING"] == "False"
    assert info["timer_slack_ns"] == 1
    assert info["gc_frozen"] > 0
    expected_nice = -20 if os.geteuid() == 0 else info["nice"]["achieved"]
    assert info["nice"]["achieved"] == expected_nice
    iso = w.isolation()
    assert iso.all_on_cpu, iso.masks  # every thread, OpenVINO's included, may run only on CPU
    assert iso.masks == {str(CPU): iso.threads}


def test_per_call_metrics_and_isolation_after_serving(served: tuple[InferenceQueue, WorkerProcess]) -> None:
    queue, w = served
    cursor = w.calls().cursor
    with QueueClient.attach(queue.descriptor) as c:
        for _ in range(50):
            c.infer(example_inputs(64, 8), timeout_s=30)
    batch = w.calls(cursor)
    assert batch.rows.shape == (50, len(CALL_FIELDS)) and batch.lost == 0
    col = {n: i for i, n in enumerate(CALL_FIELDS)}
    rows = batch.rows
    assert (rows[:, col["batch"]] == 8).all() and (rows[:, col["slots"]] == 1).all()
    assert (rows[:, col["wall_ms"]] >= rows[:, col["engine_wall_ms"]]).all()
    assert (rows[:, col["deschedule_ms"]] >= 0).all()
    np.testing.assert_allclose(
        rows[:, col["deschedule_ms"]], np.maximum(0, rows[:, col["wall_ms"]] - rows[:, col["cpu_ms"]])
    )
    assert (rows[:, col["queue_wait_ms"]] >= 0).all() and (rows[:, col["run_delay_ms"]] >= 0).all()
    rep = w.report(cursor)
    assert rep.state == "serving" and rep.calls == 50
    assert rep.percentiles["wall_ms"].n == 50
    iso = w.isolation()
    assert iso.engine_calls >= 50
    # The predecessor's 1:1 test: only the serving thread used CPU during infer().
    assert iso.engine_cpu_ratio == pytest.approx(1.0, abs=0.1), iso
    assert iso.ok, iso.detail


def test_a_malformed_request_fails_alone(served: tuple[InferenceQueue, WorkerProcess]) -> None:
    queue, w = served
    failed_before = w.report().failed_requests
    with QueueClient.attach(queue.descriptor) as bad, QueueClient.attach(queue.descriptor) as good:
        pb = bad.start({"obs": np.zeros((3, 63), np.float32)})
        pg = good.start(example_inputs(64, 3))
        with pytest.raises(
            RequestFailed, match=r"malformed request: .*float32\[3, 63\]: expected float32\[batch, 64\]"
        ):
            pb.finish(timeout_s=30)
        assert pg.finish(timeout_s=30)["value"].shape == (3, 1)
        with pytest.raises(RequestFailed, match=r"the model expects exactly \['obs'\]"):
            bad.infer({"observation": np.zeros((1, 64), np.float32)}, timeout_s=30)
        assert good.infer(example_inputs(64, 2), timeout_s=30)["value"].shape == (2, 1)
    assert w.alive()
    assert (
        report_when(w, lambda r: r.failed_requests == failed_before + 2).failed_requests == failed_before + 2
    )


def test_a_worker_that_cannot_start_says_why(small_model: Path, tmp_path: Path) -> None:
    with small_queue() as queue:
        w = WorkerProcess.start(queue.descriptor, CPU, small_model, WorkerConfig(precision="f64"))
        with pytest.raises(WorkerStartFailed, match="precision='f64'"):
            w.wait_ready(120)
        w.stop()
        assert not w.alive()
    with pytest.raises(ModelNotFound, match=r"exactly one OpenVINO \.xml") as missing:
        WorkerProcess.start(queue.descriptor, CPU, tmp_path)
    assert isinstance(missing.value, LowtailError) and isinstance(missing.value, FileNotFoundError)


def test_killed_worker_fails_in_flight_requests_and_a_restarted_worker_serves(tmp_path: Path) -> None:
    xml = write_slow_model(tmp_path / "slow")
    x = {"obs": np.random.default_rng(0).standard_normal((64, 1024), dtype=np.float32)}
    with small_queue(request_bytes=266240, response_bytes=266240, max_batch_samples=64) as queue:
        w = WorkerProcess.start(
            queue.descriptor, CPU, xml, WorkerConfig(name="victim", max_batch=64, warm_up=False)
        )
        w.wait_ready(120)
        with QueueClient.attach(queue.descriptor) as c:
            assert c.infer(x, timeout_s=30)["value"].shape == (64, 1024)
            for _ in range(20):
                pending = c.start(x)
                deadline = time.monotonic() + 30
                # Until the worker has claimed it; on a loaded host this thread can miss the whole
                # ~0.1 s PROCESSING window, so an answer already there means "try again", not a hang.
                while queue.snapshot().counts["PROCESSING"] == 0 and not pending.done():
                    assert time.monotonic() < deadline, "the worker never claimed the request"
                if pending.done():
                    pending.finish(timeout_s=30)
                    continue
                os.kill(w.pid, signal.SIGSTOP)  # frozen: what we see now is what the kill will hit
                if queue.snapshot().counts["PROCESSING"] == 1:
                    break
                os.kill(w.pid, signal.SIGCONT)  # it finished before it froze (a loaded host): again
                pending.finish(timeout_s=30)
            else:
                pytest.fail("never caught the worker with a request in PROCESSING")
            os.kill(w.pid, signal.SIGKILL)
            with pytest.raises(WorkerDied):
                pending.finish(timeout_s=30)
            os.waitid(os.P_PID, w.pid, os.WEXITED | os.WNOWAIT)  # dead, not yet reaped: a zombie
            with pytest.raises(WorkerExited, match=f"worker pid {w.pid} on CPU {CPU} has exited"):
                w.isolation()  # not the zombie's one leftover thread reported as the worker's
            w.stop()
            assert w.exitcode == -signal.SIGKILL

            w2 = WorkerProcess.start(
                queue.descriptor, CPU, xml, WorkerConfig(name="restarted", max_batch=64, warm_up=False)
            )
            try:
                w2.wait_ready(120)
                snap = queue.snapshot()
                assert snap.worker_alive and snap.worker_pid == w2.pid
                assert snap.counts["PROCESSING"] == 0
                out = c.infer(x, timeout_s=30)
                assert out["value"].shape == (64, 1024)
            finally:
                assert w2.stop() == 0


def test_stop_leaves_no_process_or_fd_behind(small_model: Path) -> None:
    def start_and_stop() -> int:
        with small_queue() as queue:
            w = WorkerProcess.start(queue.descriptor, CPU, small_model)
            w.wait_ready(120)
            assert w.stop(timeout_s=10) == 0
            assert w.stop() == 0 and not w.alive()  # idempotent
            return w.pid

    start_and_stop()  # the first spawn may start multiprocessing's resource tracker (one pipe, for good)
    fds_before = set(os.listdir("/proc/self/fd"))
    pid = start_and_stop()
    assert not Path(f"/proc/{pid}").exists()
    assert set(os.listdir("/proc/self/fd")) <= fds_before


@pytest.mark.parametrize("when", ["while-starting", "serving"])
def test_a_worker_stops_quietly_on_a_ctrl_c_sent_while_it_starts_or_serves(
    small_model: Path, when: str, capfd: pytest.CaptureFixture[str]
) -> None:
    """Started with SIGINT blocked (its parent's ``deaf_to_ctrl_c``), the worker unblocks it once its
    quiet-stop handler is set: a Ctrl-C sent while it still imports arrives then, and stops it as one
    sent while it serves does. Sent to the worker alone: this test's own process is not interrupted."""
    with small_queue() as queue:
        w = WorkerProcess.start(queue.descriptor, CPU, small_model)
        try:
            if when == "serving":
                w.wait_ready(120)
            os.kill(w.pid, signal.SIGINT)  # "while-starting": its interpreter has just begun
            deadline = time.monotonic() + 120
            while w.alive():
                assert time.monotonic() < deadline, "the worker did not stop on Ctrl-C"
                time.sleep(0.05)
        finally:
            code = w.stop()
    err = capfd.readouterr().err
    assert code == 0, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def _start_worker_then_die(
    desc: object, model: str, conn: object, wait_ready: bool, config: WorkerConfig | None = None
) -> None:
    w = WorkerProcess.start(desc, CPU, model, config)
    if wait_ready:
        w.wait_ready(120)
    conn.send(w.pid)  # type: ignore[attr-defined]
    os._exit(0)  # no cleanup: as if the Ray actor were killed


@contextlib.contextmanager
def _orphaned_worker(
    queue: InferenceQueue, model: Path, wait_ready: bool, config: WorkerConfig | None = None
) -> Iterator[int]:
    """A worker whose parent (a process standing in for the Ray actor) died without cleanup: its pid.
    Killed on the way out, so a failing test leaves no orphan on CPU 1."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    worker_pid = 0
    middle = ctx.Process(
        target=_start_worker_then_die, args=(queue.descriptor, str(model), child, wait_ready, config)
    )
    middle.start()
    try:
        assert parent.poll(120)
        worker_pid = parent.recv()
        middle.join(30)
        yield worker_pid
    finally:
        if worker_pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(worker_pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and "Z" not in _state(pid)


@pytest.mark.parametrize("wait_ready", [True, False], ids=["after-ready", "while-starting"])
def test_worker_exits_when_its_parent_dies(small_model: Path, wait_ready: bool) -> None:
    """The parent dies right after the worker said ready, or while the worker still starts (imports,
    compile). Either way the orphan exits and leaves its CPU. The first catches a race (lost only on a
    loaded host): a worker that reads its parent with getppid() only after ready can find the reaper
    there, and then serves forever, pinned on its CPU."""
    with small_queue() as queue, _orphaned_worker(queue, small_model, wait_ready) as worker_pid:
        # Half a second of idle housekeeping, or the rest of its start-up; the bound is generous:
        # it proves "exits", not how fast.
        deadline = time.monotonic() + 120
        while _alive(worker_pid):
            assert time.monotonic() < deadline, "the orphaned worker kept running"
            time.sleep(0.05)


def test_a_busy_worker_exits_when_its_parent_dies(small_model: Path) -> None:
    """The parent dies while clients keep the worker busy (a claim never comes back empty): the orphan
    still exits, within its housekeeping interval, instead of serving on until its clients go away
    (the chaos soak saw a killed actor's worker serve for 15 s). A claim that waits up to 30 s never
    comes back empty here, so only a check on the busy path can see the parent go."""
    x = example_inputs(64, 1)
    config = WorkerConfig(claim_timeout_s=30.0)
    with (
        small_queue() as queue,
        QueueClient.attach(queue.descriptor) as c,
        _orphaned_worker(queue, small_model, True, config) as worker_pid,
    ):
        # Two requests in flight at all times: the worker always finds one when it claims.
        pending = [c.start(x), c.start(x)]
        deadline = time.monotonic() + 20  # generous: the claim's 30 s is what it must not wait for
        while _alive(worker_pid):
            assert time.monotonic() < deadline, "the orphaned worker kept serving"
            with contextlib.suppress(WorkerDied, RequestFailed, QueueTimeout):
                pending.pop(0).finish(timeout_s=5)  # once the worker left: failed, never a hang
            pending.append(c.start(x))
        for p in pending:
            p.withdraw()


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"


def test_measure_pinned_serves_the_requested_calls_and_cleans_up(small_model: Path) -> None:
    from lowtail.serve.worker_process import measure_pinned

    before = os.sched_getaffinity(0)
    client_cpu = min(before)
    m = measure_pinned(CPU, small_model, client_cpu=client_cpu, batch=4, calls=200)
    assert os.sched_getaffinity(0) == before
    assert m.rows.shape == (200, len(CALL_FIELDS))
    assert m.report.calls == 200 and m.report.percentiles["deschedule_ms"].n == 200
    assert m.ready["affinity"] == [CPU] and m.isolation.all_on_cpu
    assert not Path(f"/proc/{m.ready['pid']}").exists() or _state(m.ready["pid"]) == "Z"


@pytest.mark.parametrize("scope", ["work", "call"])
def test_sched_fifo_scope_work_makes_no_system_call_between_back_to_back_batches(
    small_model: Path, scope: str
) -> None:
    """Eight 16-sample requests queued at once are eight batches served back to back (16 = the batch
    limit). "call" switches the policy twice per batch; "work" enters once, stays in SCHED_FIFO while
    a batch is ready, and leaves when the queue is empty, so it switches at most once per batch (in
    practice twice in all). Counted by the worker (SchedFifo.switches in the stats segment). The eight
    are published before the worker starts, so all of them are waiting when it serves, however slowly
    a loaded host runs this client."""
    # "busy" holds FIFO until a claim timeout passes idle: 5 s, so that a test process preempted on a
    # loaded host still reads the policy before the worker leaves FIFO (the worker checks its stop word
    # between claims, so stop() below is given longer than that).
    cfg = WorkerConfig(name=scope, fifo_scope=scope, claim_timeout_s=5.0 if scope == "busy" else 1.0)
    with (
        small_queue(slots_per_lane=8, max_batch_samples=16) as queue,
        QueueClient.attach(queue.descriptor) as c,
    ):
        x = example_inputs(64, 16)
        pending = [c.start(x) for _ in range(8)]
        w = WorkerProcess.start(queue.descriptor, CPU, small_model, cfg)
        try:
            info = w.wait_ready(120)
            if not info["sched_fifo"]:
                pytest.skip(f"SCHED_FIFO not permitted here ({info['sched_fifo_reason']}): nothing to count")
            for p in pending:
                assert next(iter(p.finish(timeout_s=30).values())).shape[0] == 16

            # Idle: both scopes leave SCHED_FIFO. The worker publishes its counts after what they count
            # (a call's row after its answer, the switch count just after the system call that leaves),
            # and on a loaded CPU it is preempted right there (leaving FIFO drops it behind the tasks
            # waiting for the CPU): the policy and the answers can show before the counts, so wait for
            # all three. In SCHED_OTHER every FIFO stretch is counted twice (enter, leave): an even count.
            def idle_and_counted(r: WorkerReport) -> bool:
                other = os.sched_getscheduler(w.pid) == os.SCHED_OTHER
                return other and r.calls == 8 and r.fifo_switches % 2 == 0

            report = report_when(w, idle_and_counted)  # 30 s: a loaded CPU 1 may delay its next claim
            assert os.sched_getscheduler(w.pid) == os.SCHED_OTHER
            assert report.calls == 8 and report.fifo_switches % 2 == 0, report
            # Batches longer than the RT credit (20 ms: 16 samples on a loaded host, 36 ms in one CI
            # run) spend it, and a cool-down keeps the worker in SCHED_OTHER until half of it is back:
            # "work" then leaves and enters once more per cool-down, "call" skips the batches cooled.
            cooled = report.fifo_cooldowns
            if scope == "call":
                assert report.fifo_switches == 2 * report.calls or cooled, report
                assert report.fifo_switches <= 2 * report.calls, report
            else:
                assert 2 <= report.fifo_switches <= report.calls + 2 * cooled, report
        finally:
            assert w.stop() == 0


def test_a_worker_busy_for_longer_than_the_rt_budget_slice_cools_down_and_serves_on(tmp_path: Path) -> None:
    """Sixteen batches of 64 (0.03-0.1 s each) queued at once keep the worker busy 0.5-1.6 s without a
    gap. In the "work" scope
    it holds SCHED_FIFO across them, so its RT-budget limit (hold <= 90 ms of each 100 ms at the
    default 95% budget) must switch it to SCHED_OTHER at least once, and every request is answered.
    Without the limit the kernel's RT throttling would stop it for the rest of its period instead."""
    from lowtail.serve.pinning import rt_budget_share

    share = rt_budget_share()
    if share is None:
        pytest.skip("unlimited RT budget here (sched_rt_runtime_us = -1): the worker never cools down")
    xml = write_slow_model(tmp_path / "slow")
    x = {"obs": np.random.default_rng(0).standard_normal((64, 1024), dtype=np.float32)}
    geometry = dict(request_bytes=266240, response_bytes=266240, max_batch_samples=64, slots_per_lane=16)
    with small_queue(lanes=1, **geometry) as queue:
        w = WorkerProcess.start(
            queue.descriptor, CPU, xml, WorkerConfig(name="hot", max_batch=64, warm_up=False)
        )
        try:
            if not w.wait_ready(120)["sched_fifo"]:
                pytest.skip("SCHED_FIFO not permitted here: nothing to cool down")
            with QueueClient.attach(queue.descriptor) as c:
                pending = [c.start(x) for _ in range(16)]
                for p in pending:
                    assert p.finish(timeout_s=60)["value"].shape == (64, 1024)
            report = report_when(w, lambda r: r.calls == 16)
            assert report.calls == 16 and report.fifo_cooldowns >= 1, report
        finally:
            assert w.stop() == 0


@pytest.mark.parametrize("scope", ["call", "busy"])
def test_sched_fifo_scope_call_toggles_per_batch_and_busy_holds_until_idle(
    small_model: Path, scope: str
) -> None:
    # "busy" holds FIFO until a claim timeout passes idle: 5 s, so that a test process preempted on a
    # loaded host still reads the policy before the worker leaves FIFO (the worker checks its stop word
    # between claims, so stop() below is given longer than that).
    cfg = WorkerConfig(name=scope, fifo_scope=scope, claim_timeout_s=5.0 if scope == "busy" else 1.0)
    with small_queue() as queue, QueueClient.attach(queue.descriptor) as c:
        w = WorkerProcess.start(queue.descriptor, CPU, small_model, cfg)
        try:
            info = w.wait_ready(120)
            assert os.sched_getscheduler(w.pid) == os.SCHED_OTHER  # idle: never FIFO
            c.infer(example_inputs(64, 4), timeout_s=30)
            if not info["sched_fifo"]:  # not permitted here: the worker serves on nice alone
                assert os.sched_getscheduler(w.pid) == os.SCHED_OTHER
                return
            deadline = time.monotonic() + 10
            policy = os.sched_getscheduler(w.pid)
            while scope == "call" and policy != os.SCHED_OTHER and time.monotonic() < deadline:
                policy = os.sched_getscheduler(w.pid)  # it leaves FIFO right after answering
            # "busy" keeps FIFO until a whole claim timeout (5 s here) passes without a request.
            assert policy == (os.SCHED_OTHER if scope == "call" else os.SCHED_FIFO)
        finally:
            assert w.stop(timeout_s=15.0) == 0


def test_every_answer_carries_the_timing_of_its_engine_call(
    served: tuple[InferenceQueue, WorkerProcess],
) -> None:
    queue, w = served
    with QueueClient.attach(queue.descriptor) as c:
        for batch in (1, 8, 16):
            cursor = w.calls().cursor
            p = c.start(example_inputs(64, batch))
            p.finish(timeout_s=30)
            t = p.timing
            assert t is not None and t.batch_size == batch  # one client: the call held only this request
            assert t.engine_s > 0 and t.call_deschedule_s >= 0 and t.client_overhead_s > 0
            assert t.queue_wait_s >= 0 and t.queue_wait_s + t.engine_s <= t.round_trip_s
            assert t.ready_to_return_s >= 0
            rows = _rows_after(w, cursor)
            col = {n: i for i, n in enumerate(CALL_FIELDS)}
            # The same call as the worker's own row: its infer() wall time, to the nanosecond.
            assert rows[-1, col["engine_wall_ms"]] == pytest.approx(t.engine_s * 1e3, abs=1e-6)
            assert rows[-1, col["batch"]] == batch


def test_the_rows_report_the_wakes_of_parked_clients_on_their_own(
    served: tuple[InferenceQueue, WorkerProcess],
) -> None:
    """Whether a client parks depends on the host's timing (its predictive sleep may find the answer
    first): the rows must agree with what the client did, whatever it did (the queue's own test,
    tests/shm/test_worker_wakes.py, forces the parked case)."""
    queue, w = served
    cursor = w.calls().cursor
    with QueueClient.attach(queue.descriptor, spin_us=0) as c:  # never spins: sleeps or parks
        before = c.wait_counts["futex_waits"]
        for _ in range(20):
            c.start(example_inputs(64, 1)).finish(timeout_s=30)
        waits = c.wait_counts["futex_waits"] - before
    deadline = time.monotonic() + 10
    while (rows := w.calls(cursor).rows).shape[0] < 20:
        assert time.monotonic() < deadline, "the calls' rows never appeared"
        time.sleep(0.001)
    col = {n: i for i, n in enumerate(CALL_FIELDS)}
    woken, wake = rows[:, col["woken"]], rows[:, col["wake_us"]]
    assert woken.sum() <= waits  # a lane is woken only while its client waits on the futex
    assert set(woken.tolist()) <= {0.0, 1.0}  # one client: at most its lane per call
    assert (wake[woken == 0] == 0).all() and (wake[woken == 1] > 0).all()
    assert (wake <= rows[:, col["answer_us"]]).all()  # the wakes are a part of the answer
    less = rows[:, col["overhead_us"]] - wake
    assert rows[:, col["overhead_less_wakes_us"]] == pytest.approx(less)


def _rows_after(w: WorkerProcess, cursor: int) -> np.ndarray:
    deadline = time.monotonic() + 10
    while (rows := w.calls(cursor).rows).shape[0] == 0:  # the row follows the answer
        assert time.monotonic() < deadline, "the call's row never appeared"
        time.sleep(0.001)
    return rows


def _write_batch_dropping_model(out: Path) -> Path:
    """A model whose output sums over the batch axis: one row of outputs whatever the batch.

    A batch of one sample is answered correctly; any larger batch gets outputs that cannot be split per
    request, so ``Batch.complete`` refuses them: a real fault inside the worker's batch block.
    """
    import openvino.opset13 as ops

    obs = ops.parameter([-1, 8], ov.Type.f32, name="obs")
    obs.output(0).get_tensor().set_names({"obs"})
    total = ops.reduce_sum(obs, ops.constant(np.array([0], np.int64)), keep_dims=True)
    total.output(0).get_tensor().set_names({"total"})
    out.mkdir(parents=True, exist_ok=True)
    xml = out / "total.xml"
    ov.save_model(ov.Model([total], [obs], "total"), str(xml), compress_to_fp16=False)
    return xml


def test_a_fault_inside_a_batch_fails_its_requests_alone_and_the_worker_serves_on(tmp_path: Path) -> None:
    xml = _write_batch_dropping_model(tmp_path / "total")
    with small_queue(coalesce_us=0) as queue:
        w = WorkerProcess.start(queue.descriptor, CPU, xml, WorkerConfig(name="faulty", max_batch=4))
        try:
            w.wait_ready(120)
            with QueueClient.attach(queue.descriptor) as c, QueueClient.attach(queue.descriptor) as other:
                ones = np.ones((1, 8), np.float32)
                np.testing.assert_allclose(c.infer({"obs": ones}, timeout_s=30)["total"], ones)
                with pytest.raises(RequestFailed, match=r"must share the batch's leading dimension 2"):
                    c.infer({"obs": np.ones((2, 8), np.float32)}, timeout_s=30)
                # The same worker answers the next requests, the faulty client's and its neighbour's.
                np.testing.assert_allclose(other.infer({"obs": 2 * ones}, timeout_s=30)["total"], 2 * ones)
                np.testing.assert_allclose(c.infer({"obs": 3 * ones}, timeout_s=30)["total"], 3 * ones)
            assert w.alive()
            rep = report_when(w, lambda r: r.failed_requests == 1 and r.calls == 3)
            assert rep.state == "serving" and rep.failed_requests == 1 and rep.calls == 3
        finally:
            assert w.stop() == 0


@pytest.mark.parametrize("forged", [(1 << 64) - 1, 1 << 63, "an hour ahead"])
def test_a_forged_submit_stamp_leaves_a_neighbours_calls_recorded_in_its_batch_and_the_next(
    small_model: Path, forged: int | str
) -> None:
    """A submit stamp is a word the client writes: one client writes stamps from the future, into a call
    of its own and into one it shares with a neighbour. Every call's row and counters are still written
    (the neighbour's next one too), and no wait exceeds the test's own time: the forged stamp reads as
    no wait, the shared call's is the neighbour's."""
    import types

    from lowtail.shm import client as client_module
    from lowtail.shm import native
    from lowtail.shm.client import Ticket

    col = {n: i for i, n in enumerate(CALL_FIELDS)}
    # Two lanes active: the worker holds a claimed request up to 100 ms for the other's samples.
    with small_queue(min_batch_samples=2, coalesce_us=100_000) as queue:
        w = WorkerProcess.start(queue.descriptor, CPU, small_model)
        try:
            w.wait_ready(120)
            with native.use(False):  # the Python path's submit stamps with the clock patched below
                forger = QueueClient.attach(queue.descriptor)
            with forger, QueueClient.attach(queue.descriptor) as neighbour:
                stamp = time.monotonic_ns() + 3600 * 10**9 if isinstance(forged, str) else forged
                started = time.monotonic_ns()
                cursor, before = w.calls().cursor, w.report()

                def forge(arrays: dict[str, np.ndarray]) -> Ticket:
                    real_time = client_module.time
                    client_module.time = types.SimpleNamespace(monotonic_ns=lambda: stamp)  # type: ignore[assignment]
                    try:
                        return forger.submit(arrays)
                    finally:
                        client_module.time = real_time

                forger.wait(
                    forge(example_inputs(64, 2)), timeout_s=30
                )  # its own call: the neighbour's is next
                neighbour.infer(example_inputs(64, 2), timeout_s=30)
                shared = attempts = 0
                while not shared and attempts < 20:  # together in one call, unless a loaded host splits them
                    attempts += 1
                    t_forged = forge(example_inputs(64, 1))
                    t_neighbour = neighbour.submit(example_inputs(64, 1))
                    neighbour.wait(t_neighbour, timeout_s=30)
                    forger.wait(t_forged, timeout_s=30)
                    rows = _rows_after(w, cursor)
                    shared = int((rows[:, col["slots"]] == 2).sum())
                neighbour.infer(example_inputs(64, 2), timeout_s=30)  # its next call, alone
                elapsed_ms = (time.monotonic_ns() - started) / 1e6
            rows = _rows_after(w, cursor)
            rep = report_when(w, lambda r: r.calls - before.calls >= len(rows))
        finally:
            assert w.stop() == 0
    assert shared, "the two requests never shared a call"
    calls = len(rows)
    assert rows[-1, col["slots"]] == 1 and rows[-1, col["batch"]] == 2  # the neighbour's next call
    waits = rows[:, col["queue_wait_ms"]]
    assert ((waits >= 0) & (waits <= elapsed_ms)).all(), waits  # the neighbour's waits, not the forged
    assert rep.calls - before.calls == calls
    assert rep.samples - before.samples == rows[:, col["batch"]].sum()
    assert rows[:, col["slots"]].sum() == 2 * attempts + 3  # every request of both is in a row
