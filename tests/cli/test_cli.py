from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from lowtail.cli.main import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.mark.parametrize(
    "name", ["epyc9634_2s", "epyc9634_2s_smt", "epyc_1s_nps1", "epyc_2s_nps4", "offline_cpus"]
)
def test_topology_and_plan_json_contract(
    name: str, machine_roots: dict[str, tuple[Path, Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    s, p = machine_roots[name]
    code, out, _ = run(capsys, "topology", "--sysfs-root", str(s), "--procfs-root", str(p), "--json", "-")
    assert code == 0
    topo = json.loads(out)
    for key in (
        "cpus",
        "sockets",
        "numa_nodes",
        "cores_per_socket",
        "threads_per_core",
        "l3_groups",
        "virtual",
        "deceptive",
    ):
        assert key in topo
    assert {"cpu", "socket", "core", "node", "l3", "siblings"} <= set(topo["cpus"][0])
    assert {"hypervisor_flag", "vendor", "findings"} <= set(topo["virtual"])
    code, out, _ = run(capsys, "plan", "--sysfs-root", str(s), "--procfs-root", str(p), "--json", "-")
    assert code == 0
    plan = json.loads(out)
    for key in ("housekeeping", "isolated", "per_node", "l3_groups", "kernel_args"):
        assert key in plan
    assert all({"housekeeping", "isolated"} <= set(v) for v in plan["per_node"].values())


def test_vmware_topology_json_is_deceptive(
    machine_roots: dict[str, tuple[Path, Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    s, p = machine_roots["vmware_88"]
    code, out, _ = run(capsys, "topology", "--sysfs-root", str(s), "--procfs-root", str(p), "--json", "-")
    assert code == 0
    data = json.loads(out)
    assert data["deceptive"] is True
    assert data["sockets"] == 88 and data["numa_nodes"] == 1


def test_tables_are_readable(
    machine_roots: dict[str, tuple[Path, Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    s, p = machine_roots["epyc9634_2s"]
    code, out, _ = run(capsys, "plan", "--sysfs-root", str(s), "--procfs-root", str(p))
    assert code == 0
    assert "isolcpus=managed_irq,7-83,91-167" in out
    assert "housekeeping" in out and "0-6" in out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--housekeeping", "0-3,999"], "999 do not exist or are offline"),
        (["--housekeeping", "0-5"], "no CPU on socket 1"),
        (["--housekeeping", "0-167"], "expected at least one isolated CPU"),
        (["--housekeeping", "x"], "'x'"),
    ],
)
def test_bad_input_exits_2_naming_the_value(
    args: list[str],
    message: str,
    machine_roots: dict[str, tuple[Path, Path]],
    capsys: pytest.CaptureFixture[str],
) -> None:
    s, p = machine_roots["epyc9634_2s"]
    code, _, err = run(capsys, "plan", "--sysfs-root", str(s), "--procfs-root", str(p), *args)
    assert code == 2
    assert message in err


def test_missing_sysfs_root_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "topology", "--sysfs-root", str(tmp_path / "none"))
    assert code == 2
    assert "missing" in err


def test_console_script_runs_on_this_machine() -> None:
    exe = Path(sys.executable).with_name("lowtail")
    out = subprocess.run([str(exe), "plan", "--json", "-"], check=True, capture_output=True, text=True).stdout
    assert json.loads(out)["isolated"]


@pytest.mark.parametrize(("command", "schema"), [("topology", "lowtail.topology"), ("plan", "lowtail.plan")])
def test_topology_and_plan_json_carry_the_schema_stamp(
    command: str, schema: str, machine_roots: dict[str, tuple[Path, Path]], capsys: pytest.CaptureFixture[str]
) -> None:
    from lowtail import __version__

    s, p = machine_roots["epyc9634_2s"]
    code, out, _ = run(capsys, command, "--sysfs-root", str(s), "--procfs-root", str(p), "--json", "-")
    doc = json.loads(out)
    assert code == 0
    assert (doc["schema"], doc["schema_version"], doc["lowtail_version"]) == (schema, 1, __version__)


def test_a_stamped_plan_file_is_read_by_every_plan_reader(
    machine_roots: dict[str, tuple[Path, Path]], capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # `lowtail plan --json FILE` is what operators pass to `validate --plan` and to the lease allocator
    # ($LOWTAIL_PLAN): the stamp's extra keys must not make them refuse it.
    from lowtail.node.plan import load_plan

    s, p = machine_roots["epyc9634_2s"]
    target = tmp_path / "plan.json"
    code, _, _ = run(capsys, "plan", "--sysfs-root", str(s), "--procfs-root", str(p), "--json", str(target))
    assert code == 0 and json.loads(target.read_text())["schema"] == "lowtail.plan"
    plan = load_plan(target)
    assert plan.isolated == frozenset(range(7, 84)) | frozenset(range(91, 168))
    code, out, err = run(
        capsys,
        "validate",
        "--sysfs-root",
        str(s),
        "--procfs-root",
        str(p),
        "--plan",
        str(target),
        "--no-probes",
        "--only",
        "isolation",
        "--allow-virtual",
        "--json",
        "-",
    )
    assert code in (0, 1), err
    assert json.loads(out)["host"]["plan_source"].startswith(str(target))
