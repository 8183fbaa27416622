"""Every play is tagged by the concern it changes; preflight and the rollout's bookkeeping always run."""

from __future__ import annotations

import re

import pytest

from tests.ansible.conftest import ROOT, run_ansible

PLAYBOOKS = ["site.yml", "playbooks/runtime.yml", "playbooks/validate.yml"]
PROVISION = {
    "kernel": "Write the kernel arguments for the isolated CPUs",
    "tuning": "Write the runtime tuning for the isolated CPUs",
    "kubelet": "Configure kubelet and reboot once, in one maintenance window",
    "runtime": "lowtail_runtime : ",
    "k8s": "lowtail_k8s : ",
    "validate": "lowtail_validate : ",
}


def _tasks(tags: str) -> str:
    """The tasks --tags would run; a role's argument validation is always listed (Ansible tags it always)."""
    argv = [
        "ansible-playbook",
        "-i",
        str(ROOT / "inventory/example"),
        *PLAYBOOKS,
        "--list-tasks",
        "--tags",
        tags,
    ]
    out = run_ansible(argv, timeout=120)
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    return "\n".join(line for line in lines if "Validating arguments against arg spec" not in line)


@pytest.mark.parametrize("tag", sorted(PROVISION))
def test_a_tag_runs_its_concern_with_preflight_and_nothing_else(tag: str) -> None:
    listed = _tasks(tag)
    assert "lowtail_preflight : Compute the CPU plan" in listed  # the plan every concern reads
    assert "Record the hosts this batch starts with" in listed  # the failure budget still holds
    for other, task in PROVISION.items():
        assert (task in listed) == (other == tag), (
            f"--tags {tag}: {task!r} {'missing' if other == tag else 'listed'}"
        )


def test_every_concern_tag_is_documented_in_the_readme() -> None:
    readme = (ROOT / "README.md").read_text()
    for tag in PROVISION:
        assert re.search(rf"`{tag}`", readme), tag
