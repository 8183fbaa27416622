"""site.yml end to end over a local connection against fixture machines, always in check mode.

Each bad input must fail the preflight play (on its host, and stop the healthy host too: any_errors_fatal)
with a message that names the value, before the provisioning play starts. A good inventory shows what
check mode would change and changes nothing on this machine.
"""

from __future__ import annotations

import json
import os
import shutil
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.ansible.conftest import run_ansible

LOCAL = {"ansible_connection": "local", "ansible_python_interpreter": "/usr/bin/python3"}
BOOT_CMDLINE = "BOOT_IMAGE=/vmlinuz-6.1.0-28-amd64 root=UUID=0b1f ro quiet"
NODE_MEM_KB = 384 * 2**20  # 384 GiB per NUMA node, as a 2 x EPYC 9634 with 12 x 32 GiB DIMMs per socket


def host_tree(tmp_path: Path, name: str, machine: tuple[Path, Path], init: str) -> tuple[Path, Path]:
    """A private copy of a fixture machine with what preflight reads besides the topology: PID 1's name
    (this test machine has no systemd as PID 1) and each NUMA node's MemTotal."""
    src_sys, src_proc = machine
    dst = tmp_path / "hosts" / name
    sys_root, proc_root = dst / "sys", dst / "proc"
    shutil.copytree(src_sys, sys_root)
    shutil.copytree(src_proc, proc_root)
    (proc_root / "1").mkdir(parents=True, exist_ok=True)
    (proc_root / "1/comm").write_text(init + "\n")
    if not (proc_root / "cmdline").exists():
        (proc_root / "cmdline").write_text(BOOT_CMDLINE + "\n")
    for node in sorted((sys_root / "devices/system/node").glob("node[0-9]*")):
        (node / "meminfo").write_text(f"Node {node.name[4:]} MemTotal:       {NODE_MEM_KB} kB\n")
    return sys_root, proc_root


def write_inventory(
    tmp_path: Path, roots: dict[str, tuple[Path, Path]], hosts: dict[str, dict[str, Any]]
) -> Path:
    entries = {}
    for name, host in hosts.items():
        spec = dict(host)
        sys_root, proc_root = host_tree(
            tmp_path, name, roots[spec.pop("machine")], spec.pop("init", "systemd")
        )
        entries[name] = {
            **LOCAL,
            "lowtail_sysfs_root": str(sys_root),
            "lowtail_procfs_root": str(proc_root),
            "lowtail_boot_root": str(tmp_path / "boot"),
            # Nothing here may touch this machine even outside check mode.
            "lowtail_kernel_apply": False,
            "lowtail_tuning_apply": False,
            "lowtail_kubelet_apply": False,
            "lowtail_kernel_grub_dropin": str(tmp_path / "grub.d/60-lowtail.cfg"),
            "lowtail_kernel_grub_cfg": str(tmp_path / "boot/grub/grub.cfg"),
            "lowtail_kernel_cmdline_path": str(proc_root / "cmdline"),
            "lowtail_kubelet_config_path": str(tmp_path / "kubelet/config.yaml"),
            **spec,
        }
    inventory = tmp_path / "hosts.yml"
    inventory.write_text(yaml.safe_dump({"all": {"children": {"lowtail_nodes": {"hosts": entries}}}}))
    return inventory


def run_site(inventory: Path) -> tuple[int, str]:
    result = run_ansible(["ansible-playbook", "-i", str(inventory), "site.yml", "--check", "--diff"])
    return result.returncode, result.stdout + result.stderr


GOOD = {"machine": "epyc9634_2s"}

BAD_INPUTS = {
    "housekeeping_cpu_missing": (
        {"machine": "epyc9634_2s", "lowtail_housekeeping": "0-6,84-90,200"},
        "CPUs 200 do not exist or are offline",
    ),
    "housekeeping_cpu_offline": (
        {"machine": "offline_cpus", "lowtail_housekeeping": "0,6,16,22"},
        "CPUs 6,22 do not exist or are offline",
    ),
    "housekeeping_splits_core": (
        {"machine": "epyc9634_2s_smt", "lowtail_housekeeping": "0-6,84-90"},
        "'0-6,84-90' splits cores",
    ),
    "housekeeping_leaves_nothing": (
        {"machine": "epyc9634_2s", "lowtail_housekeeping": "0-167"},
        "takes every online CPU",
    ),
    "housekeeping_too_many_cores": (
        {"machine": "epyc9634_2s", "lowtail_housekeeping": 85},
        "housekeeping 85 cores per socket",
    ),
    "rt_runtime_above_period": (
        {"machine": "epyc9634_2s", "lowtail_rt_runtime_us": 1500000},
        "lowtail_rt_runtime_us 1500000 is larger than lowtail_rt_period_us 1000000",
    ),
    "rt_runtime_not_integer": (
        {"machine": "epyc9634_2s", "lowtail_rt_runtime_us": "95%"},
        "lowtail_rt_runtime_us '95%': expected an integer",
    ),
    "rt_unlimited_without_stalld": (
        {"machine": "epyc9634_2s", "lowtail_rt_runtime_us": -1},
        "lowtail_rt_runtime_us -1 (no RT throttling) without stalld",
    ),
    "memory_unbalanced": (
        {
            "machine": "epyc9634_2s",
            "lowtail_kubelet_memory": {
                "kube_reserved": "1Gi",
                "system_reserved": "1Gi",
                "eviction_hard": "100Mi",
                "per_numa": {0: "1Gi", 1: "1Gi"},
            },
        },
        "memory reservations do not balance",
    ),
    "unknown_key_in_memory_dict": (
        {"machine": "epyc9634_2s", "lowtail_kubelet_memory": {"kube_reservd": "1Gi"}},
        "kube_reservd",
    ),
    "unknown_key_in_hardware_dict": (
        {"machine": "epyc9634_2s", "lowtail_expected_hardware": {"sokets": 2}},
        "sokets",
    ),
    "virtual_not_allowed": ({"machine": "vmware_88"}, "lowtail_allow_virtual is false"),
    "bios_differs": (
        {"machine": "epyc_2s_nps4", "lowtail_expected_hardware": {"numa_per_socket": 1}},
        "numa_per_socket expected 1, host has 4",
    ),
    # Inputs that would only fail (or do harm) later, in the provision play: preflight refuses them first.
    "cstate_limit_negative": (
        {"machine": "epyc9634_2s", "lowtail_kernel_cstate_limit": -1},
        "lowtail_kernel_cstate_limit -1: expected null",
    ),
    "hugepages_beyond_node_memory": (
        {"machine": "epyc9634_2s", "lowtail_kernel_hugepages": {"size": "1G", "count": 100000}},
        "NUMA node 0 would need 50000 x 1G",
    ),
    "rt_runtime_zero": (
        {"machine": "epyc9634_2s", "lowtail_rt_runtime_us": 0},
        "lowtail_rt_runtime_us 0 gives real-time tasks no CPU time",
    ),
    "rt_runtime_equal_to_period_without_stalld": (
        {"machine": "epyc9634_2s", "lowtail_rt_runtime_us": 1000000},
        "lowtail_rt_runtime_us 1000000 (the whole period: no RT throttling) without stalld",
    ),
    "serial_not_a_count_or_percentage": (
        {"machine": "epyc9634_2s", "lowtail_serial": "abc"},
        "lowtail_serial 'abc': expected a number of hosts",
    ),
    "kernel_arg_with_shell_syntax": (
        {"machine": "epyc9634_2s", "lowtail_kernel_extra_args": ["quiet$(touch /tmp/lowtail-pwned)"]},
        "lowtail_kernel_extra_args 'quiet$(touch /tmp/lowtail-pwned)': a kernel argument may only use",
    ),
    "kernel_arg_with_quotes_and_spaces": (
        {"machine": "epyc9634_2s", "lowtail_kernel_extra_args": ['dyndbg="module x +p"']},
        "lowtail_kernel_extra_args 'dyndbg=\"module x +p\"': a kernel argument may only use",
    ),
    "kernel_arg_repeats_a_lowtail_key": (
        {"machine": "epyc9634_2s", "lowtail_kernel_extra_args": ["isolcpus=1-3"]},
        "'isolcpus=1-3' sets isolcpus, which lowtail already sets",
    ),
    "init_not_systemd": (
        {"machine": "epyc9634_2s", "init": "init"},
        "PID 1 is 'init'",
    ),
    "pm_qos_latency_not_a_number": (
        {"machine": "epyc9634_2s", "lowtail_tuning_pm_qos_resume_latency_us": "10; reboot"},
        'lowtail_tuning_pm_qos_resume_latency_us "10; reboot": expected a whole number',
    ),
    "sysctl_value_with_a_newline": (
        {"machine": "epyc9634_2s", "lowtail_tuning_sysctls": {"vm.swappiness": "1\nkernel.panic = 1"}},
        "lowtail_tuning_sysctls",
    ),
    "governor_outside_its_choices": (
        {"machine": "epyc9634_2s", "lowtail_tuning_governor": "performance\nw /etc/motd - - - - x"},
        "lowtail_tuning_governor",
    ),
    "other_role_input_outside_its_spec": (
        {"machine": "epyc9634_2s", "lowtail_kernel_thp": "sometimes"},
        "lowtail_kernel_thp",
    ),
}


def host_failure(out: str, host: str) -> str:
    """What Ansible reported for ``host``'s failure: the ``msg`` and any ``argument_errors`` of the YAML
    result under its ``fatal: [host]`` line (read as YAML: it quotes and wraps the message), or ""."""
    lines = out.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(f"fatal: [{host}]")), None)
    if start is None:
        return ""
    end = next((i for i in range(start + 1, len(lines)) if lines[i][:1] not in (" ", "")), len(lines))
    result = yaml.safe_load(textwrap.dedent("\n".join(lines[start + 1 : end])))
    return " ".join([str(result.get("msg", "")), *map(str, result.get("argument_errors", []))])


def recap_line(out: str, host: str) -> str:
    recap = out[out.rindex("PLAY RECAP") :]
    return next((line for line in recap.splitlines() if line.split()[:1] == [host]), "")


# Inputs the preflight role's own argument specification refuses as the role starts, before its
# checks collect anything; the other inputs fail at the checks' single assert.
ROLE_ENTRY_CASES = {"unknown_key_in_memory_dict", "unknown_key_in_hardware_dict"}


@pytest.fixture(scope="module")
def bad_input_runs(
    tmp_path_factory: pytest.TempPathFactory, machine_roots: dict[str, tuple[Path, Path]]
) -> dict[bool, tuple[int, str]]:
    """Two site.yml runs, each with a healthy host and one host per bad input: one for the inputs that
    fail as the preflight role starts, one for those its checks collect. The hosts of a run fail at the
    same task, so each reports its own input as it would alone (any_errors_fatal ends the play after
    that task, not before it); two runs instead of one per input save a playbook run and the healthy
    host's preflight per input."""
    runs = {}
    for at_entry in (True, False):
        cases = {c: bad for c, (bad, _) in BAD_INPUTS.items() if (c in ROLE_ENTRY_CASES) == at_entry}
        tmp = tmp_path_factory.mktemp("bad-inputs")
        runs[at_entry] = run_site(write_inventory(tmp, machine_roots, {"good-host": GOOD, **cases}))
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_input_fails_in_preflight_before_any_change(
    case: str, bad_input_runs: dict[bool, tuple[int, str]]
) -> None:
    rc, out = bad_input_runs[case in ROLE_ENTRY_CASES]
    _, message = BAD_INPUTS[case]
    assert rc != 0, out
    failure = host_failure(out, case)
    if case not in ROLE_ENTRY_CASES:
        assert f"{case}: " in failure and "preflight problem(s), nothing was changed" in failure, out
    assert message in failure, failure
    assert "PLAY [Preflight" in out and "PLAY [Provision" not in out, out
    # The healthy host stopped too (any_errors_fatal) without failing, and nothing changed anywhere.
    good, bad = recap_line(out, "good-host"), recap_line(out, case)
    assert "changed=0" in good and "failed=0" in good and not host_failure(out, "good-host"), good
    assert "changed=0" in bad and "failed=1" in bad, bad


@pytest.mark.slow
def test_every_problem_of_every_host_is_reported_in_one_run(
    tmp_path: Path, machine_roots: dict[str, tuple[Path, Path]]
) -> None:
    many = {
        "machine": "epyc9634_2s",
        "lowtail_kernel_cstate_limit": -1,
        "lowtail_rt_runtime_us": 0,
        "lowtail_serial": "abc",
        "lowtail_kernel_extra_args": ["a;b"],
        "lowtail_kernel_thp": "sometimes",
    }
    other = {"machine": "vmware_88", "init": "bash"}
    inventory = write_inventory(
        tmp_path, machine_roots, {"good-host": GOOD, "bad-host": many, "vm-host": other}
    )
    rc, out = run_site(inventory)
    assert rc != 0, out
    words = " ".join(out.split())
    assert "bad-host: 5 preflight problem(s)" in words, out
    for fragment in (
        "lowtail_kernel_cstate_limit -1",
        "lowtail_rt_runtime_us 0",
        "lowtail_serial 'abc'",
        "lowtail_kernel_extra_args 'a;b'",
        "lowtail_kernel_thp",
    ):
        assert fragment in words, fragment
    assert "vm-host: 2 preflight problem(s)" in words and "PID 1 is 'bash'" in words, out
    assert "lowtail_allow_virtual is false" in words, out
    assert "PLAY [Provision" not in out
    recap = out[out.rindex("PLAY RECAP") :]
    for host in ("good-host", "bad-host", "vm-host"):
        assert "changed=0" in recap.split(host)[1].splitlines()[0], recap


@pytest.mark.slow
def test_check_mode_reports_changes_and_changes_nothing(
    tmp_path: Path, machine_roots: dict[str, tuple[Path, Path]]
) -> None:
    inventory = write_inventory(tmp_path, machine_roots, {"good-host": GOOD})
    owned = [
        Path("/etc/sysctl.d/60-lowtail.conf"),
        Path("/etc/tmpfiles.d/lowtail-tuning.conf"),
        Path("/etc/systemd/system.conf.d/60-lowtail-cpu-affinity.conf"),
    ]
    before = {p: p.exists() for p in owned}
    rc, out = run_site(inventory)
    assert rc == 0, out
    assert "PLAY [Provision" in out
    # --diff shows the GRUB drop-in that would be written, with the plan's arguments.
    assert "isolcpus=managed_irq,7-83,91-167 nohz_full=7-83,91-167" in out, out
    assert "IRQBALANCE_BANNED_CPULIST=7-83,91-167" in out, out
    recap = out[out.rindex("PLAY RECAP") :]
    assert "changed=0" not in recap.split("good-host")[1].splitlines()[0], recap
    assert not (tmp_path / "grub.d").exists()
    assert {p: p.exists() for p in owned} == before


@pytest.mark.slow
def test_example_inventory_passes_preflight_on_its_hardware(
    tmp_path: Path, machine_roots: dict[str, tuple[Path, Path]]
) -> None:
    """inventory/example describes 2 x EPYC 9634 hosts: its group_vars (expected hardware included) and
    its per-host housekeeping must pass preflight on that machine's fixture tree."""
    root = Path(__file__).resolve().parents[2] / "inventory/example"
    group_vars = yaml.safe_load((root / "group_vars/lowtail_nodes.yml").read_text())
    group_vars.pop("ansible_user")
    hosts = yaml.safe_load((root / "hosts.yml").read_text())["all"]["children"]["lowtail_nodes"]["hosts"]
    inventory = write_inventory(
        tmp_path,
        machine_roots,
        {
            name: {
                "machine": "epyc9634_2s",
                **group_vars,
                **{k: v for k, v in (spec or {}).items() if k != "ansible_host"},
            }
            for name, spec in hosts.items()
        },
    )
    result = run_ansible(["ansible-playbook", "-i", str(inventory), "playbooks/preflight.yml", "--check"])
    out = result.stdout + result.stderr
    assert result.returncode == 0, out
    words = " ".join(out.split())  # the YAML callback may wrap the plan message
    assert "housekeeping 0-6,84-90," in words and "housekeeping 0-13,84-97," in words, out


# A stand-in for update-grub that is faithful where it matters here: like grub-mkconfig it sources
# /etc/default/grub's drop-ins with /bin/sh (as root on a real host) and writes the kernel lines of
# grub.cfg from GRUB_CMDLINE_LINUX (grub-mkconfig, util/grub.d/10_linux.in). It logs every call.
UPDATE_GRUB = """#!/bin/sh
set -e
GRUB_CMDLINE_LINUX="root=UUID=0b1f ro"
for f in {dropins}/*.cfg; do [ -e "$f" ] && . "$f"; done
mkdir -p "$(dirname {cfg})"
cat > {cfg} <<END
menuentry 'Debian GNU/Linux' {{
\tlinux\t/vmlinuz-6.1.0-28-amd64 $GRUB_CMDLINE_LINUX quiet
}}
menuentry 'Debian GNU/Linux (recovery mode)' {{
\tlinux\t/vmlinuz-6.1.0-28-amd64 $GRUB_CMDLINE_LINUX single
}}
END
echo called >> {log}
"""


def kernel_playbook(tmp_path: Path) -> tuple[Path, Path, Path]:
    """Preflight and the kernel role alone, with the stand-in update-grub first on PATH."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    cfg, log = tmp_path / "boot/grub/grub.cfg", tmp_path / "update-grub.log"
    script = bin_dir / "update-grub"
    script.write_text(UPDATE_GRUB.format(dropins=tmp_path / "grub.d", cfg=cfg, log=log))
    script.chmod(0o755)
    root = Path(__file__).resolve().parents[2]
    playbook = tmp_path / "kernel.yml"
    playbook.write_text(
        yaml.safe_dump(
            [
                {
                    "name": "Preflight",
                    "ansible.builtin.import_playbook": str(root / "playbooks/preflight.yml"),
                },
                {
                    "name": "Kernel arguments only",
                    "hosts": "lowtail_nodes",
                    "gather_facts": False,
                    "environment": {"PATH": f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin"},
                    "roles": [{"role": "lowtail_kernel"}],
                },
            ],
            sort_keys=False,
        )
    )
    return playbook, cfg, log


def run_playbook(inventory: Path, playbook: Path, *extra: str) -> tuple[int, str]:
    result = run_ansible(["ansible-playbook", "-i", str(inventory), str(playbook), *extra])
    return result.returncode, result.stdout + result.stderr


def calls(log: Path) -> int:
    return len(log.read_text().splitlines()) if log.exists() else 0


def fresh_inventory(tmp_path: Path, roots: dict[str, tuple[Path, Path]], host: dict[str, Any]) -> Path:
    shutil.rmtree(tmp_path / "hosts", ignore_errors=True)
    return write_inventory(tmp_path, roots, {"host": host})


@pytest.mark.slow
def test_bootloader_is_regenerated_from_its_state_not_from_a_notification(
    tmp_path: Path, machine_roots: dict[str, tuple[Path, Path]]
) -> None:
    playbook, cfg, log = kernel_playbook(tmp_path)
    applied = {**GOOD, "lowtail_kernel_apply": True}
    # 1. A first run with apply off writes the drop-in only: grub.cfg is now stale.
    rc, out = run_playbook(fresh_inventory(tmp_path, machine_roots, GOOD), playbook)
    assert rc == 0, out
    assert (tmp_path / "grub.d/60-lowtail.cfg").exists() and calls(log) == 0
    # 2. The next run changes no file, yet sees the stale grub.cfg and regenerates it (a handler
    #    notified by an unchanged template never would).
    inventory = fresh_inventory(tmp_path, machine_roots, applied)
    rc, out = run_playbook(inventory, playbook)
    assert rc == 0, out
    assert calls(log) == 1, out
    text = cfg.read_text()
    assert "isolcpus=managed_irq,7-83,91-167" in text and "rcupdate.rcu_normal_after_boot=1" in text, text
    # 3. Up to date: no regeneration.
    rc, out = run_playbook(inventory, playbook)
    assert rc == 0 and calls(log) == 1, out
    # 4. An interrupted run: the drop-in was rewritten after grub.cfg was generated.
    later = cfg.stat().st_mtime + 5
    os.utime(tmp_path / "grub.d/60-lowtail.cfg", (later, later))
    rc, out = run_playbook(inventory, playbook)
    assert rc == 0 and calls(log) == 2, out
    # 5. An argument the plan drops leaves grub.cfg too.
    rc, out = run_playbook(
        fresh_inventory(tmp_path, machine_roots, {**applied, "lowtail_kernel_cstate_limit": 1}), playbook
    )
    assert rc == 0 and "processor.max_cstate=1" in cfg.read_text(), out
    rc, out = run_playbook(fresh_inventory(tmp_path, machine_roots, applied), playbook)
    assert rc == 0 and calls(log) == 4, out
    assert "processor.max_cstate" not in cfg.read_text()


@pytest.mark.slow
def test_shell_syntax_never_reaches_the_sourced_dropin(
    tmp_path: Path, machine_roots: dict[str, tuple[Path, Path]]
) -> None:
    """Preflight refuses the argument, so the stand-in update-grub (which sources the drop-in with sh)
    never runs it, even with apply on."""
    playbook, _, log = kernel_playbook(tmp_path)
    marker = tmp_path / "pwned"
    bad = {**GOOD, "lowtail_kernel_apply": True, "lowtail_kernel_extra_args": [f"x$(touch${{IFS}}{marker})"]}
    rc, out = run_playbook(fresh_inventory(tmp_path, machine_roots, bad), playbook)
    assert rc != 0 and "may only use letters" in out, out
    assert not marker.exists() and calls(log) == 0 and not (tmp_path / "grub.d").exists()


@pytest.mark.slow
def test_check_mode_with_reboot_ok_succeeds_and_reports_the_reboot(
    tmp_path: Path, machine_roots: dict[str, tuple[Path, Path]]
) -> None:
    host = {**GOOD, "lowtail_reboot_ok": True, "lowtail_kernel_apply": True}
    inventory = write_inventory(tmp_path, machine_roots, {"good-host": host})
    rc, out = run_site(inventory)
    assert rc == 0, out
    words = " ".join(out.split())
    assert (
        "Check mode: would drain (no kubelet), reboot good-host and verify isolcpus=managed_irq,7-83,91-167"
        in words
    ), out
    assert "Reboot the host" not in out
    assert not (tmp_path / "grub.d").exists() and not (tmp_path / "boot/grub/grub.cfg").exists()


# A stand-in for grubby (RHEL family), strict where the role relies on it: only --info=ALL and
# --update-kernel=ALL with --args / --remove-args are accepted (anything else exits 1, as grubby does on
# an unknown option); --args sets a key's value or appends it; --remove-args removes a word or, given
# without a value, every word with that key (grubby's man page). Entries live in a JSON file.
GRUBBY = """#!/usr/bin/python3
import json, sys
state, log = {state!r}, {log!r}
entries = json.load(open(state))
argv = sys.argv[1:]
open(log, "a").write(" ".join(argv) + "\\n")
key = lambda w: w.split("=", 1)[0]
if argv == ["--info=ALL"]:
    for i, e in enumerate(entries):
        print(f"index={{i}}")
        print(f'kernel="{{e["kernel"]}}"')
        print(f'args="{{" ".join(e["args"])}}"')
    sys.exit(0)
ok = len(argv) == 2 and argv[0] == "--update-kernel=ALL"
if not ok or not argv[1].startswith(("--args=", "--remove-args=")):
    sys.exit(f"grubby: bad argument {{argv}}")
opt, words = argv[1].split("=", 1)
for e in entries:
    for w in words.split():
        if opt == "--args":
            e["args"] = [a for a in e["args"] if key(a) != key(w)] + [w]
        else:
            e["args"] = [a for a in e["args"] if a != w and ("=" in w or key(a) != w)]
json.dump(entries, open(state, "w"))
"""


@pytest.mark.slow
def test_grubby_adds_missing_arguments_and_removes_the_ones_the_plan_dropped(
    tmp_path: Path, machine_roots: dict[str, tuple[Path, Path]]
) -> None:
    playbook, _, _ = kernel_playbook(tmp_path)
    state, log = tmp_path / "grubby.json", tmp_path / "grubby.log"
    base = ["ro", "crashkernel=1G-4G:192M"]
    state.write_text(
        json.dumps(
            [
                {"kernel": "/boot/vmlinuz-5.14.0-427.el9.x86_64", "args": list(base)},
                {"kernel": "/boot/vmlinuz-0-rescue", "args": list(base)},
            ]
        )
    )
    script = tmp_path / "bin/grubby"
    script.write_text(GRUBBY.format(state=str(state), log=str(log)))
    script.chmod(0o755)
    # This host is Debian: pick the RHEL family's bootloader the way its vars file would.
    rhel = ["-e", '{"__lowtail_kernel_bootloader": "grubby", "__lowtail_kernel_grub_update": []}']
    applied = {
        **GOOD,
        "lowtail_kernel_apply": True,
        "lowtail_kernel_state_dir": str(tmp_path / "state"),
        "lowtail_kernel_cstate_limit": 1,
    }

    def entries() -> list[list[str]]:
        return [e["args"] for e in json.loads(state.read_text())]

    rc, out = run_playbook(fresh_inventory(tmp_path, machine_roots, applied), playbook, *rhel)
    assert rc == 0, out
    for args in entries():
        assert "isolcpus=managed_irq,7-83,91-167" in args and "processor.max_cstate=1" in args, args
    assert "processor.max_cstate=1" in (tmp_path / "state/kernel-args").read_text()
    # Up to date: grubby is only asked for its view.
    rc, out = run_playbook(fresh_inventory(tmp_path, machine_roots, applied), playbook, *rhel)
    assert rc == 0, out
    assert log.read_text().splitlines()[-1] == "--info=ALL", log.read_text()
    # The plan drops the C-state limit: the argument lowtail added leaves every entry.
    without = {k: v for k, v in applied.items() if k != "lowtail_kernel_cstate_limit"}
    rc, out = run_playbook(fresh_inventory(tmp_path, machine_roots, without), playbook, *rhel)
    assert rc == 0, out
    assert "--update-kernel=ALL --remove-args=processor.max_cstate=1" in log.read_text().splitlines()
    for args in entries():
        assert "processor.max_cstate=1" not in args and "crashkernel=1G-4G:192M" in args, args
