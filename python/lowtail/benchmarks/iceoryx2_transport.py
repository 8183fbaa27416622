"""Eclipse iceoryx2 (PyPI ``iceoryx2``, the optional group ``peer``) as a ``lowtail bench queue`` transport.

iceoryx2 is the zero-copy shared-memory IPC library a user would pick instead of lowtail's queue; its
request-response pattern carries the same echo as every other transport: a ctypes request of 16 x 512
float32 written into a loaned sample, the server answering ``obs[:, :64]`` in a loaned response.

- ``iceoryx2_busy``: both sides poll (``server.receive()``, ``pending.receive()``) without sleeping:
  iceoryx2's lowest-latency mode, a CPU each while idle.
- ``iceoryx2_waitset``: the idle-friendly mode: the server sleeps in a ``WaitSet`` on an event service the
  client notifies after each request; the client sleeps on a ``Listener`` the server notifies after
  each response (the pattern of iceoryx2's ``request_response_with_events`` example).

Every run gets its own iceoryx2 root directory (``<tmp>/lowtail-iox2-<pid>-<token>/``, 0700, instead of
the shared default ``/tmp/iceoryx2/``) and file-name prefix (``ltiox2_<pid>_<token>_``: iceoryx2 names
its shared-memory segments ``/dev/shm/<prefix>...``, and leaves a ``global_mgmt`` segment behind even
after a clean shutdown). Stopping removes both, so a finished, an interrupted, or a killed-server run
leaves nothing; when the client's process is killed, its server exits within ``POLL_S`` and the next
run removes the files of runs whose process is gone.
Every spin and wait is bounded by a deadline; iceoryx2's own signal handlers are disabled (Ctrl-C stays
the caller's KeyboardInterrupt).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import secrets
import shutil
import signal
import tempfile
import time
from pathlib import Path
from typing import Any

import iceoryx2 as iox2
import numpy as np

from lowtail.benchmarks.queue_transports import TRANSPORTS, Arrays, Transport, _ctx, echo, prepare

ROWS, COLS, OUT_COLS = 16, 512, 64
SHM_DIR = Path("/dev/shm")
_ROOT_PREFIX = "lowtail-iox2-"
_FILE_PREFIX = "ltiox2_"
_RUN = re.compile(r"^(?:lowtail-iox2-|ltiox2_)(\d+)[-_]")
POLL_S = 0.05  # a server re-checks its stop flag at least this often
ANSWER_TIMEOUT_S = 10.0


class Request(ctypes.Structure):
    _fields_ = [("obs", ctypes.c_float * (ROWS * COLS))]


class Response(ctypes.Structure):
    _fields_ = [("logits", ctypes.c_float * (ROWS * OUT_COLS))]


def _view(sample: Any, rows: int, cols: int) -> np.ndarray[Any, Any]:
    """The payload of a loaned or received sample as a float32 array, in place (no copy)."""
    return np.frombuffer(sample.payload().contents, np.float32).reshape(rows, cols)


def _node(root: str, prefix: str) -> Any:
    cfg = iox2.config.default()
    cfg.global_cfg.root_path = iox2.Path.new(root + "/")
    cfg.global_cfg.prefix = iox2.FileName.new(prefix)
    return (
        iox2.NodeBuilder.new()
        .config(cfg)
        .signal_handling_mode(iox2.SignalHandlingMode.Disabled)
        .create(iox2.ServiceType.Ipc)
    )


def _service(node: Any) -> Any:
    return (
        node.service_builder(iox2.ServiceName.new("lowtail/bench/echo"))
        .request_response(Request, Response)
        .open_or_create()
    )


def _event(node: Any, name: str) -> Any:
    return node.service_builder(iox2.ServiceName.new(f"lowtail/bench/echo/{name}")).event().open_or_create()


def _answer(active: Any) -> None:
    resp = active.loan_uninit()
    np.copyto(_view(resp, ROWS, OUT_COLS), echo(_view(active, ROWS, COLS)))
    resp.assume_init().send()
    active.delete()


def _server(root: str, prefix: str, waitset: bool, cpu: int | None, prio: str, ready: Any, stop: Any) -> None:  # noqa: PLR0917 - a process target
    parent = os.getppid()
    prepare(cpu, prio)
    node = _node(root, prefix)
    server = _service(node).server_builder().create()
    if waitset:
        requests = _event(node, "requests").listener_builder().create()
        answers = _event(node, "answers").notifier_builder().create()
        ws = (
            iox2.WaitSetBuilder.new()
            .signal_handling_mode(iox2.SignalHandlingMode.Disabled)
            .create(iox2.ServiceType.Ipc)
        )
        guard = ws.attach_notification(requests)
        timeout = iox2.Duration.from_secs_f64(POLL_S)
    ready.set()
    while not stop.is_set() and os.getppid() == parent:  # a killed client leaves no orphan spinning
        if waitset:
            ws.wait_and_process_with_timeout(timeout)  # woken by the client's notify, or the timeout
            requests.try_wait()  # consume the notifications, or the WaitSet stays ready
            while (active := server.receive()) is not None:
                _answer(active)
                answers.notify()
        else:
            deadline = time.monotonic() + POLL_S
            while (active := server.receive()) is None and time.monotonic() < deadline:
                pass
            if active is not None:
                _answer(active)
    if waitset:
        guard.delete()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale(tmp: Path | None = None, shm: Path = SHM_DIR) -> list[Path]:
    """Remove the iceoryx2 files of earlier runs whose process is gone; return what was removed."""
    removed: list[Path] = []
    for base in (Path(tmp or tempfile.gettempdir()), shm):
        with contextlib.suppress(OSError):
            for p in base.iterdir():
                m = _RUN.match(p.name)
                if m is None or _pid_alive(int(m.group(1))):
                    continue
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
                removed.append(p)
    return removed


def leftovers(root: str | Path, prefix: str, shm: Path = SHM_DIR) -> list[Path]:
    """What a run's iceoryx2 files still on disk are: its root directory and its shared-memory segments."""
    out = [Path(root)] if Path(root).exists() else []
    return out + sorted(p for p in shm.glob(f"{prefix}*"))


class Iceoryx2Transport(Transport):
    """iceoryx2 request-response: server in a spawned child, client in the caller."""

    name = "iceoryx2_busy"
    waitset = False

    def start(self) -> None:
        try:
            self._start()
        except BaseException:
            self.stop()  # a server that failed to start leaves no file either
            raise

    def _start(self) -> None:
        remove_stale()
        token = secrets.token_hex(4)
        self.root = tempfile.mkdtemp(prefix=f"{_ROOT_PREFIX}{os.getpid()}-{token}-")  # 0700
        self.prefix = f"{_FILE_PREFIX}{os.getpid()}_{token}_"
        ready, self.stop_event = _ctx().Event(), _ctx().Event()
        self.proc = _ctx().Process(
            target=_server,
            args=(self.root, self.prefix, self.waitset, self.worker_cpu, self.prio, ready, self.stop_event),
        )
        # Started deaf to Ctrl-C (SIG_IGN survives the spawn's exec, and Python keeps it): a Ctrl-C to the
        # process group ends the run in the caller, which stops the server; none prints a traceback.
        old = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            self.proc.start()
        finally:
            signal.signal(signal.SIGINT, old)
        deadline = time.monotonic() + 60  # a spawned child takes seconds to import numpy on a loaded host
        while not ready.wait(0.05):
            if not self.proc.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{self.name}: the server did not start (exit code {self.proc.exitcode})")
        self.node = _node(self.root, self.prefix)
        self.client = _service(self.node).client_builder().create()
        if self.waitset:
            self.notify = _event(self.node, "requests").notifier_builder().create()
            self.answers = _event(self.node, "answers").listener_builder().create()
            self.wait_step = iox2.Duration.from_secs_f64(POLL_S)

    def round_trip(self, arrays: Arrays) -> Arrays:
        req = self.client.loan_uninit()
        np.copyto(_view(req, ROWS, COLS), arrays["obs"])
        pending = req.assume_init().send()
        if self.waitset:
            self.notify.notify()
        deadline = time.monotonic() + ANSWER_TIMEOUT_S
        try:
            while (resp := pending.receive()) is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.name}: no answer in {ANSWER_TIMEOUT_S} s")
                if self.waitset:  # a stale notification only costs one more look
                    self.answers.timed_wait(self.wait_step)
            out = _view(resp, ROWS, OUT_COLS).copy()
            resp.delete()
        finally:
            pending.delete()
        return {"logits": out}

    def stop(self) -> None:
        super().stop()  # sets stop_event, joins, then terminates or kills
        for port in ("answers", "notify", "client"):
            if hasattr(self, port):
                getattr(self, port).delete()
                delattr(self, port)
        if hasattr(self, "node"):
            del self.node
        if hasattr(self, "root"):
            shutil.rmtree(self.root, ignore_errors=True)
            for p in SHM_DIR.glob(f"{self.prefix}*"):
                p.unlink(missing_ok=True)


class Iceoryx2WaitSetTransport(Iceoryx2Transport):
    name = "iceoryx2_waitset"
    waitset = True


# Registered here, not imported by name: queue_transports imports this module, and either may be first.
TRANSPORTS.update({t.name: t for t in (Iceoryx2Transport, Iceoryx2WaitSetTransport)})
