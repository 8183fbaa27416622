"""lowtail.node.kubelet_options: what each claimed kubelet minor refuses, and what lowtail writes for it.

tests/kubelet/test_oracle_differential.py checks check_files against each release's own code over a
generated corpus; these tests pin the messages and the choices lowtail makes.
"""

from __future__ import annotations

import pytest

from lowtail.node import kubelet_options as ko
from lowtail.node.kubelet_options import (
    KubeletVersionError,
    check,
    check_config,
    check_files,
    choose_options,
    eviction_hard,
)

CLAIMED = ("v1.35.4", "v1.36.3", "v1.37.2")
RECOMMENDED = {
    "full-pcpus-only": "true",
    "strict-cpu-reservation": "true",
    "prefer-align-cpus-by-uncorecache": "true",
}


@pytest.mark.parametrize("version", CLAIMED)
def test_recommended_options_start_on_every_claimed_minor_without_a_gate(version: str) -> None:
    result = choose_options(version, None, {}, "single-numa-node")
    assert result.options == RECOMMENDED
    assert result.gates == {}
    assert result.problems == []


def test_uncorecache_is_beta_on_1_35_and_ga_from_1_36() -> None:
    off = {ko.BETA_GATE: False}
    assert check("v1.35.4", {"prefer-align-cpus-by-uncorecache": "true"}, off).problems == [
        "option 'prefer-align-cpus-by-uncorecache' is beta in kubelet 1.35 and needs "
        "featureGates.CPUManagerPolicyBetaOptions: true"
    ]
    assert check("v1.36.3", {"prefer-align-cpus-by-uncorecache": "true"}, off).problems == []


@pytest.mark.parametrize(
    ("a", "b"),
    [
        ("full-pcpus-only", "distribute-cpus-across-cores"),
        ("distribute-cpus-across-numa", "distribute-cpus-across-cores"),
        ("prefer-align-cpus-by-uncorecache", "distribute-cpus-across-cores"),
        ("prefer-align-cpus-by-uncorecache", "distribute-cpus-across-numa"),
    ],
)
def test_forbidden_pairs_are_refused_together_but_not_alone(a: str, b: str) -> None:
    gates = {ko.ALPHA_GATE: True}
    assert check("v1.37.2", {a: "true", b: "true"}, gates).problems == [
        f"options {a!r} and {b!r} can not be used at the same time (kubelet 1.37)"
    ]
    assert check("v1.37.2", {a: "true", b: "false"}, gates).problems == []


def test_align_by_socket_is_refused_with_single_numa_node() -> None:
    gates = {ko.ALPHA_GATE: True}
    problems = check("v1.36.3", {"align-by-socket": "true"}, gates, "single-numa-node").problems
    assert problems == [
        "option 'align-by-socket' is incompatible with topologyManagerPolicy single-numa-node"
    ]
    assert check("v1.36.3", {"align-by-socket": "true"}, gates, "restricted").problems == []


@pytest.mark.parametrize("value", [True, "yes", "", "TRUE ", 1])
def test_option_values_must_be_go_bool_strings(value: object) -> None:
    problems = check("v1.37.2", {"full-pcpus-only": value}).problems
    assert problems == [
        f"option 'full-pcpus-only' has value {value!r}; expected the string 'true' or 'false'"
    ]


@pytest.mark.parametrize("version", ["v1.34.9", "v1.38.0", "v1.27.9", "v2.0.0"])
def test_minors_outside_the_claimed_range_are_refused_naming_version_and_range(version: str) -> None:
    with pytest.raises(KubeletVersionError) as e:
        check(version, {})
    assert str(e.value) == (
        f"kubelet {version} is not supported; lowtail claims kubelet 1.35 to 1.37, the minors whose own "
        "start-up code it is tested against"
    )


def test_an_unreadable_version_is_refused_naming_it() -> None:
    with pytest.raises(KubeletVersionError, match="kubelet version 'garbage' is not readable"):
        check("garbage", {})


def test_explicit_alpha_option_gets_its_gate() -> None:
    result = choose_options("v1.37.2", {"distribute-cpus-across-cores": "true"}, {}, "single-numa-node")
    assert result.gates == {ko.ALPHA_GATE: True}
    assert result.problems == []


def test_explicit_alpha_option_with_the_gate_turned_off_is_a_problem() -> None:
    result = choose_options(
        "v1.36.3", {"distribute-cpus-across-cores": "true"}, {ko.ALPHA_GATE: False}, "single-numa-node"
    )
    assert result.problems == [
        "option 'distribute-cpus-across-cores' is alpha in kubelet 1.36 and needs "
        "featureGates.CPUManagerPolicyAlphaOptions: true"
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


# check_config: the merged file kubelet reads, not lowtail's inputs alone (2 NUMA nodes, 1Gi + 1Gi +
# 100Mi reserved).
MERGED: dict[str, object] = {
    "cpuManagerPolicy": "static",
    "cpuManagerPolicyOptions": {"full-pcpus-only": "true"},
    "reservedSystemCPUs": "0-6,84-90",
    "topologyManagerPolicy": "single-numa-node",
    "memoryManagerPolicy": "Static",
    "reservedMemory": [
        {"numaNode": 0, "limits": {"memory": "1074Mi"}},
        {"numaNode": 1, "limits": {"memory": "1074Mi"}},
    ],
    "kubeReserved": {"memory": "1Gi"},
    "systemReserved": {"memory": "1Gi"},
    "evictionHard": {"memory.available": "100Mi"},
}
CPUS = frozenset(range(168))


@pytest.mark.parametrize("version", CLAIMED)
def test_the_merged_file_starts(version: str) -> None:
    assert check_config(version, MERGED, 2, sockets=2, cpus=CPUS, cgroup_version=2).problems == []


def test_existing_option_refused_with_the_one_lowtail_adds() -> None:
    added = choose_options("v1.36.3", None, {}, "single-numa-node").options
    merged = {**MERGED, "cpuManagerPolicyOptions": {"distribute-cpus-across-numa": "true", **added}}
    assert check_config("v1.36.3", merged).problems == [
        "options 'prefer-align-cpus-by-uncorecache' and 'distribute-cpus-across-numa' can not be used at "
        "the same time (kubelet 1.36)"
    ]


@pytest.mark.parametrize(("gate", "value"), [("CPUManagerPolicyOptions", False), ("MemoryManager", False)])
def test_locked_gates_set_against_their_lock_are_refused_on_1_35(gate: str, value: bool) -> None:
    problems = check_config("v1.35.4", {**MERGED, "featureGates": {gate: value}}).problems
    assert problems == [f"cannot set feature gate {gate} to false, feature is locked to true (kubelet 1.35)"]


def test_a_gate_the_release_no_longer_has_is_unrecognized_naming_where_it_is() -> None:
    (problem,) = check_config("v1.36.3", {**MERGED, "featureGates": {"MemoryManager": True}}).problems
    assert problem == (
        "unrecognized feature gate: MemoryManager (kubelet 1.36, k8s.io/kubernetes@v1.36.3, does not have "
        "it; the claimed minors with it: 1.35)"
    )


def test_a_misspelt_gate_is_unrecognized() -> None:
    (problem,) = check_config(
        "v1.37.2", {**MERGED, "featureGates": {"CPUManagerPolicyAlphaOption": True}}
    ).problems
    assert problem.startswith("unrecognized feature gate: CPUManagerPolicyAlphaOption (kubelet 1.37")


def test_pod_level_resource_managers_gate_exists_from_1_36() -> None:
    gates = {"featureGates": {"PodLevelResourceManagers": True}}
    assert check_config("v1.36.3", {**MERGED, **gates}).problems == []
    assert (
        check_config("v1.35.4", {**MERGED, **gates})
        .problems[0]
        .startswith("unrecognized feature gate: PodLevelResourceManagers")
    )


@pytest.mark.parametrize("value", ["true", 1, None])
def test_gate_values_that_are_not_booleans_are_refused(value: object) -> None:
    merged = {**MERGED, "featureGates": {ko.ALPHA_GATE: value}}
    assert check_config("v1.36.3", merged).problems[0] == (
        f"featureGates.CPUManagerPolicyAlphaOptions is {value!r}; expected true or false (kubelet's "
        "featureGates is a map of booleans and does not start with another value)"
    )


def test_options_with_the_none_policy_are_refused() -> None:
    merged = {**MERGED, "cpuManagerPolicy": "none"}
    assert check_config("v1.37.2", merged).problems == [
        "None policy: received unsupported options ['full-pcpus-only']"
    ]


@pytest.mark.parametrize("version", CLAIMED)
def test_24_numa_nodes_get_max_allowable_numa_nodes(version: str) -> None:
    chosen = choose_options(version, None, {}, "single-numa-node", numa_nodes=24)
    assert chosen.topology_options == {"max-allowable-numa-nodes": "24"}
    assert (
        check_config(version, MERGED, numa_nodes=24)
        .problems[-1]
        .startswith(
            "the topology manager (single-numa-node) is unsupported on machines with more than 8 NUMA nodes"
        )
    )


@pytest.mark.parametrize("value", ["7", "x", 24, "24 "])
def test_max_allowable_numa_nodes_must_be_a_string_of_at_least_8(value: object) -> None:
    merged = {**MERGED, "topologyManagerPolicyOptions": {"max-allowable-numa-nodes": value}}
    assert check_config("v1.37.2", merged, numa_nodes=2).problems != []


def test_failcgroupv1_defaults_to_refusing_a_cgroup_v1_host() -> None:
    (problem,) = check_config("v1.35.4", MERGED, cgroup_version=1).problems
    assert "this host runs cgroup v1; set failCgroupV1: false" in problem
    assert check_config("v1.35.4", {**MERGED, "failCgroupV1": False}, cgroup_version=1).problems == []
    assert check_config("v1.35.4", MERGED, cgroup_version=2).problems == []


def test_reserved_memory_that_does_not_balance_is_refused() -> None:
    merged = {**MERGED, "systemReserved": {"memory": "2Gi"}}
    (problem,) = check_config("v1.36.3", merged).problems
    assert problem.startswith("memoryManagerPolicy Static: reservedMemory sums to")


def test_align_by_socket_on_more_sockets_than_numa_nodes_is_refused() -> None:
    merged = {
        **MERGED,
        "topologyManagerPolicy": "restricted",
        "cpuManagerPolicyOptions": {"align-by-socket": "true"},
        "featureGates": {ko.ALPHA_GATE: True},
    }
    assert check_config("v1.37.2", merged, 2, sockets=2).problems == []
    merged["reservedMemory"] = [{"numaNode": 0, "limits": {"memory": "2148Mi"}}]
    (problem,) = check_config("v1.37.2", merged, 1, sockets=88).problems
    assert "sockets (88) outnumber the NUMA nodes (1)" in problem


def test_check_files_refuses_a_drop_in_without_the_kubelet_header() -> None:
    main = {"apiVersion": ko.API_VERSION, "kind": ko.KIND, **MERGED}
    result = check_files("v1.37.2", main, [("95-x.conf", {"topologyManagerScope": "pod"})])
    assert result.problems == [
        "drop-in 95-x.conf has apiVersion None and kind None; expected kubelet.config.k8s.io/v1beta1 "
        "KubeletConfiguration (kubelet fails to load it)"
    ]
    # Files other than *.conf are not read.
    assert check_files("v1.37.2", main, [("95-x.yaml", "anything")]).problems == []
