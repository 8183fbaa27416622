"""Render lowtail's Kubernetes manifests with the real role (ansible-playbook, local connection)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.ansible.conftest import zip_bytecode_env

REPO = Path(__file__).resolve().parents[2]
ANSIBLE_PLAYBOOK = Path(sys.executable).parent / "ansible-playbook"
IMAGE = "registry.example.com/rl/lowtail:0.1.0"


@dataclass
class Rendered:
    returncode: int
    output: str
    out_dir: Path

    def objects(self) -> dict[str, dict[str, Any]]:
        """Every rendered object by kind."""
        found: dict[str, dict[str, Any]] = {}
        for path in sorted(self.out_dir.glob("*.yaml")):
            for doc in yaml.safe_load_all(path.read_text()):
                if doc:
                    found[doc["kind"]] = doc
        return found


def render_manifests(
    tmp: Path,
    inventory_vars: dict[str, Any],
    check: bool = False,
    children: dict[str, Any] | None = None,
    playbook: Path = REPO / "playbooks" / "k8s.yml",
    *,
    extra: Sequence[str] = (),
) -> Rendered:
    """Run playbooks/k8s.yml (or another playbook) with these inventory variables (group_vars of all,
    not extra vars), inventory groups and further ansible-playbook arguments."""
    out_dir = Path(inventory_vars.get("lowtail_k8s_output_dir", tmp / "manifests"))
    inventory = {
        "all": {
            "hosts": {
                "localhost": {"ansible_connection": "local", "ansible_python_interpreter": sys.executable}
            },
            "vars": {"lowtail_k8s_output_dir": str(out_dir), **inventory_vars},
            # The play runs once for the tuned nodes' group; here that is the controller itself.
            "children": children or {"lowtail_nodes": {"hosts": {"localhost": None}}},
        }
    }
    inv = tmp / "inventory.yml"
    inv.write_text(yaml.safe_dump(inventory))
    cmd = [str(ANSIBLE_PLAYBOOK), "-i", str(inv), str(playbook), *extra]
    if check:
        cmd += ["--check", "--diff"]
    proc = subprocess.run(
        cmd,
        check=False,
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        env=zip_bytecode_env(
            {"PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin", "ANSIBLE_NOCOLOR": "1", "HOME": str(tmp)}
        ),
    )
    return Rendered(proc.returncode, proc.stdout + proc.stderr, out_dir)


@pytest.fixture(scope="session")
def render(tmp_path_factory: pytest.TempPathFactory) -> Callable[..., Rendered]:
    def _render(inventory_vars: dict[str, Any] | None = None, check: bool = False) -> Rendered:
        tmp = tmp_path_factory.mktemp("k8s")
        return render_manifests(tmp, {"lowtail_k8s_image": IMAGE, **(inventory_vars or {})}, check=check)

    return _render


@pytest.fixture(scope="session")
def default_render(render: Callable[..., Rendered]) -> Rendered:
    rendered = render()
    assert rendered.returncode == 0, rendered.output
    return rendered
