"""``lowtail bench lanes`` and ``lowtail bench ndslot``: how the queue's costs grow with the work.

``lanes``: a queue with 1, 16, 64 or 256 attached lanes of which 1-4 are active. The idle lanes are real
clients (attached in this process, each having sent one request, so the worker knows their lanes and
polls their doorbells), the active ones are closed-loop sampler processes sending one 1 x 64 float32
observation per request. A pinned echo worker (the queue without OpenVINO) answers. Reported: the
samplers' round trip p50/p99/p99.9 with n, and the worker's claim cost per batch (the poll that took the
first request -> claim() returned: ``Batch.claimed_ns``). Target: idle lanes do not cost the active ones
(flat within noise across the lane counts).

``ndslot``: requests of 64 KiB to 64 MiB (one float32 row) go through ndarray slots (the request slot is
too small for them); the worker copies each into a preallocated buffer, as the engine does, and answers
one number. Throughput in GB/s per request against the floor: one numpy copy of the same size in one
process (a plain memcpy). The request's throughput is given at its median and at its 10th percentile
(the fastest decile: on a loaded host the median can be mostly scheduling delay).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import math
import multiprocessing
import os
import sys
import time
import traceback
from collections.abc import Iterator
from typing import Any

import numpy as np

from lowtail.benchmarks.report import json_safe, write_bench_html
from lowtail.errors import UsageError
from lowtail.options import (
    add_html,
    add_json,
    add_no_progress,
    add_plot,
    json_to_stdout,
    positive,
    write_json,
    write_text,
)
from lowtail.render import table
from lowtail.render.progress import Progress
from lowtail.render.schema import stamp
from lowtail.serve import call_stats as metrics
from lowtail.serve.pinning import pin_thread_to_cpu, raise_priority, set_timer_slack_ns, start_pinned

log = logging.getLogger(__name__)
LANES = (1, 16, 64, 256)
ACTIVE = (1, 2, 3, 4)
ND_SIZES_KIB = (64, 256, 1024, 4096, 16384, 65536)
OBS = 64  # floats per lanes-benchmark request


def register(bench_sub: Any) -> None:
    p = bench_sub.add_parser("lanes", help="claim cost and round trip with 1-256 attached lanes, 1-4 active")
    _common(p, default_duration=2.0)
    p.add_argument("--lanes", default=",".join(map(str, LANES)), help="attached lane counts")
    p.add_argument("--active", default=",".join(map(str, ACTIVE)), help="active sampler counts")
    p.set_defaults(func=run_lanes)
    q = bench_sub.add_parser("ndslot", help="ndarray-slot requests 64 KiB-64 MiB in GB/s vs a numpy copy")
    _common(q, default_duration=1.0)
    q.add_argument("--sizes-kib", default=",".join(map(str, ND_SIZES_KIB)), help="request sizes in KiB")
    q.set_defaults(func=run_ndslot)


def _common(p: argparse.ArgumentParser, default_duration: float) -> None:
    # The CLI convention (lowtail.options): --json FILE or '-', --plot, --seconds (old names: aliases).
    add_json(p, "the full report (always, even on errors)")
    add_plot(p, "the results", old="--png", dest="png")
    add_html(p, "a report with the table, the plot, the settings and the host")
    p.add_argument(
        "--seconds",
        "--duration",
        dest="duration",
        type=positive(float),
        default=default_duration,
        help="seconds per configuration",
    )
    add_no_progress(p)
    p.add_argument("--cpu", type=int, help="CPU of the echo worker (default: the highest CPU allowed)")


def _ints(flag: str, text: str, lo: int, hi: int) -> list[int]:
    try:
        vals = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} {text!r}: expected comma-separated integers") from None
    if not vals or any(not lo <= v <= hi for v in vals):
        raise UsageError(f"{flag} {text!r}: expected integers in {lo}..{hi}")
    return vals


def _cpus(args: argparse.Namespace) -> tuple[int, frozenset[int]]:
    allowed = os.sched_getaffinity(0)
    cpu = max(allowed) if args.cpu is None else args.cpu
    if cpu not in allowed:
        raise UsageError(f"--cpu {cpu}: expected one of the CPUs this process may use, {sorted(allowed)}")
    return cpu, frozenset(allowed - {cpu} or allowed)


# ---- the echo worker (a child process pinned to its CPU) --------------------------------------------


def _echo_server(*, desc: Any, cpu: int, copy_bytes: int, stop: Any, conn: Any) -> None:
    """Answer every request until ``stop`` is set; report claim costs per batch and copy-in times (ns)."""
    from lowtail.shm.payload import NdarraySegment
    from lowtail.shm.queue import QueueWorker

    pin_thread_to_cpu(cpu)
    raise_priority(-20)
    set_timer_slack_ns(1)
    buf = np.empty(max(1, copy_bytes // 4), dtype=np.float32)  # the engine's bound input buffer
    buf.fill(0)  # first touch here, not in the first measured request
    claim_ns: list[int] = []
    copy_ns: list[int] = []
    mono = time.monotonic_ns
    with QueueWorker.attach(desc) as w:
        conn.send("ready")
        while not stop.is_set():
            batch = w.claim(timeout_s=0.05)
            if batch is None:
                continue
            with batch:
                t = mono()
                claim_ns.append(t - batch.claimed_ns)
                x = next(iter(batch.inputs.values()))
                if copy_bytes:
                    np.copyto(buf[: x.size], x.reshape(-1))  # read every byte, as the engine's copy-in does
                    copy_ns.append(mono() - t)
                batch.complete({"y": x[:, :1].copy()})
    conn.send({"claim_ns": claim_ns, "copy_ns": copy_ns, "attached": NdarraySegment.attached})
    conn.close()


class _EchoWorker:
    def __init__(self, desc: Any, cpu: int, copy_bytes: int = 0) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._stop = ctx.Event()
        self._conn, child = ctx.Pipe(duplex=False)
        kw = {"desc": desc, "cpu": cpu, "copy_bytes": copy_bytes, "stop": self._stop, "conn": child}
        log.debug(
            "echo worker (spawned process) pinned on CPU %d, copying %d bytes per request", cpu, copy_bytes
        )
        self._proc = ctx.Process(target=_echo_server, kwargs=kw, daemon=True)
        start_pinned(self._proc, cpu)
        child.close()
        if not self._conn.poll(60) or self._conn.recv() != "ready":
            self.close()
            raise RuntimeError("the echo worker did not start")

    def finish(self) -> dict[str, Any]:
        """The worker's report: claim and copy-in times (us) and the ndarray slots it attached."""
        self._stop.set()
        try:
            got = self._conn.recv() if self._conn.poll(30) else {}
        except EOFError:
            got = {}
        self.close()
        return {
            "claim_us": np.asarray(got.get("claim_ns", []), dtype=np.float64) / 1e3,
            "copy_us": np.asarray(got.get("copy_ns", []), dtype=np.float64) / 1e3,
            "attached": int(got.get("attached", -1)),
        }

    def close(self) -> None:
        self._stop.set()
        self._proc.join(10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join()


# ---- lanes ------------------------------------------------------------------------------------------


def _sampler(*, desc: Any, duration: float, cpus: frozenset[int], conn: Any) -> None:
    lat: list[int] = []
    error = ""
    try:
        from lowtail.shm.queue import QueueClient

        os.sched_setaffinity(0, cpus)
        raise_priority(-20)  # as bench serve's samplers: a loaded shared host must not decide the figure
        x = {"obs": np.ones((1, OBS), dtype=np.float32)}
        perf = time.perf_counter_ns
        with QueueClient.attach(desc) as c:
            for _ in range(200):  # warm-up: page faults, the worker's first sight of this lane
                c.infer(x, timeout_s=10)
            t = perf()
            end = t + int(duration * 1e9)
            while t < end:
                c.infer(x, timeout_s=10)
                t1 = perf()
                lat.append(t1 - t)
                t = t1
    except BaseException as e:  # the row records it; the run goes on
        error = "".join(traceback.format_exception_only(type(e), e)).strip()
    conn.send({"lat_ns": lat, "error": error})
    conn.close()


def lanes_case(
    lanes: int, active: int, cpu: int, sampler_cpus: frozenset[int], duration: float
) -> dict[str, Any]:
    from lowtail.shm.queue import InferenceQueue, QueueClient, QueueConfig

    cfg = QueueConfig(
        lanes=lanes, slots_per_lane=2, request_bytes=4096, response_bytes=4096, min_batch_samples=1
    )
    log.debug(
        "%s; %d idle clients, %d sampler processes on CPUs %s",
        cfg,
        lanes - active,
        active,
        sorted(sampler_cpus),
    )
    row: dict[str, Any] = {"lanes": lanes, "active": active, "error": ""}
    ctx = multiprocessing.get_context("spawn")
    with InferenceQueue.create(cfg) as queue:
        worker = _EchoWorker(queue.descriptor, cpu)
        idle: list[Any] = []
        procs: list[Any] = []
        try:
            x = {"obs": np.ones((1, OBS), dtype=np.float32)}
            for _ in range(lanes - active):  # idle clients: each used its lane once, then went quiet
                c = QueueClient.attach(queue.descriptor)
                c.infer(x, timeout_s=10)
                idle.append(c)
            conns = []
            for _ in range(active):
                parent, child = ctx.Pipe(duplex=False)
                kw = {"desc": queue.descriptor, "duration": duration, "cpus": sampler_cpus, "conn": child}
                p = ctx.Process(target=_sampler, kwargs=kw, daemon=True)
                p.start()
                child.close()
                procs.append(p)
                conns.append(parent)
            reports = [
                c.recv() if c.poll(duration + 120) else {"lat_ns": [], "error": "no report"} for c in conns
            ]
        finally:
            for p in procs:
                p.join(10)
                if p.is_alive():
                    p.kill()
                    p.join()
            for c in idle:
                c.close()
            claim = worker.finish()["claim_us"]
    row["error"] = "; ".join(str(r["error"]) for r in reports if r["error"])
    lat = np.concatenate([np.asarray(r["lat_ns"], dtype=np.float64) for r in reports]) / 1e3
    row["rtt_us"] = metrics.percentiles(lat).to_dict()
    row["claim_us"] = metrics.percentiles(claim).to_dict()
    return row


def run_lanes(args: argparse.Namespace) -> int:
    lane_counts = _ints("--lanes", args.lanes, 1, 256)
    actives = _ints("--active", args.active, 1, 16)
    cpu, sampler_cpus = _cpus(args)
    load = os.getloadavg()
    cases = [(n, a) for n in lane_counts for a in actives if a <= n]
    rows: list[dict[str, Any]] = []
    try:
        bar = Progress("bench lanes", len(cases), enabled=not args.no_progress)
        for i, (n, a) in enumerate(cases, 1):
            bar.update(i - 1, f"{n} lanes, {a} active")
            try:
                rows.append(lanes_case(n, a, cpu, sampler_cpus, args.duration))
            except Exception as e:  # the other rows survive
                rows.append({"lanes": n, "active": a, "error": f"{type(e).__name__}: {e}"})
        bar.finish()
    finally:
        report = {
            "benchmark": "lanes",
            "command": "lowtail " + " ".join(sys.argv[1:]),
            "cpu": cpu,
            "sampler_cpus": sorted(sampler_cpus),
            "duration_s": args.duration,
            "request": f"1 x {OBS} float32",
            "host": {"cpus": os.cpu_count(), "loadavg_before": load, "loadavg_after": os.getloadavg()},
            "rows": rows,
        }
        _write_json(args.json, report)
    return _show(args, report, lanes_table, plot_lanes, load)


Tabulated = tuple[str, list[str], list[list[Any]]]  # title, headers, rows


def _show(
    args: argparse.Namespace,
    report: dict[str, Any],
    tabulate: Any,
    plot: Any,
    load: tuple[float, ...],
) -> int:
    """Print the table and the host line, write the plot and the page; exit 1 when a configuration
    failed. The table goes first: a file that cannot be written now must not hide the result."""
    rows = report["rows"]
    title, headers, cells = tabulate(rows)
    if not json_to_stdout(args):
        print(table.render(headers, cells, title=title))
        print(_host_line(load))
    png = plot(rows) if (args.png or args.html) and any(not r["error"] for r in rows) else b""
    if args.png and png:
        write_text(args.png, png)
    if args.html:
        write_html(args.html, report, (title, headers, cells), png)
    return 1 if any(r["error"] for r in rows) else 0


SETTINGS = ("command", "cpu", "sampler_cpus", "client_cpus", "duration_s", "request", "floor", "path")


def write_html(path: str, report: dict[str, Any], tabulated: Tabulated, png: bytes) -> None:
    """The page: the results table, the plot, the run's settings and the host, the JSON folded away."""
    from lowtail.render import html

    title, headers, cells = tabulated
    settings = [
        [k, ", ".join(map(str, v)) if isinstance(v, list) else str(v)]
        for k in SETTINGS
        if (v := report.get(k)) is not None
    ]
    sections = [html.Section(title, table=html.Table(headers, cells))]
    if png:
        sections.append(html.Section("Plot", images=[html.Image(title, png)]))
    sections.append(html.Section("Settings", table=html.Table(["setting", "value"], settings)))
    write_bench_html(path, f"lowtail bench {report['benchmark']}", report, sections)


def _host_line(load: tuple[float, ...]) -> str:
    after = os.getloadavg()[0]
    return f"host: {os.cpu_count()} CPUs, 1-min load average {load[0]:.1f} before, {after:.1f} after"


def _p(row: dict[str, Any], key: str, q: str) -> str:
    v = row.get(key, {}).get(q, float("nan"))
    return "-" if v is None or math.isnan(v) else f"{v:.1f}"


def lanes_table(rows: list[dict[str, Any]]) -> Tabulated:
    out = []
    for r in rows:
        rtt = r.get("rtt_us", {})
        out.append(
            [
                r["lanes"],
                r["active"],
                _p(r, "rtt_us", "p50"),
                _p(r, "rtt_us", "p99"),
                _p(r, "rtt_us", "p999"),
                rtt.get("n", 0),
                _p(r, "claim_us", "p50"),
                _p(r, "claim_us", "p99"),
                r.get("claim_us", {}).get("n", 0),
                r["error"][:60],
            ]
        )
    headers = [
        "lanes",
        "active",
        "rtt p50 us",
        "p99",
        "p99.9",
        "n",
        "claim p50 us",
        "p99",
        "n batches",
        "error",
    ]
    return "lowtail bench lanes: idle lanes must not cost the active ones", headers, out


def plot_lanes(rows: list[dict[str, Any]]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for act in sorted({r["active"] for r in rows}):
        rs = [r for r in rows if r["active"] == act and "rtt_us" in r]
        xs = [r["lanes"] for r in rs]
        a.plot(xs, [r["rtt_us"]["p50"] for r in rs], "o-", label=f"{act} active p50")
        a.plot(xs, [r["rtt_us"]["p99"] for r in rs], "x:", label=f"{act} active p99")
        b.plot(xs, [r["claim_us"]["p50"] for r in rs], "o-", label=f"{act} active p50")
    for ax, title in ((a, "sampler round trip, us"), (b, "worker claim cost per batch, us")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("attached lanes")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.tight_layout()
    return _png(fig)


# ---- ndarray slots ----------------------------------------------------------------------------------


def numpy_copy_gbps(nbytes: int, duration: float) -> dict[str, float]:
    src = np.ones(nbytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    np.copyto(dst, src)  # fault the pages in
    times = _repeat(lambda: np.copyto(dst, src), duration)
    return _gbps(nbytes, times)


def _repeat(fn: Any, duration: float, at_least: int = 5) -> np.ndarray:
    perf = time.perf_counter_ns
    out: list[int] = []
    end = perf() + int(duration * 1e9)
    while len(out) < at_least or perf() < end:
        t = perf()
        fn()
        out.append(perf() - t)
    return np.asarray(out, dtype=np.float64)


def _gbps(nbytes: int, times_ns: np.ndarray) -> dict[str, float]:
    # The 10th percentile next to the median: on a loaded host the median can be scheduling delay
    # (the two processes waiting for their CPUs), the fast decile is the path's own cost.
    p10, med = (float(v) for v in np.percentile(times_ns, [10, 50]))
    return {
        "gbps_median": nbytes / med,
        "us_median": med / 1e3,
        "gbps_p10": nbytes / p10,
        "us_p10": p10 / 1e3,
        "n": int(times_ns.size),
    }


WARMUP = 8  # requests before the measured ones: every slot of a rotation created and attached


def ndslot_case(nbytes: int, cpu: int, duration: float) -> dict[str, Any]:
    """Requests of ``nbytes`` through an ndarray slot: GB/s, and where the time goes.

    ``write_us``: the client's submit (mostly its copy into the slot); ``worker_copy_us``: the
    worker's copy-in; ``slots_created``: ndarray slots the client created during the measured
    requests (0: nothing is created per request); ``slots_attached_total``: the ndarray slots the
    worker attached in the whole run, warm-up included (the rotation's few, not one per request).
    """
    from lowtail.shm.payload import NdarraySegment
    from lowtail.shm.queue import InferenceQueue, QueueClient, QueueConfig

    cfg = QueueConfig(lanes=1, slots_per_lane=2, request_bytes=4096, response_bytes=4096, min_batch_samples=1)
    x = {"obs": np.ones((1, nbytes // 4), dtype=np.float32)}
    perf = time.perf_counter_ns
    write_ns: list[int] = []

    def request(c: Any) -> None:
        t = perf()
        ticket = c.submit(x)
        write_ns.append(perf() - t)
        c.wait(ticket, timeout_s=60)

    with InferenceQueue.create(cfg) as queue:
        worker = _EchoWorker(queue.descriptor, cpu, copy_bytes=nbytes)
        try:
            with QueueClient.attach(queue.descriptor) as c:
                for _ in range(WARMUP):
                    c.infer(x, timeout_s=60)
                created = NdarraySegment.created
                times = _repeat(lambda: request(c), duration)
                created = NdarraySegment.created - created
        finally:
            report = worker.finish()
    out: dict[str, Any] = dict(_gbps(nbytes, times))
    out["write_us"] = metrics.percentiles(np.asarray(write_ns, dtype=np.float64) / 1e3).to_dict()
    copy = report["copy_us"][WARMUP:]
    out["worker_copy_us"] = metrics.percentiles(copy).to_dict()
    out["slots_created"] = created
    out["slots_attached_total"] = report["attached"]
    return out


@contextlib.contextmanager
def _client_thread(cpus: frozenset[int]) -> Iterator[None]:
    """The calling thread on the client CPUs at nice -20 (as the samplers are), restored afterwards."""
    saved_mask, saved_nice = os.sched_getaffinity(0), os.getpriority(os.PRIO_PROCESS, 0)
    os.sched_setaffinity(0, cpus)
    raise_priority(-20)
    try:
        yield
    finally:
        os.sched_setaffinity(0, saved_mask)
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, 0, saved_nice)


def run_ndslot(args: argparse.Namespace) -> int:
    sizes = _ints("--sizes-kib", args.sizes_kib, 4, 1 << 20)
    cpu, client_cpus = _cpus(args)
    load = os.getloadavg()
    rows: list[dict[str, Any]] = []
    try:
        bar = Progress("bench ndslot", len(sizes), enabled=not args.no_progress)
        for i, kib in enumerate(sizes, 1):
            bar.update(i - 1, f"{kib} KiB")
            row: dict[str, Any] = {"kib": kib, "error": ""}
            try:
                with _client_thread(client_cpus):  # both measured on the same CPUs at the same priority
                    row["numpy_copy"] = numpy_copy_gbps(kib * 1024, args.duration)
                    row["ndslot"] = ndslot_case(kib * 1024, cpu, args.duration)
                row["ratio"] = row["ndslot"]["gbps_median"] / row["numpy_copy"]["gbps_median"]
            except Exception as e:  # the other sizes survive
                row["error"] = f"{type(e).__name__}: {e}"
            rows.append(row)
        bar.finish()
    finally:
        report = {
            "benchmark": "ndslot",
            "command": "lowtail " + " ".join(sys.argv[1:]),
            "cpu": cpu,
            "client_cpus": sorted(client_cpus),
            "duration_s": args.duration,
            "floor": "numpy copyto of the same size in one process",
            "path": "client writes the ndarray slot, worker copies it into a buffer and answers one float",
            "host": {"cpus": os.cpu_count(), "loadavg_before": load, "loadavg_after": os.getloadavg()},
            "rows": rows,
        }
        _write_json(args.json, report)
    return _show(args, report, ndslot_table, plot_ndslot, load)


def ndslot_table(rows: list[dict[str, Any]]) -> Tabulated:
    out = []
    for r in rows:
        nd, cp = r.get("ndslot", {}), r.get("numpy_copy", {})
        out.append(
            [
                r["kib"],
                f"{cp['gbps_median']:.2f}" if cp else "-",
                f"{nd['gbps_median']:.2f}" if nd else "-",
                f"{r['ratio']:.2f}" if "ratio" in r else "-",
                f"{nd['us_median']:.0f}" if nd else "-",
                f"{nd['gbps_p10']:.2f}" if nd else "-",
                f"{nd['us_p10']:.0f}" if nd else "-",
                f"{cp['us_median']:.0f}" if cp else "-",
                _p(nd, "write_us", "p50"),
                _p(nd, "worker_copy_us", "p50"),
                nd.get("slots_created", "-"),
                nd.get("n", 0),
                r["error"][:60],
            ]
        )
    # Where a request's time goes: the floor's one copy against the client's write into the slot
    # (its copy) and the worker's copy-in; "new slots" is what the measured requests created.
    headers = ["KiB", "numpy copy GB/s", "ndslot GB/s", "ratio", "request us p50", "GB/s p10", "us p10"]
    headers += ["copy us", "write us", "worker copy us", "new slots", "n", "error"]
    return "lowtail bench ndslot: request throughput vs one numpy copy", headers, out


def plot_ndslot(rows: list[dict[str, Any]]) -> bytes:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in rows if "ratio" in r]
    fig, ax = plt.subplots(figsize=(6, 4))
    xs = [r["kib"] for r in ok]
    ax.plot(xs, [r["numpy_copy"]["gbps_median"] for r in ok], "o-", label="numpy copy (floor)")
    ax.plot(xs, [r["ndslot"]["gbps_median"] for r in ok], "s-", label="ndarray-slot request (median)")
    ax.plot(xs, [r["ndslot"]["gbps_p10"] for r in ok], "^:", label="ndarray-slot request (fastest 10%)")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("request KiB")
    ax.set_ylabel("GB/s (median)")
    ax.set_title("ndarray-slot throughput")
    ax.legend()
    fig.tight_layout()
    return _png(fig)


def _png(fig: Any) -> bytes:
    import matplotlib.pyplot as plt

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110)
    plt.close(fig)
    return buf.getvalue()


def _write_json(path: str | None, report: dict[str, Any]) -> None:
    write_json(path, json_safe({**stamp(f"bench.{report['benchmark']}"), **report}))
