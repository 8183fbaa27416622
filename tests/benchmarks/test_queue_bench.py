"""`lowtail bench queue --quick`: every transport runs, the JSON has the `lowtail.bench.queue` schema,
plots are written.

A smoke run: it checks behaviour (schema, counts, files, cleanup), never a latency or a ratio.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import psutil
import pytest

from lowtail.cli.main import main

NAMES = [
    "lowtail", "lowtail_python", "iceoryx2_busy", "iceoryx2_waitset", "seed_flock_poll", "mp_pipe",
    "tcp_pickle", "ray_actor", "spin_floor", "native_floor",
]  # fmt: skip
TMP = Path(tempfile.gettempdir())


def iceoryx2_files() -> set[Path]:
    """Every iceoryx2 file a bench run creates: its root directories and its shared-memory segments."""
    return {*TMP.glob("lowtail-iox2-*"), *Path("/dev/shm").glob("ltiox2_*")}


def test_quick_bench_reports_every_transport(tmp_path: Path) -> None:
    before = iceoryx2_files()
    out = tmp_path / "q.json"
    png, page = tmp_path / "q.png", tmp_path / "q.html"
    # A subprocess: Ray is started and shut down there, never in the test session's process. The
    # fairness window is long enough that its last staggered client (it starts at the window's middle)
    # is answered on a loaded host: at 0.3 s it had 0.15 s to be scheduled and served.
    proc = subprocess.run(
        [sys.executable, "-m", "lowtail.cli.main", "bench", "queue", "--quick", "--json", str(out),
         "--png", str(png), "--html", str(page), "--throughput-seconds", "2"],
        check=False, capture_output=True, text=True, timeout=600,
        env={**os.environ, "COLUMNS": "200"},  # wide enough that no header wraps
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    assert set(doc["transports"]) == set(NAMES)
    for name in NAMES:
        r = doc["transports"][name]
        assert r["n"] >= 50
        assert 0 < r["p50_us"] <= r["p99_us"] <= r["p999_us"] <= r["max_us"]
        assert r["client_run_delay_ms"] >= 0 and r["client_involuntary_switches"] >= 0
    assert doc["workload"]["request"].startswith("obs: float32[16, 512]")
    # which hot path ran, in the JSON and above the tables; the native floor's targets beside the others
    core = doc["workload"]["queue_core"]
    assert core["name"] in ("native", "python") and core["reason"]
    assert f"queue hot path: {core['name']}" in proc.stdout
    floor = {t["target"] for t in doc["targets"] if "native_floor" in t["target"]}
    assert floor == {"lowtail p50 within 1.5x of native_floor", "lowtail p99.9 within 2x of native_floor"}
    assert set(doc["throughput"]) == {"lowtail", "seed_flock_poll"}
    assert all(v["clients"] == 4 and v["requests_per_s"] > 0 for v in doc["throughput"].values())
    fair = doc["fairness"]  # 8 staggered saturating clients: none starves, nothing is left unanswered
    assert fair["clients"] == 8 and fair["starved_clients"] == 0
    assert all(c["answered"] > 0 and c["unanswered"] == 0 for c in fair["per_client"]), fair["per_client"]
    assert "fairness: queue wait of a ready request" in proc.stdout
    assert doc["targets"][0]["target"].startswith("lowtail p50 within 2x of spin_floor")
    assert any(t["target"].startswith("lowtail p99.9 within 3x of its own p50") for t in doc["targets"])
    lt = doc["transports"]["lowtail"]  # where the answers found the client, and the host's interrupts
    assert sum(lt["client_wait_counts"][k] for k in ("immediate", "spinning", "parked")) >= lt["n"]
    assert lt["client_gc_collections"] >= 0 and isinstance(lt["timer_interrupts_per_cpu"], dict)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = page.read_text()
    assert "<img" in html
    # a report, not a terminal dump: the targets first, tables as tables, the JSON folded
    assert html.index("<h2>Targets") < html.index("<h2>Plots</h2>") < html.index("<h2>JSON</h2>")
    assert (
        "<pre>" not in html.split("<h2>JSON</h2>")[0] and "<details><summary>Show the JSON</summary>" in html
    )
    assert "<th>p50 us</th>" in html and "Workload and settings" in html
    assert (doc["schema"], doc["complete"], doc["interrupted"]) == ("lowtail.bench.queue", True, False)
    # a quick run's p99.9 targets rest on a few hundred samples: never decided (lowtail.validation.evidence)
    # (the fifo-only target is not this run's to decide at the default priority, whatever the samples)
    p999 = [t for t in doc["targets"] if "p99.9" in t["target"] and "--priority fifo" not in t["target"]]
    assert p999 and all(t["met"] is None and "too few samples for p99.9" in t["why"] for t in p999)
    (fifo,) = [t for t in doc["targets"] if "--priority fifo" in t["target"]]
    assert fifo["met"] is None and fifo["why"] == "decided under --priority fifo only"
    assert "within 3x of its own p50" not in proc.stdout  # left out of the table, counted in its heading
    assert not any("issue" in t["target"] for t in doc["targets"])
    assert "p50 vs lowtail" in proc.stdout and "seed_flock_poll" in proc.stdout
    # the peer: in the table and in the targets, and its files gone after the run
    assert "iceoryx2_waitset" in proc.stdout
    peer = [t for t in doc["targets"] if "iceoryx2" in t["target"]]
    assert [t["target"] for t in peer] == [
        "lowtail p50 at or below iceoryx2_busy's", "lowtail p99.9 at or below iceoryx2_busy's",
        "lowtail p50 at or below iceoryx2_waitset's", "lowtail p99.9 at or below iceoryx2_waitset's",
        "lowtail ahead of iceoryx2_busy at p50 and p99.9 in >= 9 of 10 interleaved rounds",
    ]  # fmt: skip
    assert all(isinstance(t["ratio"], float) for t in peer)
    assert doc["workload"]["iceoryx2"] == "0.10.0"  # python/constraints.txt's pin
    assert iceoryx2_files() <= before


def test_bench_rejects_unknown_transport(capsys) -> None:  # type: ignore[no-untyped-def]
    assert main(["bench", "queue", "--transports", "lowtail,carrier_pigeon"]) == 2
    assert "unknown ['carrier_pigeon']" in capsys.readouterr().err


def test_predecessor_baseline_unpickles_only_numpy_arrays() -> None:
    """The predecessor system's pickled dicts are kept for the comparison, but a pickle naming any other
    callable (here os.system) is refused before it runs."""
    import os
    import pickle

    import numpy as np
    import pytest

    from lowtail.benchmarks.queue_transports import arrays_loads

    got = arrays_loads(pickle.dumps({"x": np.arange(6, dtype=np.float32).reshape(2, 3)}, protocol=5))
    assert got["x"].shape == (2, 3) and float(got["x"].sum()) == 15.0

    class Exploit:
        def __reduce__(self) -> tuple[object, tuple[str]]:
            return (os.system, ("true",))

    with pytest.raises(pickle.UnpicklingError, match="system"):
        arrays_loads(pickle.dumps(Exploit()))


def _lowtail_run(code: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)], check=False, capture_output=True, text=True,
        timeout=timeout_s,
    )  # fmt: skip


def test_without_iceoryx2_its_transports_are_absent_and_asking_for_one_exits_2() -> None:
    """An environment where the package does not import (None in sys.modules: the import machinery
    raises ModuleNotFoundError, as when it is not installed): the transport is not offered, the default
    run leaves it out, and asking for it names the package and the command that installs it."""
    proc = _lowtail_run("""
        import sys
        sys.modules["iceoryx2"] = None
        from lowtail.benchmarks import queue_transports as qt
        print(sorted(qt.MISSING), "iceoryx2_busy" in qt.TRANSPORTS)
        from lowtail.cli.main import main
        sys.exit(main(["bench", "queue", "--transports", "lowtail,iceoryx2_busy", "--quick"]))
    """)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[0] == "['iceoryx2_busy', 'iceoryx2_waitset'] False"
    assert "needs the Python package iceoryx2" in proc.stderr
    assert "pip install 'lowtail[peer]'" in proc.stderr
    assert "round trips" not in proc.stderr  # refused before anything started


def test_iceoryx2_with_the_package_is_offered() -> None:
    from lowtail.benchmarks import queue_transports as qt

    assert qt.MISSING == {} and {"iceoryx2_busy", "iceoryx2_waitset"} <= set(qt.TRANSPORTS)


@pytest.mark.parametrize("name", ["iceoryx2_busy", "iceoryx2_waitset"])
def test_iceoryx2_killed_server_leaves_nothing(name: str) -> None:
    import numpy as np

    from lowtail.benchmarks import iceoryx2_transport as iox
    from lowtail.benchmarks.queue_transports import TRANSPORTS

    t = TRANSPORTS[name](None, "normal")
    t.start()
    assert isinstance(t, iox.Iceoryx2Transport)
    root, prefix = t.root, t.prefix
    try:
        obs = np.arange(16 * 512, dtype=np.float32).reshape(16, 512)
        assert np.array_equal(t.round_trip({"obs": obs})["logits"], obs[:, :64])
        assert iox.leftovers(root, prefix)  # the files this cleanup must find exist while it runs
        assert t.proc is not None
        os.kill(t.proc.pid, signal.SIGKILL)
        t.proc.join(10)
    finally:
        t.stop()
    assert iox.leftovers(root, prefix) == []


def test_iceoryx2_killed_client_leaves_no_server_and_the_next_run_removes_its_files() -> None:
    from lowtail.benchmarks import iceoryx2_transport as iox

    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import time
            from lowtail.benchmarks.iceoryx2_transport import Iceoryx2Transport
            t = Iceoryx2Transport(None, "normal")
            t.start()
            print(t.root, t.prefix, t.proc.pid, flush=True)
            time.sleep(120)
        """)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        root, prefix, server = proc.stdout.readline().split()
    finally:
        proc.kill()
        proc.wait(30)
    assert iox.leftovers(root, prefix)  # SIGKILL: nothing ran to clean up
    deadline = time.monotonic() + 20
    while iox._pid_alive(int(server)):  # the orphaned server sees its parent gone and exits
        assert time.monotonic() < deadline, f"server {server} still running after its client was killed"
        time.sleep(0.05)
    removed = iox.remove_stale()
    assert Path(root) in removed and iox.leftovers(root, prefix) == []


def test_interrupted_iceoryx2_run_leaves_nothing(tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the whole process group, as a terminal sends it) in the middle of the round
    trips: a partial report, exit 130, no iceoryx2 file and no process left."""
    before = iceoryx2_files()

    def started() -> bool:  # the client connected, then into the round trips
        return any(p.suffix == ".connection" for p in iceoryx2_files() - before)

    _ctrl_c_bench_queue(
        tmp_path, ["--transports", "iceoryx2_waitset", "--samples", "100000000"], started, 1.0
    )
    assert iceoryx2_files() <= before


@pytest.mark.parametrize(
    ("transport", "phase", "processes"),
    [
        ("lowtail", ["--samples", "100000000"], 2),
        ("mp_pipe", ["--samples", "100000000"], 2),
        ("tcp_pickle", ["--samples", "100000000"], 2),
        ("native_floor", ["--samples", "100000000"], 2),
        # the throughput window: a server and two clients
        ("lowtail", ["--samples", "200", "--clients", "2", "--throughput-seconds", "600"], 4),
    ],
    ids=["lowtail", "mp_pipe", "tcp_pickle", "native_floor", "lowtail-throughput"],
)
def test_ctrl_c_reaches_no_child_of_the_in_tree_transports(
    transport: str, phase: list[str], processes: int, tmp_path: Path
) -> None:
    """Ctrl-C to the whole process group while the round trips (or the throughput window) run: the
    servers and clients, started deaf to it, print no KeyboardInterrupt; the run stops them."""
    pid: list[int] = []

    def started() -> bool:  # the server (and the clients) spawned, then past their imports
        return len(_session(pid[0])) >= processes

    _ctrl_c_bench_queue(tmp_path, ["--transports", transport, *phase], started, 3.0, pid)


def _ctrl_c_bench_queue(
    tmp_path: Path,
    args: list[str],
    started: Callable[[], bool],
    settle_s: float,
    pid: list[int] | None = None,
) -> None:
    """``bench queue ARGS`` in a session of its own, Ctrl-C to the group once ``started()`` and
    ``settle_s`` more: exit 130, no traceback, a partial report, nothing of the group left running."""
    out = tmp_path / "q.json"
    proc = subprocess.Popen(
        [sys.executable, "-m", "lowtail.cli.main", "bench", "queue", *args, "--json", str(out),
         "--fairness-clients", "0", "--no-progress"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )  # fmt: skip
    if pid is not None:
        pid.append(proc.pid)
    try:
        deadline = time.monotonic() + 120
        while not started():
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not start"
            time.sleep(0.05)
        time.sleep(settle_s)
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
    assert proc.returncode == 130, err[-3000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-3000:]
    doc = json.loads(out.read_text())
    assert doc["interrupted"] is True and doc["complete"] is False
    deadline = time.monotonic() + 20  # nothing of the group is left running (a zombie awaits its reaper)
    while left := [p for p in _session(proc.pid) if p.status() != psutil.STATUS_ZOMBIE]:
        assert time.monotonic() < deadline, f"left running after Ctrl-C: {left}"
        time.sleep(0.05)


def _session(sid: int) -> list[psutil.Process]:
    out = []
    for p in psutil.process_iter():
        with contextlib.suppress(OSError, psutil.Error):
            if os.getsid(p.pid) == sid:
                out.append(p)
    return out


def test_co_tenant_runs_pinned_at_normal_priority_and_leaves_no_process() -> None:
    from lowtail.benchmarks.co_tenant import co_tenants

    cpu = min(os.sched_getaffinity(0))
    with co_tenants([cpu]) as pids:
        (pid,) = pids
        p = psutil.Process(pid)
        assert p.cpu_affinity() == [cpu] and p.nice() == 0
        assert p.status() in {psutil.STATUS_RUNNING, psutil.STATUS_SLEEPING} and p.cpu_times().user >= 0
    assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE


def test_co_tenant_dies_with_its_parent() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent("""
            import os, time
            from lowtail.benchmarks.co_tenant import co_tenants
            with co_tenants([min(os.sched_getaffinity(0))]) as pids:
                print(*pids, flush=True)
                time.sleep(120)
        """)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        (pid,) = (int(x) for x in proc.stdout.readline().split())
    finally:
        proc.kill()
        proc.wait(30)
    deadline = time.monotonic() + 20
    while psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline, f"co-tenant {pid} outlived its parent"
        time.sleep(0.05)


def test_co_tenant_option_is_reported_and_its_loops_end_with_the_run(tmp_path: Path) -> None:
    out = tmp_path / "q.json"
    proc = subprocess.run(
        [sys.executable, "-m", "lowtail.cli.main", "bench", "queue", "--quick", "--co-tenant",
         "--transports", "lowtail,iceoryx2_busy", "--fairness-clients", "0", "--throughput-seconds", "0.2",
         "--json", str(out), "--no-progress"],
        check=False, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    tenant = doc["workload"]["co_tenant"]
    assert tenant["cpus"] == sorted({doc["workload"]["client_cpu"], doc["workload"]["worker_cpu"]} - {None})
    assert len(tenant["pids"]) == len(tenant["cpus"]) and tenant["priority"] == "SCHED_OTHER nice 0"
    assert not any(psutil.pid_exists(p) for p in tenant["pids"])
    assert {r["n"] for r in doc["transports"].values()} == {300}


def test_the_rounds_target_counts_the_rounds_lowtail_was_ahead_in() -> None:
    from lowtail.benchmarks.queue_bench import rounds_target

    def rnd(lt: tuple[float, float], peer: tuple[float, float], n: int = 5000) -> dict[str, dict[str, float]]:
        row = lambda p50, p999: {"p50_us": p50, "p999_us": p999, "n": n}  # noqa: E731
        return {"lowtail": row(*lt), "iceoryx2_busy": row(*peer)}

    nine = [rnd((10, 50), (12, 60))] * 9 + [rnd((10, 70), (12, 60))]  # behind at p99.9 in one round
    (t,) = rounds_target(nine)
    assert (t["met"], t["figure"], t["ratio"]) == (True, "9/10 rounds", 0.9)
    (t,) = rounds_target([rnd((10, 50), (12, 60))] * 8 + [rnd((13, 50), (12, 60))] * 2)
    assert (t["met"], t["figure"]) == (False, "8/10 rounds")
    (t,) = rounds_target([rnd((10, 50), (12, 60))] * 3)
    assert t["met"] is None and "need at least 10" in t["why"]
    (t,) = rounds_target([rnd((10, 50), (12, 60), n=300)] * 10)
    assert t["met"] is None and "too few samples for p99.9" in t["why"]
    (t,) = rounds_target([])
    assert t["met"] is None and t["why"] == "not measured"


@pytest.mark.parametrize("window", ["throughput", "fairness"])
def test_a_ctrl_c_while_the_windows_server_attaches_stops_it(
    window: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A Ctrl-C (KeyboardInterrupt) while the throughput or fairness window's server, deaf to it, is still
    attaching: the run stops the server it started. Left running, multiprocessing would join it at exit
    and the run would never end."""
    import multiprocessing
    import types

    from lowtail.benchmarks import queue_transports as qt

    pressed = []

    def sleep(s: float) -> None:  # in the attach wait (its 5 ms steps), the server spawned
        if s == 0.005 and not pressed:
            pressed.append(s)
            raise KeyboardInterrupt
        time.sleep(s)

    monkeypatch.setattr(qt, "time", types.SimpleNamespace(monotonic=time.monotonic, sleep=sleep))
    # Kept: as in a process that exits on it, the traceback keeps the run's frames (and its queue) alive.
    with pytest.raises(KeyboardInterrupt) as caught:
        if window == "throughput":
            qt.throughput("lowtail", 1, 0.5, None, None, "normal")
        else:
            qt.fairness(1, 1, 0.5, None, None, "normal")
    assert pressed, "the interrupt did not land in the attach wait"
    deadline = time.monotonic() + 20
    while left := multiprocessing.active_children():
        assert time.monotonic() < deadline, f"still running after the interrupt: {left}"
        time.sleep(0.05)
    assert caught.tb is not None


def _die_holding(event: object) -> None:
    """A server killed inside ``stop.is_set()``: it dies holding the event's lock."""
    with event._cond:  # type: ignore[attr-defined]
        os.kill(os.getpid(), signal.SIGKILL)


def test_stop_after_the_server_died_holding_its_stop_flag_does_not_hang() -> None:
    """A server SIGKILLed while it read its stop event (the iceoryx2 waitset server polls it) leaves the
    event's lock held for ever: ``Transport.stop`` must not wait on it for a server that is gone (CI
    once hung here for 600 s, in ``test_iceoryx2_killed_server_leaves_nothing``)."""
    import threading

    from lowtail.benchmarks.queue_transports import Transport, _ctx

    t = Transport(None, "normal")
    t.stop_event = _ctx().Event()  # type: ignore[attr-defined]
    t.proc = _ctx().Process(target=_die_holding, args=(t.stop_event,))  # type: ignore[attr-defined]
    t.proc.start()
    t.proc.join(30)
    assert t.proc.exitcode == -signal.SIGKILL
    stopper = threading.Thread(target=t.stop, daemon=True)
    stopper.start()
    stopper.join(20)
    assert not stopper.is_alive(), "Transport.stop hung on the dead server's lock"
