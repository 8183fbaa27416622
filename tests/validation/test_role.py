"""The lowtail_validate role through playbooks/validate.yml, with real ansible-playbook.

Two inventory hosts on the local connection stand for two nodes: one validates the tuned EPYC fixture
(passes), the other the predecessor's VMware guest (fails). Each host's `lowtail validate` reads its own
fixture tree; the play must fetch both reports, print one fleet table, and fail only the VMware host.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.ansible.conftest import zip_bytecode_env
from tests.fixtures.machines import MACHINES, write_machine

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
STATIC = ["topology", "kernel_args", "isolation", "rt_budget", "irq_affinity", "thp"]


def _play(tmp: Path, hosts: dict[str, dict[str, Any]], *extra: str) -> subprocess.CompletedProcess[str]:
    inventory = {
        "all": {
            "children": {"lowtail_nodes": {"hosts": hosts}},
            "vars": {
                "ansible_connection": "local",
                "ansible_python_interpreter": sys.executable,
                "lowtail_validate_command": str(BIN / "lowtail"),
                "lowtail_validate_fetch_dir": str(tmp / "fetched"),
                "lowtail_validate_only": STATIC,
            },
        }
    }
    inv = tmp / "hosts.yml"
    inv.write_text(yaml.safe_dump(inventory))
    return subprocess.run(
        [str(BIN / "ansible-playbook"), "-i", str(inv), str(REPO / "playbooks/validate.yml"), *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=zip_bytecode_env({"PATH": f"{BIN}:/usr/bin:/bin", "ANSIBLE_NOCOLOR": "1", "HOME": str(tmp)}),
    )


def _node(tmp: Path, name: str, machine: str) -> dict[str, Any]:
    sys_root, proc_root = write_machine(tmp / machine, MACHINES[machine])
    args = ["--sysfs-root", str(sys_root), "--procfs-root", str(proc_root)]
    return {
        "lowtail_validate_remote_dir": str(tmp / name / "reports"),
        "lowtail_validate_extra_args": args,
    }


def test_the_fleet_is_validated_reported_and_the_failing_host_failed(tmp_path: Path) -> None:
    hosts = {
        "epyc-a01": _node(tmp_path, "epyc-a01", "epyc9634_2s_tuned"),
        "vmware-b01": _node(tmp_path, "vmware-b01", "vmware_88_rt500"),
    }
    proc = _play(tmp_path, hosts)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out  # ansible-playbook: some host failed
    recap = out[out.index("PLAY RECAP") :]
    assert "epyc-a01                   : ok=" in recap and "failed=0" in recap.split("\n")[1]
    assert "vmware-b01" in recap and "failed=1" in recap.split("\n")[2]

    fetched = tmp_path / "fetched"
    for host, status in (("epyc-a01", "pass"), ("vmware-b01", "fail")):
        report = json.loads((fetched / f"{host}.json").read_text())
        assert report["summary"]["status"] == status
        assert [c["name"] for c in report["checks"]] == STATIC
        assert (fetched / f"{host}.html").read_text().startswith("<!doctype html>")

    table = (fetched / "fleet.txt").read_text().splitlines()
    assert table[0].split()[:4] == ["host", "status", "p99.9", "deschedule"]
    rows = [line.split() for line in table[2:-1] if not line.startswith(" ")]
    assert [(r[0], r[1]) for r in rows] == [("vmware-b01", "FAIL"), ("epyc-a01", "PASS")]  # failures first
    assert "failed: topology, kernel_args, isolation, rt_budget" in table[2]
    assert table[-1] == "1 of 2 hosts failed validation"
    # Printed as one block of unquoted lines, not a list of quoted strings.
    assert "\n        vmware-b01  FAIL " in out and "'vmware-b01" not in out and "p999" not in out
    fleet = json.loads((fetched / "fleet.json").read_text())
    assert fleet["vmware-b01"]["failed"] == ["topology", "kernel_args", "isolation", "rt_budget"]
    # Each failed check has its own line under its host, with value and its whole reason.
    detail = [line.split() for line in table if line.startswith("    ")]
    assert [d[:2] for d in detail] == [[n, "FAIL"] for n in fleet["vmware-b01"]["failed"]]
    assert not any("{'" in line for line in table)  # objects as key=value, never a Python dict
    assert fleet["vmware-b01"]["checks"]["rt_budget"]["status"] == "fail"
    assert set(fleet["epyc-a01"]["checks"]) == set(STATIC)
    page = (fetched / "fleet.html").read_text()
    assert page.index("1 of 2 hosts failed validation") < page.index("vmware-b01") < page.index("epyc-a01<")
    assert '<a href="vmware-b01.html">' in page and '<a href="epyc-a01.html">' in page
    assert "rt_budget fail (SCHED_FIFO threads are throttled" in out


def test_a_node_where_validate_cannot_run_is_failed_with_its_error(tmp_path: Path) -> None:
    hosts = {
        "broken-c01": {
            "lowtail_validate_remote_dir": str(tmp_path / "c01"),
            "lowtail_validate_extra_args": ["--sysfs-root", str(tmp_path / "missing")],
        }
    }
    proc = _play(tmp_path, hosts)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "lowtail validate exited with status 2 on broken-c01" in out
    assert "missing " in out and "devices/system/cpu/online" in out
    assert "broken-c01" in (tmp_path / "fetched/fleet.txt").read_text()
    assert "ERROR" in (tmp_path / "fetched/fleet.txt").read_text()


def test_check_mode_still_validates_and_reports(tmp_path: Path) -> None:
    # Validation only reads and measures: a dry run that skipped it would report nothing.
    proc = _play(tmp_path, {"epyc-a01": _node(tmp_path, "epyc-a01", "epyc9634_2s_tuned")}, "--check")
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert json.loads((tmp_path / "fetched/epyc-a01.json").read_text())["summary"]["status"] == "pass"
    assert "0 of 1 hosts failed validation" in (tmp_path / "fetched/fleet.txt").read_text()


def test_check_mode_runs_no_probe_and_still_checks_the_firmware(tmp_path: Path) -> None:
    node = {
        **_node(tmp_path, "epyc-a01", "epyc9634_2s_tuned"),
        "lowtail_validate_only": [*STATIC, "firmware", "timer", "deschedule"],
        "lowtail_validate_expected_hardware": {"sockets": 2, "numa_per_socket": 4},
    }
    proc = _play(tmp_path, {"epyc-a01": node}, "--check")
    out = proc.stdout + proc.stderr
    report = json.loads((tmp_path / "fetched/epyc-a01.json").read_text())
    # The probes were asked for, and a dry run measured nothing: they are not in the report at all.
    assert [c["name"] for c in report["checks"]] == [*STATIC, "firmware"], out
    firmware = report["checks"][-1]
    assert firmware["status"] == "fail" and "numa_per_socket is 1, expected 4" in firmware["reason"]
    table = (tmp_path / "fetched/fleet.txt").read_text()
    assert "    firmware         FAIL" in table and "numa_per_socket is 1, expected 4" in table


def test_an_air_gapped_node_without_rt_tests_fails_naming_the_package_to_mirror(tmp_path: Path) -> None:
    node = {
        **_node(tmp_path, "epyc-a01", "epyc9634_2s_tuned"),
        "lowtail_validate_rt_tests_tools": ["cyclictest-lowtail-absent", "oslat"],
        # Not in any repository: apt refuses it exactly as on a node whose mirror lacks rt-tests.
        "lowtail_validate_rt_tests_package": "lowtail-absent-rt-tests",
        "lowtail_validate_rt_tests_update_cache": False,  # leave this shared host's apt lists alone
    }
    proc = _play(tmp_path, {"epyc-a01": node})
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out
    assert "cyclictest-lowtail-absent missing on epyc-a01" in out
    assert "mirror that package (Debian)" in out and "'lowtail-absent-rt-tests'" in out
    assert not (tmp_path / "epyc-a01/reports/report.json").exists()


def test_a_misspelt_threshold_probe_is_rejected_before_anything_runs(tmp_path: Path) -> None:
    node = {
        **_node(tmp_path, "epyc-a01", "epyc9634_2s_tuned"),
        "lowtail_validate_thresholds": {"deschedul": "1:2"},
    }
    proc = _play(tmp_path, {"epyc-a01": node})
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "deschedul" in out
    assert not (tmp_path / "epyc-a01/reports").exists()


BOOLEANS = (
    "lowtail_validate_quick",
    "lowtail_validate_allow_virtual",
    "lowtail_validate_install_rt_tests",
    "lowtail_validate_rt_tests_update_cache",
    "lowtail_validate_fail_on_warn",
)


def test_every_boolean_of_the_role_is_a_listed_bool_read_through_the_bool_filter() -> None:
    """An `-e NAME=false` arrives as the string "false", which Jinja finds true: every use must say | bool."""
    import re

    spec = yaml.safe_load((REPO / "roles/lowtail_validate/meta/argument_specs.yml").read_text())
    options = spec["argument_specs"]["main"]["options"]
    assert {k for k, v in options.items() if v.get("type") == "bool"} == set(BOOLEANS)
    tasks = (REPO / "roles/lowtail_validate/tasks/main.yml").read_text()
    for name in BOOLEANS:
        uses = re.findall(rf"\b{name}\b[^\n]{{0,12}}", tasks)
        assert uses, name
        assert all(re.match(rf"{name}\s*\|\s*bool", u) for u in uses if not u.startswith(f"{name}:")), uses


def _recorder(tmp: Path) -> Path:
    """A `lowtail` that logs its arguments and makes the report a warn (to see fail_on_warn act)."""
    script = tmp / "lowtail-recorder"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, subprocess, sys\n"
        f"with open({str(tmp / 'argv.log')!r}, 'a') as log:\n"
        "    log.write(json.dumps(sys.argv[1:]) + '\\n')\n"
        f"rc = subprocess.run([{str(BIN / 'lowtail')!r}, *sys.argv[1:]]).returncode\n"
        "path = sys.argv[sys.argv.index('--json') + 1]\n"
        "doc = json.load(open(path))\n"
        "doc['summary']['status'] = 'warn'\n"
        "json.dump(doc, open(path, 'w'))\n"
        "sys.exit(0 if rc in (0, 1) else rc)\n"
    )
    script.chmod(0o755)
    return script


@pytest.mark.parametrize("value", ["true", "false"])
def test_each_boolean_given_as_an_extra_var_string_acts_as_the_yaml_boolean(
    tmp_path: Path, value: str
) -> None:
    on = value == "true"
    node = {**_node(tmp_path, "epyc-a01", "epyc9634_2s_tuned"), "lowtail_validate_only": ["thp"]}
    extra = [a for name in BOOLEANS for a in ("-e", f"{name}={value}")]
    extra += ["-e", f"lowtail_validate_command={_recorder(tmp_path)}"]
    proc = _play(tmp_path, {"epyc-a01": node}, *extra)
    out = proc.stdout + proc.stderr
    argv = json.loads((tmp_path / "argv.log").read_text().splitlines()[0])
    assert ("--quick" in argv) is on, argv
    assert ("--samples" in argv) is not on, argv
    assert ("--allow-virtual" in argv) is on, argv
    look = out[out.index("TASK [lowtail_validate : Look for the rt-tests tools") :]
    look = look[: look.index("TASK [", 10)]
    assert ("skipping: [epyc-a01]" in look) is not on, look  # install_rt_tests decides whether it looks
    # fail_on_warn: the recorder's report warned; only "true" fails the host.
    assert proc.returncode == (2 if on else 0), out
    assert ("validation warn on epyc-a01" in out) is on
