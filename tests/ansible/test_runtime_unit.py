"""The Ray unit of lowtail_runtime: every inventory value reaches the unit file as data.

The template is rendered by Ansible's own template module (a local play) and read back with
systemd-analyze verify and with systemd's quoting rules (systemd.syntax(7)): a value with a newline, a
quote, a backslash, a ``%`` or a ``$`` must stay one value and never become a directive of its own."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import yaml

from tests.ansible.conftest import ROOT, run_ansible

TEMPLATE = ROOT / "roles/lowtail_runtime/templates/lowtail-ray.service.j2"
INJECTION = "1\nExecStartPre=+/bin/touch /tmp/lowtail-pwned"
RAY: dict[str, Any] = {
    "enabled": True,
    "head": True,
    "address": "",
    "port": 6379,
    "num_cpus": "auto",
    "object_store_mib": 512,
    "resources": {},
    "env": {},
    "user": "lowtail",
    "node_ip": "",
    "nice": 0,
    "ports": {},
}
PLAN = {"housekeeping": "0-6", "isolated": "7-83", "per_node": {}, "l3_groups": [], "kernel_args": []}


def local_play(tmp_path: Path, tasks: list[dict[str, Any]], variables: dict[str, Any]) -> tuple[int, str]:
    playbook = tmp_path / "play.yml"
    playbook.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "Ray unit",
                    "hosts": "localhost",
                    "gather_facts": False,
                    "vars": variables,
                    "tasks": tasks,
                }
            ]
        )
    )
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(
        yaml.safe_dump(
            {
                "all": {
                    "hosts": {
                        "localhost": {
                            "ansible_connection": "local",
                            "ansible_python_interpreter": sys.executable,
                        }
                    }
                }
            }
        )
    )
    result = run_ansible(["ansible-playbook", "-i", str(inventory), str(playbook)])
    return result.returncode, result.stdout + result.stderr


def render(tmp_path: Path, ray: dict[str, Any]) -> tuple[int, str, Path]:
    unit = tmp_path / "lowtail-ray.service"
    variables = {
        "__lowtail_runtime_r": {**RAY, **ray},
        "lowtail_runtime_plan": PLAN,
        "__lowtail_runtime_num_cpus": 77,
        "lowtail_runtime_config_dir": "/etc/lowtail",
        "lowtail_runtime_prefix": "/opt/lowtail",
        "__lowtail_runtime_state_dir": "lowtail",
    }
    task = {
        "name": "Render",
        "ansible.builtin.template": {"src": str(TEMPLATE), "dest": str(unit), "mode": "0644"},
    }
    rc, out = local_play(tmp_path, [task], variables)
    return rc, out, unit


def directives(text: str) -> list[tuple[str, str]]:
    """(key, value) of every directive line, with backslash continuations joined (systemd.syntax)."""
    joined = re.sub(r"\\\n", " ", text)
    return [
        tuple(line.split("=", 1))  # type: ignore[misc]
        for line in joined.splitlines()
        if line and not line.startswith(("#", ";", "[")) and "=" in line
    ]


def unquote_words(value: str, exec_line: bool = False) -> list[str]:
    """systemd's splitting of a directive value into words: double quotes group, backslash escapes the
    next character, %% is %, and on Exec*= lines $$ is $ (only what the filter emits is handled)."""
    words, i = [], 0
    while i < len(value):
        if value[i] == " ":
            i += 1
            continue
        assert value[i] == '"', value
        i += 1
        word = ""
        while value[i] != '"':
            if value[i] == "\\":
                i += 1
            elif value[i] == "%" or (exec_line and value[i] == "$"):
                assert value[i + 1] == value[i], value
                i += 1
            word += value[i]
            i += 1
        words.append(word)
        i += 1
    return words


@pytest.fixture(scope="module")
def filters() -> ModuleType:
    from tests.ansible.conftest import load_module

    return load_module(ROOT / "filter_plugins/lowtail.py", "lowtail_filters_unit")


@pytest.mark.parametrize(
    ("value", "quoted"),
    [
        ("plain", '"plain"'),
        ('a"b', '"a\\"b"'),
        ("a\\b", '"a\\\\b"'),
        ("100%", '"100%%"'),
        ("$HOME", '"$HOME"'),
    ],
)
def test_systemd_quote_keeps_every_character_data(filters: ModuleType, value: str, quoted: str) -> None:
    assert filters.systemd_quote(value) == quoted
    assert unquote_words(quoted) == [value]


def test_systemd_quote_doubles_dollar_on_exec_lines_and_refuses_control_characters(
    filters: ModuleType,
) -> None:
    assert filters.systemd_quote("$X", exec_line=True) == '"$$X"'
    for bad in (INJECTION, "a\rb", "a\tb", "a\x00b"):
        with pytest.raises(Exception, match="control character"):
            filters.systemd_quote(bad)


@pytest.mark.slow
def test_env_values_with_quotes_and_specifiers_stay_one_value(tmp_path: Path) -> None:
    env = {"A": 'he said "hi"', "B": "50% \\ of $HOME", "C": "x y"}
    resources = {"odd$name%": 1}
    rc, out, unit = render(tmp_path, {"env": env, "resources": resources})
    assert rc == 0, out
    text = unit.read_text()
    found = directives(text)
    envs = [unquote_words(v)[0] for k, v in found if k == "Environment"]
    assert envs == ["LOWTAIL_PLAN=/etc/lowtail/plan.json"] + [f"{k}={v}" for k, v in env.items()], text
    (execstart,) = [v for k, v in found if k == "ExecStart"]
    resources_word = execstart[execstart.index('"--resources=') :].strip()
    (word,) = unquote_words(resources_word, exec_line=True)
    assert json.loads(word.removeprefix("--resources=")) == {"lowtail_isolated_cpu": 77, **resources}
    assert [k for k, _ in found].count("ExecStart") == 1 and "ExecStartPre" not in dict(found)
    if shutil.which("systemd-analyze"):
        fixed = unit.with_name("lowtail-ray-check.service")
        # verify wants an executable ExecStart; the unit's venv does not exist here.
        fixed.write_text(
            re.sub(r"/opt/lowtail/venv/bin/ray", "/bin/true", text)
            .replace("User=lowtail\n", "")
            .replace("Group=lowtail\n", "")
        )
        check = subprocess.run(
            ["systemd-analyze", "verify", "--man=no", str(fixed)],
            check=False,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert check.returncode == 0, check.stderr


@pytest.mark.slow
def test_env_value_with_a_newline_never_becomes_a_directive(tmp_path: Path) -> None:
    rc, out, unit = render(tmp_path, {"env": {"LOWTAIL_X": INJECTION}})
    assert rc != 0, out
    assert "control character" in out, out
    assert not unit.exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    "ray",
    [
        {"env": {"LOWTAIL_X": INJECTION}},
        {"env": {"BAD KEY": "1"}},
        {"env": {"A\nExecStartPre": "1"}},
        {"head": False, "address": "10.0.0.1:6379\n"},
        {"head": False, "address": 'h";x:6379'},
        {"user": "lowtail\nExecStartPre=+/bin/sh"},
        {"node_ip": "10.0.0.1\n"},
    ],
    ids=[
        "env_value_newline",
        "env_key_space",
        "env_key_newline",
        "address_newline",
        "address_quote",
        "user",
        "node_ip_newline",
    ],
)
def test_validation_refuses_unit_injection_before_anything_is_installed(
    tmp_path: Path, ray: dict[str, Any]
) -> None:
    archive = tmp_path / "wheelhouse.tar"
    archive.write_text("")
    wheelhouse = tmp_path / "wheelhouse.json"
    wheelhouse.write_text(
        json.dumps(
            {
                "id": "0123456789abcdef",
                "archive": str(archive),
                "lowtail_version": "0",
                "python": "x",
                "wheels": ["pip-24.0-py3-none-any.whl"],
            }
        )
    )
    variables = {
        "lowtail_runtime_wheelhouse": str(wheelhouse),
        "lowtail_runtime_plan": PLAN,
        "lowtail_runtime_ray": {
            **{k: v for k, v in RAY.items() if k in ("enabled", "head")},
            "address": "10.0.0.1:6379",
            **ray,
        },
        "lowtail_runtime_python": sys.executable,
    }
    task = {
        "name": "Validate",
        "ansible.builtin.include_role": {"name": "lowtail_runtime", "tasks_from": "validate"},
    }
    rc, out = local_play(tmp_path, [task], variables)
    assert rc != 0, out
    assert "lowtail_runtime_ray" in out and ("Check the Ray options" in out or "environment" in out), out
