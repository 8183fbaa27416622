"""python/lowtail/kubelet_memory.py: per-NUMA reservedMemory whose sum is exact."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lowtail.node.kubelet_memory import (
    MemoryReservationError,
    format_quantity,
    parse_quantity,
    plan_reservations,
)

MI, GI = 2**20, 2**30


@pytest.mark.parametrize(
    ("text", "n"),
    [
        ("1Gi", GI),
        ("100Mi", 100 * MI),
        ("512Ki", 512 * 1024),
        ("1G", 10**9),
        ("7", 7),
        (4096, 4096),
        # Every form resource.ParseQuantity takes (the oracle differential test checks them against kubelet).
        ("1.5Gi", GI + GI // 2),
        (".5Gi", GI // 2),
        ("1e9", 10**9),
        ("1E3", 1000),
        ("+1Gi", GI),
        ("1500000m", 1500),
        ("Gi", 0),
    ],
)
def test_quantities_parse_to_bytes(text: str | int, n: int) -> None:
    assert parse_quantity(text) == n


@pytest.mark.parametrize("bad", ["1gb", "-1Gi", "", "1K", "1 Gi", "10%", "100m", "1.5", True, -5])
def test_bad_quantity_names_the_value(bad: object) -> None:
    with pytest.raises(MemoryReservationError, match="expected") as e:
        parse_quantity(bad, "kube_reserved")  # type: ignore[arg-type]
    assert f"kube_reserved {bad!r}" in str(e.value)


def test_a_fraction_of_a_byte_is_named_as_such() -> None:
    with pytest.raises(MemoryReservationError, match="expected a whole number of bytes"):
        parse_quantity("100m", "kube_reserved")


def test_format_uses_the_largest_exact_binary_suffix() -> None:
    assert format_quantity(1074 * MI) == "1074Mi"
    assert format_quantity(2 * GI) == "2Gi"
    assert format_quantity(1536 * 1024) == "1536Ki"
    assert format_quantity(1001) == "1001"


def test_auto_split_over_two_nodes_is_exact() -> None:
    r = plan_reservations([0, 1], "1Gi", "1Gi", "100Mi")
    assert r.reserved_memory() == [
        {"numaNode": 0, "limits": {"memory": "1074Mi"}},
        {"numaNode": 1, "limits": {"memory": "1074Mi"}},
    ]
    assert sum(r.per_numa.values()) == r.total == 2148 * MI


def test_remainder_goes_to_the_lowest_node() -> None:
    r = plan_reservations([0, 1, 2], "1Gi", "1Gi", "100Mi")  # 2148Mi over 3 nodes: 716Mi each
    assert r.per_numa == {0: 716 * MI, 1: 716 * MI, 2: 716 * MI}
    r = plan_reservations([0, 1, 2, 3], "1Gi", "0", "1Mi")  # 1025Mi over 4 nodes
    assert r.per_numa[0] == 257 * MI and r.per_numa[1] == 256 * MI
    assert sum(r.per_numa.values()) == r.total


@given(
    st.integers(1, 8),
    st.integers(0, 64 * GI),
    st.integers(0, 64 * GI),
    st.integers(1, 4 * GI),
)
def test_auto_split_always_sums_exactly(nodes: int, kube: int, system: int, eviction: int) -> None:
    r = plan_reservations(range(nodes), kube, system, eviction)
    assert sum(r.per_numa.values()) == kube + system + eviction
    assert sum(parse_quantity(e["limits"]["memory"]) for e in r.reserved_memory()) == r.total


def test_explicit_split_that_balances_is_kept() -> None:
    r = plan_reservations([0, 1], "1Gi", "1Gi", "100Mi", {0: "1124Mi", "1": "1024Mi"})
    assert r.per_numa == {0: 1124 * MI, 1: 1024 * MI}


def test_unbalanced_split_names_both_sums() -> None:
    with pytest.raises(MemoryReservationError) as e:
        plan_reservations([0, 1], "1Gi", "1Gi", "100Mi", {0: "1Gi", 1: "1Gi"})
    msg = str(e.value)
    assert "do not balance" in msg and "2Gi" in msg and "2148Mi" in msg


def test_split_naming_a_missing_numa_node_fails() -> None:
    with pytest.raises(MemoryReservationError, match="NUMA node 2"):
        plan_reservations([0, 1], "1Gi", "1Gi", "100Mi", {0: "1074Mi", 2: "1074Mi"})


def test_zero_total_fails() -> None:
    with pytest.raises(MemoryReservationError, match="is 0"):
        plan_reservations([0], 0, "0", "0Mi")
