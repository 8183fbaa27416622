"""Pinning and priority on real kernel interfaces; unprivileged cases run as a real unprivileged process."""

from __future__ import annotations

import ctypes
import json
import os
import resource
import subprocess
import sys
import textwrap
import threading
from pathlib import Path
from typing import Any

import pytest

from lowtail.serve.pinning import (
    CpuAffinityError,
    SchedFifo,
    pin_thread_to_cpu,
    rt_budget_share,
    set_timer_slack_ns,
)

PR_CAPBSET_DROP = 24
CAP_SYS_NICE = 23


def in_thread(fn: Any) -> Any:
    """Run fn in a fresh thread (affinity, policy and slack are per thread) and return its result."""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:
            box["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in box:
        raise box["error"]
    return box["value"]


def test_pin_thread_to_cpu_pins_only_the_calling_thread() -> None:
    before = os.sched_getaffinity(0)
    cpu = max(before)
    assert in_thread(lambda: (pin_thread_to_cpu(cpu), os.sched_getaffinity(0))[1]) == {cpu}
    assert os.sched_getaffinity(0) == before


def test_pinning_to_a_cpu_that_does_not_exist_names_it_and_the_allowed_ones() -> None:
    with pytest.raises(CpuAffinityError, match=r"cannot pin to CPU 4095 .*may run on CPUs \["):
        in_thread(lambda: pin_thread_to_cpu(4095))
    with pytest.raises(CpuAffinityError, match="cpu=-1"):
        pin_thread_to_cpu(-1)


def test_timer_slack_is_set_to_one_nanosecond() -> None:
    assert in_thread(lambda: set_timer_slack_ns(1)) == 1


def run_unprivileged(code: str) -> dict[str, Any]:
    """Run ``code`` (which prints one JSON line) without CAP_SYS_NICE and with RLIMIT_RTPRIO 0.

    That is a Kubernetes container without SYS_NICE. As root, CAP_SYS_NICE is dropped from the bounding
    set, so the exec'd interpreter cannot regain it (an unprivileged user could not run this venv's
    interpreter under /root); as non-root the limits alone already forbid it.
    """
    libc = ctypes.CDLL(None, use_errno=True)

    def drop() -> None:
        resource.setrlimit(resource.RLIMIT_RTPRIO, (0, 0))
        resource.setrlimit(resource.RLIMIT_NICE, (0, 0))
        if os.getuid() == 0 and libc.prctl(PR_CAPBSET_DROP, CAP_SYS_NICE, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "PR_CAPBSET_DROP CAP_SYS_NICE")

    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        preexec_fn=drop,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd="/",
    )
    assert proc.returncode == 0, proc.stderr
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["stderr"] = proc.stderr
    return result


def test_sched_fifo_falls_back_once_where_not_permitted() -> None:
    r = run_unprivileged(
        """
        import json, logging, os
        logging.basicConfig(level=logging.INFO)
        from lowtail.serve.pinning import SchedFifo, raise_priority
        nice = raise_priority(-20)
        fifo = SchedFifo(1)
        detected = fifo.detect()
        for _ in range(3):          # enter/leave must be harmless no-ops now
            fifo.enter()
            policy = os.sched_getscheduler(0)
            fifo.leave()
        caps = next(l for l in open("/proc/self/status") if l.startswith("CapEff:")).split()[1]
        print(json.dumps({"cap_sys_nice": bool(int(caps, 16) >> 23 & 1),
                          "detected": detected,
                          "available": fifo.available, "reason": fifo.reason,
                          "policy": policy, "other": os.SCHED_OTHER,
                          "nice_error": nice.error, "nice": nice.achieved}))
        """
    )
    assert r["cap_sys_nice"] is False
    assert r["detected"] is False and r["available"] is False
    assert "sched_setscheduler(SCHED_FIFO, 1) failed: Operation not permitted" in r["reason"]
    assert r["policy"] == r["other"]
    assert r["nice_error"] == "setpriority(-20) failed: Permission denied"
    assert r["nice"] == os.getpriority(os.PRIO_PROCESS, 0)  # unchanged (pytest may run under nice)
    assert r["stderr"].count("SCHED_FIFO unavailable") == 1  # logged once, not per inference


def test_sched_fifo_where_permitted_is_only_held_around_the_work() -> None:
    fifo = SchedFifo(1)

    def cycle() -> tuple[bool, int, int, int]:
        os.setpriority(os.PRIO_PROCESS, 0, 5)  # a nice value that must survive the switches
        ok = fifo.detect()
        fifo.enter()
        during = os.sched_getscheduler(0)
        fifo.leave()
        return ok, during, os.sched_getscheduler(0), os.getpriority(os.PRIO_PROCESS, 0)

    ok, during, after, nice = in_thread(cycle)
    if not ok:  # this host forbids it even to us: the fallback test above covers that path
        assert fifo.reason.startswith("sched_setscheduler(SCHED_FIFO, 1) failed")
        pytest.skip(f"SCHED_FIFO not permitted here ({fifo.reason}): nothing to check")
    assert during == os.SCHED_FIFO
    assert after == os.SCHED_OTHER
    assert nice == 5


def test_sched_fifo_enter_and_leave_are_idempotent() -> None:
    fifo = SchedFifo(1)

    def run() -> list[tuple[bool, int]]:
        seen = []
        if not fifo.detect():
            return []
        for step in (fifo.enter, fifo.enter, fifo.leave, fifo.leave):
            step()
            seen.append((fifo.active, os.sched_getscheduler(0)))
        return seen

    seen = in_thread(run)
    if not seen:
        pytest.skip(f"SCHED_FIFO not permitted here ({fifo.reason}): nothing to check")
    fifo_p, other = os.SCHED_FIFO, os.SCHED_OTHER
    assert seen == [(True, fifo_p), (True, fifo_p), (False, other), (False, other)]


def _rt_files(root: Path, runtime: int, period: int, name: str = "sched_rt") -> None:
    root.mkdir(parents=True, exist_ok=True)
    (root / f"{name}_runtime_us").write_text(f"{runtime}\n")
    (root / f"{name}_period_us").write_text(f"{period}\n")


def test_rt_budget_share_reads_the_global_and_the_cgroup_v1_budget(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    _rt_files(proc, 950000, 1000000)
    cg = tmp_path / "cgroup"
    cg.write_text("4:memory:/pod\n1:cpu,cpuacct:/kubepods/pod1\n0::/\n")
    root = tmp_path / "fs"
    assert rt_budget_share(str(proc), str(cg), str(root)) == pytest.approx(0.95)  # no cgroup file: global
    _rt_files(root / "cpu,cpuacct/kubepods/pod1", 400000, 1000000, name="cpu.rt")
    assert rt_budget_share(str(proc), str(cg), str(root)) == pytest.approx(0.40)  # the smaller one
    _rt_files(proc, -1, 1000000)
    _rt_files(root / "cpu,cpuacct/kubepods/pod1", -1, 1000000, name="cpu.rt")
    assert rt_budget_share(str(proc), str(cg), str(root)) is None  # unlimited everywhere


def test_sched_fifo_is_never_held_longer_than_the_rt_budget_allows() -> None:
    """At a 95% budget SCHED_FIFO is held at most 90 ms of each 100 ms slice, then the thread runs
    10 ms as SCHED_OTHER, so the kernel's RT throttling (which stops the whole CPU's RT tasks for the
    rest of its period) never triggers. Driven by a fake clock; the policy changes are real."""
    now = [0]
    fifo = SchedFifo(1, budget_share=0.95, clock=lambda: now[0])
    assert fifo.hold_ns == 90_000_000 and fifo.cool_ns == 10_000_000

    def run() -> list[tuple[int, int]]:
        if not fifo.detect():
            return []
        seen = []
        for t in (0, 50_000_000, 90_000_001, 95_000_000, 100_000_002, 150_000_000):
            now[0] = t
            fifo.enter()
            seen.append((t, os.sched_getscheduler(0)))
        fifo.leave()
        return seen

    seen = in_thread(run)
    if not seen:
        pytest.skip(f"SCHED_FIFO not permitted here ({fifo.reason}): nothing to check")
    fifo_, other = os.SCHED_FIFO, os.SCHED_OTHER
    assert seen == [
        (0, fifo_),
        (50_000_000, fifo_),  # held, no system call
        (90_000_001, other),  # held longer than 90 ms: cool down
        (95_000_000, other),  # still cooling
        (100_000_002, fifo_),  # cooled 10 ms: back in
        (150_000_000, fifo_),
    ]
    assert fifo.cooldowns == 1 and fifo.switches == 4


def test_sched_fifo_is_not_used_with_a_budget_too_small_to_hold() -> None:
    fifo = SchedFifo(1, budget_share=0.04)
    assert fifo.detect() is False and not fifo.available
    assert "4%" in fifo.reason and "throttled" in fifo.reason
    fifo.enter()
    assert not fifo.active and fifo.switches == 0
