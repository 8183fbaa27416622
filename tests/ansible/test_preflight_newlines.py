"""Validation patterns end at the very end of the value (\\Z), not before a trailing newline ($): a
kernel argument `quiet\\n` would be written inside the GRUB quotes and never match /proc/cmdline, a
sysctl key `vm.swappiness\\n` would write two broken lines, a PM QoS latency `10\\n` a broken sysfs write."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.ansible.test_site_playbook import GOOD, run_site, write_inventory

pytestmark = pytest.mark.slow


def test_values_with_a_trailing_newline_fail_preflight_naming_each(
    tmp_path: Path, machine_roots: dict[str, tuple[Path, Path]]
) -> None:
    bad = {
        "machine": "epyc9634_2s",
        "lowtail_kernel_extra_args": ["quiet\n"],
        "lowtail_tuning_sysctls": {"vm.swappiness\n": "1"},
        "lowtail_tuning_pm_qos_resume_latency_us": "10\n",
    }
    inventory = write_inventory(tmp_path, machine_roots, {"good-host": GOOD, "bad-host": bad})
    rc, out = run_site(inventory)
    assert rc != 0, out
    words = " ".join(out.split())
    assert "bad-host: 3 preflight problem(s)" in words, out
    assert "lowtail_kernel_extra_args 'quiet\\n': a kernel argument may only use" in words, out
    assert 'lowtail_tuning_sysctls {"vm.swappiness\\n": "1"}' in words, out
    assert 'lowtail_tuning_pm_qos_resume_latency_us "10\\n"' in words, out
    assert "PLAY [Provision" not in out
