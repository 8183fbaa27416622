"""The lease allocator core, without Ray: placement, exhaustion, reclaim, persistence, concurrency."""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from multiprocessing.synchronize import Barrier
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lowtail.node import cpulist, lease
from lowtail.node.lease import (
    BadOwner,
    BadPlacement,
    Lease,
    LeaseAllocator,
    LeaseError,
    LeaseExhausted,
    LeaseStateError,
    OwnerConflict,
    owner_kind,
    pid_alive,
    process_start_time,
)
from lowtail.node.plan import Plan, make_plan
from lowtail.node.topology import read_topology
from tests.fixtures.plans import tiny_plan
from tests.fixtures.tmpfs import tmpfs  # noqa: F401 - a fixture, shared


@pytest.fixture(scope="module")
def epyc(machine_roots: dict[str, tuple[Path, Path]]) -> Plan:
    """2 x EPYC 9634: 2 NUMA nodes, 12 L3 groups of 7 cores per socket, group 0 of each is housekeeping."""
    return make_plan(read_topology(*machine_roots["epyc9634_2s"]))


def sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def dead_pid() -> int:
    p = sleeper()
    p.kill()
    p.wait()
    return p.pid


# --- owners --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("owner", "kind"),
    [
        ("infer:3:0", "infer"),
        ("sample:h3:env-7", "sample"),
        ("other:probe", "other"),
        ("sample:a.b_c", "sample"),
    ],
)
def test_owner_names_of_the_three_kinds_are_accepted(owner: str, kind: str) -> None:
    assert owner_kind(owner) == kind


@pytest.mark.parametrize(
    "owner", ["infer:3", "infer:3:0:1", "sample:", "worker:1", "sample:a b", "", "infer::0", "other"]
)
def test_bad_owner_names_are_rejected_with_the_name_and_the_expected_forms(owner: str) -> None:
    alloc = LeaseAllocator(tiny_plan())
    with pytest.raises(BadOwner) as e:
        alloc.acquire(owner)
    assert repr(owner) in str(e.value) and "infer:<hero>:<actor>" in str(e.value)
    assert alloc.leases() == []


# --- placement -----------------------------------------------------------------------------------------


def test_only_isolated_cpus_are_leased_and_exhaustion_names_the_pool(epyc: Plan) -> None:
    alloc = LeaseAllocator(epyc)
    got = {alloc.acquire(f"sample:s{i}").cpu for i in range(len(epyc.isolated))}
    assert got == epyc.isolated
    assert not got & epyc.housekeeping
    with pytest.raises(LeaseExhausted) as e:
        alloc.acquire("infer:0:0")
    msg = str(e.value)
    assert "'infer:0:0'" in msg and f"{len(epyc.isolated)} CPUs" in msg and "node 0: 77, node 1: 77" in msg
    assert "sample=154" in msg


def test_same_owner_gets_the_same_cpu_again_with_its_new_identity(epyc: Plan) -> None:
    alloc = LeaseAllocator(epyc)
    first = alloc.acquire("infer:1:0")
    alloc.acquire("infer:1:1")
    again = alloc.acquire("infer:1:0", pid=os.getpid())
    assert again.cpu == first.cpu and again.pid == os.getpid() and again.pid_start is not None
    assert len(alloc.leases()) == 2


def test_a_live_owner_name_cannot_be_taken_by_another_process() -> None:
    alloc = LeaseAllocator(tiny_plan())
    child = sleeper()
    try:
        alloc.acquire("infer:1:0", pid=child.pid)
        with pytest.raises(OwnerConflict, match=f"holds CPU 1 for live pid {child.pid}; pid {os.getpid()}"):
            alloc.acquire("infer:1:0", pid=os.getpid())
    finally:
        child.kill()
        child.wait()
    assert alloc.acquire("infer:1:0", pid=os.getpid()).cpu == 1  # the restarted owner takes over


def test_near_cpu_prefers_its_l3_group_then_its_numa_node_then_elsewhere() -> None:
    # node 0: L3 {1,2,3} and {4,5}; node 1: L3 {6,7}
    plan = Plan.from_dict(
        {
            "housekeeping": "0",
            "isolated": "1-7",
            "per_node": {
                "0": {"housekeeping": "0", "isolated": "1-5"},
                "1": {"housekeeping": "", "isolated": "6-7"},
            },
            "l3_groups": [
                {"index": 0, "node": 0, "socket": 0, "cpus": "0-3", "isolated": "1-3"},
                {"index": 1, "node": 0, "socket": 0, "cpus": "4-5", "isolated": "4-5"},
                {"index": 2, "node": 1, "socket": 1, "cpus": "6-7", "isolated": "6-7"},
            ],
            "kernel_args": [],
        }
    )
    alloc = LeaseAllocator(plan)
    infer = alloc.acquire("infer:0:0", near_cpu=2)
    assert infer.cpu == 1 and infer.placement == "same-l3"
    placed = [alloc.acquire(f"sample:{i}", near_cpu=infer.cpu) for i in range(6)]
    assert [(x.cpu, x.placement) for x in placed] == [
        (2, "same-l3"),
        (3, "same-l3"),
        (4, "same-node"),
        (5, "same-node"),
        (6, "other-node"),
        (7, "other-node"),
    ]
    assert {x.node for x in placed[:4]} == {0} and placed[4].node == 1


def test_near_node_prefers_that_node(epyc: Plan) -> None:
    alloc = LeaseAllocator(epyc)
    on1 = [alloc.acquire(f"sample:{i}", near_node=1) for i in range(5)]
    node1 = epyc.per_node[1][1]
    assert all(x.cpu in node1 and x.node == 1 and x.placement == "same-node" for x in on1)


def test_without_a_hint_leases_spread_over_l3_groups(epyc: Plan) -> None:
    alloc = LeaseAllocator(epyc)
    l3s = [alloc.acquire(f"infer:0:{i}").l3 for i in range(22)]
    assert len(set(l3s)) == 22  # 22 isolated L3 groups: one inference actor each before any doubles up


def test_bad_near_hints_are_clear_errors(epyc: Plan) -> None:
    alloc = LeaseAllocator(epyc)
    with pytest.raises(BadPlacement, match="near_cpu=999"):
        alloc.acquire("sample:x", near_cpu=999)
    with pytest.raises(BadPlacement, match=r"near_node=7: this node's NUMA nodes are \[0, 1\]"):
        alloc.acquire("sample:x", near_node=7)
    with pytest.raises(BadPlacement, match="give at most one"):
        alloc.acquire("sample:x", near_cpu=10, near_node=0)


def test_release_frees_the_cpu() -> None:
    alloc = LeaseAllocator(tiny_plan("1"))
    a = alloc.acquire("infer:0:0")
    with pytest.raises(LeaseExhausted):
        alloc.acquire("infer:0:1")
    assert alloc.release("infer:0:0") == a
    assert alloc.release("infer:0:0") is None
    assert alloc.acquire("infer:0:1").cpu == a.cpu


def test_allowed_cpus_narrow_the_pool_and_an_empty_pool_is_an_error() -> None:
    alloc = LeaseAllocator(tiny_plan("1-8"), allowed={0, 1, 2, 3})
    assert alloc.pool == {1, 2, 3} and alloc.excluded == {4, 5, 6, 7, 8}
    with pytest.raises(LeaseExhausted, match="plan's isolated CPUs 1-8 and the CPUs allowed here 0 "):
        LeaseAllocator(tiny_plan("1-8"), allowed={0})


def test_demo_pool_override_and_sharing_are_stated_in_the_audit_line() -> None:
    plan = tiny_plan("1", "0", ("0-1",))
    with pytest.raises(BadPlacement, match="pool CPUs 5 are not in the plan"):
        LeaseAllocator(plan, pool={0, 5})
    alloc = LeaseAllocator(plan, pool={0, 1}, share=2)
    cpus = [alloc.acquire(o).cpu for o in ("infer:0:0", "infer:0:1", "sample:0", "sample:1")]
    assert sorted(cpus) == [0, 0, 1, 1]  # spread over both before sharing
    assert cpus[0] == 1  # the isolated CPU before the housekeeping one
    with pytest.raises(LeaseExhausted, match="x share 2"):
        alloc.acquire("other:x")
    assert "DEMO(pool=0-1 share=2)" in alloc.audit_line()
    assert "DEMO" not in LeaseAllocator(plan).audit_line()


# --- liveness and reclaim ------------------------------------------------------------------------------


def test_a_killed_owner_process_lease_is_reclaimed() -> None:
    alloc = LeaseAllocator(tiny_plan("1"))
    child = sleeper()
    try:
        alloc.acquire("sample:h0:0", pid=child.pid)
        with pytest.raises(LeaseExhausted):
            alloc.acquire("sample:h0:1", pid=os.getpid())
        assert alloc.reclaim() == []
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert [x.owner for x in alloc.reclaim()] == ["sample:h0:0"]
    assert alloc.acquire("sample:h0:1", pid=os.getpid()).cpu == 1


def test_exhaustion_reclaims_dead_owners_before_giving_up() -> None:
    alloc = LeaseAllocator(tiny_plan("1"))
    child = sleeper()
    alloc.acquire("sample:old", pid=child.pid)
    child.kill()
    child.wait()
    assert alloc.acquire("sample:new").cpu == 1


def test_a_recycled_pid_is_not_the_owner() -> None:
    me = process_start_time(os.getpid())
    assert me is not None
    assert pid_alive(Lease("sample:x", 1, 0, 0, pid=os.getpid(), pid_start=me))
    assert not pid_alive(Lease("sample:x", 1, 0, 0, pid=os.getpid(), pid_start=me - 1))
    assert not pid_alive(Lease("sample:x", 1, 0, 0, pid=dead_pid(), pid_start=me))
    assert not pid_alive(Lease("other:manual", 1, 0, 0))  # no owner anybody can check: reclaimable


def test_process_start_time_parses_a_comm_with_spaces_and_parens(tmp_path: Path) -> None:
    fields = ["S", *[str(i) for i in range(4, 22)], "123456", "0"]
    (tmp_path / "42").mkdir()
    (tmp_path / "42" / "stat").write_text(f"42 (evil) name (x) {' '.join(fields)}\n")
    assert process_start_time(42, tmp_path) == 123456
    (tmp_path / "42" / "stat").write_text(f"42 (zombie) {' '.join(['Z', *fields[1:]])}\n")
    assert process_start_time(42, tmp_path) is None


def test_an_unknown_pid_is_refused_at_acquire() -> None:
    with pytest.raises(LeaseError, match="is not a running process"):
        LeaseAllocator(tiny_plan()).acquire("sample:x", pid=dead_pid())


def test_a_pluggable_liveness_check_reclaims_dead_actors() -> None:
    dead_actors = {"a1"}
    alloc = LeaseAllocator(tiny_plan("1-2"), alive=lambda x: x.actor_id not in dead_actors)
    alloc.acquire("infer:0:0", actor_id="a1")
    alloc.acquire("infer:0:1", actor_id="a2")
    assert [x.owner for x in alloc.reclaim()] == ["infer:0:0"]


def test_audit_line_groups_by_kind_every_interval() -> None:
    now = [0.0]
    alloc = LeaseAllocator(tiny_plan("1-8"), audit_interval_s=30.0, clock=lambda: now[0])
    alloc.acquire("infer:0:0")
    alloc.acquire("infer:0:1")
    alloc.acquire("sample:a")
    assert alloc.tick() is None
    now[0] = 31.0
    line = alloc.tick()
    assert line is not None
    assert line.startswith("leases infer=2 [") and " sample=1 [" in line and " other=0 [-] free=5/8" in line
    assert alloc.tick() is None


# --- persistence ---------------------------------------------------------------------------------------


def test_restart_rebuilds_the_table_from_the_state_file_dropping_dead_owners(tmp_path: Path) -> None:
    first = LeaseAllocator(tiny_plan("1-4"), state_dir=tmp_path)
    live = first.acquire("infer:0:0", pid=os.getpid())
    child = sleeper()
    first.acquire("sample:gone", pid=child.pid)
    manual = first.acquire("other:manual")
    child.kill()
    child.wait()
    assert (tmp_path / "leases.json").stat().st_mode & 0o777 == 0o600

    second = LeaseAllocator(tiny_plan("1-4"), state_dir=tmp_path)
    assert {x.owner: x.cpu for x in second.leases()} == {"infer:0:0": live.cpu, "other:manual": manual.cpu}
    assert [(x.owner, why) for x, why in second.dropped_on_start] == [("sample:gone", "owner is dead")]
    saved = json.loads((tmp_path / "leases.json").read_text())
    assert sorted(x["owner"] for x in saved["leases"]) == ["infer:0:0", "other:manual"]
    assert second.acquire("infer:0:0", pid=os.getpid()).cpu == live.cpu


def test_restart_drops_leases_of_cpus_no_longer_in_the_pool(tmp_path: Path) -> None:
    before = LeaseAllocator(tiny_plan("1-4"), state_dir=tmp_path)
    on4 = [before.acquire(f"other:{i}") for i in range(4)][-1]
    assert on4.cpu == 4
    after = LeaseAllocator(tiny_plan("1-3", l3=("0-3",)), state_dir=tmp_path)
    assert [x.owner for x in after.leases()] == ["other:0", "other:1", "other:2"]
    assert "no longer in the pool 1-3" in after.dropped_on_start[0][1]


def test_a_state_file_from_another_boot_is_ignored(tmp_path: Path) -> None:
    LeaseAllocator(tiny_plan(), state_dir=tmp_path).acquire("other:x")
    path = tmp_path / "leases.json"
    data = json.loads(path.read_text())
    data["boot_id"] = "not-this-boot"
    path.write_text(json.dumps(data))
    assert LeaseAllocator(tiny_plan(), state_dir=tmp_path).leases() == []


def test_a_corrupt_state_file_is_a_clear_error_and_left_in_place(tmp_path: Path) -> None:
    path = tmp_path / "leases.json"
    path.write_text("{not json")
    with pytest.raises(LeaseStateError, match=r"lease state .*leases.json: not JSON .*move it away"):
        LeaseAllocator(tiny_plan(), state_dir=tmp_path)
    assert path.read_text() == "{not json"
    path.write_text('{"leases": [{"cpu": 1}]}')
    with pytest.raises(
        LeaseStateError, match=r"lease 0: lease keys: unknown \[\], missing \['l3', 'node', 'owner'\]"
    ):
        LeaseAllocator(tiny_plan(), state_dir=tmp_path)


# --- concurrency ---------------------------------------------------------------------------------------


def test_many_threads_never_get_one_cpu_twice(tmp_path: Path) -> None:
    alloc = LeaseAllocator(tiny_plan("1-16", l3=("0-8", "9-16")), state_dir=tmp_path)
    results: list[Lease] = []
    failures: list[str] = []
    barrier = threading.Barrier(40)

    def take(i: int) -> None:
        barrier.wait()
        try:
            results.append(alloc.acquire(f"sample:t{i}", near_cpu=1 + i % 16))
        except LeaseExhausted as e:
            failures.append(str(e))

    threads = [threading.Thread(target=take, args=(i,)) for i in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 16 and len(failures) == 24
    assert sorted(x.cpu for x in results) == list(range(1, 17))
    assert {x.owner: x.cpu for x in alloc.leases()} == {x.owner: x.cpu for x in results}


def _acquire_in_process(
    state_dir: str,
    worker: int,
    count: int,
    out: multiprocessing.Queue,  # type: ignore[type-arg]
    gates: tuple[Barrier, Barrier],
) -> None:
    start, done = gates
    alloc = LeaseAllocator(tiny_plan("1-16", l3=("0-8", "9-16")), state_dir=state_dir)
    got = []
    start.wait(timeout=60)  # all asks overlap: on a loaded host spawn starts the processes seconds apart
    for j in range(count):
        try:
            got.append((f"sample:p{worker}:{j}", alloc.acquire(f"sample:p{worker}:{j}").cpu))
        except LeaseExhausted:
            got.append((f"sample:p{worker}:{j}", -1))
        if worker % 3 == 0 and j % 2:
            alloc.release(f"sample:p{worker}:{j - 1}")  # some churn among the acquirers
    out.put(got)
    # Stay alive until the test has read the table: a dead owner's leases are dropped by the next reader.
    done.wait(timeout=60)


def test_many_processes_sharing_the_state_dir_never_get_one_cpu_twice(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    workers = 6
    start, done = ctx.Barrier(workers), ctx.Barrier(workers + 1)
    procs = [
        ctx.Process(target=_acquire_in_process, args=(str(tmp_path), w, 6, out, (start, done)))
        for w in range(workers)
    ]
    for p in procs:
        p.start()
    try:
        got = [pair for _ in procs for pair in out.get(timeout=120)]
        final = LeaseAllocator(tiny_plan("1-16", l3=("0-8", "9-16")), state_dir=tmp_path).leases()
        done.wait(timeout=60)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert all(p.exitcode == 0 for p in procs)
    cpus = [x.cpu for x in final]
    assert 0 < len(cpus) == len(set(cpus)) <= 16  # no CPU twice
    # Every lease in the final table was handed out to that owner, on that CPU, by some process.
    handed = dict(got)
    assert all(handed[x.owner] == x.cpu for x in final)
    # 36 asks, 6 released, all while every owner lives: at least 36 - 6 - 16 = 14 refused.
    assert sum(1 for _, cpu in got if cpu < 0) >= 14


@settings(max_examples=60, deadline=None)
@given(
    share=st.integers(min_value=1, max_value=3),
    ops=st.lists(
        st.tuples(
            st.sampled_from(["acquire", "release"]),
            st.integers(min_value=0, max_value=11),
            st.one_of(st.none(), st.integers(min_value=0, max_value=4)),
        ),
        max_size=60,
    ),
)
def test_random_operations_keep_the_lease_invariants(
    share: int, ops: list[tuple[str, int, int | None]]
) -> None:
    alloc = LeaseAllocator(tiny_plan("1-4", "0", ("0-2", "3-4")), share=share)
    held: dict[str, int] = {}
    for op, who, near in ops:
        owner = f"sample:{who}"
        if op == "release":
            released = alloc.release(owner)
            assert (released is not None) == (owner in held)
            held.pop(owner, None)
            continue
        try:
            got = alloc.acquire(owner, near_cpu=near)
        except LeaseExhausted:
            assert owner not in held and len(held) == 4 * share
            continue
        assert held.setdefault(owner, got.cpu) == got.cpu  # same owner, same CPU
        assert got.cpu in alloc.pool
    table = alloc.leases()
    assert {x.owner: x.cpu for x in table} == held
    assert all(sum(1 for x in table if x.cpu == cpu) <= share for cpu in range(5))


def test_node_plan_reads_lowtail_plan_from_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(tiny_plan("3-5", "0-2", ("0-5",)).to_dict()))
    monkeypatch.setenv("LOWTAIL_PLAN", str(path))
    assert lease.node_plan().isolated == cpulist.parse("3-5")


def test_a_state_file_owner_of_a_bogus_kind_is_a_clear_error(tmp_path: Path) -> None:
    LeaseAllocator(tiny_plan("1-4"), state_dir=tmp_path).acquire("other:x")
    path = tmp_path / "leases.json"
    data = json.loads(path.read_text())
    data["leases"][0]["owner"] = "bogus:x"
    path.write_text(json.dumps(data))
    with pytest.raises(LeaseStateError, match=r"lease 0: owner 'bogus:x': expected 'infer:<hero>:<actor>'"):
        LeaseAllocator(tiny_plan("1-4"), state_dir=tmp_path)


def test_the_state_file_is_private_to_its_owner_like_its_lock(tmp_path: Path) -> None:
    LeaseAllocator(tiny_plan("1-4"), state_dir=tmp_path).acquire("other:x")
    assert (tmp_path / "leases.json").stat().st_mode & 0o777 == 0o600
    assert (tmp_path / "leases.lock").stat().st_mode & 0o777 == 0o600


# --- takeover and hostile state files ----------------------------------------------------------------


def test_a_live_owners_lease_cannot_be_taken_with_or_without_a_pid(tmp_path: Path) -> None:
    """A pid-less acquire must not take the live owner's CPU: its pid set to None, it is never reclaimed."""
    holder = subprocess.Popen(["sleep", "30"])
    try:
        alloc = LeaseAllocator(tiny_plan(), state_dir=tmp_path)
        held = alloc.acquire("infer:h:0", pid=holder.pid)
        with pytest.raises(OwnerConflict, match=f"live pid {holder.pid}"):
            alloc.acquire("infer:h:0")  # without a pid: the caller is this process, not the holder
        with pytest.raises(OwnerConflict, match=f"live pid {holder.pid}"):
            alloc.acquire("infer:h:0", pid=os.getpid())
        again = alloc.get("infer:h:0")
        assert again is not None and (again.pid, again.pid_start) == (held.pid, held.pid_start)
        assert alloc.acquire("infer:h:0", pid=holder.pid).cpu == held.cpu  # the holder itself: same CPU
    finally:
        holder.kill()
        holder.wait()
    mine = alloc.acquire("infer:h:0")  # the holder died: the name is free, and recorded with our pid
    assert mine.pid == os.getpid() and mine.pid_start == process_start_time(os.getpid())


def test_a_lease_without_a_pid_in_an_old_table_is_reclaimed(tmp_path: Path) -> None:
    alloc = LeaseAllocator(tiny_plan(), state_dir=tmp_path)
    alloc.acquire("other:manual")
    path = tmp_path / "leases.json"
    data = json.loads(path.read_text())
    data["leases"][0]["pid"] = None  # what the previous version wrote for a pid-less acquire
    path.write_text(json.dumps(data))
    again = LeaseAllocator(tiny_plan(), state_dir=tmp_path)
    assert [(lease.owner, why) for lease, why in again.dropped_on_start] == [
        ("other:manual", "owner is dead")
    ]


def _valid_lease() -> dict[str, Any]:
    return {"owner": "sample:a", "cpu": 1, "node": 0, "l3": 0, "pid": os.getpid(),
            "pid_start": process_start_time(os.getpid()), "actor_id": None, "acquired_at": 1.0,
            "placement": "any"}  # fmt: skip


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"[" * 100_000 + b"]" * 100_000, "nested too deeply"),
        (b'{"leases": [{"owner": "sample:\xff"}]}', "not UTF-8"),
        (json.dumps({"leases": [{**_valid_lease(), "cpu": 3.9}]}).encode(), "cpu=3.9 has the wrong type"),
        (json.dumps({"leases": [{**_valid_lease(), "pid": 1.5}]}).encode(), "pid=1.5 has the wrong type"),
        (json.dumps({"leases": [{**_valid_lease(), "cpu": True}]}).encode(), "cpu=True has the wrong type"),
        (json.dumps({"leases": [{**_valid_lease(), "cpu": "1"}]}).encode(), "cpu='1' has the wrong type"),
        (json.dumps({"leases": [{**_valid_lease(), "pid": 2**31}]}).encode(), "out of range"),
        (json.dumps({"leases": [{**_valid_lease(), "extra": 1}]}).encode(), "unknown \\['extra'\\]"),
        (json.dumps({"leases": [_valid_lease(), _valid_lease()]}).encode(), "appears twice"),
        (json.dumps({"leases": {}}).encode(), "expected an object with a 'leases' list"),
        (json.dumps({"leases": [], "boot_id": 7}).encode(), "boot_id=7"),
        (json.dumps({"leases": [[]]}).encode(), "a lease is an object, got list"),
        (b"{" + b" " * (5 << 20) + b"}", "larger than 4194304 bytes"),
    ],
)
def test_every_malformed_state_file_is_a_lease_state_error_naming_file_and_problem(
    tmp_path: Path, content: bytes, problem: str
) -> None:
    path = tmp_path / "leases.json"
    path.write_bytes(content)
    t0 = time.monotonic()
    with pytest.raises(LeaseStateError, match=f"lease state {path}: .*{problem}"):
        LeaseAllocator(tiny_plan(), state_dir=tmp_path)
    assert time.monotonic() - t0 < 10  # a 30 MB table once took 68 s; the size bound refuses it unread
    assert path.read_bytes() == content  # left for a person


def test_temp_files_of_a_killed_contender_are_removed(tmp_path: Path) -> None:
    stale = tmp_path / ".leases.abc123"
    stale.write_text("{half")
    alloc = LeaseAllocator(tiny_plan(), state_dir=tmp_path)
    alloc.acquire("sample:a")
    assert not stale.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["leases.json", "leases.lock"]


# -- the state directory under a full file system, a stopped lock holder, symlinks, hostile numbers ------


def test_a_full_file_system_is_a_lease_state_error_and_the_table_stays(
    tmpfs: Callable[..., Path],  # noqa: F811 - the shared fixture, by name
) -> None:
    small_tmpfs = tmpfs(size="1m", inodes=64)
    alloc = LeaseAllocator(tiny_plan("1-4"), state_dir=small_tmpfs / "state")
    alloc.acquire("sample:first")
    i = 0
    while True:  # no inode left for the temp file a save writes
        try:
            (small_tmpfs / f"filler-{i}").touch()
        except OSError:
            break
        i += 1
    with pytest.raises(LeaseStateError, match="cannot save"):
        alloc.acquire("sample:second")
    assert [x.owner for x in LeaseAllocator(tiny_plan("1-4"), state_dir=small_tmpfs / "state").leases()] == [
        "sample:first"
    ]


def test_a_stopped_holder_of_the_lock_makes_acquire_fail_in_bounded_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    alloc = LeaseAllocator(tiny_plan("1-4"), state_dir=tmp_path)
    monkeypatch.setattr(lease, "LOCK_TIMEOUT_S", 0.5)
    code = (
        "import fcntl, os, signal, sys; fd = os.open(sys.argv[1], os.O_RDWR); "
        "fcntl.flock(fd, fcntl.LOCK_EX); print('held', flush=True); os.kill(os.getpid(), signal.SIGSTOP)"
    )
    holder = subprocess.Popen(
        [sys.executable, "-c", code, str(tmp_path / lease.LOCK_FILE)], stdout=subprocess.PIPE
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"held\n"
        with pytest.raises(LeaseStateError, match="held by another process"):
            alloc.acquire("sample:s")
    finally:
        holder.kill()
        holder.wait()
    assert alloc.acquire("sample:s").owner == "sample:s"  # the holder gone, the lock is free again


@pytest.mark.parametrize("what", ["dir", "table", "lock"])
def test_a_symlinked_state_dir_table_or_lock_is_refused(tmp_path: Path, what: str) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    state = tmp_path / "state"
    if what == "dir":
        state.symlink_to(elsewhere)
    else:
        state.mkdir()
        target = elsewhere / "x"
        target.write_text('{"leases": []}')
        (state / (lease.STATE_FILE if what == "table" else lease.LOCK_FILE)).symlink_to(target)
    with pytest.raises(LeaseStateError, match="symlink"):
        LeaseAllocator(tiny_plan("1-4"), state_dir=state)


def test_a_huge_integer_in_the_table_is_a_lease_state_error(tmp_path: Path) -> None:
    (tmp_path / lease.STATE_FILE).write_text('{"leases": [{"cpu": ' + "7" * 5000 + "}]}")
    with pytest.raises(LeaseStateError, match="not a table this allocator wrote"):
        LeaseAllocator(tiny_plan("1-4"), state_dir=tmp_path)
