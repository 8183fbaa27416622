"""The kubelet role's window (tests/kubelet/real/window.yml runs roles/lowtail_kubelet's plan.yml and
window.yml as they are) against a real kubelet managed by the systemctl stand-in: the change goes in
and the kubelet runs with it; a change the kubelet refuses fails the health gate and the previous file
and checkpoints go back, with the kubelet running on them again."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.kubelet.real.conftest import kubelet_version, newest_claimed, playbook
from tests.kubelet.real.stack import BIN, Stack, wait_for

# The session's containerd and image import count against the first test's timeout.
pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
UNIT = "lowtail-test-kubelet"


def main_pid(kube: Stack) -> int:
    out = kube.systemctl("show", UNIT, "--property=MainPID").stdout
    return int(out.strip().split("=")[1])


def test_window_changes_the_kubelet_and_a_failed_gate_puts_the_previous_file_back(
    kube: Stack, tmp_path: Path, plan: dict[str, Any]
) -> None:
    binary, _ = newest_claimed(kube, tmp_path / "claim")
    # The node before lowtail: the standalone kubelet's own file, the CPU manager's none policy.
    config = kube.write_config("config.yaml", kube.base_config())
    for state in ("cpu_manager_state", "memory_manager_state"):
        (kube.kubelet_root / state).unlink(missing_ok=True)
    path_dir = kube.install_systemctl(UNIT, BIN / binary, config)
    assert kube.systemctl("start", UNIT).returncode == 0
    wait_for("the kubelet before lowtail", lambda: kube.healthz() == "ok", 180)
    # /healthz can answer before the CPU manager has written its checkpoint.
    wait_for("the none policy's checkpoint", lambda: kube.cpu_manager_state()["policyName"] == "none", 60)
    before_pid = main_pid(kube)
    extra = {
        "kubelet_version": kubelet_version(binary),
        "lowtail_kubelet_config_path": str(config),
        "lowtail_kubelet_root_dir": str(kube.kubelet_root),
        "lowtail_kubelet_service": UNIT,
        "lowtail_kubelet_previous_dir": str(kube.base / "previous"),
        "lowtail_kubelet_settle_seconds": 20,
    }

    ok = playbook("window.yml", extra, path_dir)
    assert ok.returncode == 0, ok.stdout[-6000:]
    # Without a drain delegate the gate asked the kubelet itself.
    for task in (
        "Check that kubelet reported healthy",
        "Check that kubelet served its running configuration",
    ):
        assert f"TASK [lowtail_kubelet : {task}]" in ok.stdout, ok.stdout[-6000:]
    written = yaml.safe_load(config.read_text())
    assert written["cpuManagerPolicy"] == "static"
    assert written["reservedSystemCPUs"] == plan["housekeeping"]
    assert main_pid(kube) not in (0, before_pid)
    running = wait_for("/configz after the window", lambda: kube.healthz() == "ok" and kube.configz(), 60)
    assert running["kubeletconfig"]["cpuManagerPolicy"] == "static"
    assert running["kubeletconfig"]["reservedSystemCPUs"] == plan["housekeeping"]
    assert kube.cpu_manager_state()["policyName"] == "static"
    assert not (kube.base / "previous").exists()
    good_bytes, good_state = config.read_bytes(), (kube.kubelet_root / "cpu_manager_state").read_bytes()

    # A change the kubelet refuses at start-up (the role's window does not run preflight; a file
    # preflight would refuse stands for any change the kubelet turns down).
    bad = playbook(
        "window.yml",
        {**extra, "lowtail_kubelet_cpu_manager_policy_options": {"lowtail-no-such-option": "true"}},
        path_dir,
    )
    assert bad.returncode != 0, bad.stdout[-6000:]
    assert "Check that kubelet stayed up without restarting" in bad.stdout, bad.stdout[-6000:]
    assert config.read_bytes() == good_bytes
    wait_for("the kubelet on the restored file", lambda: kube.healthz() == "ok", 180)
    running = kube.configz()["kubeletconfig"]
    assert running["cpuManagerPolicy"] == "static"
    assert "lowtail-no-such-option" not in running.get("cpuManagerPolicyOptions", {})
    assert json.loads(good_state)["policyName"] == kube.cpu_manager_state()["policyName"] == "static"

    # Without a drain delegate the gate reads /configz on the node: a kubelet that answers it only to
    # authenticated clients (anonymous off here), given no client certificate, fails the gate by name
    # and the change goes back, though the kubelet runs healthy with it.
    no_anonymous = {"anonymous": {"enabled": False}, "webhook": {"enabled": False}}
    locked = {**yaml.safe_load(config.read_text()), "authentication": no_anonymous}
    config.write_text(yaml.safe_dump(locked, sort_keys=True))
    assert kube.systemctl("restart", UNIT).returncode == 0
    wait_for("the kubelet without anonymous access", lambda: kube.healthz() == "ok", 180)
    locked_bytes = config.read_bytes()
    unread = playbook(
        "window.yml",
        {**extra, "lowtail_kubelet_topology_manager_policy": "restricted"},
        path_dir,
    )
    assert unread.returncode != 0, unread.stdout[-6000:]
    assert "Check that kubelet served its running configuration" in unread.stdout, unread.stdout[-6000:]
    assert "answered 401" in unread.stdout and "lowtail_kubelet_configz_client_cert" in unread.stdout
    assert config.read_bytes() == locked_bytes
    wait_for("the kubelet on the restored file", lambda: kube.healthz() == "ok", 180)
    assert kube.systemctl("stop", UNIT).returncode == 0
