"""``lowtail bench soak``: the runtime under chaos for N minutes, and what must hold through it.

Two heroes, each with ``--replicas`` inference actors (a queue, a pinned OpenVINO worker and its hot
standby each), and ``--clients`` clients per hero (``InferenceClient`` over the hero's replicas, at a
fixed rate, some requests withdrawn), each leaving after 10-30 s and replaced by a new one. After the
baseline windows, every other window gets one fault, in shuffled rounds over ``--faults``: a SIGKILL
of a serving worker, of a standby, of a whole inference actor (then restarted, as Ray would), of a
client, or a vandal client writing garbage into its own lane for 3 s. A window starts *steady* once
every replica has its worker and standby again and no vandal runs; settling windows are not graded.

Asserted (targets, graded from the records every client sends for each request):
- every request answered or failed exactly once: none twice, none lost (a timeout), none without an
  outcome unless its client was killed;
- no answer is another request's (each is checked against the reference outputs of its input);
- no process died but those killed (a worker, an actor, a client);
- no growth of file descriptors (per process alive through the run), of segments or slot files, of
  worker RSS, and no worker process left over;
- each steady window's tail not above the baseline's (``grade_windows`` has the rule): at p99.9 where
  the windows hold 10,000 samples, else at p99 and saying so; worse only when the window's 95 %
  interval lies above the baseline's (nearest-rank order statistics); "not decided", with the reason,
  when the baseline is too small, its own windows disagree, or its clients were starved.

Why processes and not Ray actors: what the soak kills and counts is the queue's, the worker's, the
supervisor's and the client's failure containment. The actor process runs the Ray actor's own class
(``InferenceActorImpl``: supervisor, promotion, endpoint) built without Ray, and clients re-resolve a
restarted actor from a registry directory instead of Ray's names. Ray's own part (restarts, names,
placement) is tested with a real cluster in tests/actors; here Ray's daemons and worker pool would
add processes and file descriptors whose growth is not lowtail's, and seconds of restart latency per
actor kill on a 2-vCPU host.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import multiprocessing
import os
import random
import shutil
import tempfile
import textwrap
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from lowtail.options import (
    add_html,
    add_json,
    add_no_progress,
    add_plot,
    json_to_stdout,
    positive,
    write_json,
)
from lowtail.render import table
from lowtail.shm import native

FAULTS = ("worker", "standby", "actor", "client", "vandal")
HEROES = ("a", "b")
FEATURES = 64
HIDDEN = (128,)
REFERENCE_BATCHES = (1, 2, 3, 4, 5, 6, 7, 8)  # each request is one of these; a mixed-up answer shows
VANDAL_S = 3.0
# A worker is killed while it holds claimed requests when it does within this long (frozen and thawed
# until it does): a kill between batches would leave the WorkerDied path unexercised.
FREEZE_S = 2.0
# A quantile is read only with this many samples above it (a p99.9 from 10,000): fewer is a reading of
# a handful of numbers. The tail is graded at the first of TAIL_QS the baseline windows allow.
TAIL_SAMPLES = 10
TAIL_QS = (("p99.9", 0.999), ("p99", 0.99))
TAIL_TARGET = "each steady window's p99.9 as before the faults (at p99 when windows are too small for it)"
FD_SLACK = 2  # a process may hold a transient fd (a /proc read) when sampled
RSS_SLACK = (4 << 20, 0.05)  # bytes, share: worker RSS growth allowed between a first and last sample
Z95 = 1.96


def register(bench_sub: Any) -> None:
    p = bench_sub.add_parser(
        "soak",
        help="chaos for N minutes: kills, churn, garbage; exactly-once answers, no leaks, steady tails",
    )
    p.add_argument("--minutes", type=positive(float), default=10.0, help="length of the run")
    p.add_argument("--window-s", type=positive(float), default=10.0, help="length of a window")
    p.add_argument("--baseline-windows", type=positive(int), default=4, help="fault-free windows first")
    p.add_argument("--replicas", type=positive(int), default=2, help="inference actors per hero")
    p.add_argument("--clients", type=positive(int), default=3, help="clients per hero at any time")
    p.add_argument("--rate", type=positive(float), default=60.0, help="requests per second per client")
    p.add_argument("--withdraw", type=float, default=0.01, help="share of requests withdrawn at once")
    p.add_argument("--faults", default=",".join(FAULTS), help=f"comma-separated, of {', '.join(FAULTS)}")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--check", action="store_true", help="exit 1 when a target is not met")
    add_json(p, "the full report")
    add_plot(p, "each window's graded tail with the faults marked")
    add_html(p, "a report with the verdict, the targets, the windows and the plot")
    add_no_progress(p)
    p.set_defaults(func=run)


@dataclass
class Options:
    minutes: float = 10.0
    window_s: float = 10.0
    baseline_windows: int = 4
    replicas: int = 2
    clients: int = 3
    rate: float = 60.0
    withdraw: float = 0.01
    faults: tuple[str, ...] = FAULTS
    seed: int = 0


def run(args: argparse.Namespace) -> int:
    from lowtail.errors import UsageError
    from lowtail.render.progress import Progress

    faults = tuple(f.strip() for f in args.faults.split(",") if f.strip())
    bad = [f for f in faults if f not in FAULTS]
    if not faults or bad:
        raise UsageError(f"--faults {args.faults!r}: expected some of {', '.join(FAULTS)}, comma-separated")
    if not 0.0 <= args.withdraw <= 1.0:
        raise UsageError(f"--withdraw {args.withdraw}: expected a share from 0 to 1")
    opts = Options(
        args.minutes,
        args.window_s,
        args.baseline_windows,
        args.replicas,
        args.clients,
        args.rate,
        args.withdraw,
        faults,
        args.seed,
    )
    progress = Progress("soak", opts.minutes * 60, enabled=not args.no_progress)
    report = Soak(opts, progress).run()
    progress.finish(report["verdict"])
    code = 1 if args.check and report["verdict"] != "passed" else 0
    if json_to_stdout(args):
        write_json(args.json, report)
        return code
    print(render(report))
    if args.json:
        write_json(args.json, report)
    if args.plot:
        plot(report, args.plot)
    if args.html:
        write_html(args.html, report)
    return code


# -- the run ------------------------------------------------------------------------------------------------


@dataclass
class Client:
    cid: int
    hero: str
    proc: Any
    fd: int
    vandal: bool = False
    killed: bool = False
    buf: bytearray = field(default_factory=bytearray)
    bye: bool = False
    ended: bool = False  # exited, reaped, its pipe drained
    exitcode: int | None = None

    def alive(self) -> bool:
        return not self.ended and bool(self.proc.is_alive())


@dataclass
class Window:
    index: int
    kind: str  # warm-up, baseline, fault, settle, steady
    start_s: float
    end_s: float = 0.0
    load1: float = 0.0
    latencies_ms: list[float] = field(default_factory=list)  # from the intended send time (graded)
    service_ms: list[float] = field(default_factory=list)  # from the real send: a late client's share out


class Soak:
    def __init__(self, opts: Options, progress: Any) -> None:
        self.o = opts
        self.progress = progress
        self.rng = random.Random(opts.seed)
        self.ctx = multiprocessing.get_context("spawn")
        self.cpus = sorted(os.sched_getaffinity(0))
        self.work = Path(tempfile.mkdtemp(prefix="lt-soak-"))
        self.registry = str(self.work / "registry")
        os.mkdir(self.registry)
        self.actors: dict[str, Any] = {}  # "a.0" -> its process
        self.clients: dict[int, Client] = {}
        self.next_cid = 1
        self.requests: dict[tuple[int, int], list[Any]] = {}  # (cid, seq) -> [intended, [kinds], codes]
        self.windows: list[Window] = []
        self.faults: list[dict[str, Any]] = []
        self.samples: list[dict[str, Any]] = []
        self.killed_pids: set[int] = set()
        self.unexplained: list[str] = []
        self.my_pids: set[int] = {os.getpid()}
        self.worker_pids: set[int] = set()
        self.vandal_counts: list[tuple[int, int]] = []
        self.deaths_seen: dict[str, int] = {}
        self.worker_kills: dict[str, int] = {}
        self.fault_plan: list[str] = []
        self.skipped = 0
        self.interrupted = False
        self.claimed_at_kills = 0
        self.win = Window(-1, "start", 0.0)  # answers before the clock starts: counted, not timed

    # --- set-up ---------------------------------------------------------------------------------------

    def _references(self, xml: Path) -> list[tuple[np.ndarray, dict[str, np.ndarray]]]:
        from lowtail.serve.openvino_core import shared_core

        compiled = shared_core().compile_model(str(xml), "CPU", {"INFERENCE_PRECISION_HINT": "f32"})
        rng = np.random.default_rng(self.o.seed)
        refs = []
        for b in REFERENCE_BATCHES:
            x = rng.standard_normal((b, FEATURES), dtype=np.float32)
            out = compiled({"obs": x})
            refs.append((x, {o.get_any_name(): np.array(v) for o, v in out.items()}))
        return refs

    def _start_actor(self, name: str) -> None:
        from lowtail.benchmarks import soak_roles
        from lowtail.serve.worker_process import WorkerConfig
        from lowtail.shm.queue import QueueConfig

        hero, index = name.split(".")
        # Workers keep the run's nice value and no SCHED_FIFO: the host is shared, and the soak grades
        # tails against its own baseline, not against the isolated ceiling.
        worker = WorkerConfig(name=name, nice=os.nice(0), sched_fifo=False, warm_up=True, max_batch=16)
        queue = QueueConfig(
            lanes=16, slots_per_lane=4, request_bytes=8192, response_bytes=8192, worker_idle_us=200
        )
        cpu = self.cpus[(HEROES.index(hero) * self.o.replicas + int(index)) % len(self.cpus)]
        proc = self.ctx.Process(
            target=soak_roles.actor_main,
            kwargs={
                "hero": hero,
                "index": int(index),
                "cpu": cpu,
                "model_dir": str(self.work / "model"),
                "registry": self.registry,
                "worker": worker,
                "queue": queue,
            },
            name=f"soak-actor-{name}",
            daemon=False,
        )
        proc.start()
        self.actors[name] = proc
        self.my_pids.add(_pid(proc))
        self.deaths_seen[name] = 0

    def _start_client(self, hero: str) -> None:
        from lowtail.benchmarks import soak_roles

        cid = self.next_cid
        self.next_cid += 1
        r, w = self.ctx.Pipe(duplex=False)
        plan = soak_roles.ClientPlan(
            hero,
            cid,
            self.registry,
            self.o.rate,
            self.rng.uniform(10.0, 30.0),
            self.o.withdraw,
            timeout_s=20.0,
            seed=self.rng.randrange(1 << 30),
        )
        names = [f"{hero}.{i}" for i in range(self.o.replicas)]
        proc = self.ctx.Process(
            target=_client_entry, args=(plan, self.refs, w, names), name=f"soak-client-{cid}", daemon=True
        )
        proc.start()
        w.close()
        os.set_blocking(r.fileno(), False)
        self.clients[cid] = Client(cid, hero, proc, os.dup(r.fileno()))
        r.close()
        self.my_pids.add(_pid(proc))

    def _start_vandal(self) -> str:
        from lowtail.benchmarks import soak_roles

        name = self.rng.choice(sorted(self.actors))
        ep = soak_roles.read_endpoint(self.registry, name)
        if ep is None:  # every actor publishes before the soak's first fault
            raise RuntimeError(f"soak: actor {name} has published no endpoint in {self.registry}")
        cid = self.next_cid
        self.next_cid += 1
        r, w = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(
            target=_vandal_entry,
            kwargs={
                "descriptor": ep.descriptor,
                "x": self.refs[0][0],
                "seconds": VANDAL_S,
                "seed": self.rng.randrange(1 << 30),
                "conn": w,
                "cid": cid,
            },
            name=f"soak-vandal-{cid}",
            daemon=True,
        )
        proc.start()
        w.close()
        os.set_blocking(r.fileno(), False)
        self.clients[cid] = Client(cid, name.split(".")[0], proc, os.dup(r.fileno()), vandal=True)
        r.close()
        self.my_pids.add(_pid(proc))
        return name

    def _wait_actors_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while not self._recovered(clients=False):
            for name, proc in self.actors.items():
                if not proc.is_alive():
                    raise RuntimeError(f"soak: actor {name} exited with code {proc.exitcode} while starting")
            if time.monotonic() > deadline:
                raise TimeoutError(f"soak: the inference actors were not ready within {timeout_s:.0f} s")
            time.sleep(0.1)

    def _wait_clients_answered(self, timeout_s: float) -> None:
        """The clock starts once every client has had an answer (spawning one takes seconds here)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self._drain()
            if {cid for cid, _ in self.requests} >= set(self.clients):
                return
            time.sleep(0.1)

    # --- the loop ---------------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        from lowtail.serve.model import ModelSpec, write_model

        load_before = list(os.getloadavg())
        try:
            xml = write_model(self.work / "model", ModelSpec(features=FEATURES, hidden=HIDDEN))
            self.refs = self._references(xml)
            self.progress.phase(0, "starting the inference actors")
            for hero in HEROES:
                for i in range(self.o.replicas):
                    self._start_actor(f"{hero}.{i}")
            self._wait_actors_ready(300.0)
            for hero in HEROES:
                for _ in range(self.o.clients):
                    self._start_client(hero)
            self.progress.phase(0, "starting the clients")
            self._wait_clients_answered(120.0)
            try:
                self._loop()
            except KeyboardInterrupt:
                # Ctrl-C: the report still comes out, says so, and grades nothing as passed.
                self.interrupted = True
                self.win.end_s = time.monotonic()
                self.windows.append(self.win)
        finally:
            left = self._shutdown()
        return self._report(load_before, left)

    def _loop(self) -> None:
        o = self.o
        t0 = time.monotonic()
        end = t0 + o.minutes * 60
        win = self.win = Window(0, "warm-up", t0)
        fault_at: float | None = None
        while True:
            now = time.monotonic()
            self._drain()
            self._churn(end)
            self._watch()
            if fault_at is not None and now >= fault_at:
                self._fault(win)
                fault_at = None
            if now >= win.start_s + o.window_s or now >= end:
                win.end_s, win.load1 = now, os.getloadavg()[0]
                self.windows.append(win)
                if win.kind in ("baseline", "steady"):
                    self._sample(win)
                if now >= end:
                    break
                kind = self._next_kind(win)
                win = self.win = Window(win.index + 1, kind, now)
                if kind == "fault":
                    fault_at = now + self.rng.uniform(0.1, 0.6) * o.window_s
            done = sum(1 for v in self.requests.values() if len(v[1]) > 1)
            self.progress.update(
                now - t0, f"window {win.index} {win.kind}; {done} settled; {len(self.faults)} faults"
            )
            time.sleep(0.05)
        self._drain()

    def _next_kind(self, prev: Window) -> str:
        if prev.index + 1 <= self.o.baseline_windows:
            return "baseline"
        if prev.kind in ("baseline", "steady"):
            return "fault"
        last = self.faults[-1]["at_s"] if self.faults else 0.0
        recent = time.monotonic() - last < 1.0
        return "steady" if self._recovered(clients=True) and not recent else "settle"

    def _recovered(self, clients: bool) -> bool:
        from lowtail.benchmarks import soak_roles

        for name, proc in self.actors.items():
            st = soak_roles.read_status(self.registry, name)
            if (
                not proc.is_alive()
                or st is None
                or st["pid"] != proc.pid
                or not st["worker"]
                or not st["standby"]
            ):
                return False
        if clients:
            live = [c for c in self.clients.values() if c.alive()]
            if any(c.vandal for c in live) or len([c for c in live if not c.vandal]) < 2 * self.o.clients:
                return False
        return True

    # --- records ----------------------------------------------------------------------------------------

    def _drain(self) -> None:
        from lowtail.benchmarks.soak_roles import ANSWERED, BYE, REC, SENT

        for c in self.clients.values():
            if c.fd < 0:
                continue
            while True:
                try:
                    chunk = os.read(c.fd, 65536)
                except BlockingIOError:
                    break
                if not chunk:
                    os.close(c.fd)
                    c.fd = -1
                    break
                c.buf += chunk
            whole = len(c.buf) - len(c.buf) % REC.size
            for cid, seq, kind, code, t0, t1 in REC.iter_unpack(bytes(c.buf[:whole])):
                if kind == BYE:
                    c.bye = True
                    if not c.vandal:
                        self.skipped += int(t0)
                    if c.vandal:
                        self.vandal_counts.append((seq, code))
                    continue
                if kind == SENT:
                    self.requests[(cid, seq)] = [t0, [SENT], [], t1]
                    continue
                entry = self.requests.setdefault((cid, seq), [t0, [], [], t0])
                entry[1].append(kind)
                entry[2].append(code)
                if kind == ANSWERED:
                    w = self._window_for(t1)
                    w.latencies_ms.append(1e3 * (t1 - t0))
                    w.service_ms.append(1e3 * (t1 - entry[3]))
            del c.buf[:whole]

    def _window_for(self, t: float) -> Window:
        # Answers arrive within ~0.1 s of their time: the current window, or the one just closed.
        current = self.win
        if t >= current.start_s or not self.windows:
            return current
        for w in reversed(self.windows):
            if w.start_s <= t:
                return w
        return self.windows[0]

    # --- churn, faults, watching -------------------------------------------------------------------------

    def _churn(self, end: float) -> None:
        live = {h: 0 for h in HEROES}
        for c in list(self.clients.values()):
            if c.ended:
                continue
            if c.proc.is_alive():
                if not c.vandal:
                    live[c.hero] += 1
                continue
            if c.fd >= 0:
                continue  # its last records are still in the pipe
            c.proc.join(1)
            c.exitcode = c.proc.exitcode
            if c.exitcode != 0 and not c.killed:
                self.unexplained.append(f"client {c.cid} exited with code {c.exitcode}")
            c.proc.close()  # its sentinel fd: a soak that kept them would grow its own fds
            c.ended = True
        for hero in HEROES:
            for _ in range(self.o.clients - live[hero]):
                if time.monotonic() < end - 1.0:
                    self._start_client(hero)

    def _watch(self) -> None:
        """Actors that died unkilled; worker deaths beyond the soak's kills (the actor counts them)."""
        from lowtail.benchmarks import soak_roles

        for name, proc in list(self.actors.items()):
            if not proc.is_alive():
                if int(proc.pid) not in self.killed_pids:
                    self.unexplained.append(f"actor {name} pid {proc.pid} exited with code {proc.exitcode}")
                proc.join(5)
                proc.close()  # its sentinel fd
                self._start_actor(name)
                continue
            st = soak_roles.read_status(self.registry, name)
            if st is None or st["pid"] != proc.pid:
                continue
            for key in ("worker", "standby"):
                if st[key]:
                    self.worker_pids.add(int(st[key]))
            if st["deaths"] > self.deaths_seen[name]:
                extra = st["deaths"] - self.deaths_seen[name] - self.worker_kills.get(name, 0)
                if extra > 0:
                    self.unexplained.append(f"actor {name}: {extra} worker death(s) the soak did not cause")
                self.deaths_seen[name] = st["deaths"]
                self.worker_kills[name] = 0
            if st["failed"]:
                self.unexplained.append(f"actor {name} gave up: {st['failed']}")

    def _fault(self, win: Window) -> None:
        from lowtail.benchmarks import soak_roles

        if not self.fault_plan:
            self.fault_plan = list(self.o.faults)
            self.rng.shuffle(self.fault_plan)
        kind = self.fault_plan.pop()
        at = time.monotonic()
        target = ""
        if kind in ("worker", "standby", "actor"):
            name = self.rng.choice(sorted(self.actors))
            st = soak_roles.read_status(self.registry, name) or {}
            target = name
            if kind == "actor":
                pids = [self.actors[name].pid, st.get("worker"), st.get("standby")]
                self.killed_pids.update(int(p) for p in pids if p)
                soak_roles.kill_quietly(int(self.actors[name].pid))
                self.actors[name].join(10)
                # The actor's workers see their parent gone and exit (the worker's parent check).
            else:
                pid = st.get(kind)
                if pid:
                    self.killed_pids.add(int(pid))
                    # The actor's supervisor counts deaths of the serving worker (the standby's too when
                    # it was serving): only the serving worker's death is the soak's to count.
                    if kind == "worker":
                        self.worker_kills[name] = self.worker_kills.get(name, 0) + 1
                        ep = soak_roles.read_endpoint(self.registry, name)
                        claimed = (
                            0
                            if ep is None
                            else soak_roles.freeze_holding_requests(int(pid), ep.descriptor, FREEZE_S)
                        )
                        target += f" ({claimed} claimed)"
                        self.claimed_at_kills += claimed
                    soak_roles.kill_quietly(int(pid))
                else:
                    target += f" (no {kind} to kill)"
        elif kind == "client":
            live = [c for c in self.clients.values() if c.alive() and not c.vandal]
            if live:
                c = self.rng.choice(live)
                c.killed = True
                self.killed_pids.add(int(c.proc.pid))
                soak_roles.kill_quietly(int(c.proc.pid))
                target = f"client {c.cid}"
        else:
            target = self._start_vandal()
        self.faults.append({"kind": kind, "target": target, "at_s": at, "window": win.index})

    # --- resources --------------------------------------------------------------------------------------

    def _sample(self, win: Window) -> None:
        import psutil

        from lowtail.shm.segments import list_segments

        mine = [s for s in list_segments() if s.pid in self.my_pids]
        procs: dict[str, dict[str, Any]] = {}
        pids = {("driver", os.getpid())} | {("actor", int(p.pid)) for p in self.actors.values()}
        pids |= {("worker", p) for p in self.worker_pids}
        live_workers = 0
        for role, pid in pids:
            try:
                p = psutil.Process(pid)
                if p.status() == psutil.STATUS_ZOMBIE:
                    continue
                fds, rss = p.num_fds(), p.memory_info().rss
            except psutil.NoSuchProcess:
                continue
            live_workers += role == "worker"
            procs[str(pid)] = {"role": role, "fds": fds, "rss": rss}
        self.samples.append(
            {
                "window": win.index,
                "at_s": time.monotonic(),
                "queues": sum(1 for s in mine if s.kind == "q" and s.liveness == "alive"),
                "queues_of_dead": sum(1 for s in mine if s.kind == "q" and s.liveness != "alive"),
                "slot_files": sum(1 for s in mine if s.kind == "nd"),
                "worker_processes": live_workers,
                "processes": procs,
            }
        )

    # --- the end ------------------------------------------------------------------------------------------

    def _shutdown(self) -> dict[str, Any]:
        """Clients leave, actors stop (workers, queues); whatever remains is killed and reported."""
        import psutil

        from lowtail.benchmarks import soak_roles
        from lowtail.shm.segments import SHM_DIR, list_segments, unlink_segment

        with contextlib.suppress(OSError):
            (Path(self.registry) / soak_roles.STOP_FILE).touch()
        deadline = time.monotonic() + 30
        while any(c.alive() for c in self.clients.values()) and time.monotonic() < deadline:
            self._drain()
            time.sleep(0.05)
        self._drain()
        stuck_clients = [c.cid for c in self.clients.values() if c.alive()]
        for c in self.clients.values():
            if c.alive():
                c.killed = True
                c.proc.kill()
            if not c.ended:
                c.proc.join(5)
            if c.fd >= 0:
                os.close(c.fd)
                c.fd = -1
        for proc in self.actors.values():
            if proc.is_alive():
                proc.terminate()
        for proc in self.actors.values():
            proc.join(30)
            if proc.is_alive():
                proc.kill()
                proc.join(5)
        time.sleep(0.5)  # a killed actor's orphaned workers see their parent gone within a claim timeout
        left_workers = [p for p in self.worker_pids if psutil.pid_exists(p)]
        for p in left_workers:
            soak_roles.kill_quietly(p)
        left_segments = [s.name for s in list_segments() if s.pid in self.my_pids]
        for name in left_segments:
            unlink_segment(SHM_DIR, name)
        shutil.rmtree(self.work, ignore_errors=True)
        return {"clients": stuck_clients, "worker_processes": left_workers, "segments": left_segments}

    def _report(self, load_before: list[float], left: dict[str, Any]) -> dict[str, Any]:
        return build_report(self, load_before, left)


def _pid(proc: Any) -> int:
    pid = proc.pid
    if pid is None:
        raise RuntimeError(f"{proc.name}: not started")
    return int(pid)


def _client_entry(plan: Any, refs: Any, conn: Any, names: list[str]) -> None:
    from lowtail.benchmarks.soak_roles import client_main

    client_main(plan, refs, conn.fileno(), names)


def _vandal_entry(conn: Any, **kwargs: Any) -> None:
    from lowtail.benchmarks.soak_roles import vandal_main

    vandal_main(fd=conn.fileno(), **kwargs)


# -- grading --------------------------------------------------------------------------------------------


def quantile_interval(sorted_ms: np.ndarray, q: float = 0.999) -> tuple[float, float, float]:
    """The nearest-rank q-quantile and its distribution-free ~95 % interval (order statistics, normal
    approximation of the binomial rank); the upper end is inf when the sample is too small to bound it."""
    from lowtail.telemetry.percentiles import quantile

    n = len(sorted_ms)
    if n == 0:
        return math.nan, math.nan, math.nan
    half = Z95 * math.sqrt(n * q * (1 - q))
    lo = max(1, math.floor(n * q - half))
    hi = math.ceil(n * q + half)
    upper = float(sorted_ms[hi - 1]) if hi <= n else math.inf
    return quantile(sorted_ms, q), float(sorted_ms[lo - 1]), upper


def min_samples(q: float) -> int:
    """The fewest samples a q-quantile is read from: TAIL_SAMPLES of them above it (10,000 for a p99.9)."""
    return round(TAIL_SAMPLES / (1 - q))


def summarize_window(w: Window, faults: list[dict[str, Any]]) -> dict[str, Any]:
    from lowtail.telemetry.percentiles import quantile

    lat = np.sort(np.asarray(w.latencies_ms, dtype=np.float64))
    svc = np.sort(np.asarray(w.service_ms, dtype=np.float64))
    tails = {name: list(quantile_interval(lat, q)) for name, q in TAIL_QS}
    return {
        "index": w.index,
        "kind": w.kind,
        "start_s": w.start_s,
        "end_s": w.end_s,
        "load1": w.load1,
        "n": int(lat.size),
        "p50_ms": quantile(lat, 0.5) if lat.size else math.nan,
        "p99_ms": tails["p99"][0],
        "p999_ms": tails["p99.9"][0],
        "p999_interval_ms": tails["p99.9"][1:],
        "tails_ms": tails,  # per percentile: [value, the lower and upper end of its ~95 % interval]
        "max_ms": float(lat[-1]) if lat.size else math.nan,
        "faults": [f["kind"] for f in faults if f["window"] == w.index],
        "from_send_p50_ms": quantile(svc, 0.5) if svc.size else math.nan,
        "from_send_p999_ms": quantile(svc, 0.999) if svc.size else math.nan,
    }


def _span(xs: list[float], fmt: str = "{:,.0f}") -> str:
    lo, hi = min(xs), max(xs)
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}"


def grade_windows(windows: list[dict[str, Any]], baseline_ms: np.ndarray) -> dict[str, Any]:
    """Each steady window's tail against the baseline's: the verdict (met True/False, or None: not
    decided), the percentile graded, the figure, why it is not decided, and the bound a window is held to.

    The rule, each step able to end in "not decided" with its reason:
    1. A q-quantile is read only from >= TAIL_SAMPLES samples above it (p99.9 from 10,000, p99 from
       1,000). The grade is at p99.9 when at least two baseline windows hold that many, else at p99,
       and it says so: a window of 3,400 samples has 3 above its p99.9, a reading of three numbers.
    2. The baseline is the host's noise without faults: its windows must agree with each other at that
       percentile (their ~95 % intervals overlap). Where two of them do not, the host moved more than
       sampling explains before any fault, and no later difference could be laid on the faults.
    3. A baseline whose upper bound reaches BEHIND_S measured starved clients (a client that late skips
       sends): nothing could be shown above it, so a "met" would be vacuous.
    4. Steady windows with enough samples for the percentile are graded: one is above the baseline
       only when its interval lies wholly above the pooled baseline's (its lower end past the upper).
    """
    out: dict[str, Any] = {"met": None, "percentile": None, "bound_ms": None, "figure": "-", "why": ""}
    base_w = [w for w in windows if w["kind"] == "baseline"]
    ns = [w["n"] for w in base_w] or [0]
    name, q = next(((nm, q) for nm, q in TAIL_QS if sum(n >= min_samples(q) for n in ns) >= 2), ("", 0.0))
    if not name:
        out["why"] = (
            f"the baseline's {len(base_w)} windows have n {_span(ns)}: fewer than two with the "
            f"{min_samples(TAIL_QS[-1][1]):,} samples a {TAIL_QS[-1][0]} needs, so neither its tail nor its "
            "spread can be read"
        )
        return out
    b, _, b_hi = quantile_interval(np.sort(baseline_ms), q)
    read = [w for w in base_w if w["n"] >= min_samples(q)]
    vals = [w["tails_ms"][name][0] for w in read]
    out.update(
        percentile=name, baseline={"n": int(baseline_ms.size), name: b, "upper_ms": b_hi, "windows": vals}
    )
    spread = f"its {len(read)} windows {_span(vals, '{:,.2f}')} ms"
    head = f"baseline {name} {b:,.2f} ms (upper bound {b_hi:,.2f}; {spread})"
    why = _baseline_doubt(read, name, b_hi)
    if why:
        return {**out, "figure": f"{head} from n {baseline_ms.size:,}", "why": why}
    return {**out, "bound_ms": b_hi, **_grade_steady(windows, name, q, b_hi, head)}


def _baseline_doubt(read: list[dict[str, Any]], name: str, b_hi: float) -> str:
    """Why the baseline cannot be the reference (steps 2 and 3 of ``grade_windows``), or ''."""
    from lowtail.benchmarks.soak_roles import BEHIND_S

    high = max(read, key=lambda w: w["tails_ms"][name][1])
    low = min(read, key=lambda w: w["tails_ms"][name][2])
    if high["tails_ms"][name][1] > low["tails_ms"][name][2]:
        return (
            f"the baseline's own windows disagree at {name}: #{high['index']} is at least "
            f"{high['tails_ms'][name][1]:,.2f} ms, #{low['index']} at most {low['tails_ms'][name][2]:,.2f} "
            "ms (their intervals do not overlap): the host moved more than sampling explains before any fault"
        )
    if b_hi >= 1e3 * BEHIND_S:
        return (
            f"the baseline's {name} upper bound {b_hi:,.0f} ms reaches the {BEHIND_S:.0f} s after which a "
            "late client skips sends: its clients were starved, and no window could be shown above it"
        )
    return ""


def _grade_steady(
    windows: list[dict[str, Any]], name: str, q: float, b_hi: float, head: str
) -> dict[str, Any]:
    """Step 4 of ``grade_windows``: met, figure and why, from the steady windows large enough to read."""
    need = min_samples(q)
    steady = [w for w in windows if w["kind"] == "steady"]
    graded = [w for w in steady if w["n"] >= need]
    if not graded:
        sn = [w["n"] for w in steady] or [0]
        why = f"no steady window with the {need:,} samples a {name} needs ({len(steady)}, n {_span(sn)})"
        return {"met": None, "figure": head, "why": why}
    worse = [w for w in graded if w["tails_ms"][name][1] > b_hi]
    top = min_samples(TAIL_QS[0][1])
    lower = f" (not {TAIL_QS[0][0]}: it needs n >= {top:,} per window)" if q != TAIL_QS[0][1] else ""
    named = ", ".join(f"#{w['index']} {w['tails_ms'][name][0]:,.2f} ms" for w in worse)
    figure = (
        f"graded at {name}{lower}: {head}; {len(graded)} of {len(steady)} steady windows graded, "
        f"{len(worse)} above it" + (f" ({named})" if worse else "")
    )
    return {"met": not worse, "figure": figure, "why": ""}


@dataclass
class _Tally:
    """How the requests of the well-behaved clients ended (a vandal's are its own)."""

    outcomes: Counter[str] = field(default_factory=Counter)
    errors: Counter[str] = field(default_factory=Counter)
    twice: int = 0
    no_outcome: int = 0
    cut: int = 0  # no outcome because its client was killed with it in flight
    unsent: int = 0  # an outcome of a request never recorded as sent: cannot happen in order


def _tally(s: Soak) -> _Tally:
    from lowtail.benchmarks.soak_roles import ERRORS, FAILED, KIND_NAMES, SENT

    vandals = {c.cid for c in s.clients.values() if c.vandal}
    killed = {c.cid for c in s.clients.values() if c.killed}
    t = _Tally()
    for (cid, _seq), (_t0, kinds, codes, _sent) in s.requests.items():
        if cid in vandals:
            continue
        if not kinds or kinds[0] != SENT:
            t.unsent += 1
        ends = [k for k in kinds if k != SENT]
        if len(ends) > 1:
            t.twice += 1
        if not ends:
            if cid in killed:
                t.cut += 1
            else:
                t.no_outcome += 1
            continue
        t.outcomes[KIND_NAMES[ends[0]]] += 1
        for k, code in zip(ends, codes, strict=True):
            if k == FAILED:
                t.errors[ERRORS[code]] += 1
    return t


def _targets(
    s: Soak, t: _Tally, windows: list[dict[str, Any]], baseline: np.ndarray, left: dict[str, Any]
) -> list[dict[str, Any]]:
    from lowtail.benchmarks.soak_roles import KIND_NAMES, LOST, WRONG

    targets: list[dict[str, Any]] = []

    def target(name: str, met: bool | None, figure: str, why: str = "") -> None:
        targets.append({"target": name, "met": met, "figure": figure, "why": why})

    lost = t.outcomes[KIND_NAMES[LOST]] + t.no_outcome
    target(
        "every request answered or failed exactly once: none twice, none lost",
        t.twice == 0 and lost == 0 and t.unsent == 0,
        f"{sum(t.outcomes.values())} settled, {t.twice} twice, {lost} lost ({t.no_outcome} without an "
        f"outcome), {t.cut} cut by their client's kill",
    )
    target(
        "no answer is another request's",
        t.outcomes[KIND_NAMES[WRONG]] == 0,
        f"{t.outcomes[KIND_NAMES[WRONG]]} wrong",
    )
    target(
        "no process died but those the soak killed",
        not s.unexplained,
        "; ".join(s.unexplained[:5]) + (f" (+{len(s.unexplained) - 5})" if len(s.unexplained) > 5 else "")
        or "none",
    )
    resources = grade_resources(s.samples, 2 * len(s.actors), len(s.actors))
    for name, (met, figure, why) in resources.items():
        target(name, met, figure, why)
    target(
        "nothing left behind after the run",
        not any(left.values()),
        ", ".join(f"{k}: {v}" for k, v in left.items() if v) or "nothing",
    )
    tails = grade_windows(windows, baseline)
    target(TAIL_TARGET, tails["met"], tails["figure"], tails["why"])
    return targets


def build_report(s: Soak, load_before: list[float], left: dict[str, Any]) -> dict[str, Any]:
    from lowtail.benchmarks.report import json_safe

    t = _tally(s)
    windows = [summarize_window(w, s.faults) for w in s.windows]
    baseline = np.asarray([x for w in s.windows if w.kind == "baseline" for x in w.latencies_ms])
    t0 = s.windows[0].start_s if s.windows else 0.0
    for w in windows:
        w["start_s"] -= t0
        w["end_s"] -= t0
    faults = [dict(f, at_s=f["at_s"] - t0) for f in s.faults]
    targets = _targets(s, t, windows, baseline, left)
    verdict = "failed" if any(x["met"] is False for x in targets) else "passed"
    if s.interrupted:
        verdict = "interrupted"
    doc: dict[str, Any] = json_safe(
        {
            "verdict": verdict,
            "steady_tails": grade_windows(windows, baseline),
            "targets": targets,
            "outcomes": dict(t.outcomes),
            "errors": dict(t.errors),
            "cut_by_client_kill": t.cut,
            "claimed_by_killed_workers": s.claimed_at_kills,
            "sends_skipped_by_late_clients": s.skipped,
            "vandal_clients": [{"answered": a, "refused_or_failed": r} for a, r in s.vandal_counts],
            "windows": windows,
            "faults": faults,
            "resources": s.samples,
            "settings": dict(
                s.o.__dict__, faults=list(s.o.faults), cpus=s.cpus, features=FEATURES, hidden=list(HIDDEN)
            ),
            "host": {"load_before": load_before, "load_after": list(os.getloadavg()), "cpus": os.cpu_count()},
            **path_in_use(),
            "interrupted": s.interrupted,
        }
    )
    return doc


def path_in_use() -> dict[str, Any]:
    """The queue path this process attaches with (and every process it spawns, which inherit its
    environment): the native core, or the Python path and why."""
    impl = native.implementation()
    return {"path": impl.name, "queue_core": impl.to_dict()}


def grade_resources(
    samples: list[dict[str, Any]], workers: int, queues: int
) -> dict[str, tuple[bool | None, str, str]]:
    """Growth between each process's first and last sample (baseline and steady windows only)."""
    out: dict[str, tuple[bool | None, str, str]] = {}
    if len(samples) < 2:
        why = f"{len(samples)} resource samples: need two (a baseline and a steady window)"
        for name in ("file descriptors", "segments and slot files", "worker RSS", "worker processes"):
            out[f"no growth of {name}"] = (None, "-", why)
        return out
    first: dict[str, dict[str, Any]] = {}
    last: dict[str, dict[str, Any]] = {}
    for smp in samples:
        for pid, p in smp["processes"].items():
            first.setdefault(pid, p)
            last[pid] = p
    fd_growth = {pid: last[pid]["fds"] - first[pid]["fds"] for pid in first if first[pid] is not last[pid]}
    worst = max(fd_growth.items(), key=lambda kv: kv[1], default=("-", 0))
    out["no growth of file descriptors"] = (
        worst[1] <= FD_SLACK,
        f"largest growth {worst[1]} (pid {worst[0]}, {first.get(worst[0], {}).get('role', '-')}) over "
        f"{len(fd_growth)} processes sampled twice or more",
        "",
    )
    seg_ok = all(x["queues"] == queues for x in samples) and samples[-1]["queues_of_dead"] == 0
    seg_ok = seg_ok and samples[-1]["slot_files"] <= samples[0]["slot_files"]
    out["no growth of segments and slot files"] = (
        seg_ok,
        f"live queues {sorted({x['queues'] for x in samples})} (expected {queues}); queues of dead actors at "
        f"the end {samples[-1]['queues_of_dead']}; slot files {samples[0]['slot_files']} -> "
        f"{samples[-1]['slot_files']}",
        "",
    )
    rss = {
        pid: (first[pid]["rss"], last[pid]["rss"])
        for pid in first
        if first[pid]["role"] == "worker" and first[pid] is not last[pid]
    }
    over = {pid: b - a for pid, (a, b) in rss.items() if b - a > RSS_SLACK[0] + RSS_SLACK[1] * a}
    growth = max((b - a for a, b in rss.values()), default=0)
    out["no growth of worker RSS"] = (
        (not over) if rss else None,
        f"largest growth {growth / 2**20:.1f} MiB over {len(rss)} workers sampled twice or more"
        + (f"; above {RSS_SLACK[0] >> 20} MiB + {RSS_SLACK[1]:.0%}: {len(over)}" if over else ""),
        "" if rss else "no worker lived through two samples",
    )
    counts = sorted({x["worker_processes"] for x in samples})
    out["no worker process left over"] = (
        counts == [workers],
        f"live workers and standbys {counts} (expected {workers})",
        "",
    )
    return out


# -- output ---------------------------------------------------------------------------------------------


def headline(report: dict[str, Any]) -> str:
    """The report's first line: the run's verdict, the hard targets, and the steady windows' tails with
    the percentile they were graded at or why they were not decided."""
    from lowtail.benchmarks.report import verdict

    hard = [t for t in report["targets"] if t["target"] != TAIL_TARGET]
    missed = [t["target"] for t in hard if t["met"] is False]
    tails = next((t for t in report["targets"] if t["target"] == TAIL_TARGET), None)
    tail = "-" if tails is None else verdict(tails)
    pct = (report.get("steady_tails") or {}).get("percentile")
    at = f" at {pct}" if pct and tails and tails["met"] is not None else ""
    return (
        f"soak: {report['verdict'].upper()}; hard targets "
        + (
            f"NOT MET: {'; '.join(missed)}"
            if missed
            else f"{sum(t['met'] is True for t in hard)} of {len(hard)} met"
        )
        + f"; steady windows' tails{at}: {tail}"
    )


def _window_rows(report: dict[str, Any]) -> tuple[list[str], list[list[Any]]]:
    head = [
        "#",
        "kind",
        "faults",
        "n",
        "p50 ms",
        "p99 ms",
        "p99.9 ms",
        "max ms",
        "from send p50/p99.9",
        "load",
    ]
    rows = [
        [
            w["index"],
            w["kind"],
            ",".join(w["faults"]) or "-",
            w["n"],
            _ms(w["p50_ms"]),
            _ms(w["p99_ms"]),
            _ms(w["p999_ms"]),
            _ms(w["max_ms"]),
            f"{_ms(w['from_send_p50_ms'])}/{_ms(w['from_send_p999_ms'])}",
            f"{w['load1']:.1f}",
        ]
        for w in report["windows"]
    ]
    return head, rows


WINDOWS_TITLE = "Windows: round trip from the intended send time (graded), and from the real send"


def render(report: dict[str, Any]) -> str:
    from lowtail.benchmarks.report import verdict

    rows = [[verdict(t), t["target"], t["figure"]] for t in report["targets"]]
    out = [headline(report), table.render(["verdict", "target", "measured"], rows, title="Targets")]
    out.append(table.render(*_window_rows(report), title=WINDOWS_TITLE))
    out.append(
        "outcomes "
        + ", ".join(f"{k} {v}" for k, v in sorted(report["outcomes"].items()))
        + (f"; failed by class {report['errors']}" if report["errors"] else "")
        + f"; cut by a client kill {report['cut_by_client_kill']}"
        + f"; claimed by the workers killed {report['claimed_by_killed_workers']}"
        + f"; sends skipped by clients > 1 s late {report['sends_skipped_by_late_clients']}"
    )
    h = report["host"]
    out.append(
        f"load average before {' '.join(f'{x:.2f}' for x in h['load_before'])}, after "
        f"{' '.join(f'{x:.2f}' for x in h['load_after'])} on {h['cpus']} CPUs; path {report['path']}"
    )
    return "\n\n".join(out)


def _ms(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f}"


def plot_png(report: dict[str, Any]) -> bytes:
    """Each window's tail at the graded percentile (p99.9 when nothing was graded), hollow where the
    window has too few samples to read it, the bound a steady window is held to, the faults marked; the
    headline (verdict first) as the title."""
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tails = report.get("steady_tails") or {}
    name = tails.get("percentile") or "p99.9"
    need = min_samples(dict(TAIL_QS)[name])
    fig, ax = plt.subplots(figsize=(10, 4.8))
    _plot_windows(ax, report["windows"], name, need)
    if tails.get("bound_ms") is not None:
        ax.axhline(tails["bound_ms"], color="tab:blue", lw=0.8, ls="--", label=f"baseline {name} upper bound")
    sent = [w for w in report["windows"] if w.get("from_send_p999_ms") is not None]
    if sent:
        ax.scatter(
            [(w["start_s"] + w["end_s"]) / 2 for w in sent],
            [w["from_send_p999_ms"] for w in sent],
            s=10,
            marker="x",
            color="black",
            label="p99.9 from the real send",
        )
    for f in report["faults"]:
        ax.axvline(f["at_s"], color="grey", lw=0.6, ls=":")
        ax.annotate(
            f["kind"], (f["at_s"], 1.0), xycoords=("data", "axes fraction"), fontsize=6, rotation=90, va="top"
        )
    ax.set_yscale("log")
    ax.set_xlabel("time (s)")
    ax.set_ylabel(f"{name} round trip per window (ms; hollow: n < {need:,})")
    title = f"lowtail bench soak ({report['path']} path): {headline(report).removeprefix('soak: ')}"
    ax.set_title("\n".join(textwrap.wrap(title, 120)), fontsize=8, loc="left")  # the headline has the why
    ax.legend(fontsize=7)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


KIND_COLORS = {
    "warm-up": "lightgrey",
    "baseline": "tab:blue",
    "fault": "tab:red",
    "settle": "tab:orange",
    "steady": "tab:green",
}


def _plot_windows(ax: Any, windows: list[dict[str, Any]], name: str, need: int) -> None:
    """Each window's tail at ``name``, coloured by its kind, hollow where n < ``need``."""
    for kind, color in KIND_COLORS.items():
        ws = [w for w in windows if w["kind"] == kind and w["tails_ms"][name][0] is not None]
        for enough in (True, False):
            sel = [w for w in ws if (w["n"] >= need) == enough]
            if sel:
                ax.scatter(
                    [(w["start_s"] + w["end_s"]) / 2 for w in sel],
                    [w["tails_ms"][name][0] for w in sel],
                    s=24,
                    color=color if enough else "none",
                    edgecolors=color,
                    label=kind if enough or not any(w["n"] >= need for w in ws) else None,
                )


def plot(report: dict[str, Any], path: str) -> None:
    Path(path).write_bytes(plot_png(report))


def write_html(path: str, report: dict[str, Any]) -> None:
    """The report page as the other benches write it: the verdict first, the targets, the windows, the
    plot, the settings and host, the JSON folded."""
    from lowtail.benchmarks.report import targets_table, write_bench_html
    from lowtail.render import html

    sections = [
        html.Section("Verdict", text=headline(report)),
        targets_table(report["targets"]),
        html.Section(WINDOWS_TITLE, table=html.Table(*_window_rows(report))),
        html.Section("Plot", images=[html.Image("tails per window, faults marked", plot_png(report))]),
    ]
    write_bench_html(path, "lowtail bench soak", report, sections)
