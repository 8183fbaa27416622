"""lowtail.node.kubelet_options: what each kubelet version refuses, and what lowtail writes for it."""

from __future__ import annotations

import pytest

from lowtail.node import kubelet_options as ko
from lowtail.node.kubelet_options import (
    KubeletVersionError,
    check,
    check_config,
    choose_options,
    eviction_hard,
)

# The role's historic default: kubelet 1.31-1.33 refused it.
OLD_DEFAULT = {
    "full-pcpus-only": "true",
    "strict-cpu-reservation": "true",
    "prefer-align-cpus-by-uncorecache": "true",
}


@pytest.mark.parametrize("version", ["Kubernetes v1.31.4", "v1.30.0", "Kubernetes v1.28.15"])
def test_uncorecache_option_is_unknown_before_1_32(version: str) -> None:
    problems = check(version, OLD_DEFAULT).problems
    assert any("unknown CPU Manager Policy option 'prefer-align-cpus-by-uncorecache'" in p for p in problems)


@pytest.mark.parametrize("version", ["v1.32.1", "v1.33.0"])
def test_uncorecache_option_needs_the_alpha_gate_in_1_32_and_1_33(version: str) -> None:
    problems = check(version, {"prefer-align-cpus-by-uncorecache": "true"}).problems
    assert problems == [
        f"option 'prefer-align-cpus-by-uncorecache' is alpha in kubelet {version[1:5]} and needs "
        "featureGates.CPUManagerPolicyAlphaOptions: true"
    ]
    assert check(version, {"prefer-align-cpus-by-uncorecache": "true"}, {ko.ALPHA_GATE: True}).problems == []


def test_old_default_starts_only_on_1_34_and_later() -> None:
    assert check("v1.34.2", OLD_DEFAULT).problems == []
    assert check("v1.35.0", OLD_DEFAULT).problems == []
    assert check("v1.33.5", OLD_DEFAULT).problems != []


def test_beta_option_is_refused_when_the_beta_gate_is_turned_off() -> None:
    problems = check("v1.30.1", {"full-pcpus-only": "true"}, {ko.BETA_GATE: False}).problems
    assert problems == [
        "option 'full-pcpus-only' is beta in kubelet 1.30 and needs "
        "featureGates.CPUManagerPolicyBetaOptions: true"
    ]
    # GA from 1.33: no gate is consulted.
    assert check("v1.33.0", {"full-pcpus-only": "true"}, {ko.BETA_GATE: False}).problems == []


@pytest.mark.parametrize(
    ("version", "a", "b"),
    [
        ("v1.31.0", "full-pcpus-only", "distribute-cpus-across-cores"),
        ("v1.31.0", "distribute-cpus-across-numa", "distribute-cpus-across-cores"),
        ("v1.32.0", "prefer-align-cpus-by-uncorecache", "distribute-cpus-across-cores"),
        ("v1.34.0", "prefer-align-cpus-by-uncorecache", "distribute-cpus-across-numa"),
    ],
)
def test_forbidden_pairs_are_refused_together_but_not_alone(version: str, a: str, b: str) -> None:
    gates = {ko.ALPHA_GATE: True}
    both = check(version, {a: "true", b: "true"}, gates).problems
    assert both == [f"options {a!r} and {b!r} can not be used at the same time (kubelet {version[1:5]})"]
    assert check(version, {a: "true", b: "false"}, gates).problems == []


def test_align_by_socket_is_refused_with_single_numa_node() -> None:
    gates = {ko.ALPHA_GATE: True}
    problems = check("v1.29.0", {"align-by-socket": "true"}, gates, "single-numa-node").problems
    assert problems == [
        "option 'align-by-socket' is incompatible with topologyManagerPolicy single-numa-node"
    ]
    assert check("v1.29.0", {"align-by-socket": "true"}, {ko.ALPHA_GATE: True}, "restricted").problems == []


@pytest.mark.parametrize("value", [True, "yes", "on", ""])
def test_option_values_must_be_go_bool_strings(value: object) -> None:
    problems = check("v1.34.0", {"full-pcpus-only": value}).problems
    assert problems == [
        f"option 'full-pcpus-only' has value {value!r}; expected the string 'true' or 'false'"
    ]


def test_every_problem_is_reported_at_once() -> None:
    problems = check("v1.31.0", {"nope": "true", "align-by-socket": "maybe"}, {}, "single-numa-node").problems
    assert len(problems) == 3


@pytest.mark.parametrize("version", ["v1.27.9", "v1.36.0", "v2.0.0", "garbage"])
def test_versions_outside_the_table_are_refused_with_the_range(version: str) -> None:
    with pytest.raises(KubeletVersionError, match=r"1\.28|not readable"):
        check(version, {})


@pytest.mark.parametrize(
    ("version", "options"),
    [
        ("v1.28.0", {"full-pcpus-only": "true"}),
        ("v1.31.3", {"full-pcpus-only": "true"}),
        ("v1.32.0", {"full-pcpus-only": "true"}),
        ("v1.33.0", {"full-pcpus-only": "true", "strict-cpu-reservation": "true"}),
        (
            "v1.34.1",
            OLD_DEFAULT,
        ),
    ],
)
def test_recommended_options_never_need_the_alpha_gate(version: str, options: dict[str, str]) -> None:
    result = choose_options(version, None, {}, "single-numa-node")
    assert result.options == options
    assert result.gates == {}
    assert result.problems == []


def test_explicit_alpha_option_gets_its_gate() -> None:
    result = choose_options("v1.32.0", {"prefer-align-cpus-by-uncorecache": "true"}, {}, "single-numa-node")
    assert result.gates == {ko.ALPHA_GATE: True}
    assert result.problems == []


def test_explicit_alpha_option_with_the_gate_turned_off_is_a_problem() -> None:
    result = choose_options(
        "v1.32.0", {"strict-cpu-reservation": "true"}, {ko.ALPHA_GATE: False}, "single-numa-node"
    )
    assert result.problems == [
        "option 'strict-cpu-reservation' is alpha in kubelet 1.32 and needs "
        "featureGates.CPUManagerPolicyAlphaOptions: true"
    ]


def test_explicit_option_this_version_lacks_is_a_problem_naming_it() -> None:
    result = choose_options(
        "Kubernetes v1.31.2", {"prefer-align-cpus-by-uncorecache": "true"}, {}, "single-numa-node"
    )
    assert result.problems == [
        "unknown CPU Manager Policy option 'prefer-align-cpus-by-uncorecache' for kubelet 1.31"
    ]


def test_eviction_hard_keeps_kubelets_defaults_and_the_files_values() -> None:
    merged = eviction_hard({"memory.available": "500Mi", "nodefs.available": "20%"}, "100Mi")
    assert merged == {
        "memory.available": "100Mi",
        "nodefs.available": "20%",
        "nodefs.inodesFree": "5%",
        "imagefs.available": "15%",
        "imagefs.inodesFree": "5%",
    }
    assert "0" not in merged.values()


# check_config: the merged file kubelet reads, not lowtail's inputs alone.
MERGED: dict[str, object] = {
    "cpuManagerPolicy": "static",
    "cpuManagerPolicyOptions": {"full-pcpus-only": "true"},
    "topologyManagerPolicy": "single-numa-node",
    "memoryManagerPolicy": "Static",
}


def test_existing_option_refused_with_the_one_lowtail_adds_on_1_34() -> None:
    # The file already had distribute-cpus-across-numa; lowtail's 1.34 default adds uncorecache.
    added = choose_options("v1.34.0", None, {}, "single-numa-node").options
    merged = {**MERGED, "cpuManagerPolicyOptions": {"distribute-cpus-across-numa": "true", **added}}
    assert check_config("v1.34.0", merged).problems == [
        "options 'prefer-align-cpus-by-uncorecache' and 'distribute-cpus-across-numa' can not be used at "
        "the same time (kubelet 1.34)"
    ]


def test_beta_gate_turned_off_in_the_file_refuses_a_beta_option_on_1_31() -> None:
    merged = {**MERGED, "featureGates": {ko.BETA_GATE: False}}
    assert check_config("v1.31.4", merged).problems == [
        "option 'full-pcpus-only' is beta in kubelet 1.31 and needs "
        "featureGates.CPUManagerPolicyBetaOptions: true"
    ]


@pytest.mark.parametrize(("version", "locked"), [("v1.33.0", True), ("v1.34.2", True), ("v1.32.3", False)])
def test_cpu_manager_policy_options_gate_is_locked_from_1_33(version: str, locked: bool) -> None:
    problems = check_config(version, {**MERGED, "featureGates": {"CPUManagerPolicyOptions": False}}).problems
    if locked:
        assert problems == [
            "cannot set feature gate CPUManagerPolicyOptions to false, feature is locked to true "
            f"(kubelet {version[1:5]})"
        ]
    else:
        # Not locked yet: kubelet refuses the options themselves (cmd/kubelet/app/server.go).
        assert problems == [
            "CPU Manager policy options ['full-pcpus-only'] require feature gate CPUManagerPolicyOptions, "
            "which featureGates turns off"
        ]
    assert check_config(version, {**MERGED, "featureGates": {"CPUManagerPolicyOptions": True}}).problems == []


def test_memory_manager_gate_off_on_1_31_is_refused_and_locked_from_1_32() -> None:
    merged = {**MERGED, "featureGates": {"MemoryManager": False}}
    (problem,) = check_config("v1.31.4", merged).problems
    assert problem.startswith("featureGates.MemoryManager: false turns the memory manager off")
    assert check_config("v1.32.0", merged).problems == [
        "cannot set feature gate MemoryManager to false, feature is locked to true (kubelet 1.32)"
    ]


@pytest.mark.parametrize("value", ["yes", "true", 1, None])
def test_gate_values_that_are_not_booleans_are_refused(value: object) -> None:
    merged = {**MERGED, "featureGates": {"MemoryManager": value}}
    assert check_config("v1.31.4", merged).problems[0] == (
        f"featureGates.MemoryManager is {value!r}; expected true or false (kubelet's featureGates is a map "
        "of booleans and does not start with another value)"
    )


def test_removed_gate_is_unrecognized_and_unknown_gate_is_a_warning() -> None:
    result = check_config("v1.33.0", {**MERGED, "featureGates": {"CPUManager": True, "SomeNewGate": True}})
    assert result.problems == ["unrecognized feature gate: CPUManager (kubelet 1.33 no longer has it)"]
    assert result.warnings == [
        "featureGates.SomeNewGate: lowtail's table does not know this gate, so it cannot tell whether "
        "kubelet 1.33 has it (kubelet refuses an unrecognized feature gate)"
    ]
    assert check_config("v1.32.0", {**MERGED, "featureGates": {"CPUManager": True}}).problems == []


def test_options_with_the_none_policy_are_refused() -> None:
    merged = {**MERGED, "cpuManagerPolicy": "none"}
    assert check_config("v1.34.0", merged).problems == [
        "None policy: received unsupported options ['full-pcpus-only']"
    ]


@pytest.mark.parametrize("version", ["v1.31.0", "v1.34.1", "v1.35.0"])
def test_24_numa_nodes_get_max_allowable_numa_nodes_where_kubelet_has_it(version: str) -> None:
    result = choose_options(version, None, {}, "single-numa-node", numa_nodes=24)
    assert result.topology_options == {"max-allowable-numa-nodes": "24"}
    merged = {**MERGED, "topologyManagerPolicyOptions": result.topology_options}
    assert check_config(version, merged, numa_nodes=24).problems == []
    # Without the option the topology manager refuses the machine.
    (problem,) = check_config(version, MERGED, numa_nodes=24).problems
    assert "more than 8 NUMA nodes and this host has 24" in problem
    # Eight nodes need nothing.
    assert choose_options(version, None, {}, "single-numa-node", numa_nodes=8).topology_options == {}


@pytest.mark.parametrize("version", ["v1.28.5", "v1.30.2"])
def test_24_numa_nodes_are_refused_before_1_31_naming_the_count(version: str) -> None:
    result = choose_options(version, None, {}, "single-numa-node", numa_nodes=24)
    assert result.topology_options == {}
    (problem,) = check_config(version, MERGED, numa_nodes=24).problems
    assert problem.startswith(
        "the topology manager (single-numa-node) is unsupported on machines with more than 8 NUMA nodes "
        "and this host has 24"
    )
    assert "needs kubelet 1.31 or later" in problem
    # The option is unknown there: writing it by hand is refused too.
    merged = {**MERGED, "topologyManagerPolicyOptions": {"max-allowable-numa-nodes": "24"}}
    assert (
        f"unknown Topology Manager Policy option 'max-allowable-numa-nodes' for kubelet {version[1:5]}"
        in check_config(version, merged, numa_nodes=24).problems
    )


@pytest.mark.parametrize("value", ["7", "many", 24, ""])
def test_max_allowable_numa_nodes_must_be_a_string_of_at_least_8(value: object) -> None:
    merged = {**MERGED, "topologyManagerPolicyOptions": {"max-allowable-numa-nodes": value}}
    problems = check_config("v1.34.0", merged, numa_nodes=4).problems
    assert problems == [
        f"topologyManagerPolicyOptions max-allowable-numa-nodes is {value!r}; expected a string holding an "
        "integer of at least 8"
    ]


def test_topology_beta_option_with_its_gate_off_is_refused() -> None:
    merged = {
        **MERGED,
        "topologyManagerPolicyOptions": {"max-allowable-numa-nodes": "24"},
        "featureGates": {"TopologyManagerPolicyBetaOptions": False},
    }
    assert check_config("v1.34.0", merged, numa_nodes=24).problems[0] == (
        "Topology Manager Policy option 'max-allowable-numa-nodes' is beta in kubelet 1.34 and needs "
        "featureGates.TopologyManagerPolicyBetaOptions: true"
    )
    assert check_config("v1.35.0", merged, numa_nodes=24).problems == []
