"""Every boolean of the kernel, tuning, runtime, k8s and validate roles acts the same given as a YAML
boolean or as an ``-e NAME=true`` / ``-e NAME=false`` string.

An extra variable given as ``-e NAME=false`` arrives as the string "false": Jinja finds any non-empty
string true, and ansible-core 2.19 refuses a ``when:`` whose result comes from a string ("Conditional
result (True) was derived from value of type 'str'"). So every use of a boolean must go through the
``bool`` filter. A static scan of every Jinja expression of the roles (and the playbooks that read their
variables) finds a use without it; ansible-playbook runs with each boolean given both ways as a string
show each one acts (the validate role's are run in tests/validation/test_role.py).
"""

from __future__ import annotations

import json
import re
import sys
import sysconfig
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.ansible.conftest import ROOT, run_ansible

ROLES = ("lowtail_kernel", "lowtail_tuning", "lowtail_runtime", "lowtail_k8s", "lowtail_validate")
# Keys whose string value is one Jinja expression without {{ }}.
EXPRESSION_KEYS = {"when", "that", "changed_when", "failed_when", "until"}
JINJA = re.compile(r"\{\{(.*?)\}\}|\{%(.*?)%\}", re.S)
STRING_LITERAL = re.compile(r"'[^']*'|\"[^\"]*\"")


def bool_options(role: str) -> set[str]:
    spec = yaml.safe_load((ROOT / "roles" / role / "meta/argument_specs.yml").read_text())
    return {
        name
        for entry in spec["argument_specs"].values()
        for name, option in entry.get("options", {}).items()
        if option.get("type") == "bool"
    }


def _strings(node: Any, key: str = "") -> Iterator[tuple[str, str]]:
    """(key, string) for every string of a YAML document, with the mapping key it sits under."""
    if isinstance(node, str):
        yield key, node
    elif isinstance(node, list):
        for item in node:
            yield from _strings(item, key)
    elif isinstance(node, dict):
        for k, v in node.items():
            yield from _strings(v, str(k))


def expressions(path: Path) -> Iterator[str]:
    """Every Jinja expression of a task, vars or playbook file, or of a template, string literals
    removed (a message that names a variable is not a use of it)."""
    if path.suffix == ".j2":
        texts: list[tuple[str, str]] = [("", path.read_text())]
    else:
        texts = list(_strings(yaml.safe_load(path.read_text())))
    for key, text in texts:
        if key in EXPRESSION_KEYS and "{{" not in text:
            found = [text]
        else:
            found = [a or b for a, b in JINJA.findall(text)]
        for expression in found:
            yield STRING_LITERAL.sub("''", expression)


def role_files(role: str) -> list[Path]:
    base = ROOT / "roles" / role
    return sorted(
        p for sub in ("tasks", "handlers", "vars", "templates") for p in (base / sub).glob("*") if p.is_file()
    )


def raw_uses(name: str, files: list[Path]) -> list[str]:
    """Uses of ``name`` in these files that do not pass it through ``| bool`` (a ``| default(...)``
    before it is allowed)."""
    default = r"default\((?:[^()]|\([^()]*\))*\)"
    raw = re.compile(rf"\b{name}\b(?!\s*\|\s*(?:{default}\s*\|\s*)?bool\b)")
    return [f"{p.name}: {e.strip()}" for p in files for e in expressions(p) if raw.search(e)]


@pytest.mark.parametrize("role", ROLES)
def test_every_boolean_of_the_role_is_read_through_the_bool_filter(role: str) -> None:
    names = bool_options(role)
    assert names, role
    files = role_files(role) + sorted((ROOT / "playbooks").rglob("*.yml")) + [ROOT / "site.yml"]
    found = {name: raw_uses(name, files) for name in names}
    assert {k: v for k, v in found.items() if v} == {}


def test_the_scan_finds_a_raw_use_in_a_condition_and_in_a_template(tmp_path: Path) -> None:
    """The scan itself: a bare condition, a template test and a use inside {{ }} are found; a use through
    the filter and a variable named in a message are not."""
    tasks = tmp_path / "main.yml"
    tasks.write_text(
        "- when: x_on\n"
        "- when: [x_on | bool, other]\n"
        "- debug: {msg: \"{{ 'x_on is false' if not x_on | bool else '' }}\"}\n"
        "- set_fact: {y: '{{ x_on and z }}'}\n"
    )
    template = tmp_path / "t.j2"
    template.write_text("{% if x_on %}\nw /x\n{% endif %}\n{% if x_on | default(true) | bool %}{% endif %}\n")
    uses = raw_uses("x_on", [tasks, template])
    assert [u.split(": ", 1)[1] for u in uses] == ["x_on", "x_on and z", "if x_on"], uses


def task_output(out: str, name: str) -> str:
    """What the play printed for the first task whose title contains ``name``, up to the next task."""
    start = out.index(f" : {name}")
    end = out.find("\nTASK [", start)
    return out[start : end if end >= 0 else len(out)]


def skipped(out: str, name: str, host: str) -> bool:
    result = task_output(out, name)
    assert f"[{host}]" in result or f"for {host}" in result, result  # include_tasks: "included: ... for"
    return f"skipping: [{host}]" in result


KERNEL_TUNING = sorted(bool_options("lowtail_kernel") | bool_options("lowtail_tuning"))


@pytest.mark.slow
@pytest.mark.parametrize("value", ["true", "false"])
def test_kernel_and_tuning_booleans_given_as_extra_var_strings_act_as_booleans(
    tmp_path: Path, machine_roots: dict[str, tuple[Path, Path]], value: str
) -> None:
    """site.yml in check mode (nothing changes on this machine) with every boolean of both roles given as
    ``-e NAME=value``: each one's effect shows in the output (a task run or skipped, a line in a diff)."""
    from tests.ansible.test_site_playbook import GOOD, write_inventory

    on = value == "true"
    inventory = write_inventory(tmp_path, machine_roots, {"good-host": GOOD})
    irq = tmp_path / "hosts/good-host/proc/irq/0/smp_affinity_list"  # one IRQ on every CPU, to move
    irq.parent.mkdir(parents=True)
    irq.write_text("0-167\n")
    extra = [a for name in KERNEL_TUNING for a in ("-e", f"{name}={value}")]
    result = run_ansible(["ansible-playbook", "-i", str(inventory), "site.yml", "--check", "--diff", *extra])
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    words = " ".join(out.split())
    # lowtail_kernel_rcu_normal_after_boot: the argument in the GRUB drop-in's diff.
    assert ("rcupdate.rcu_normal_after_boot=1" in out) is on, out
    # lowtail_kernel_apply and lowtail_kernel_reboot_ok: the reboot is planned only with both.
    assert ("Check mode: would drain (no kubelet), reboot good-host" in words) is on, out
    assert ("not rebooting because lowtail_kernel_reboot_ok is false" in words) is not on, out
    # lowtail_tuning_irqbalance, _ksm_off, _mce_ignore_ce: their lines in the rendered files' diffs.
    assert ("IRQBALANCE_BANNED_CPULIST=" in out) is on, out
    assert ("/sys/kernel/mm/ksm/run" in out) is on, out
    assert ("machinecheck*/ignore_ce" in out) is on, out
    # lowtail_tuning_fwupd_refresh_off, _apply, _apply_irq_affinity: their tasks run or are skipped.
    assert skipped(out, "Look for fwupd's refresh timer", "good-host") is not on, out
    assert skipped(out, "Apply the runtime tuning that differs", "good-host") is not on, out
    assert skipped(out, "Move the IRQs that exist now", "good-host") is not on, out
    assert irq.read_text() == "0-167\n"  # check mode


def runtime_play(tmp: Path, *extra: str) -> tuple[int, str]:
    """The lowtail_runtime role alone, in check mode, on this machine over a local connection: a
    wheelhouse description for this Python whose venv is already installed (its stamp exists), so the
    role goes on to the link, the plan and the Ray unit without installing anything."""
    from tests.ansible.test_runtime_unit import PLAN

    tag = f"cp{sys.version_info[0]}{sys.version_info[1]}-{sysconfig.get_platform()}"  # the node's Python
    wheelhouse_id = "0123456789abcdef"
    archive = tmp / "wheelhouse.tar.gz"
    archive.write_bytes(b"")
    description = tmp / "wheelhouse.json"
    description.write_text(
        json.dumps(
            {
                "id": wheelhouse_id,
                "archive": str(archive),
                "lowtail_version": "0",
                "python": tag,
                "wheels": ["pip-24.0-py3-none-any.whl"],
                "pip": "pip",
            }
        )
    )
    prefix = tmp / "opt"
    (prefix / "venvs" / wheelhouse_id).mkdir(parents=True)
    (prefix / "venvs" / wheelhouse_id / ".lowtail-wheelhouse").write_text(wheelhouse_id + "\n")
    playbook = tmp / "runtime.yml"
    playbook.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "Runtime",
                    "hosts": "all",
                    "gather_facts": False,
                    "roles": [{"role": "lowtail_runtime"}],
                }
            ]
        )
    )
    host = {
        "ansible_connection": "local",
        "ansible_python_interpreter": sys.executable,
        "lowtail_runtime_wheelhouse": str(description),
        "lowtail_runtime_prefix": str(prefix),
        "lowtail_runtime_python": sys.executable,
        "lowtail_runtime_config_dir": str(tmp / "etc"),
        "lowtail_runtime_plan": PLAN,
    }
    inventory = tmp / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"hosts": {"node-a": host}}}))
    result = run_ansible(["ansible-playbook", "-i", str(inventory), str(playbook), "--check", *extra])
    return result.returncode, result.stdout + result.stderr


@pytest.mark.slow
@pytest.mark.parametrize("value", ["true", "false"])
def test_runtime_link_cli_and_ray_enabled_given_as_strings_act_as_booleans(
    tmp_path: Path, value: str
) -> None:
    on = value == "true"
    ray = json.dumps({"lowtail_runtime_ray": {"enabled": "false", "head": value}})
    rc, out = runtime_play(tmp_path, "-e", f"lowtail_runtime_link_cli={value}", "-e", ray)
    assert rc == 0, out
    assert skipped(out, "Link the lowtail command into /usr/local/bin", "node-a") is not on, out
    # Ray given as the string "false" is off: the role looks for a unit to remove, and runs none.
    assert not skipped(out, "Look for an installed Ray unit", "node-a"), out
    assert skipped(out, "Enable and start the Ray unit", "node-a"), out
    assert not (tmp_path / "etc").exists()  # check mode


@pytest.mark.slow
def test_runtime_ray_worker_given_as_strings_needs_the_heads_address(tmp_path: Path) -> None:
    """enabled "true" and head "false": a worker, which must be told the head's address."""
    ray = json.dumps({"lowtail_runtime_ray": {"enabled": "true", "head": "false", "address": ""}})
    rc, out = runtime_play(tmp_path, "-e", ray)
    assert rc != 0, out
    words = " ".join(out.split())
    assert "for a worker an address HOST:PORT of the head" in words, out
    assert "fatal: [node-a]" in task_output(out, "Check the Ray options"), out


@pytest.mark.slow
@pytest.mark.parametrize("value", ["true", "false"])
def test_k8s_label_nodes_given_as_a_string_acts_as_a_boolean(tmp_path: Path, value: str) -> None:
    from tests.deploy.test_apply import calls, run, setup_cluster

    kubectl, bin_dir = setup_cluster(tmp_path)
    rendered = run(tmp_path, kubectl, extra=["-e", f"lowtail_k8s_label_nodes={value}"])
    assert rendered.returncode == 0, rendered.output
    made = calls(bin_dir)
    assert ("label node node-a lowtail.io/tuned=true --overwrite" in made) is (value == "true"), made
