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


ARGS = "isolcpus=managed_irq,7-83 nohz_full=7-83 skew_tick=1"
GRUB_CFG = (
    "menuentry 'Debian GNU/Linux' --class debian {\n"
    f"\tlinux\t/vmlinuz-6.1.0-28-amd64 root=UUID=0b1f ro quiet {ARGS} nosoftlockup\n"
    "\tinitrd\t/initrd.img-6.1.0-28-amd64\n}\n"
    "menuentry 'Debian GNU/Linux, recovery mode' {\n"
    f"\tlinux\t/vmlinuz-6.1.0-28-amd64 root=UUID=0b1f ro single {ARGS}\n}}\n"
    "menuentry 'Memory test (memtest86+x64.bin)' {\n\tlinux\t/memtest86+x64.bin\n}\n"
)


def test_boot_entry_missing_an_argument_is_reported(filters: ModuleType) -> None:
    # The recovery entry lacks nosoftlockup; the memtest image is not a kernel and is ignored.
    assert filters.boot_entries_missing(WANTED, GRUB_CFG) == ["nosoftlockup"]


def test_grub_cfg_without_kernel_entries_misses_everything(filters: ModuleType) -> None:
    assert filters.boot_entries_missing(WANTED, "") == WANTED
    assert filters.boot_entries_missing(WANTED, "set timeout=5\n") == WANTED


def test_grubby_info_entries_are_read(filters: ModuleType) -> None:
    info = (
        'index=0\nkernel="/boot/vmlinuz-5.14.0-427.el9.x86_64"\n'
        'args="ro crashkernel=1G-4G:192M isolcpus=managed_irq,7-83 nohz_full=7-83 skew_tick=1 nosoftlockup"\n'
        'index=1\nkernel="/boot/vmlinuz-0-rescue"\nargs="ro crashkernel=1G-4G:192M"\n'
    )
    assert filters.boot_entries_missing(WANTED, info) == WANTED  # the rescue entry has none of them
    assert filters.boot_entries_present(["skew_tick=1", "processor.max_cstate=1"], info) == ["skew_tick=1"]


def test_dropped_arguments_are_those_whose_key_left_the_plan(filters: ModuleType) -> None:
    old = ["nohz_full=7-83", "processor.max_cstate=1", "nosoftlockup"]
    new = ["nohz_full=8-83", "nosoftlockup"]
    # nohz_full changed value (the new one replaces it); processor.max_cstate left the plan.
    assert filters.args_dropped(old, new) == ["processor.max_cstate=1"]
