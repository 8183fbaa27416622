from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from lowtail.node import cpulist

cpu_sets = st.frozensets(st.integers(min_value=0, max_value=511), max_size=200)


@given(cpu_sets)
def test_parse_of_format_round_trips(cpus: frozenset[int]) -> None:
    assert cpulist.parse(cpulist.format(cpus)) == cpus


@given(cpu_sets)
def test_format_is_normalised_and_stable(cpus: frozenset[int]) -> None:
    text = cpulist.format(cpus)
    assert cpulist.format(cpulist.parse(text)) == text
    # normalised: no run of consecutive singles survives, no element repeats
    parts = text.split(",") if text else []
    assert len(parts) == len(set(parts))


@given(st.lists(st.integers(min_value=0, max_value=300), max_size=50))
def test_format_ignores_order_and_duplicates(items: list[int]) -> None:
    assert cpulist.format(items) == cpulist.format(sorted(set(items)))


@pytest.mark.parametrize(
    ("text", "expected"),
    [("0-3,8,10-11", {0, 1, 2, 3, 8, 10, 11}), ("", set()), ("5\n", {5}), (" 1, 3-4 ", {1, 3, 4})],
)
def test_parse_kernel_format(text: str, expected: set[int]) -> None:
    assert cpulist.parse(text) == expected


def test_format_collapses_runs() -> None:
    assert cpulist.format([11, 10, 8, 3, 2, 1, 0]) == "0-3,8,10-11"


@pytest.mark.parametrize("bad", ["a", "3-1", "1,,2", "-1", "0-", "1-2-3"])
def test_parse_rejects_malformed_lists_naming_them(bad: str) -> None:
    with pytest.raises(cpulist.CpuListError, match="cpulist"):
        cpulist.parse(bad)
