"""cstates, firmware and hwlat: fixture sysfs trees for what this KVM guest cannot show, the real tracefs
and MSR interfaces where it can (here: neither, so those probes must skip and say why)."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from lowtail.node.plan import make_plan
from lowtail.node.topology import read_topology
from lowtail.validation.check import Status
from lowtail.validation.firmware import check_cstates, check_firmware, parse_hwlat, probe_hwlat
from tests.fixtures.machines import MACHINES
from tests.validation.conftest import base_machine, by_name, validate_fixture

TUNED = "epyc9634_2s_tuned"
ISO = frozenset({7, 8})

# Documentation/trace/hwlat_detector.rst and a 6.x kernel's output: "count" appeared in 5.11.
HWLAT_TRACE = """\
# tracer: hwlat
#
# entries-in-buffer/entries-written: 3/3   #P:8
#
#                                _-----=> irqs-off
#           TASK-PID     CPU#   ||||   TIMESTAMP  FUNCTION
#              | |         |   ||||      |         |
           <...>-1729  [007] d...   678.473449: #1 inner/outer(us):   11/12    ts:1581527483.343962693 count:6
           <...>-1729  [008] d...   689.556542: #2 inner/outer(us):   16/9     ts:1581527494.889008092 count:1
     hwlatd-331 [007] d... 700.000001: #3 inner/outer(us):  412/6     ts:1466041017.012337541 nmi-total:0
"""


def _idle(cpus: frozenset[int], states: list[tuple[str, int]], qos: str = "0") -> dict[str, str]:
    files = {"devices/system/cpu/cpuidle/current_driver": "acpi_idle"}
    for cpu in cpus:
        base = f"devices/system/cpu/cpu{cpu}"
        files[f"{base}/power/pm_qos_resume_latency_us"] = qos
        for i, (name, lat) in enumerate(states):
            files |= {
                f"{base}/cpuidle/state{i}/name": name,
                f"{base}/cpuidle/state{i}/latency": str(lat),
                f"{base}/cpuidle/state{i}/disable": "0",
            }
    return files


EPYC_STATES = [("POLL", 0), ("C1", 1), ("C2", 400)]


def _machine(tmp: Path, files: dict[str, str]) -> Path:
    root = tmp / "sys"
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text + "\n")
    return root


def test_an_isolated_cpu_offered_epyc_c2_fails_naming_the_state(tmp_path: Path) -> None:
    c = check_cstates(_machine(tmp_path, _idle(ISO, EPYC_STATES)), ISO)
    assert c.status is Status.FAIL and c.value == 400
    assert "may enter C2 (400 us exit latency)" in c.reason


def test_a_pm_qos_resume_latency_limit_keeps_c2_out_and_passes(tmp_path: Path) -> None:
    c = check_cstates(_machine(tmp_path, _idle(ISO, EPYC_STATES, qos="10")), ISO)
    assert c.status is Status.PASS and c.value == 1, c


def test_pm_qos_n_a_allows_only_polling(tmp_path: Path) -> None:
    c = check_cstates(_machine(tmp_path, _idle(ISO, EPYC_STATES, qos="n/a")), ISO)
    assert c.status is Status.PASS and c.value == 0
    assert c.data["per_cpu"]["7"]["usable"] == ["POLL (0 us)"]


def test_a_disabled_deep_state_is_not_counted(tmp_path: Path) -> None:
    files = _idle(ISO, EPYC_STATES)
    files |= {f"devices/system/cpu/cpu{c}/cpuidle/state2/disable": "1" for c in ISO}
    assert check_cstates(_machine(tmp_path, files), ISO).status is Status.PASS


def test_the_cstates_of_this_machine_are_read() -> None:
    c = check_cstates(Path("/sys"), frozenset({0}))
    assert c.status is not Status.SKIP and "current_driver" in c.evidence[0]


def test_nps4_and_smt_against_the_expected_hardware_fail_naming_the_bios_setting(tmp_path: Path) -> None:
    base = base_machine("epyc_2s_nps4")
    topo = read_topology(base / "sys", base / "proc")
    plan = make_plan(topo)
    smt = topo.threads_per_core > 1
    expected = {"sockets": 2, "numa_per_socket": 1, "smt": not smt}
    c = check_firmware(base / "sys", topo, plan, plan.isolated, expected)
    assert c.status is Status.FAIL
    assert "numa_per_socket is 4, expected 1 (check the BIOS NPS setting" in c.reason
    assert f"smt is {smt}, expected {not smt} (check the BIOS SMT setting)" in c.reason
    assert "sockets" not in c.reason


def test_amd_pstate_not_in_the_plans_mode_fails_and_in_it_passes(tmp_path: Path) -> None:
    # The tuned fixture booted with amd_pstate=guided: the driver not in that mode is the firmware's doing.
    assert "amd_pstate=guided" in MACHINES[TUNED].proc_files["cmdline"]
    fail = by_name(validate_fixture(tmp_path, TUNED, ("firmware",)))["firmware"]
    assert fail.status is Status.FAIL and "CPPC is off in the BIOS" in fail.reason
    cmdline = MACHINES[TUNED].proc_files["cmdline"].replace("amd_pstate=guided", "")
    pending = by_name(validate_fixture(tmp_path / "p", TUNED, ("firmware",), proc_files={"cmdline": cmdline}))
    assert (
        pending["firmware"].status is Status.WARN
        and "not on this boot's command line yet" in pending["firmware"].reason
    )
    ok = by_name(
        validate_fixture(
            tmp_path / "b",
            TUNED,
            ("firmware",),
            sys_files={
                "devices/system/cpu/amd_pstate/status": "guided",
                "devices/system/cpu/cpufreq/boost": "0",
            },
            expected_hardware={"sockets": MACHINES[TUNED].sockets, "smt": False},
        )
    )["firmware"]
    assert ok.status is Status.PASS, ok
    assert ok.data["facts"]["boost"] == "off (cpufreq/boost)"


def test_each_firmware_cause_gets_its_own_fix_not_a_bios_one(tmp_path: Path) -> None:
    from lowtail.validation.report import fix

    booted = by_name(validate_fixture(tmp_path, TUNED, ("firmware",)))["firmware"]
    assert fix(booted.to_dict()) == "enable CPPC in the BIOS (the kernel already asks for amd_pstate)"
    cmdline = MACHINES[TUNED].proc_files["cmdline"].replace("amd_pstate=guided", "")
    pending = by_name(validate_fixture(tmp_path / "p", TUNED, ("firmware",), proc_files={"cmdline": cmdline}))
    assert fix(pending["firmware"].to_dict()) == (
        "add amd_pstate=guided to the kernel command line (the plan's kernel arguments, "
        "roles/lowtail_kernel) "
        "and reboot"
    )


def test_hwlat_output_is_parsed_with_cpu_inner_outer_and_count() -> None:
    gaps = parse_hwlat(HWLAT_TRACE)
    assert [(g.cpu, g.us, g.count) for g in gaps] == [(7, 12, 6), (8, 16, 1), (7, 412, 1)]


def test_hwlat_skips_naming_the_missing_interface_here() -> None:
    c = probe_hwlat(Path("/sys"), frozenset({1}), "AuthenticAMD", duration_s=1, progress=False)
    tracefs = Path("/sys/kernel/tracing/available_tracers")
    if tracefs.exists() and "hwlat" in tracefs.read_text():
        assert c.status is not Status.SKIP
    else:
        assert c.status is Status.SKIP
        assert "tracefs is not mounted" in c.reason or "CONFIG_HWLAT_TRACER" in c.reason


def _tracefs(tmp: Path, tracers: str = "hwlat function nop") -> Path:
    t = tmp / "sys/kernel/tracing"
    (t / "hwlat_detector").mkdir(parents=True)
    for name, text in {
        "available_tracers": tracers,
        "current_tracer": "nop",
        "tracing_on": "1",
        "tracing_thresh": "0",
        "tracing_cpumask": "ff",
        "trace": "",
        "hwlat_detector/width": "500000",
        "hwlat_detector/window": "1000000",
    }.items():
        (t / name).write_text(text + "\n")
    return t


def test_hwlat_drives_the_tracer_files_and_restores_them(tmp_path: Path) -> None:
    """A stand-in for the kernel: while current_tracer is hwlat, it appends the documented lines."""
    t = _tracefs(tmp_path)
    stop = threading.Event()
    seen: dict[str, str] = {}

    def kernel() -> None:
        while not stop.wait(0.05):
            if (t / "current_tracer").read_text().strip() == "hwlat":
                seen.update({n: (t / n).read_text().strip() for n in ("tracing_thresh", "tracing_cpumask")})
                # Atomic, as the kernel's buffer is to a reader: never a half-written file.
                (t / "trace.new").write_text(HWLAT_TRACE)
                os.replace(t / "trace.new", t / "trace")

    th = threading.Thread(target=kernel)
    th.start()
    try:
        # 3 s: room for the stand-in thread to be scheduled on a loaded machine.
        c = probe_hwlat(tmp_path / "sys", frozenset({7, 8}), "AuthenticAMD", duration_s=3, progress=False)
    finally:
        stop.set()
        th.join()
    assert seen == {"tracing_thresh": "10", "tracing_cpumask": "00000180"}
    assert c.status is Status.FAIL and c.value == 0.412 and c.data["gaps"] == 3
    assert "ls_smi_rx" in " ".join(c.evidence)
    # Everything it touched is back as it was; the tracer is off.
    assert (t / "current_tracer").read_text().strip() == "nop"
    assert (t / "tracing_thresh").read_text().strip() == "0"
    assert (t / "tracing_cpumask").read_text().strip() == "ff"


def test_hwlat_does_not_take_over_a_tracer_someone_else_runs(tmp_path: Path) -> None:
    t = _tracefs(tmp_path)
    (t / "current_tracer").write_text("function\n")
    c = probe_hwlat(tmp_path / "sys", frozenset({1}), "AuthenticAMD", duration_s=1, progress=False)
    assert c.status is Status.SKIP and "someone else is tracing" in c.reason
    assert (t / "current_tracer").read_text().strip() == "function"


def test_hwlat_without_the_tracer_in_the_kernel_skips(tmp_path: Path) -> None:
    _tracefs(tmp_path, tracers="function nop")
    c = probe_hwlat(tmp_path / "sys", frozenset({1}), "GenuineIntel", duration_s=1, progress=False)
    assert c.status is Status.SKIP and "CONFIG_HWLAT_TRACER" in c.reason


def test_hwlat_passes_when_the_tracer_records_no_gap(tmp_path: Path) -> None:
    _tracefs(tmp_path)
    t0 = time.monotonic()
    c = probe_hwlat(tmp_path / "sys", frozenset({1}), "GenuineIntel", duration_s=1, progress=False)
    assert c.status is Status.PASS and c.value == 0 and time.monotonic() - t0 >= 1
    assert "msr not readable" in " ".join(c.evidence)
