"""The drain role's entry points on a node run without a drain delegate (``lowtail_allow_undrained``).

Every kubectl task is skipped then, but Ansible templates ``delegate_to`` before it evaluates ``when``:
an empty delegate failed each entry point with "Empty hostname produced from delegate_to" (2.19).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from tests.ansible.conftest import run_ansible

pytestmark = pytest.mark.slow  # ansible-playbook runs


def test_every_entry_point_runs_and_calls_no_kubectl_without_a_delegate(tmp_path: Path) -> None:
    log = tmp_path / "kubectl.log"
    kubectl = tmp_path / "kubectl"
    kubectl.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    kubectl.chmod(0o755)
    play = {
        "name": "Open, keep cordoned and close a window without a drain delegate",
        "hosts": "localhost",
        "connection": "local",
        "gather_facts": False,
        "vars": {
            "lowtail_drain_delegate": "",
            "lowtail_allow_undrained": True,
            "lowtail_drain_kubectl": [str(kubectl)],
            "lowtail_drain_reason": "a test",
        },
        "tasks": [
            {
                "name": f"Entry point {ep}",
                "ansible.builtin.include_role": {"name": "lowtail_drain", "tasks_from": ep},
            }
            for ep in ("open", "keep_cordoned", "close")
        ],
    }
    playbook = tmp_path / "play.yml"
    playbook.write_text(yaml.safe_dump([play], sort_keys=False))
    r = run_ansible(["ansible-playbook", "-i", "localhost,", str(playbook)])
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "failed=0" in r.stdout
    assert not log.exists()  # nothing to cordon or drain through: no kubectl call at all
