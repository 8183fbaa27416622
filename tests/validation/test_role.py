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
    assert table[0].split()[:3] == ["host", "status", "p999"]
    rows = {line.split()[0]: line.split() for line in table[2:] if line and not line.startswith(" ")}
    assert rows["epyc-a01"][1] == "PASS"
    assert rows["vmware-b01"][1] == "FAIL"
    assert "topology,kernel_args,isolation,rt_budget" in rows["vmware-b01"][3]
    assert table[-1] == "1 of 2 hosts failed validation"
    assert "1 of 2 hosts failed validation" in out  # printed once, in the play output
    fleet = json.loads((fetched / "fleet.json").read_text())
    assert fleet["vmware-b01"]["failed"] == ["topology", "kernel_args", "isolation", "rt_budget"]
    # Each failed check has its own line under its host, with value and reason; every check is in the JSON.
    detail = [line.split() for line in table if line.startswith("    ")]
    assert [d[:2] for d in detail] == [[n, "FAIL"] for n in fleet["vmware-b01"]["failed"]]
    assert fleet["vmware-b01"]["checks"]["rt_budget"]["status"] == "fail"
    assert set(fleet["epyc-a01"]["checks"]) == set(STATIC)
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
