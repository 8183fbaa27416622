"""Every boolean of lowtail_kubelet, lowtail_preflight and lowtail_drain acts the same given as a YAML
boolean or as the string an ``-e NAME=false`` / ``-e NAME=true`` makes of it (Jinja finds the string
"false" true): each is read through ``| bool``, and ansible-playbook runs show the two spellings agree.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from tests.ansible.conftest import ROOT, run_ansible
from tests.ansible.test_site_playbook import write_inventory

ROLES = ("lowtail_kubelet", "lowtail_preflight", "lowtail_drain")
PREFLIGHT_BOOLEANS = ("lowtail_allow_virtual", "lowtail_stalld", "lowtail_reboot_ok")


def booleans(role: str) -> set[str]:
    spec = yaml.safe_load((ROOT / f"roles/{role}/meta/argument_specs.yml").read_text())
    return {
        name
        for entry in spec["argument_specs"].values()
        for name, option in (entry.get("options") or {}).items()
        if option.get("type") == "bool"
    }


def test_the_preflight_booleans_are_the_roles_own() -> None:
    assert booleans("lowtail_preflight") == set(PREFLIGHT_BOOLEANS)


@pytest.mark.parametrize("role", ROLES)
def test_every_boolean_is_read_through_the_bool_filter(role: str) -> None:
    """Every use is `NAME | bool` (or `NAME | default(...) | bool`). Not uses: setting it (`NAME:`),
    comments, and prose in a message ("... (lowtail_kubelet_apply is false)")."""
    names = booleans(role)
    assert names, role
    bad = []
    role_dir = ROOT / "roles" / role
    for path in sorted(role_dir.glob("tasks/*.yml")) + sorted(role_dir.glob("templates/*")):
        for n, line in enumerate(path.read_text().splitlines(), 1):
            if line.lstrip().startswith("#"):
                continue
            for name in names:
                for m in re.finditer(rf"\b{name}\b(?!:)", line):
                    after = line[m.end() :]
                    if re.match(r"\s*\|\s*(default\([^)]*\)\s*\|\s*)?bool\b", after):
                        continue
                    if re.match(r" is (false|true)\)", after):
                        continue
                    bad.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()}")
    assert not bad, "read without | bool:\n" + "\n".join(bad)


def preflight(tmp_path: Path, machine_roots: dict, extra: list[str]) -> tuple[int, str]:
    # A VMware guest with unlimited RT time: refused unless allow_virtual and stalld are true.
    inventory = write_inventory(
        tmp_path, machine_roots, {"vm-a": {"machine": "vmware_88", "lowtail_rt_runtime_us": -1}}
    )
    playbook = tmp_path / "play.yml"
    playbook.write_text(
        yaml.safe_dump(
            [
                {"import_playbook": str(ROOT / "playbooks/preflight.yml")},
                {
                    "name": "Show what preflight published",
                    "hosts": "lowtail_nodes",
                    "gather_facts": False,
                    "tasks": [
                        {
                            "name": "Print reboot_ok",
                            "ansible.builtin.debug": {
                                "msg": "reboot_ok={{ lowtail_node.reboot_ok | to_json }}"
                            },
                        }
                    ],
                },
            ],
            sort_keys=False,
        )
    )
    result = run_ansible(["ansible-playbook", "-i", str(inventory), str(playbook), "--check", *extra])
    return result.returncode, " ".join((result.stdout + result.stderr).split())


@pytest.mark.slow
@pytest.mark.parametrize("value", [False, True])
def test_preflight_booleans_as_extra_var_strings_act_as_yaml_booleans(
    tmp_path: Path, machine_roots: dict, value: bool
) -> None:
    as_strings = [a for name in PREFLIGHT_BOOLEANS for a in ("-e", f"{name}={str(value).lower()}")]
    as_yaml = ["-e", json.dumps(dict.fromkeys(PREFLIGHT_BOOLEANS, value))]
    runs = {}
    for spelling, extra in (("string", as_strings), ("yaml", as_yaml)):
        rc, out = preflight(tmp_path / spelling, machine_roots, extra)
        refusals = (
            "lowtail_allow_virtual is false" in out,
            "lowtail_rt_runtime_us -1 (no RT throttling) without stalld" in out,
        )
        runs[spelling] = (rc == 0, refusals, f"reboot_ok={json.dumps(value)}" in out)
        assert runs[spelling] == (value, (not value, not value), value), f"{spelling}: {out[-3000:]}"
    assert runs["string"] == runs["yaml"]
