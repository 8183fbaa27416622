"""lowtail_kubelet_config_target: dropin, through ansible-playbook over a local connection.

Preflight runs against the stand-in kubelet and a stand-in `systemctl cat`
(tests/ansible/test_kubelet_preflight.py). The maintenance window runs the role's main entry point
against a stand-in systemctl whose start/restart runs the strict stand-in kubelet
(molecule/default/standin/kubelet.py) with `--config` and `--config-dir` for a few seconds: it reads the
main file and the drop-ins in kubelet's order, refuses what kubelet refuses and writes the checkpoints
the health gate reads; `systemctl show` then reports it active, or restarting when it exited.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.ansible.conftest import ROOT, local_node_inventory, run_ansible
from tests.ansible.test_kubelet_preflight import KUBEADM, KUBEADM_UNIT, STANDIN, node, run_preflight
from tests.fixtures.machines import MACHINES, write_machine
from tests.kubelet.oracle_minors import MINORS, oracle_path

pytestmark = pytest.mark.slow

HEADER = {"apiVersion": "kubelet.config.k8s.io/v1beta1", "kind": "KubeletConfiguration"}
# Every field lowtail writes (roles/lowtail_kubelet/vars/main.yml, __lowtail_kubelet_fields), and the
# gates it may add.
LOWTAIL_FIELDS = {
    "cpuManagerPolicy",
    "cpuManagerPolicyOptions",
    "reservedSystemCPUs",
    "topologyManagerPolicy",
    "topologyManagerScope",
    "topologyManagerPolicyOptions",
    "memoryManagerPolicy",
    "reservedMemory",
    "kubeReserved",
    "systemReserved",
    "evictionHard",
    "featureGates",
}


def dropin_unit(config_dir: Path) -> str:
    return KUBEADM_UNIT.replace("--config=@CONFIG@", f"--config=@CONFIG@ --config-dir={config_dir}")


def preflight(tmp_path: Path, version: str = "1.36.3", unit: str | None = None) -> tuple[int, str]:
    config_dir = tmp_path / "kubelet.conf.d"
    config_dir.mkdir(exist_ok=True)
    return run_preflight(
        tmp_path,
        version,
        KUBEADM,
        unit=dropin_unit(config_dir) if unit is None else unit,
        lowtail_kubelet_config_target="dropin",
    )


def test_preflight_passes_and_says_the_drop_in_survives_kubeadm_upgrades(tmp_path: Path) -> None:
    rc, out = preflight(tmp_path)
    assert rc == 0, out
    # (the output quotes the message in YAML, where ' is doubled)
    assert f"drop-in {tmp_path}/kubelet.conf.d/90-lowtail.conf alone, so lowtail" in out, out


def test_preflight_refuses_a_kubelet_without_config_dir(tmp_path: Path) -> None:
    rc, out = preflight(tmp_path, unit=KUBEADM_UNIT)
    assert rc != 0, out
    assert (
        "lowtail_kubelet_config_target is dropin but kubelet.service starts kubelet without --config-dir"
        in out
    ), out
    assert "add --config-dir=/etc/kubernetes/kubelet.conf.d to kubelet's command line" in out, out


def test_preflight_refuses_only_a_drop_in_sorting_after_lowtails_that_overrides_its_field(
    tmp_path: Path,
) -> None:
    config_dir = tmp_path / "kubelet.conf.d"
    config_dir.mkdir()
    # Before lowtail's: lowtail's drop-in wins over it.
    (config_dir / "20-policy.conf").write_text(yaml.safe_dump({**HEADER, "cpuManagerPolicy": "none"}))
    rc, out = preflight(tmp_path)
    assert rc == 0, out
    (config_dir / "95-policy.conf").write_text(yaml.safe_dump({**HEADER, "reservedSystemCPUs": "0-1"}))
    rc, out = preflight(tmp_path)
    assert rc != 0, out
    assert (
        f"{config_dir}/95-policy.conf sets reservedSystemCPUs, which overrides reservedSystemCPUs that "
        f"lowtail writes to its drop-in {config_dir}/90-lowtail.conf" in out
    ), out
    assert "20-policy.conf sets" not in out, out


def test_preflight_checks_the_merged_result_with_lowtails_new_drop_in(tmp_path: Path) -> None:
    """Lowtail's drop-in from an earlier run is replaced, not merged under, in the result checked; an
    earlier drop-in's gate, merged under lowtail's drop-in, is what kubelet would refuse."""
    config_dir = tmp_path / "kubelet.conf.d"
    config_dir.mkdir()
    (config_dir / "90-lowtail.conf").write_text(
        yaml.safe_dump(
            {**HEADER, "cpuManagerPolicy": "none", "featureGates": {"CPUManagerPolicyOptions": False}}
        )
    )
    rc, out = preflight(tmp_path)
    assert rc == 0, out
    (config_dir / "10-gates.conf").write_text(
        yaml.safe_dump({**HEADER, "featureGates": {"CPUManagerPolicyOptions": False}})
    )
    rc, out = preflight(tmp_path)
    assert rc != 0, out
    assert "the configuration kubelet would read: cannot set feature gate CPUManagerPolicyOptions" in out, out
    assert "10-gates.conf sets" not in out, out


# A stand-in systemctl for kubelet's unit (Type=simple, Restart=always): `cat` prints the unit;
# start/restart runs the stand-in kubelet in the background with --config and --config-dir and waits
# until it serves its configuration or exits; `show` reports it active while it runs, and restarting
# (NRestarts growing, as systemd's restart loop) once it exited on its own.
SYSTEMCTL = """#!/bin/sh
echo "systemctl $*" >> {log}
pid=$(cat {pidfile} 2>/dev/null)
running() {{ [ -n "$pid" ] && kill -0 "$pid" 2>/dev/null; }}
halt() {{
  if running; then kill "$pid"; while kill -0 "$pid" 2>/dev/null; do sleep 0.1; done; fi
  rm -f {pidfile}
}}
case "$1" in
  cat) cat {unit} ;;
  stop) halt; echo stopped > {status} ;;
  start|restart)
    halt
    setsid {kubelet} --config={config} --config-dir={config_dir} </dev/null >> {klog} 2>&1 &
    pid=$!; echo $pid > {pidfile}
    i=0
    while running && [ ! -f {run}/configz.json ] && [ $i -lt 300 ]; do sleep 0.1; i=$((i+1)); done
    if running; then echo active > {status}; else echo failed > {status}; rm -f {pidfile}; fi ;;
  show)
    echo LoadState=loaded
    n=$(cat {restarts} 2>/dev/null || echo 0)
    if running; then printf 'ActiveState=active\\nSubState=running\\nMainPID=%s\\nNRestarts=%s\\n' "$pid" "$n"
    elif [ "$(cat {status} 2>/dev/null)" = failed ]; then
      n=$((n + 1)); echo $n > {restarts}
      printf 'ActiveState=activating\\nSubState=auto-restart\\nMainPID=0\\nNRestarts=%s\\n' "$n"
    else printf 'ActiveState=inactive\\nSubState=dead\\nMainPID=0\\nNRestarts=%s\\n' "$n"; fi ;;
  *) exit 2 ;;
esac
"""


class Node:
    """A node under tmp_path: kubeadm's main file, kubelet's --config-dir, its root dir and the stand-ins."""

    def __init__(self, tmp_path: Path) -> None:
        self.tmp = tmp_path
        self.config = tmp_path / "config.yaml"
        self.config_dir = tmp_path / "kubelet.conf.d"
        self.dropin = self.config_dir / "90-lowtail.conf"
        self.root = tmp_path / "var/lib/kubelet"
        self.state = tmp_path / "etc/lowtail-standin"
        self.log = tmp_path / "systemctl.log"
        for d in (self.config_dir, self.root, self.state, tmp_path / "bin", tmp_path / "lib"):
            d.mkdir(parents=True, exist_ok=True)
        (self.state / "kubelet-version").write_text("1.36.3\n")
        # The stand-in's oracle reads the machine from this sysfs as cadvisor does: two NUMA nodes, as
        # reservedMemory names, on cgroup v2 (kubeadm's file has no failCgroupV1).
        write_machine(tmp_path, MACHINES["epyc9634_2s_cgroup2"])
        (tmp_path / "lib/lowtail_node").symlink_to(ROOT / "python/lowtail/node")
        kubelet = tmp_path / "kubelet"
        kubelet.write_text(
            f"#!/bin/sh\nLOWTAIL_STANDIN_PREFIX={tmp_path} PYTHONPATH={tmp_path / 'lib'} "
            f"LOWTAIL_STANDIN_ORACLE_DIR={oracle_path(MINORS[0]).parent} "
            f'exec {sys.executable} {STANDIN} "$@"\n'
        )
        kubelet.chmod(0o755)
        self.config.write_text(yaml.safe_dump(KUBEADM))
        (tmp_path / "kubeadm-flags.env").write_text("")
        unit = tmp_path / "unit.txt"
        unit.write_text(
            dropin_unit(self.config_dir)
            .replace("@CONFIG@", str(self.config))
            .replace("@FLAGS_ENV@", str(tmp_path / "kubeadm-flags.env"))
        )
        systemctl = tmp_path / "bin/systemctl"
        systemctl.write_text(
            SYSTEMCTL.format(
                log=self.log,
                unit=unit,
                state=self.state,
                kubelet=kubelet,
                config=self.config,
                config_dir=self.config_dir,
                klog=tmp_path / "kubelet.log",
                status=tmp_path / "kubelet.status",
                restarts=tmp_path / "kubelet.restarts",
                pidfile=tmp_path / "kubelet.daemon.pid",
                run=tmp_path / "run/lowtail-standin",
            )
        )
        systemctl.chmod(0o755)
        # The stand-in kubectl on the drain delegate (localhost): node state, Ready while the stand-in
        # kubelet runs, its /configz.
        (tmp_path / "var/lib/lowtail-standin").mkdir(parents=True)
        (tmp_path / "var/log").mkdir(parents=True)
        (tmp_path / "var/lib/lowtail-standin/node.json").write_text(
            json.dumps(
                {"name": "node-a", "unschedulable": False, "taints": [], "labels": {}, "annotations": {}}
            )
        )
        self.kubectl = tmp_path / "kubectl"
        self.kubectl.write_text(
            f"#!/bin/sh\nLOWTAIL_STANDIN_PREFIX={tmp_path} exec {sys.executable} "
            f'{STANDIN.parent / "kubectl.py"} "$@"\n'
        )
        self.kubectl.chmod(0o755)
        # The node runs kubelet with kubeadm's file before lowtail comes (its checkpoints say none).
        started = subprocess.run([str(systemctl), "start", "kubelet"], check=False, capture_output=True)
        assert started.returncode == 0 and (tmp_path / "kubelet.status").read_text() == "active\n", started
        assert '"policyName": "none"' in (self.root / "cpu_manager_state").read_text()
        self.log.unlink()

    def stop(self) -> None:
        """Stop the stand-in kubelet this test started, if it still runs."""
        pidfile = self.tmp / "kubelet.daemon.pid"
        if pidfile.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pidfile.read_text()), signal.SIGTERM)
            for _ in range(100):
                try:
                    os.kill(int(pidfile.read_text()), 0)
                except (ProcessLookupError, ValueError):
                    break
                time.sleep(0.1)

    def run(self, entry: str = "main", *args: str, **extra: Any) -> tuple[int, str]:
        tasks: list[dict[str, Any]] = [
            {
                "name": "Check the kubelet",
                "ansible.builtin.include_role": {"name": "lowtail_kubelet", "tasks_from": "preflight"},
            }
        ]
        if entry != "preflight":
            tasks.append(
                {
                    "name": "Run the kubelet role",
                    "ansible.builtin.include_role": {"name": "lowtail_kubelet", "tasks_from": entry},
                }
            )
        playbook = self.tmp / "play.yml"
        playbook.write_text(
            yaml.safe_dump(
                [
                    {
                        "name": "Kubelet in a drop-in",
                        "hosts": "all",
                        "gather_facts": False,
                        "environment": {"PATH": f"{self.tmp / 'bin'}:/usr/sbin:/usr/bin:/sbin:/bin"},
                        "vars": {
                            "lowtail_node": {**node(2), "kubelet": {"present": True}},
                            "lowtail_versions": {"kernel_release": "6.1.0-28-amd64", "oci_runtimes": {}},
                            "lowtail_drain_delegate": "localhost",
                            "lowtail_drain_kubectl": [str(self.kubectl)],
                            "lowtail_kubelet_binary": str(self.tmp / "kubelet"),
                            "lowtail_kubelet_config_path": str(self.config),
                            "lowtail_kubelet_root_dir": str(self.root),
                            "lowtail_kubelet_previous_dir": str(self.tmp / "previous"),
                            "lowtail_kubelet_flag_files": [],
                            "lowtail_kubelet_settle_seconds": 1,
                            "lowtail_kubelet_config_target": "dropin",
                            **extra,
                        },
                        "tasks": tasks,
                    }
                ]
            )
        )
        inventory = local_node_inventory(self.tmp)
        result = run_ansible(["ansible-playbook", "-i", str(inventory), str(playbook), *args])
        return result.returncode, result.stdout + result.stderr

    def kubectl_calls(self) -> list[str]:
        log = self.tmp / "var/log/lowtail-kubectl.log"
        return log.read_text().splitlines() if log.exists() else []

    def calls(self) -> list[str]:
        return self.log.read_text().splitlines() if self.log.exists() else []


@pytest.fixture
def n(tmp_path: Path) -> Iterator[Node]:
    host = Node(tmp_path)
    yield host
    host.stop()


def recap(out: str) -> str:
    return out[out.rindex("PLAY RECAP") :]


def test_dropin_mode_writes_only_its_drop_in_which_kubelet_accepts_and_a_second_run_changes_nothing(
    tmp_path: Path, n: Node
) -> None:
    main_before = n.config.read_bytes()
    rc, out = n.run()
    assert rc == 0, out
    assert n.config.read_bytes() == main_before, out
    assert not (tmp_path / "config.yaml.lowtail-orig").exists()
    assert stat.S_IMODE(n.dropin.stat().st_mode) == 0o600
    written = yaml.safe_load(n.dropin.read_text())
    assert {k: written[k] for k in HEADER} == HEADER
    assert set(written) - set(HEADER) <= LOWTAIL_FIELDS, written
    assert written["cpuManagerPolicy"] == "static" and written["reservedSystemCPUs"] == "0-6,84-90"
    # The strict stand-in kubelet read the main file and the drop-in, accepted the merged result and
    # runs with it: lowtail's policy over kubeadm's cluster settings (its /configz, which the health
    # gate read through the stand-in kubectl).
    assert (tmp_path / "kubelet.status").read_text() == "active\n", (tmp_path / "kubelet.log").read_text()
    running = json.loads((tmp_path / "run/lowtail-standin/configz.json").read_text())["kubeletconfig"]
    assert running["cpuManagerPolicy"] == "static" and running["clusterDNS"] == ["10.96.0.10"], running
    assert running["reservedSystemCPUs"] == "0-6,84-90"
    assert any(c.startswith("get --raw /api/v1/nodes/node-a/proxy/configz") for c in n.kubectl_calls())
    assert not (tmp_path / "previous").exists()
    calls = n.calls()
    # Stopped for the checkpoint reset, then started with the new configuration.
    assert calls.index("systemctl stop kubelet") < calls.index("systemctl start kubelet"), calls

    dropin_before = n.dropin.read_bytes()
    rc, out = n.run()
    assert rc == 0, out
    assert "changed=0" in recap(out), out
    assert n.calls() == [*calls, "systemctl cat -- kubelet.service"], n.calls()
    assert n.dropin.read_bytes() == dropin_before and n.config.read_bytes() == main_before


def test_check_mode_writes_nothing_and_reports(tmp_path: Path, n: Node) -> None:
    main_before = n.config.read_bytes()
    rc, out = n.run("main", "--check", "--diff")
    assert rc == 0, out
    assert not n.dropin.exists() and n.config.read_bytes() == main_before
    assert "changed: [node-a]" in out and "90-lowtail.conf" in out, out
    assert not any("restart" in c or "stop" in c for c in n.calls()), n.calls()


def test_failed_health_gate_removes_a_first_drop_in_and_leaves_the_main_file(tmp_path: Path, n: Node) -> None:
    main_before = n.config.read_bytes()
    (n.state / "fail-always").write_text("")
    rc, out = n.run()
    assert rc != 0, out
    words = " ".join(out.split())
    assert "kubelet did not stay up" in words, out
    assert f"lowtail's drop-in {n.dropin} was removed (there was none before this run)" in words, out
    assert not n.dropin.exists()
    assert n.config.read_bytes() == main_before
    # The stand-in still fails with the earlier configuration: the same gate says so.
    assert "but kubelet did not pass the health gate with it either" in words, out
    assert not (tmp_path / "previous").exists()


def test_failed_health_gate_puts_the_earlier_drop_in_back_byte_for_byte(tmp_path: Path, n: Node) -> None:
    main_before = n.config.read_bytes()
    earlier = (
        b"# lowtail's drop-in as an earlier run wrote it, with the operator's comment\n"
        + yaml.safe_dump({**HEADER, "cpuManagerPolicy": "none"}).encode()
    )
    n.dropin.write_bytes(earlier)
    n.dropin.chmod(0o600)
    (n.state / "fail-always").write_text("")
    rc, out = n.run()
    assert rc != 0, out
    assert f"lowtail's drop-in {n.dropin} from before this run was restored" in " ".join(out.split()), out
    assert n.dropin.read_bytes() == earlier
    assert n.config.read_bytes() == main_before


def test_rollback_removes_the_drop_in_through_the_health_gate(tmp_path: Path, n: Node) -> None:
    main_before = n.config.read_bytes()
    rc, out = n.run()
    assert rc == 0 and n.dropin.exists(), out
    before_rollback = len(n.calls())
    rc, out = n.run("rollback")
    assert rc == 0, out
    assert not n.dropin.exists()
    assert n.config.read_bytes() == main_before
    # The checkpoints were reset (static -> none) and kubelet restarted and gated with the main file.
    calls = n.calls()[before_rollback:]
    assert calls.index("systemctl stop kubelet") < calls.index("systemctl start kubelet"), calls
    assert any(c.startswith("systemctl show kubelet") for c in calls), calls
    assert '"policyName": "none"' in (n.root / "cpu_manager_state").read_text()


@pytest.mark.parametrize("value", ["false", "true"])
def test_apply_given_as_an_extra_var_string_acts_as_the_yaml_boolean(n: Node, value: str) -> None:
    """`-e lowtail_kubelet_apply=false` arrives as the string "false": it must only write the file."""
    rc, out = n.run("main", "-e", f"lowtail_kubelet_apply={value}")
    assert rc == 0, out
    assert yaml.safe_load(n.dropin.read_text())["cpuManagerPolicy"] == "static"
    stopped = [c for c in n.calls() if c.split()[1:2] in (["stop"], ["restart"], ["start"])]
    assert bool(stopped) is (value == "true"), n.calls()
    gate = "TASK [lowtail_kubelet : Check that kubelet stayed up without restarting]"
    assert (gate in out) is (value == "true"), out[-3000:]
