"""Each role README reads like a linux-system-roles README and stays true to the role:

- a table of the role's variables that matches meta/argument_specs.yml: the table is generated from the
  spec (and the default from defaults/main.yml where the spec has none), and this test fails when the
  two drift apart;
- an example playbook that parses and passes ``ansible-playbook --syntax-check`` with the role;
- the variables the role sets for its caller, exactly the public names its tasks set (``set_fact``
  keys and ``register`` names without the ``__`` private prefix);
- the supported versions: every platform and version of ``meta/main.yml``, the minimum Ansible
  version, and for the kubelet role the kubelet minors of ``lowtail.node.kubelet_options``;
- what happens on failure.

``python -m tests.ansible.test_role_readmes`` rewrites the tables (between the markers below, appended
to the README the first time).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
ROLES = sorted(p.parent.parent for p in (ROOT / "roles").glob("*/meta/argument_specs.yml"))
BEGIN = "<!-- variables: generated from meta/argument_specs.yml by tests/ansible/test_role_readmes.py -->"
END = "<!-- /variables -->"


def _cell(value: Any) -> str:
    if value == "":
        return '""'
    text = value if isinstance(value, str) else yaml.safe_dump(value, default_flow_style=True).strip()
    text = text.removesuffix("\n...").strip()
    return text.replace("|", "\\|").replace("\n", " ")


def _description(spec: dict[str, Any]) -> str:
    text = spec.get("description", "")
    return " ".join(text) if isinstance(text, list) else str(text)


def _suboption_defaults(option: dict[str, Any]) -> dict[str, Any]:
    return {k: v["default"] for k, v in (option.get("options") or {}).items() if "default" in v}


def table(role: Path) -> str:
    """The generated block for one role: every entry point's options, its defaults and descriptions."""
    specs = yaml.safe_load((role / "meta/argument_specs.yml").read_text())["argument_specs"]
    defaults_file = role / "defaults/main.yml"
    defaults = (yaml.safe_load(defaults_file.read_text()) or {}) if defaults_file.exists() else {}
    lines = [BEGIN, "", "## Variables (from `meta/argument_specs.yml`)", ""]
    main = (specs.get("main") or {}).get("options") or {}
    only_main: list[str] = []
    for entry, spec in specs.items():
        # Another entry point lists only what it takes beyond (or differently from) main.
        options = {
            k: v for k, v in (spec.get("options") or {}).items() if entry == "main" or main.get(k) != v
        }
        if not options:
            if entry != "main":
                only_main.append(f"`{entry}`")
            continue
        if entry != "main":
            lines += [f"Entry point `{entry}` (`tasks_from: {entry}`) also takes:", ""]
        lines += ["| Variable | Type | Default | Description |", "|---|---|---|---|"]
        for name, option in options.items():
            kind = option.get("type", "str")
            if option.get("elements"):
                kind += f" of {option['elements']}"
            if option.get("choices"):
                kind += " (" + ", ".join(str(c) for c in option["choices"]) + ")"
            if option.get("required"):
                default = "required"
            elif "default" in option:
                default = f"`{_cell(option['default'])}`"
            elif name in defaults and not defaults[name] and _suboption_defaults(option):
                # An empty dict whose keys take their defaults from the spec: show what it means.
                default = f"`{_cell(_suboption_defaults(option))}`"
            elif name in defaults:
                default = f"`{_cell(defaults[name])}`"
            else:
                default = ""
            lines.append(f"| `{name}` | {kind} | {default} | {_cell(_description(option))} |")
        lines.append("")
    if only_main:
        lines += [f"Entry points {', '.join(only_main)} take only variables of the table above.", ""]
    lines.append(END)
    return "\n".join(lines)


def block(readme: str) -> str | None:
    if BEGIN not in readme or END not in readme:
        return None
    return readme[readme.index(BEGIN) : readme.index(END) + len(END)]


@pytest.mark.parametrize("role", ROLES, ids=[r.name for r in ROLES])
def test_readme_variables_match_the_argument_specs(role: Path) -> None:
    readme = (role / "README.md").read_text()
    assert block(readme) == table(role), (
        f"{role.name}/README.md: the variables table differs from meta/argument_specs.yml; "
        "run `python -m tests.ansible.test_role_readmes` and review the diff"
    )


SECTIONS = ("Example playbook", "Variables the role sets", "Supported versions", "What happens on failure")


def section(readme: str, title: str) -> str:
    """The text under ``## title`` up to the next second-level heading ('' when there is none)."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |^<!-- variables|\Z)", readme, re.M | re.S)
    return match.group(1) if match else ""


def _walk_tasks(node: Any, names: set[str]) -> None:
    if isinstance(node, list):
        for item in node:
            _walk_tasks(item, names)
    elif isinstance(node, dict):
        for key in ("ansible.builtin.set_fact", "set_fact"):
            if isinstance(node.get(key), dict):
                names.update(k for k in node[key] if k != "cacheable")
        if isinstance(node.get("register"), str):
            names.add(node["register"])
        for key in ("block", "rescue", "always"):
            _walk_tasks(node.get(key), names)


def names_set_by(role: Path) -> set[str]:
    """The public variables a role's tasks and handlers set: what a caller can read after it ran."""
    names: set[str] = set()
    for path in sorted(role.glob("tasks/*.yml")) + sorted(role.glob("handlers/*.yml")):
        _walk_tasks(yaml.safe_load(path.read_text()), names)
    return {n for n in names if not n.startswith("_")}


def _example(role: Path) -> list[dict[str, Any]]:
    text = section((role / "README.md").read_text(), "Example playbook")
    match = re.search(r"```yaml\n(.*?)```", text, re.S)
    assert match, f"{role.name}/README.md: no ```yaml block under '## Example playbook'"
    plays = yaml.safe_load(match.group(1))
    assert isinstance(plays, list) and all(isinstance(p, dict) and "hosts" in p for p in plays), plays
    return plays


def _uses(node: Any, role: str) -> bool:
    if isinstance(node, list):
        return any(_uses(item, role) for item in node)
    if isinstance(node, dict):
        for key in (
            "ansible.builtin.include_role",
            "ansible.builtin.import_role",
            "include_role",
            "import_role",
        ):
            if isinstance(node.get(key), dict) and node[key].get("name") == role:
                return True
        return any(_uses(v, role) for k, v in node.items() if k in ("roles", "tasks", "block", "role"))
    return node == role


@pytest.mark.parametrize("role", ROLES, ids=[r.name for r in ROLES])
def test_readme_has_the_sections_of_a_system_role(role: Path) -> None:
    readme = (role / "README.md").read_text()
    missing = [t for t in SECTIONS if not section(readme, t).strip()]
    assert not missing, f"{role.name}/README.md lacks (or has empty) sections: {missing}"


def _vars_given(node: Any) -> set[str]:
    """The variable names an example sets: play, role and task ``vars``."""
    if isinstance(node, list):
        return set().union(*(_vars_given(item) for item in node)) if node else set()
    if not isinstance(node, dict):
        return set()
    names = set(node["vars"]) if isinstance(node.get("vars"), dict) else set()
    for key in ("roles", "tasks", "pre_tasks", "post_tasks", "block", "rescue", "always"):
        names |= _vars_given(node.get(key))
    return names


def _specified() -> set[str]:
    names: set[str] = set()
    for role in ROLES:
        for spec in yaml.safe_load((role / "meta/argument_specs.yml").read_text())["argument_specs"].values():
            names |= set(spec.get("options") or {})
    return names


@pytest.mark.parametrize("role", ROLES, ids=[r.name for r in ROLES])
def test_readme_example_playbook_uses_the_role(role: Path) -> None:
    plays = _example(role)
    assert _uses(plays, role.name), f"{role.name}/README.md: the example playbook never runs the role"
    unknown = _vars_given(plays) - _specified()
    assert not unknown, (
        f"{role.name}/README.md: the example sets {sorted(unknown)}, which no role's argument spec has"
    )


def test_readme_example_playbooks_pass_ansible_syntax_check(tmp_path: Path) -> None:
    from tests.ansible.conftest import run_ansible

    paths = []
    for role in ROLES:
        path = tmp_path / f"{role.name}.yml"
        path.write_text(yaml.safe_dump(_example(role), sort_keys=False))
        paths.append(str(path))
    run = run_ansible([str(BIN / "ansible-playbook"), "--syntax-check", "-i", "localhost,", *paths])
    assert run.returncode == 0, run.stdout + run.stderr


@pytest.mark.parametrize("role", ROLES, ids=[r.name for r in ROLES])
def test_readme_lists_exactly_the_variables_the_role_sets(role: Path) -> None:
    text = section((role / "README.md").read_text(), "Variables the role sets")
    listed = set(re.findall(r"^\| `([A-Za-z_][A-Za-z0-9_]*)`", text, re.M))
    actual = names_set_by(role)
    assert listed == actual, (
        f"{role.name}/README.md lists {sorted(listed)} under 'Variables the role sets'; "
        f"its tasks set {sorted(actual)}"
    )
    if not actual:
        assert "None" in text, f"{role.name}/README.md: say 'None' when the role sets no variable"


@pytest.mark.parametrize("role", ROLES, ids=[r.name for r in ROLES])
def test_readme_supported_versions_match_meta(role: Path) -> None:
    text = section((role / "README.md").read_text(), "Supported versions")
    info = yaml.safe_load((role / "meta/main.yml").read_text())["galaxy_info"]
    wanted = [f"Ansible {info['min_ansible_version']}"]
    for platform in info["platforms"]:
        wanted += [platform["name"], *(str(v) for v in platform["versions"])]
    if role.name == "lowtail_kubelet":
        from lowtail.node.kubelet_options import MAX_MINOR, MIN_MINOR

        wanted += [f"1.{MIN_MINOR}", f"1.{MAX_MINOR}"]
    missing = [w for w in wanted if w not in text]
    assert not missing, f"{role.name}/README.md 'Supported versions' does not name {missing} (meta/main.yml)"


def write() -> None:
    for role in ROLES:
        path = role / "README.md"
        readme = path.read_text()
        old = block(readme)
        new = table(role)
        readme = readme.replace(old, new) if old else readme.rstrip("\n") + "\n\n" + new + "\n"
        path.write_text(readme)


if __name__ == "__main__":
    write()
    sys.exit(0)
