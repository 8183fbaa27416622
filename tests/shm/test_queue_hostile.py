"""Hostile neighbours and hostile clients: names planted by another uid, a squatted or symlinked
directory, a client that truncates, shrinks or punches its own ndarray segment, path tricks in slot
names. Each fails only what it touched; honest clients on the same queue keep their answers."""

from __future__ import annotations

import ctypes
import json
import os
import random
import threading
import time
from multiprocessing.context import BaseContext
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from lowtail.cli.main import main
from lowtail.shm import payload, segments
from lowtail.shm.errors import BadRequest, PayloadTooLarge, QueueError, QueueTimeout, ShmDirUnsafe
from lowtail.shm.queue import InferenceQueue, QueueClient, QueueConfig, QueueDescriptor, QueueWorker
from tests.shm.helpers import NOBODY, as_nobody, checking_client, echo_server, hold_ndslot

# Every test here runs on both hot paths: the Python reference and the native core.
pytestmark = pytest.mark.usefixtures("queue_impl")

# -- names: strict, and only in this uid's 0700 directory ---------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "lowtail.q.1.2147483648.0123456789ab",  # psutil.pid_exists raises OverflowError at 2^31
        f"lowtail.q.1.{2**22 + 1}.0123456789ab",  # above PID_MAX_LIMIT
        "lowtail.q.1.0.0123456789ab",
        "lowtail.q.1.+5.0123456789ab",
        "lowtail.q.1. 5.0123456789ab",
        "lowtail.q.1.1_0.0123456789ab",
        "lowtail.q.1.\u0661.0123456789ab",  # an Arabic-Indic digit int() would accept
        "lowtail.nd.1.5.link/secret",
        "lowtail.nd.1.5.0123456789ab/x",
        "lowtail.nd.1.5.../../etc",
        "lowtail.nd.1.5.0123456789AB",
        "lowtail.nd.1.5.x",
        "lowtail.nd.1.5.0123456789ab.more",
        "lowtail.zz.1.5.0123456789ab",
    ],
)
def test_a_malformed_name_is_not_a_segment_name(name: str) -> None:
    assert segments.parse_name(name) is None


def test_a_pid_out_of_range_is_no_process() -> None:
    assert not segments.process_alive(2**31) and not segments.process_alive(-1)


def _plant_names(top: Path, count: int) -> None:
    ns = segments.pid_namespace()
    for i in range(count):
        (top / f"lowtail.q.{ns}.{2**31 + i}.x").touch()
    (top / f"lowtail.q.{ns}.2147483648.0123456789ab").touch()
    (top / f"lowtail.nd.{ns}.1.0123456789ab").mkdir()


def test_names_another_user_plants_in_the_mount_stop_nothing(
    shared_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Names any user can create in /dev/shm (a pid past 2^31, a directory) make create/close/ls/gc
    neither raise (an OverflowError from a pid that big) nor stall."""
    assert as_nobody(lambda: _plant_names(shared_dir, 2000)) == 0
    planted = sorted(os.listdir(shared_dir))
    cfg = QueueConfig(lanes=1, slots_per_lane=1, shm_dir=str(shared_dir))
    t0 = time.monotonic()
    with InferenceQueue.create(cfg) as q, QueueClient.attach(q.descriptor):
        pass
    took_s = time.monotonic() - t0
    assert main(["shm", "ls", "--dir", str(shared_dir), "--json", "-"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["dir"] == str(segments.private_dir(str(shared_dir))) and doc["segments"] == []
    assert main(["shm", "gc", "--dir", str(shared_dir)]) == 0
    capsys.readouterr()
    assert sorted(n for n in os.listdir(shared_dir) if n != f"lowtail-{os.geteuid()}") == planted
    assert took_s < 5.0  # generous: the 2000 names are not even listed


def test_a_squatted_or_symlinked_directory_is_refused_naming_its_owner(shared_dir: Path) -> None:
    mine = segments.private_dir(str(shared_dir))
    cfg = QueueConfig(lanes=1, slots_per_lane=1, shm_dir=str(shared_dir))
    assert as_nobody(lambda: mine.mkdir(mode=0o777)) == 0  # their directory under our name
    with pytest.raises(ShmDirUnsafe, match=f"owned by uid {NOBODY}"):
        InferenceQueue.create(cfg)
    assert os.listdir(mine) == []  # nothing of ours went into it
    mine.rmdir()
    theirs = shared_dir / "theirs"

    def symlink_to_own_dir() -> None:
        theirs.mkdir(mode=0o777)
        mine.symlink_to(theirs)

    assert as_nobody(symlink_to_own_dir) == 0
    with pytest.raises(ShmDirUnsafe, match="is a symlink"):
        InferenceQueue.create(cfg)
    with pytest.raises(ShmDirUnsafe, match="is a symlink"):
        segments.list_segments(str(shared_dir))
    assert os.listdir(theirs) == []
    mine.unlink()
    with InferenceQueue.create(cfg) as q:  # the impostor gone, lowtail makes its own
        assert q.descriptor.path.parent == mine
        st = mine.stat()
        assert (st.st_uid, st.st_mode & 0o777) == (os.geteuid(), 0o700)


def test_entries_of_our_directory_that_are_not_segments_are_counted_and_flagged(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    d = segments.private_dir(str(tmp_path))
    d.mkdir(mode=0o700)
    (d / "junk").touch()
    (d / "lowtail.q.1.2147483648.x").touch()
    link = d / f"lowtail.nd.{segments.pid_namespace()}.{os.getpid()}.0123456789ab"
    link.symlink_to("/etc/passwd")
    found = segments.scan(str(tmp_path))
    assert found.ignored == 2
    assert [(s.name, s.foreign) for s in found.segments] == [(link.name, "symlink")]
    assert segments.sweep_dead(str(tmp_path)) == [] and link.is_symlink()
    assert main(["shm", "ls", "--dir", str(tmp_path)]) == 0
    out = " ".join(capsys.readouterr().out.split())  # the title may be wrapped to the terminal
    assert "FOREIGN: symlink" in out and "2 other entries ignored" in out and "root" in out


# -- a client's own ndarray segment cannot hurt the worker -------------------------------------------

# request_bytes 256: every request (honest or not) goes through an ndarray segment
CFG = QueueConfig(lanes=4, slots_per_lane=4, request_bytes=256, response_bytes=4096, coalesce_us=0)
_libc = ctypes.CDLL(None, use_errno=True)
FALLOC_FL_KEEP_SIZE, FALLOC_FL_PUNCH_HOLE = 1, 2


def _punch(fd: int, size: int) -> None:
    _libc.fallocate(fd, FALLOC_FL_KEEP_SIZE | FALLOC_FL_PUNCH_HOLE, ctypes.c_long(0), ctypes.c_long(size))


def _pwrite_only(slot: payload.NdarraySegment, arrays: Any, spec: payload.Spec) -> dict[str, Any]:
    """The hostile client writes its slot with pwrite: its own mapping would SIGBUS it, not the worker."""
    for a in payload.array_offsets(spec, 0)[0]:
        os.pwrite(slot.segment.fd, np.ascontiguousarray(arrays[a.name]).tobytes(), a.offset)
    return {"name": slot.name, "shm_dir": slot.shm_dir, "spec": spec}


def hostile_client(desc: QueueDescriptor, seconds: float, out: Any) -> None:
    """Submit, then truncate / shrink / punch / restore its slot at random moments until the answer."""
    payload.NdarraySegment.write = _pwrite_only  # type: ignore[method-assign]
    rng = random.Random(7)
    answered = refused = 0
    stop = threading.Event()
    with QueueClient.attach(desc) as c:
        fds: list[int] = []

        def vandal() -> None:
            while not stop.is_set():
                for fd in list(fds):
                    size = 1 << 16
                    with_action = rng.randrange(5)
                    if with_action == 0:
                        os.ftruncate(fd, 0)
                    elif with_action == 1:
                        os.ftruncate(fd, 100)
                    elif with_action == 2:
                        os.ftruncate(fd, 0)
                        os.ftruncate(fd, size)  # the same size, all holes
                    elif with_action == 3:
                        _punch(fd, size)
                    else:
                        os.ftruncate(fd, size)
                        os.posix_fallocate(fd, 0, size)
                time.sleep(rng.random() * 0.0005)

        th = threading.Thread(target=vandal, daemon=True)
        th.start()
        # At least ``seconds``, and on until one vandalised request was refused (a starved process on
        # a loaded host may get few rounds in): at most a minute.
        start = time.monotonic()
        while time.monotonic() - start < seconds or (not refused and time.monotonic() - start < 60):
            x = np.full((16, 64), 3.0, np.float32)
            try:
                t = c.submit({"x": x})
                fds[:] = [s.segment.fd for s in c._pool._all]
                c.wait(t, timeout_s=5.0)
                answered += 1
            except QueueTimeout:
                raise
            except QueueError:
                refused += 1
        stop.set()
        th.join()
    out.put((answered, refused))


def test_a_client_vandalising_its_own_slot_fails_alone(ctx: BaseContext) -> None:
    with InferenceQueue.create(CFG) as q:
        w = ctx.Process(target=echo_server, args=(q.descriptor, None, 300.0))
        w.start()
        try:
            out = ctx.Queue()
            hostile = ctx.Process(target=hostile_client, args=(q.descriptor, 3.0, out))
            honest = [ctx.Process(target=checking_client, args=(q.descriptor, s, 150, out)) for s in (1, 2)]
            for p in [hostile, *honest]:
                p.start()
            for p in [hostile, *honest]:
                p.join(60)
            results = [out.get(timeout=5) for _ in range(3)]
            assert w.is_alive(), f"the worker died (exit {w.exitcode}): a client's own slot killed it"
            assert hostile.exitcode == 0 and all(p.exitcode == 0 for p in honest)
            vandal = next(r for r in results if len(r) == 2)
            assert vandal[1] > 0, f"no vandalised request was refused: {vandal}"
            assert sorted(r for r in results if len(r) == 3) == [(1, 150, 0), (2, 150, 0)]
        finally:
            w.terminate()
            w.join(10)


# -- a request names only its own client's slots, inside the directory ------------------------------


def _rename_slot(c: QueueClient, t: Any, name: str, spec: payload.Spec | None = None) -> None:
    """Rewrite the header of ``c``'s published request ``t`` to name ``name`` (what a hostile client can)."""
    m = c._m
    off = m.geo.req_off(c._g0 + t.slot)
    old = payload.read_header(m.mem, m.q, off, m.geo.req_bytes)[1].spec
    payload.write_header(m.buf, off, name, old if spec is None else spec)


@pytest.mark.parametrize("trick", ["other client", "path", "too large"])
def test_a_request_naming_a_slot_not_its_own_fails_alone(ctx: BaseContext, trick: str) -> None:
    cfg = QueueConfig(
        lanes=3, slots_per_lane=2, request_bytes=512, response_bytes=4096, max_ndslot_bytes=1 << 20
    )
    with InferenceQueue.create(cfg) as q:
        out = ctx.Queue()
        other = ctx.Process(target=hold_ndslot, args=(q.descriptor, out))
        other.start()
        try:
            victim = out.get(timeout=30)
            with QueueWorker.attach(q.descriptor) as w, QueueClient.attach(q.descriptor) as c:
                x = np.full((16, 64), 1.0, np.float32)
                t = c.submit({"x": x})
                mine = next(iter(c._nd_req.values())).name
                if trick == "other client":
                    _rename_slot(c, t, victim)
                    expected: tuple[type[Exception], str] = (BadRequest, "is not one the client of lane")
                elif trick == "path":
                    _rename_slot(c, t, mine[:-4] + "/../" + mine[-4:])
                    expected = (BadRequest, "is not a lowtail.nd")
                else:
                    _rename_slot(c, t, mine, (("x", "<f4", (16, 1 << 16)),))  # 4 MiB named, 1 MiB limit
                    expected = (PayloadTooLarge, "exceeds max_ndslot_bytes=1048576")
                computed = []
                for _ in range(40):  # the hostile request fails at decode; only the victim's is computed
                    b = w.claim(timeout_s=0.05)
                    if b is not None:
                        computed.append(b.inputs["x"].copy())
                        b.complete({"y": b.inputs["x"][:, :1].copy()})
                with pytest.raises(expected[0], match=expected[1]):
                    c.wait(t, timeout_s=2.0)
                assert len(computed) == 1 and (computed[0] == 9.0).all()  # the victim's own data only
                t = c.submit({"x": x})  # the same client goes on
                b = w.claim(timeout_s=1.0)
                assert b is not None
                b.complete({"y": b.inputs["x"][:, :1].copy()})
                np.testing.assert_array_equal(c.wait(t, timeout_s=1.0)["y"], x[:, :1])
        finally:
            other.kill()
            other.join(10)


# -- a killed client's slots go while the queue lives -------------------------------------------------


def test_a_killed_clients_slot_files_are_swept_while_the_queue_lives(ctx: BaseContext) -> None:
    with InferenceQueue.create(CFG) as q:
        w = ctx.Process(target=echo_server, args=(q.descriptor, None, 300.0))
        w.start()
        try:
            out = ctx.Queue()
            victim = ctx.Process(target=hold_ndslot, args=(q.descriptor, out))
            victim.start()
            name = out.get(timeout=30)
            path = segments.private_dir(CFG.shm_dir) / name
            assert path.exists()
            victim.kill()
            victim.join(10)
            deadline = time.monotonic() + 10
            while path.exists() and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not path.exists(), "a killed client's ndarray segment outlived it while the queue lives"
            assert w.is_alive()
        finally:
            w.terminate()
            w.join(10)


def _round_trip_through_ndslots(shm_dir: str) -> None:
    cfg = QueueConfig(lanes=1, slots_per_lane=2, request_bytes=256, response_bytes=256, shm_dir=shm_dir)
    x = np.arange(16 * 64, dtype=np.float32).reshape(16, 64)
    with InferenceQueue.create(cfg) as q, QueueClient.attach(q.descriptor) as c:
        with QueueWorker.attach(q.descriptor) as w:
            t = c.submit({"x": x})
            b = w.claim(timeout_s=1.0)
            assert b is not None
            b.complete({"y": b.inputs["x"] * 2})
            np.testing.assert_array_equal(c.wait(t, timeout_s=1.0)["y"], x * 2)
        st = segments.private_dir(shm_dir).stat()
        assert (st.st_uid, st.st_mode & 0o777) == (os.geteuid(), 0o700)


def test_the_slot_path_works_for_root_and_for_a_second_uid(shared_dir: Path) -> None:
    _round_trip_through_ndslots(str(shared_dir))
    assert as_nobody(lambda: _round_trip_through_ndslots(str(shared_dir))) == 0
    assert sorted(os.listdir(shared_dir)) == [f"lowtail-{os.geteuid()}", f"lowtail-{NOBODY}"]
    assert os.listdir(segments.private_dir(str(shared_dir), NOBODY)) == []
