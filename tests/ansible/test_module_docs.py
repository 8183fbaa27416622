"""What the modules and roles say about themselves matches what they do: each module's DOCUMENTATION
against its argument_spec, the kernel keys preflight reserves against the kernel role's arguments, and
the shell-inert rule for kernel arguments (one pattern, anchored at the very end)."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from lowtail.node import kernel_args

from .conftest import ROOT, load_module

MODULES = sorted((ROOT / "library").glob("*.py"))


def normalized(options: dict[str, Any]) -> dict[str, Any]:
    """The parts of an option both sides state, with Ansible's defaults filled in (type str, not
    required, no default)."""
    out = {}
    for name, spec in options.items():
        out[name] = {
            "type": spec.get("type", "str"),
            "required": bool(spec.get("required", False)),
            "default": spec.get("default"),
            "choices": spec.get("choices"),
            "elements": spec.get("elements"),
            "options": normalized(spec["options"]) if spec.get("options") else None,
        }
    return out


@pytest.mark.parametrize("path", MODULES, ids=[p.stem for p in MODULES])
def test_documentation_matches_the_argument_spec(path: Path) -> None:
    module = load_module(path, f"doc_{path.stem}")
    documented = yaml.safe_load(module.DOCUMENTATION)
    assert documented["module"] == path.stem
    assert normalized(documented["options"]) == normalized(module.ARGUMENT_SPEC)
    for name, spec in documented["options"].items():
        assert spec.get("description"), f"{path.stem}: option {name} has no description"


def test_kernel_role_keys_match_the_arguments_the_kernel_role_adds() -> None:
    """Preflight refuses an extra argument that repeats a key the kernel role sets itself; the role's
    own keys are the literal 'key=' words of its argument list (vars/main.yml)."""
    node_plan = load_module(ROOT / "library/lowtail_node_plan.py", "keys_lowtail_node_plan")
    text = (ROOT / "roles/lowtail_kernel/vars/main.yml").read_text()
    expression = text[text.index("__lowtail_kernel_args:") : text.index("__lowtail_kernel_arg_keys:")]
    role_keys = set(re.findall(r"'([A-Za-z0-9_.]+)=", expression)) | (
        {"idle"} if "'idle=poll'" in expression else set()
    )
    assert role_keys == set(node_plan.KERNEL_ROLE_KEYS)


@pytest.mark.parametrize("arg", ["quiet\n", "quiet\r", "a b", "x$(id)", 'a"b', "a;b", "", "-x", 7])
def test_kernel_arguments_that_are_not_shell_inert_are_refused(arg: object) -> None:
    assert not kernel_args.is_safe(arg)
    node_plan = load_module(ROOT / "library/lowtail_node_plan.py", "args_lowtail_node_plan")
    with pytest.raises(node_plan.PreflightError, match="a kernel argument may only use"):
        node_plan.check_kernel_args([arg], None, set())


@pytest.mark.parametrize(
    "arg", ["quiet", "rcu_nocb_poll", "isolcpus=managed_irq,7-83", "console=ttyS0,115200"]
)
def test_ordinary_kernel_arguments_pass(arg: str) -> None:
    assert kernel_args.is_safe(arg)
    assert kernel_args.unsafe([arg, "a\n"]) == ["a\n"]


@pytest.mark.parametrize("value", ["950000\n", "950000 ", "9e5"])
def test_integer_inputs_with_a_trailing_newline_are_refused(value: str) -> None:
    node_plan = load_module(ROOT / "library/lowtail_node_plan.py", "nl_lowtail_node_plan")
    with pytest.raises(node_plan.PreflightError, match="expected an integer"):
        node_plan.check_rt_budget(value, 1000000, False)
    with pytest.raises(node_plan.PreflightError, match="expected a whole number"):
        node_plan.check_hugepages(Path("/nonexistent"), {"size": "1G", "count": value}, {0: 0})


def test_kubelet_memory_defaults_are_written_once() -> None:
    """The reservations' defaults have one source, the plan module's KUBELET_MEMORY_DEFAULTS: its
    argument_spec is built from it (DOCUMENTATION is held equal by the test above), the preflight role's
    argument spec states the same defaults (it documents them), and neither the role's defaults nor
    the example inventory restate them."""
    node_plan = load_module(ROOT / "library/lowtail_node_plan.py", "mem_lowtail_node_plan")
    source = node_plan.KUBELET_MEMORY_DEFAULTS
    assert set(source) == {"kube_reserved", "system_reserved", "eviction_hard", "per_numa"}
    module_spec = node_plan.ARGUMENT_SPEC["kubelet_memory"]["options"]
    assert {k: v["default"] for k, v in module_spec.items()} == source
    role = yaml.safe_load((ROOT / "roles/lowtail_preflight/meta/argument_specs.yml").read_text())
    role_spec = role["argument_specs"]["main"]["options"]["lowtail_kubelet_memory"]["options"]
    assert {k: v["default"] for k, v in role_spec.items()} == source
    defaults = yaml.safe_load((ROOT / "roles/lowtail_preflight/defaults/main.yml").read_text())
    assert defaults["lowtail_kubelet_memory"] == {}
    example = yaml.safe_load((ROOT / "inventory/example/group_vars/lowtail_nodes.yml").read_text())
    assert "lowtail_kubelet_memory" not in example


@pytest.mark.parametrize(
    "given",
    [None, {}, {"kube_reserved": "2Gi"}, {"kube_reserved": None, "per_numa": None}],
    ids=["unset", "empty", "one-key", "null-keys"],
)
def test_kubelet_memory_keys_left_out_take_the_module_defaults(
    given: dict[str, Any] | None, machine_roots: dict[str, Any]
) -> None:
    from tests.ansible.test_modules import params

    node_plan = load_module(ROOT / "library/lowtail_node_plan.py", "memd_lowtail_node_plan")
    node, _ = node_plan.build_node(params(*machine_roots["epyc9634_2s"], kubelet_memory=given))
    wanted = {**node_plan.KUBELET_MEMORY_DEFAULTS, **{k: v for k, v in (given or {}).items() if v}}
    memory = node["kubelet_memory"]
    assert (memory["kube_reserved"], memory["system_reserved"], memory["eviction_hard"]) == (
        wanted["kube_reserved"],
        wanted["system_reserved"],
        wanted["eviction_hard"],
    )
