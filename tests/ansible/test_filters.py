"""The Jinja filters in filter_plugins/lowtail.py."""

from __future__ import annotations

from types import ModuleType

import pytest
from ansible.errors import AnsibleFilterError

WANTED = ["isolcpus=managed_irq,7-83", "nohz_full=7-83", "skew_tick=1", "nosoftlockup"]


def test_cmdline_with_every_argument_misses_nothing(filters: ModuleType) -> None:
    cmdline = (
        "BOOT_IMAGE=/vmlinuz root=/dev/sda1 ro "
        "isolcpus=managed_irq,7-83 nohz_full=7-83 skew_tick=1 nosoftlockup\n"
    )
    assert filters.cmdline_missing(WANTED, cmdline) == []


def test_argument_with_another_value_counts_as_missing(filters: ModuleType) -> None:
    cmdline = "ro isolcpus=managed_irq,8-83 nohz_full=7-83 skew_tick=1 nosoftlockup"
    assert filters.cmdline_missing(WANTED, cmdline) == ["isolcpus=managed_irq,7-83"]


def test_flag_without_value_must_be_present(filters: ModuleType) -> None:
    assert filters.cmdline_missing(WANTED, "isolcpus=managed_irq,7-83 nohz_full=7-83 skew_tick=1") == [
        "nosoftlockup"
    ]


def test_last_value_of_a_repeated_key_wins(filters: ModuleType) -> None:
    cmdline = "nohz_full=7-83 nohz_full=1 isolcpus=managed_irq,7-83 skew_tick=1 nosoftlockup"
    assert filters.cmdline_missing(WANTED, cmdline) == ["nohz_full=7-83"]


def test_arguments_after_double_dash_belong_to_init(filters: ModuleType) -> None:
    cmdline = "ro -- isolcpus=managed_irq,7-83 nohz_full=7-83 skew_tick=1 nosoftlockup"
    assert filters.cmdline_missing(WANTED, cmdline) == WANTED


def test_unparsable_cmdline_is_an_error_naming_it(filters: ModuleType) -> None:
    with pytest.raises(AnsibleFilterError, match="unparsable"):
        filters.cmdline_missing(WANTED, 'ro "unterminated')


def test_changed_keys_reports_changed_added_and_removed_fields(filters: ModuleType) -> None:
    old = {"cpuManagerPolicy": "none", "reservedSystemCPUs": "0-1", "memoryManagerPolicy": "Static"}
    new = {"cpuManagerPolicy": "static", "reservedSystemCPUs": "0-1", "reservedMemory": [{"numaNode": 0}]}
    keys = ["cpuManagerPolicy", "reservedSystemCPUs", "memoryManagerPolicy", "reservedMemory"]
    assert filters.changed_keys(old, new, keys) == [
        "cpuManagerPolicy",
        "memoryManagerPolicy",
        "reservedMemory",
    ]
    assert filters.changed_keys(new, new, keys) == []
    assert filters.changed_keys(None, {}, keys) == []
