"""Shared fixtures for the Ansible tests: the repository's modules loaded for unit tests, and a
runner for ansible-playbook/ansible against fixture machines over a local connection."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def load_module(path: Path, name: str) -> ModuleType:
    """Import a module file (library/ or filter_plugins/) with ``ansible.module_utils.lowtail`` pointing
    at lowtail.node, which is what the module_utils/lowtail symlink ships to hosts."""
    import lowtail.node
    import lowtail.node.cpulist
    import lowtail.node.kernel_args
    import lowtail.node.kubelet_memory
    import lowtail.node.plan
    import lowtail.node.topology

    sys.modules.setdefault("ansible.module_utils.lowtail", lowtail.node)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="session")
def node_plan_module() -> ModuleType:
    return load_module(ROOT / "library/lowtail_node_plan.py", "lowtail_node_plan")


@pytest.fixture(scope="session")
def irq_module() -> ModuleType:
    return load_module(ROOT / "library/lowtail_irq_affinity.py", "lowtail_irq_affinity")


@pytest.fixture(scope="session")
def filters() -> ModuleType:
    return load_module(ROOT / "filter_plugins/lowtail.py", "lowtail_filters")


ZIP_BYTECODE_HOOK = Path(__file__).resolve().parent / "zip_bytecode"
ZIP_BYTECODE_CACHE = ROOT / "build/ansible-zip-bytecode"


def zip_bytecode_env(env: dict[str, str]) -> dict[str, str]:
    """``env`` with the test-only bytecode cache for zip imports (``zip_bytecode/sitecustomize.py``):
    the processes of an ansible-playbook run, local-connection modules included, compile Ansible's
    module_utils once instead of at every module run."""
    ZIP_BYTECODE_CACHE.mkdir(parents=True, exist_ok=True)
    path = env.get("PYTHONPATH")
    return {
        **env,
        "PYTHONPATH": f"{ZIP_BYTECODE_HOOK}:{path}" if path else str(ZIP_BYTECODE_HOOK),
        "LOWTAIL_TEST_ZIP_BYTECODE": str(ZIP_BYTECODE_CACHE),
    }


def ansible_env() -> dict[str, str]:
    env = zip_bytecode_env(dict(os.environ))
    env["PATH"] = f"{BIN}:{env.get('PATH', '')}"
    env["ANSIBLE_CONFIG"] = str(ROOT / "ansible.cfg")
    env["ANSIBLE_NOCOLOR"] = "1"
    env["ANSIBLE_FORCE_COLOR"] = "0"
    return env


def local_node_inventory(directory: Path, host: str = "node-a") -> Path:
    """An inventory of one host on the local connection, with this interpreter (lowtail importable)."""
    inventory = directory / "hosts.yml"
    inventory.write_text(
        f"all:\n  hosts:\n    {host}:\n      ansible_connection: local\n"
        f"      ansible_python_interpreter: {sys.executable}\n"
    )
    return inventory


def run_ansible(args: list[str], timeout: int = 300, **kw: Any) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        args, cwd=ROOT, env=ansible_env(), capture_output=True, text=True, timeout=timeout, check=False, **kw
    )


@pytest.fixture(scope="session")
def sysfs_module() -> ModuleType:
    return load_module(ROOT / "library/lowtail_sysfs_values.py", "lowtail_sysfs_values")
