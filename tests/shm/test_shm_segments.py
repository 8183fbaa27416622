"""Segments on disk: sweeping dead owners, `lowtail shm`, capacity on a small tmpfs, NUMA placement, futex."""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from lowtail.cli.main import main
from lowtail.shm import futex, numa, segments
from lowtail.shm.queue import InferenceQueue, NumaError, QueueConfig, ShmTooSmall


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


@pytest.fixture
def shm_dir(tmp_path: Path) -> Path:
    return tmp_path  # a plain directory stands in for /dev/shm where only naming and unlinking matter


def _fake_segment(d: Path, kind: str, pid: int, ns: int | None = None) -> Path:
    ns = segments.pid_namespace() if ns is None else ns
    d = segments.private_dir(str(d))
    d.mkdir(mode=0o700, exist_ok=True)
    p = d / f"lowtail.{kind}.{ns}.{pid}.abcdef012345"
    p.write_bytes(b"\0" * 4096)
    p.chmod(0o600)
    return p


def test_sweep_removes_dead_owners_only(shm_dir: Path) -> None:
    dead = _fake_segment(shm_dir, "q", _dead_pid())
    alive = _fake_segment(shm_dir, "nd", os.getpid())
    foreign = _fake_segment(shm_dir, "q", _dead_pid(), ns=1)  # another PID namespace: not ours to judge
    unrelated = segments.private_dir(str(shm_dir)) / "psm_something"
    unrelated.write_bytes(b"x")
    removed = segments.sweep_dead(str(shm_dir))
    assert [s.name for s in removed] == [dead.name]
    assert not dead.exists() and alive.exists() and foreign.exists() and unrelated.exists()


def test_creating_a_queue_sweeps_stale_segments(shm_dir: Path) -> None:
    stale = _fake_segment(shm_dir, "q", _dead_pid())
    with InferenceQueue.create(QueueConfig(lanes=1, slots_per_lane=1, shm_dir=str(shm_dir))):
        assert not stale.exists()


def test_shm_ls_and_gc_commands(shm_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    dead = _fake_segment(shm_dir, "nd", _dead_pid())
    live = _fake_segment(shm_dir, "q", os.getpid())
    assert main(["shm", "ls", "--dir", str(shm_dir), "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    by_name = {s["name"]: s for s in doc["segments"]}
    assert by_name[dead.name]["liveness"] == "dead" and by_name[live.name]["liveness"] == "alive"
    assert by_name[live.name]["mode"] == "0o600" and by_name[live.name]["size"] == 4096
    assert main(["shm", "ls", "--dir", str(shm_dir)]) == 0
    assert "lowtail segments in" in capsys.readouterr().out
    assert main(["shm", "gc", "--dir", str(shm_dir), "--dry-run", "--json", "-"]) == 0
    assert [s["name"] for s in json.loads(capsys.readouterr().out)["removed"]] == [dead.name]
    assert dead.exists()
    assert main(["shm", "gc", "--dir", str(shm_dir)]) == 0
    assert "removed 1 segment(s)" in capsys.readouterr().out
    assert not dead.exists() and live.exists()
    assert main(["shm", "ls", "--dir", str(shm_dir / "nope")]) == 2
    assert "is not a directory" in capsys.readouterr().err


@pytest.fixture
def small_tmpfs(tmpfs: Callable[..., Path]) -> Path:
    return tmpfs(size="2m")


def test_a_too_small_shm_is_a_clear_error_at_creation(small_tmpfs: Path) -> None:
    cfg = QueueConfig(shm_dir=str(small_tmpfs))  # 256 slots x 48 KiB: ~12 MiB in a 2 MiB tmpfs
    with pytest.raises(
        ShmTooSmall, match=rf"{small_tmpfs} cannot hold a \d+-byte segment \(\d+ bytes free\)"
    ):
        InferenceQueue.create(cfg)
    assert os.listdir(segments.private_dir(str(small_tmpfs))) == []  # nothing half-made left behind
    with InferenceQueue.create(QueueConfig(lanes=2, slots_per_lane=2, shm_dir=str(small_tmpfs))) as q:
        assert q.descriptor.path.parent == segments.private_dir(str(small_tmpfs))  # one that fits is fine


def test_queue_bound_to_node0_reports_its_pages_on_node0() -> None:
    with InferenceQueue.create(QueueConfig(lanes=2, slots_per_lane=2, numa_node=0)) as q:
        placement = q.placement()
        assert placement == {"node0": q.nbytes // mmap.PAGESIZE}


def test_binding_to_a_node_that_does_not_exist_names_it() -> None:
    bad = max(numa.online_nodes()) + 7
    with pytest.raises(NumaError, match=f"NUMA node {bad} is not online; online nodes: "):
        InferenceQueue.create(QueueConfig(lanes=1, slots_per_lane=1, numa_node=bad))


def test_page_report_does_not_fault_pages_in() -> None:
    mm = mmap.mmap(-1, 16 * mmap.PAGESIZE)
    assert numa.placement(mm) == {"absent": 16}
    mm[0] = 1
    assert numa.placement(mm) == {"absent": 15, "node0": 1}
    mm.close()


@pytest.mark.parametrize("waker", ["futex_wake", "futex_wake_all"])
def test_futex_wakes_a_parked_thread_and_times_out(waker: str) -> None:
    mm = mmap.mmap(-1, mmap.PAGESIZE)
    anchor = ctypes.c_char.from_buffer(mm)
    addr = ctypes.addressof(anchor)
    handle = futex.wake_handle(addr + 64)  # the worker's pre-converted form, on a word 64 bytes in
    if waker == "futex_wake_all":
        addr += 64

        def wake() -> int:
            return futex.futex_wake_all(handle)
    else:

        def wake() -> int:
            return futex.futex_wake(addr)

    assert wake() == 0  # nobody parked yet
    assert futex.futex_wait(addr, 0, 0.01) is False  # timed out
    assert futex.futex_wait(addr, 5, 1.0) is True  # value differs: returns at once
    woke: list[float] = []

    def park() -> None:
        t = time.monotonic()
        futex.futex_wait(addr, 0, 5.0)
        woke.append(time.monotonic() - t)

    th = threading.Thread(target=park)
    th.start()
    n = 0
    deadline = time.monotonic() + 5
    while n == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
        n = wake()
    th.join(5)
    assert n == 1 and woke and woke[0] < 5.0
    futex.full_barrier()
    del anchor
    mm.close()


def test_an_unreaped_zombie_still_owns_its_segments(shm_dir: Path) -> None:
    p = subprocess.Popen(["true"])
    # Wait for it to exit without reaping it (WNOWAIT): until its parent reaps it the pid is not reusable.
    os.waitid(os.P_PID, p.pid, os.WEXITED | os.WNOWAIT)
    assert segments.process_alive(p.pid)
    zombie = _fake_segment(shm_dir, "q", p.pid)
    assert segments.sweep_dead(str(shm_dir)) == [] and zombie.exists()
    p.wait()
    assert not segments.process_alive(p.pid)


def test_a_thread_id_is_not_a_live_owner() -> None:
    # kill(tid, 0) succeeds for a thread; a segment name carries a process id, so a pid reused as some
    # process's thread id must not keep a dead owner's segments alive.
    stop = threading.Event()
    tid: list[int] = []
    t = threading.Thread(target=lambda: (tid.append(threading.get_native_id()), stop.wait(10)))
    t.start()
    try:
        while not tid:
            time.sleep(0.001)
        os.kill(tid[0], 0)  # the old check's view: "exists"
        assert not segments.process_alive(tid[0])
    finally:
        stop.set()
        t.join()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to become another uid")
def test_another_users_process_is_alive_to_an_unprivileged_caller() -> None:
    # As nobody, kill(1, 0) fails with EPERM: the process exists but is not ours, so it is alive. A forked
    # child drops to nobody in-process (nobody cannot exec this venv's interpreter under /root).
    dead = _dead_pid()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child reports through the pipe and never returns
        code = 1
        try:
            os.close(r)
            os.setgid(65534)
            os.setuid(65534)
            os.write(w, f"{segments.process_alive(1)} {segments.process_alive(dead)}".encode())
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    with os.fdopen(r) as f:
        out = f.read()
    assert os.waitpid(pid, 0)[1] == 0
    assert out.split() == ["True", "False"]
