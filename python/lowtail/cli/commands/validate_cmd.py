"""``lowtail validate``: static checks and latency probes; exit 0 (no fail), 1 (a check failed), 2 (could
not run)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from lowtail.cli.commands.topology_cmd import add_root_args
from lowtail.errors import UsageError
from lowtail.node import cpulist
from lowtail.options import (
    add_html,
    add_json,
    add_no_progress,
    json_to_stdout,
    output_path,
    write_json,
    write_text,
)
from lowtail.render import console
from lowtail.validation.check import Limits, ThresholdError
from lowtail.validation.evidence import min_samples
from lowtail.validation.runner import (
    ALL_CHECKS,
    DEFAULT_DURATION_S,
    DEFAULT_SAMPLES,
    QUICK_DURATION_S,
    QUICK_SAMPLES,
    THRESHOLDS,
    Options,
    ValidationError,
    parse_only,
    run,
)
from lowtail.validation.static import Sources
from lowtail.validation.threads import LEASE_STATE

HARDWARE_KEYS = {"sockets": int, "numa_per_socket": int, "smt": bool, "l3_per_socket": int}


def register(sub: Any) -> None:
    p = sub.add_parser(
        "validate",
        help="prove a node fit: static checks and latency probes (exit 0 ok, 1 a check failed, 2 cannot run)",
        description="Checks: " + ", ".join(ALL_CHECKS),
    )
    add_root_args(p)
    _add_outputs(p)
    _add_probe_options(p)
    _add_judging_options(p)
    _add_target_options(p)
    _add_static_inputs(p)
    add_no_progress(p)
    p.set_defaults(func=run_validate)


def _add_outputs(p: argparse.ArgumentParser) -> None:
    """Where the report goes."""
    # The CLI convention (lowtail.options): output paths are checked before any probe runs.
    add_json(p, "the report")
    add_html(p, "the report with plots")
    p.add_argument(
        "--junit",
        metavar="FILE",
        type=output_path(),
        help="write each check as a JUnit XML test case (fail a failure, skip skipped) for CI",
    )


def _add_probe_options(p: argparse.ArgumentParser) -> None:
    """Which checks run, on which CPUs, for how long."""
    p.add_argument(
        "--quick",
        action="store_true",
        help=f"{QUICK_SAMPLES:,} samples per CPU (just above the least a p99.9 verdict accepts) and "
        f"{QUICK_DURATION_S:g} s rt-tests and sampling windows; every check on a 2-CPU host then takes about "
        "half a minute (the inference probe compiles a model)",
    )
    p.add_argument("--only", metavar="NAME[,NAME...]", help="run only these checks (default: all)")
    p.add_argument(
        "--cpus",
        metavar="CPULIST",
        help="CPUs to probe (default: the plan's isolated CPUs if the kernel isolates CPUs, else every "
        "online CPU but 0)",
    )
    p.add_argument(
        "--samples",
        type=int,
        metavar="N",
        help=f"samples per CPU (default: {DEFAULT_SAMPLES}, {QUICK_SAMPLES} with --quick; a p99.9 below "
        f"{min_samples(0.999):,} cannot pass)",
    )
    p.add_argument(
        "--seconds",
        "--duration",
        dest="duration",
        type=float,
        metavar="S",
        help=f"seconds per rt-tests run and hwlat/leased_threads window (default: {DEFAULT_DURATION_S:g}, "
        f"{QUICK_DURATION_S:g} "
        "with --quick)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="N",
        help="run each probe N times and report the spread (mean, deviation, outlier rounds); the report "
        "keeps the median round (default: 1)",
    )


def _add_judging_options(p: argparse.ArgumentParser) -> None:
    """What the node is judged against: its plan, the limits."""
    p.add_argument("--plan", metavar="FILE", help="plan JSON (`lowtail plan --json FILE`); default: computed")
    p.add_argument(
        "--housekeeping",
        default="auto",
        metavar="auto|N|CPULIST",
        help="housekeeping of the computed plan, as for `lowtail plan` (ignored with --plan)",
    )
    p.add_argument(
        "--allow-virtual", action="store_true", help="a VM or made-up topology warns instead of failing"
    )
    p.add_argument(
        "--threshold",
        action="append",
        default=[],
        metavar="PROBE=PASS:WARN",
        help="limits in ms, e.g. deschedule=0.1:1; repeat for several (default: "
        + ", ".join(f"{k}={v.pass_max:g}:{v.warn_max:g}" for k, v in THRESHOLDS.items())
        + "; cstates in us of exit latency, leased_threads in ms of foreign run time per second)",
    )


def _add_target_options(p: argparse.ArgumentParser) -> None:
    """The process cfs_throttle and affinity look at."""
    target = p.add_mutually_exclusive_group()
    target.add_argument(
        "--pid",
        type=int,
        metavar="PID",
        help="cfs_throttle and affinity look at this process (default: itself)",
    )
    target.add_argument(
        "--actor",
        metavar="NAME",
        help="... or at the lease owner with this name (infer:hero:actor, or its last part) or Ray actor id",
    )
    p.add_argument(
        "--lease-state", default=str(LEASE_STATE), metavar="FILE", help="the lease allocator's state file"
    )


def _add_static_inputs(p: argparse.ArgumentParser) -> None:
    """What the static checks read and expect."""
    p.add_argument(
        "--expected-hardware",
        metavar="JSON",
        help='lowtail_expected_hardware, e.g. \'{"sockets": 2, "numa_per_socket": 1, "smt": false}\'',
    )
    p.add_argument("--no-probes", action="store_true", help="static checks only: measure nothing")
    p.add_argument(
        "--kernel-config", metavar="FILE", help="kernel config (default: /boot/config-$(uname -r))"
    )
    p.add_argument("--shm-path", default="/dev/shm", metavar="DIR", help="shared memory mount to size")
    p.add_argument(
        "--shm-bytes", type=int, default=0, metavar="N", help="bytes the runtime needs in /dev/shm"
    )
    p.add_argument(
        "--kubelet-config",
        default="/var/lib/kubelet/config.yaml",
        metavar="FILE",
        help="the KubeletConfiguration the kubelet check reads",
    )
    p.add_argument(
        "--kubelet-state",
        default="/var/lib/kubelet/cpu_manager_state",
        metavar="FILE",
        help="the CPU manager checkpoint the kubelet check reads",
    )


def _limits(items: list[str]) -> dict[str, Limits]:
    out = {}
    for item in items:
        name, sep, spec = item.partition("=")
        if not sep or name not in THRESHOLDS:
            raise UsageError(
                f"--threshold {item!r}: expected PROBE=PASS:WARN in ms, PROBE one of {', '.join(THRESHOLDS)}"
            )
        try:
            out[name] = Limits.parse(spec)
        except ThresholdError as e:
            raise UsageError(f"--threshold {name}: {e}") from None
    return out


def _expected_hardware(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        doc = json.loads(text)
    except json.JSONDecodeError as e:
        raise UsageError(f"--expected-hardware {text!r}: not JSON ({e})") from None
    if not isinstance(doc, dict):
        raise UsageError(f"--expected-hardware {text!r}: expected a JSON object")
    for key, value in doc.items():
        want = HARDWARE_KEYS.get(key)
        if want is None:
            raise UsageError(
                f"--expected-hardware: unknown key {key!r}; expected keys: {', '.join(HARDWARE_KEYS)}"
            )
        ok = value is None or (isinstance(value, want) and (want is bool or not isinstance(value, bool)))
        if not ok:
            raise UsageError(f"--expected-hardware: {key} is {value!r}, expected {want.__name__} or null")
    return doc


def options_from_args(args: argparse.Namespace) -> Options:
    try:
        cpus = cpulist.parse(args.cpus) if args.cpus is not None else None
        only = parse_only(args.only) if args.only else ()
    except (cpulist.CpuListError, ValidationError) as e:
        raise UsageError(str(e)) from None
    if args.samples is not None and args.samples < 1:
        raise UsageError(
            f"--samples {args.samples}: expected a positive count "
            f"(a p99.9 verdict needs {min_samples(0.999):,})"
        )
    if args.rounds < 1:
        raise UsageError(f"--rounds {args.rounds}: expected a count of 1 or more")
    if args.pid is not None and args.pid < 1:
        raise UsageError(f"--pid {args.pid}: expected a positive process id")
    if args.duration is not None and args.duration < 1:
        raise UsageError(f"--seconds {args.duration}: expected at least 1 second")
    src = Sources(
        sys_root=Path(args.sysfs_root),
        proc_root=Path(args.procfs_root),
        kernel_config=Path(args.kernel_config) if args.kernel_config else None,
        shm_path=Path(args.shm_path),
        kubelet_config=Path(args.kubelet_config),
        kubelet_state=Path(args.kubelet_state),
        lease_state=Path(args.lease_state),
    )
    return Options(
        src=src,
        plan_path=Path(args.plan) if args.plan else None,
        housekeeping=args.housekeeping,
        only=only,
        cpus=cpus,
        samples=args.samples,
        quick=args.quick,
        allow_virtual=args.allow_virtual,
        limits=_limits(args.threshold),
        duration_s=args.duration,
        shm_bytes=args.shm_bytes,
        progress=not args.no_progress,
        target_pid=args.pid,
        actor=args.actor,
        expected_hardware=_expected_hardware(args.expected_hardware),
        no_probes=args.no_probes,
        rounds=args.rounds,
    )


def run_validate(args: argparse.Namespace) -> int:
    opts = options_from_args(args)
    try:
        report = run(opts)
    except ValidationError as e:
        raise UsageError(str(e)) from None
    from lowtail.validation.report import render_html, render_junit, render_table

    doc = report.to_dict()
    # The table first: a file that cannot be written now (a full disk) must not hide the result.
    notes = sys.stderr if json_to_stdout(args) else sys.stdout
    if not json_to_stdout(args):
        print(render_table(doc))
    write_json(args.json, doc)
    if args.json and args.json != "-":
        console.info(f"JSON report: {args.json}", notes)
    if args.html:
        write_text(args.html, render_html(report))
        console.info(f"HTML report: {args.html}", notes)
    if args.junit:
        write_text(args.junit, render_junit(doc))
        console.info(f"JUnit report: {args.junit}", notes)
    if report.interrupted:
        return 130  # the shell's code for SIGINT: callers stop, as they would had the run been killed
    return 1 if report.failed else 0
