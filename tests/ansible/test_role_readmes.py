"""Each role README carries a table of the role's variables that matches meta/argument_specs.yml: the
table is generated from the spec (and the default from defaults/main.yml where the spec has none), and
this test fails when the two drift apart.

``python -m tests.ansible.test_role_readmes`` rewrites the tables (between the markers below, appended
to the README the first time).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
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
